"""Default target with the default draft on HumanEval prompts: greedy output is unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from braid.bench.datasets import humaneval
from braid.config import EngineConfig
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams
from braid.spec_decode import goodput
from tests.spec_decode.test_spec_engine import FixedStepCosts

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def run(target: Any, draft: Any | None, prompts: list[str], policy: str = "fixed",
        concurrency: int = 4, params: SamplingParams = GREEDY, kv_cache_dtype: str = "auto",
        **spec_options: Any) -> tuple[list[list[int]], LLMEngine]:
    """Outputs of `prompts` (greedy unless `params`), at most `concurrency` in flight, and
    the engine that ran them."""
    model, tokenizer = target
    spec = ({"method": "draft_model", "num_speculative_tokens": 3, "policy": policy,
             **spec_options} if draft else None)
    engine = LLMEngine(
        EngineConfig(max_model_len=1024, kv_cache_gib=0.25, log_stats_interval=0,
                     speculative_config=spec, kv_cache_dtype=kv_cache_dtype),
        model=model, tokenizer=tokenizer, draft_model=draft[0] if draft else None)
    done: dict[str, list[int]] = {}
    for start in range(0, len(prompts), concurrency):
        for i in range(start, min(start + concurrency, len(prompts))):
            engine.add_request(str(i), prompts[i], params)
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()
                     if o.finished})
    return [done[str(i)] for i in range(len(prompts))], engine


@pytest.fixture(scope="module")
def plain(default_target: Any) -> tuple[list[str], list[list[int]]]:
    prompts = [p.prompt for p in humaneval(4)]
    return prompts, run(default_target, None, prompts)[0]


def test_draft_speculation_is_lossless_on_humaneval(default_target: Any, default_draft: Any,
                                                    plain: Any) -> None:
    prompts, reference = plain
    for lookup in (True, False):  # drafts from prompt lookups beside the model's, or not
        spec_out, engine = run(default_target, default_draft, prompts,
                               draft_prompt_lookup=lookup)
        spec = engine.stats.spec_stats
        print(f"draft k=3 on 4 HumanEval prompts, lookups {lookup}: {spec.as_dict()}")
        assert spec_out == reference
        assert spec.num_drafts > 0 and spec.acceptance_rate > 0.3
        assert (engine.speculator.lookup_windows > 0) is lookup  # type: ignore[union-attr]


def test_draft_speculation_is_lossless_with_a_float16_kv_cache(default_target: Any,
                                                                default_draft: Any) -> None:
    """--kv-cache-dtype float16 (both models' caches): greedy output with the draft equals
    greedy output without it, over two batches."""
    prompts = [p.prompt for p in humaneval(4)]
    reference, engine = run(default_target, None, prompts, concurrency=2,
                            kv_cache_dtype="float16")
    assert engine.runner.kv_cache.dtype == torch.float16
    spec_out, engine = run(default_target, default_draft, prompts, concurrency=2,
                           kv_cache_dtype="float16")
    assert spec_out == reference
    assert engine.stats.spec_stats.num_drafts > 0


def fixed_step_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Feed the goodput policy's cost model fixed forward times shaped like the float32
    target beside the quantized draft (a target forward streams 7 GB whatever its few tokens,
    a draft forward costs a twentieth of it) instead of the measured ones, so what the policy
    chooses does not depend on how loaded the machine is. The forwards still run for real."""
    monkeypatch.setattr(goodput, "StepCostModel", lambda: FixedStepCosts(
        target=(0.2, 0.002), draft=(0.01, 0.0005)))


def test_goodput_policy_is_lossless_on_humaneval(default_target: Any, float_target: Any,
                                                 default_draft: Any, plain: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The default policy, one request at a time, lossless whatever it chooses: with the
    quantized target on a CPU like this one it mostly keeps k = 0 (docs/benchmarks.md,
    Speculation). Beside the float32 target the quantized draft is cheap and drafting pays;
    there the policy sees fixed step costs of that shape (fixed_step_costs: measured ones
    made this half depend on the machine's load) and the draft really proposes."""
    prompts, reference = plain
    spec_out, _ = run(default_target, default_draft, prompts[:2], "goodput", concurrency=1)
    assert spec_out == reference[:2]
    float_reference = run(float_target, None, prompts[:2])[0]
    fixed_step_costs(monkeypatch)
    spec_out, engine = run(float_target, default_draft, prompts[:2], "goodput", concurrency=1)
    spec = engine.stats.spec_stats
    assert spec_out == float_reference
    assert spec.num_drafts > 0 and spec.acceptance_rate > 0.3


def test_seeded_sampling_is_unchanged_by_speculation(default_target: Any,
                                                     default_draft: Any) -> None:
    """Temperature 0.7, a seed per request: the same tokens without speculation, with the
    draft at k = 3 (coupled and greedy drafts) and with the goodput policy."""
    prompts = [p.prompt for p in humaneval(2)]
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=42, max_tokens=24,
                            ignore_eos=True)
    reference = run(default_target, None, prompts, params=params)[0]
    for options in ({"draft_sampling": "coupled"}, {"draft_sampling": "greedy"},
                    {"policy": "goodput"}):
        out, engine = run(default_target, default_draft, prompts, params=params, **options)
        spec = engine.stats.spec_stats
        print(f"seeded, temperature 0.7, {options}: {spec.as_dict()}")
        assert out == reference, options
        if "policy" not in options:
            assert spec.num_drafts > 0


def test_prefix_cache_with_the_draft_is_lossless(default_target: Any, default_draft: Any
                                                 ) -> None:
    """A second turn resending the first with its answer: with prefix caching and the draft
    it shares the first turn's blocks (target and draft KV) and equals a run without either."""
    model, tokenizer = default_target
    first = tokenizer.encode(humaneval(1)[0].prompt)

    def engine(caching: bool, draft: bool) -> LLMEngine:
        spec = {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"}
        return LLMEngine(EngineConfig(max_model_len=1024, kv_cache_gib=0.25, log_stats_interval=0,
                                      enable_prefix_caching=caching,
                                      speculative_config=spec if draft else None),
                         model=model, tokenizer=tokenizer,
                         draft_model=default_draft[0] if draft else None)

    def turn(e: LLMEngine, rid: str, ids: list[int]) -> Any:
        e.add_request(rid, ids, GREEDY)
        return [o for o in e.run_until_done() if o.finished][0]

    cached = engine(caching=True, draft=True)
    answer = turn(cached, "1", first).outputs[0].token_ids
    second = first + answer + tokenizer.encode("\n\n# Now test it:\n")
    got = turn(cached, "2", second)
    want = turn(engine(caching=False, draft=False), "2", second)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens >= (len(first) + len(answer) - 1) // 16 * 16 - 16
    assert cached.stats.spec_stats.num_drafts > 0
