"""A seeded request's tokens never depend on speculation: not on the method, k, the policy,
how drafts are sampled or verified, the batch, the token budget, chunking or preemption."""

from __future__ import annotations

from dataclasses import replace

import pytest

from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams
from tests.engine.test_engine import STAGGERED, make_engine, prompts
from tests.spec_decode.test_spec_engine import spec_engine
from tests.tiny import random_weights, tiny_config

SAMPLED = [
    SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.2, top_k=20, repetition_penalty=1.3, max_tokens=20,
                   ignore_eos=True),
]
OTHER = tiny_config("qwen2")
OTHER_WEIGHTS = random_weights(OTHER, seed=5)


def seeded(i: int) -> SamplingParams:
    return replace(SAMPLED[i % len(SAMPLED)], seed=1000 + i)


def run_seeded(engine: LLMEngine, arrivals: dict[int, list[int]], unseeded: bool = False
               ) -> dict[str, list[int]]:
    """Prompt i with seed 1000 + i (and, with `unseeded`, an unseeded twin "u<i>" next to it,
    whose tokens are not compared). Returns the seeded requests' tokens by id."""
    ps, done, step = prompts(), {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), ps[i], seeded(i))
            if unseeded:
                engine.add_request(f"u{i}", ps[i], replace(seeded(i), seed=None))
        for out in engine.step():
            if out.finished and not out.request_id.startswith("u"):
                done[out.request_id] = out.outputs[0].token_ids
                spec = out.metrics.spec_stats
                if _always_drafts(engine) and len(out.outputs[0].token_ids) > 2:
                    assert spec.get("num_drafts", 0) > 0  # seeded requests keep speculating
                    assert spec["verification"] == "coupled"
        step += 1
    return done


def _always_drafts(engine: LLMEngine) -> bool:
    """A draft model at fixed k drafts for every decoding request (n-gram needs a match,
    the goodput policy may choose k = 0)."""
    spec = engine.config.spec_config
    return spec is not None and spec.method == "draft_model" and spec.policy == "fixed"


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    """Each request alone, without speculation."""
    out: dict[str, list[int]] = {}
    for i in range(len(prompts())):
        out.update(run_seeded(make_engine(max_num_seqs=1, max_num_batched_tokens=256), {0: [i]}))
    return out


def draft(k: int, unrelated: bool = False, **options) -> LLMEngine:
    if unrelated:
        return spec_engine("draft_model", k, draft_weights=OTHER_WEIGHTS, draft_cfg=OTHER,
                           **options)
    return spec_engine("draft_model", k, **options)


CONFIGS = {
    "no_spec_batched": lambda: make_engine(max_num_batched_tokens=32),
    "no_spec_prefill_first": lambda: make_engine(enable_chunked_prefill=False),
    "ngram_k3": lambda: spec_engine("ngram", 3, max_num_batched_tokens=32),
    "suffix_k4": lambda: spec_engine("suffix", 4, max_num_batched_tokens=32),
    "suffix_goodput_preempted": lambda: spec_engine("suffix", 4, policy="goodput",
                                                    num_kv_blocks=64,
                                                    max_num_batched_tokens=32),
    "draft_k1": lambda: draft(1, max_num_batched_tokens=32),
    "draft_k2_budget8": lambda: draft(2, max_num_batched_tokens=8),
    "draft_k5": lambda: draft(5, max_num_batched_tokens=64),
    "unrelated_draft_k3": lambda: draft(3, unrelated=True, max_num_batched_tokens=32),
    "draft_k3_prefill_first": lambda: draft(3, enable_chunked_prefill=False),
    "draft_k3_preempted": lambda: draft(3, num_kv_blocks=64, max_num_batched_tokens=32),
    "goodput": lambda: spec_engine("draft_model", 4, policy="goodput",
                                   max_num_batched_tokens=32),
    "goodput_lookups": lambda: spec_engine("draft_model", 3, policy="goodput",
                                           max_num_batched_tokens=32, draft_prompt_lookup=True),
    "draft_k3_lookups_preempted": lambda: draft(3, num_kv_blocks=64, max_num_batched_tokens=32,
                                                draft_prompt_lookup=True),
    "draft_suffix_preempted": lambda: draft(3, num_kv_blocks=64, max_num_batched_tokens=32,
                                            draft_suffix_decoding=True),
    "greedy_drafts": lambda: spec_engine("draft_model", 3, max_num_batched_tokens=32,
                                         draft_sampling="greedy"),
    "independent_drafts_rejection": lambda: spec_engine(
        "draft_model", 3, max_num_batched_tokens=32, draft_sampling="independent",
        verification="rejection"),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_seeded_outputs_equal_no_speculation_alone(alone, config: str) -> None:
    engine = CONFIGS[config]()
    assert run_seeded(engine, STAGGERED, unseeded=True) == alone
    if engine.config.spec_config is not None:
        assert engine.stats.spec_stats.num_drafts > 0
    if config.endswith("lookups_preempted"):
        assert engine.speculator.lookup_windows > 0  # type: ignore[union-attr]
    if config.endswith("preempted"):
        assert engine.stats.num_preemptions > 0


def test_unseeded_requests_follow_the_engine_seed() -> None:
    """Unseeded requests draw their seeds from --seed in arrival order: two engines with the
    same seed agree, and a different seed changes the tokens."""
    params = replace(SAMPLED[0], seed=None)
    outs = []
    for seed in (1, 1, 2):
        engine = draft(3, unrelated=True, seed=seed)
        for i, p in enumerate(prompts()[:3]):
            engine.add_request(str(i), p, params)
        outs.append({o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()
                     if o.finished})
    assert outs[0] == outs[1] != outs[2]


def test_coupled_drafts_are_accepted_more_than_greedy_ones_when_sampling() -> None:
    """The target as its own draft: coupled drafts are its own samples (all accepted);
    greedy drafts are accepted only when the sample is the argmax."""
    rates = {}
    for how in ("coupled", "greedy"):
        engine = spec_engine("draft_model", 3, max_num_batched_tokens=32, draft_sampling=how)
        run_seeded(engine, {0: [0, 1, 3]})
        rates[how] = engine.stats.spec_stats.acceptance_rate
    assert rates["coupled"] == 1.0 > rates["greedy"]
