"""Default target with the default draft on HumanEval prompts: greedy output is unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from braid.bench.datasets import humaneval
from braid.config import EngineConfig
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def run(target: Any, draft: Any | None, prompts: list[str]) -> tuple[list[list[int]], Any]:
    model, tokenizer = target
    spec = {"method": "draft_model", "num_speculative_tokens": 3} if draft else None
    engine = LLMEngine(
        EngineConfig(max_model_len=1024, kv_cache_gib=0.25, log_stats_interval=0,
                     speculative_config=spec),
        model=model, tokenizer=tokenizer, draft_model=draft[0] if draft else None)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done() if o.finished}
    return [done[str(i)] for i in range(len(prompts))], engine.stats.spec


def test_draft_speculation_is_lossless_on_humaneval(default_target: Any, default_draft: Any
                                                    ) -> None:
    prompts = [p.prompt for p in humaneval(4)]
    plain, _ = run(default_target, None, prompts)
    spec_out, spec = run(default_target, default_draft, prompts)
    print(f"draft k=3 on 4 HumanEval prompts: {spec.as_dict()}")
    assert spec_out == plain
    assert spec.num_drafts > 0 and spec.acceptance_rate > 0.3
