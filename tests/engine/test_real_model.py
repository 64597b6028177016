"""Continuous batching on the default target: 4 prompts at once equal the same run alone."""

from __future__ import annotations

from typing import Any

import pytest

from braid.config import EngineConfig
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def quicksort(arr):",
    "# Print the first ten prime numbers in Python\n",
    "The capital of France is",
    "SELECT name, COUNT(*) FROM orders",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def generate(model_and_tokenizer: Any, prompts: list[str], **options: Any) -> list[list[int]]:
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(EngineConfig(max_model_len=256, kv_cache_gib=0.25, log_stats_interval=0,
                                    **options), model=model, tokenizer=tokenizer)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done() if o.finished}
    return [done[str(i)] for i in range(len(prompts))]


def test_batch_equals_one_by_one(default_target: Any) -> None:
    together = generate(default_target, PROMPTS, max_num_batched_tokens=16)
    alone = [generate(default_target, [p])[0] for p in PROMPTS]
    assert together == alone
