"""Automatic prefix caching: the same greedy tokens with the cache on and off (speculation,
chunking, preemption, eviction, failed steps), with cached tokens counted, shared between
requests admitted together, reused by the draft model, and never poisoned by drafts."""

from __future__ import annotations

import itertools

import pytest
import torch

from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams
from tests.engine.test_engine import CFG, make_engine
from tests.engine.test_prompt_logprobs import assert_close
from tests.spec_decode.test_seeded import draft
from tests.spec_decode.test_spec_engine import spec_engine

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def random_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, CFG.vocab_size, (n,), generator=gen).tolist()


SYSTEM = random_ids(41, seed=1)  # a shared system prompt (10 blocks of 4 and one token)
QUESTIONS = [random_ids(n, seed=10 + n) for n in (3, 9, 17, 6)]


def finish(engine: LLMEngine, requests: dict[str, list[int]],
           params: SamplingParams = GREEDY) -> dict[str, tuple[list[int], int]]:
    """Add the requests at once and run until done: (tokens, cached prompt tokens) by id."""
    for rid, ids in requests.items():
        engine.add_request(rid, ids, params)
    return {o.request_id: (o.outputs[0].token_ids, o.num_cached_tokens)
            for o in engine.run_until_done() if o.finished}


def conversation(engine: LLMEngine) -> dict[str, tuple[list[int], int]]:
    """A shared system prompt, staggered; a second turn resent with its history after idle;
    a repeated prompt; then a burst of requests sharing a prefix admitted together."""
    done: dict[str, tuple[list[int], int]] = {}
    step = 0
    while step < 4 or engine.has_unfinished_requests():
        if step < 4:  # one new question per step while earlier ones run
            engine.add_request(f"q{step}", SYSTEM + QUESTIONS[step], GREEDY)
        done.update({o.request_id: (o.outputs[0].token_ids, o.num_cached_tokens)
                     for o in engine.step() if o.finished})
        step += 1
    history = SYSTEM + QUESTIONS[0] + done["q0"][0]
    done |= finish(engine, {"turn2": history + random_ids(5, seed=99)})
    done |= finish(engine, {"again": SYSTEM + QUESTIONS[2]})
    done |= finish(engine, {f"burst{i}": history + random_ids(2 + i, seed=50 + i)
                            for i in range(4)})
    return done


ENGINES = {
    "chunks of 16": lambda **o: make_engine(max_num_batched_tokens=16, **o),
    "one chunk": lambda **o: make_engine(max_num_batched_tokens=256, **o),
    "prefill first": lambda **o: make_engine(enable_chunked_prefill=False, **o),
    "preempted": lambda **o: make_engine(num_kv_blocks=24, max_model_len=96,
                                         max_num_batched_tokens=32, **o),
    "ngram": lambda **o: spec_engine("ngram", 3, max_num_batched_tokens=32, **o),
    "draft": lambda **o: spec_engine("draft_model", 3, max_num_batched_tokens=32, **o),
    "unrelated draft": lambda **o: draft(3, unrelated=True, max_num_batched_tokens=32, **o),
    "goodput": lambda **o: spec_engine("draft_model", 4, policy="goodput",
                                       max_num_batched_tokens=32, **o),
}


@pytest.fixture(scope="module")
def uncached() -> dict[str, list[int]]:
    done = conversation(make_engine(max_num_batched_tokens=256, enable_prefix_caching=False))
    assert all(cached == 0 for _, cached in done.values())
    return {rid: tokens for rid, (tokens, _) in done.items()}


@pytest.mark.parametrize("name", list(ENGINES))
def test_greedy_outputs_equal_with_caching_on_and_off(uncached, name: str) -> None:
    engine = ENGINES[name]()
    done = conversation(engine)
    assert {rid: tokens for rid, (tokens, _) in done.items()} == uncached
    cached = {rid: c for rid, (_, c) in done.items()}
    stats = engine.stats
    assert 0 < stats.prefix_cache_hit_rate < 1
    if name == "preempted":  # a pool this small evicts: hits vary, outputs do not
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    else:
        # later questions share the system prompt's 10 full blocks; the second turn its
        # history; the repeated prompt all but its last token's block
        assert all(cached[f"q{i}"] in (0, 40) for i in range(4)) and cached["q3"] == 40
        history_len = len(SYSTEM) + len(QUESTIONS[0]) + GREEDY.max_tokens
        assert cached["turn2"] == history_len // 4 * 4
        assert cached["again"] == (len(SYSTEM) + len(QUESTIONS[2]) - 1) // 4 * 4
        assert all(cached[f"burst{i}"] >= history_len // 4 * 4 for i in range(4))
        assert stats.prefix_cache_hits == sum(cached.values())
    if "draft" in name:
        assert stats.spec_stats.num_drafts > 0
    if name == "unrelated draft":
        assert stats.spec_stats.acceptance_rate < 0.5  # drafts rejected all along


def test_caching_off_finds_nothing() -> None:
    """Nor does it count lookups (vLLM's prefix_cache_queries): with caching off, or for a
    request whose prompt logprobs need its whole prompt computed, no lookup is made, and
    the hit rate is that of the lookups made."""
    engine = make_engine(enable_prefix_caching=False)
    done = finish(engine, {"a": SYSTEM + QUESTIONS[0]}) | finish(engine, {"b": SYSTEM})
    assert done["b"][1] == 0 and engine.stats.prefix_cache_hits == 0
    assert engine.blocks.num_cached_blocks == 0
    assert engine.stats.prefix_cache_queries == 0
    engine = make_engine()
    finish(engine, {"a": SYSTEM})
    queries = engine.stats.prefix_cache_queries
    assert queries == len(SYSTEM)
    engine.add_request("scored", SYSTEM, SamplingParams(temperature=0, max_tokens=2,
                                                        prompt_logprobs=1))
    list(engine.run_until_done())
    assert engine.stats.prefix_cache_queries == queries
    finish(engine, {"again": SYSTEM})
    assert engine.stats.prefix_cache_queries == 2 * queries
    assert engine.stats.prefix_cache_hits == (len(SYSTEM) - 1) // 4 * 4


def test_requests_admitted_together_share_the_prefix_computed_in_that_step() -> None:
    """n choices of one prompt (or requests with one system prompt) arriving at once: the
    first computes the prefix, the others share its blocks in the same step."""
    engine = make_engine(max_num_batched_tokens=256)
    outs = finish(engine, {f"c{j}": SYSTEM + QUESTIONS[1] for j in range(3)})
    assert [outs[f"c{j}"][1] for j in range(3)] == [0, 48, 48]
    assert len({tuple(tokens) for tokens, _ in outs.values()}) == 1
    step = engine.stats.recent[0]
    assert step.num_prefill_tokens + step.num_decode_tokens == 50 + 2 * 2  # not 3 x 50


def test_llm_generate_n_shares_the_prompt(tmp_path) -> None:
    from braid.llm import LLM

    llm = LLM.__new__(LLM)
    llm.engine = make_engine()
    llm._ids = itertools.count()
    outs = llm.generate([SYSTEM + QUESTIONS[2]], SamplingParams(n=3, max_tokens=4, seed=5),
                        use_tqdm=False)
    assert len(outs[0].outputs) == 3
    assert llm.engine.stats.prefix_cache_hits == 2 * 56


def test_eviction_under_pressure_keeps_outputs() -> None:
    """A pool that holds two prompts at a time: old prefixes are evicted least recently used
    first, every output stays right, and a prefix used again recently survives."""
    many = {f"p{i}": random_ids(40, seed=200 + i) for i in range(6)}  # 13 blocks each
    reference = finish(make_engine(enable_prefix_caching=False), many)
    engine = make_engine(num_kv_blocks=64, max_model_len=64, max_num_seqs=2)
    assert finish(engine, many) == {rid: (tokens, 0) for rid, (tokens, _) in reference.items()}
    assert engine.blocks.num_cached_blocks <= 64
    again = finish(engine, {"p5-again": many["p5"], "p0-again": many["p0"]})
    assert again["p5-again"] == (reference["p5"][0], 36)  # freed last: still cached
    assert again["p0-again"][0] == reference["p0"][0]
    assert again["p0-again"][1] < 36  # freed first: (mostly) evicted
    engine.scheduler.check_invariants()


def test_rejected_drafts_never_poison_the_cache() -> None:
    """An unrelated draft is rejected at most positions, so its KV lands in the request's
    blocks all along; a later request whose prompt is that request's whole output shares those
    blocks and must see only the target's KV of the accepted tokens."""
    first = SYSTEM[:18]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = draft(3, unrelated=True, max_num_batched_tokens=32)
    out = finish(engine, {"a": first}, params)["a"][0]
    assert engine.stats.spec_stats.acceptance_rate < 0.5
    follow_up = first + out + [5]
    got = finish(engine, {"b": follow_up})
    assert got["b"][1] == 44  # every full block of a's tokens that has KV (not its last)
    want = finish(make_engine(enable_prefix_caching=False), {"b": follow_up})
    assert got["b"][0] == want["b"][0]


def failing_first_forward(monkeypatch, prompts: dict[str, list[int]]) -> LLMEngine:
    """An engine with `prompts` added whose first forward raised once (a fault of that
    forward alone): the step ran again in parts (braid/engine/isolation.py)."""
    engine = make_engine(max_num_batched_tokens=256)
    execute = engine.runner.execute
    calls = {"n": 0}

    def fail_once(inp):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return execute(inp)

    monkeypatch.setattr(engine.runner, "execute", fail_once)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    assert all(o.outputs[0].finish_reason is None for o in engine.step())
    return engine


def test_a_step_run_again_publishes_what_it_computed(monkeypatch) -> None:
    engine = failing_first_forward(monkeypatch, {"a": SYSTEM})
    assert engine.blocks.num_cached_blocks == len(SYSTEM) // 4  # written by the second run
    got = finish(engine, {"b": SYSTEM})
    assert got["b"][1] == len(SYSTEM) // 4 * 4 - (len(SYSTEM) % 4 == 0) * 4
    want = finish(make_engine(enable_prefix_caching=False), {"b": SYSTEM})
    assert got["b"][0] == want["b"][0] == got["a"][0]


def test_a_request_admitted_onto_a_failed_step_s_blocks_recomputes_them(monkeypatch) -> None:
    """"b" is admitted onto the blocks "a" publishes in the same step (the same prompt), and
    the step fails: run again in parts, b would read KV a part without a never wrote, so b
    goes back to waiting and recomputes; a's result stands; both outputs are the model's."""
    engine = failing_first_forward(monkeypatch, {"a": SYSTEM, "b": SYSTEM})
    b = engine.requests["b"]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    got = finish(engine, {})
    want = finish(make_engine(enable_prefix_caching=False), {"b": SYSTEM})
    assert got["a"][0] == got["b"][0] == want["b"][0]


def test_draft_catch_up_skips_a_cached_prefix() -> None:
    """The draft's KV is cached with the target's: a second request on the same prompt gets
    its first drafts without the draft recomputing the prefix."""
    engine = spec_engine("draft_model", 3, max_num_batched_tokens=256)
    proposer = engine.speculator.proposer
    sizes: list[int] = []
    run = proposer.runner.execute
    proposer.runner.execute = lambda inp: (sizes.append(inp.input_ids.numel()), run(inp))[1]
    prompt = SYSTEM + QUESTIONS[3]  # 47 tokens
    finish(engine, {"a": prompt})
    first_catch_up_a = sizes[0]
    sizes.clear()
    lags: list[int] = []  # what the goodput policy would price b's first draft at
    propose = proposer.propose
    proposer.propose = lambda reqs, ks: (lags.extend(proposer.lag(r) for r in reqs),
                                         propose(reqs, ks))[1]
    finish(engine, {"b": prompt[:44] + [7, 8, 9]})
    assert first_catch_up_a == len(prompt) + 1  # the whole prompt and the first token
    assert lags[0] == 3 + 1
    # b shares 44 tokens of target KV, and the draft's KV of them: its catch-up is its own
    # 3 tokens and the first generated one
    assert sizes[0] == 3 + 1
    assert engine.stats.spec_stats.acceptance_rate == 1.0


def test_prompt_logprobs_requests_compute_the_whole_prompt() -> None:
    """Prompt logprobs need every prompt position's logits, so such a request does not
    take cached blocks (as in vLLM), and gets the same logprobs as on a fresh engine."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    engine = make_engine()
    finish(engine, {"warm": SYSTEM})
    engine.add_request("lp", SYSTEM, params)
    got = [o for o in engine.run_until_done() if o.finished][0]
    fresh = make_engine(enable_prefix_caching=False)
    fresh.add_request("lp", SYSTEM, params)
    want = [o for o in fresh.run_until_done() if o.finished][0]
    assert got.num_cached_tokens == 0
    assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
    assert_close(got.prompt_logprobs, [None if e is None else {t: lp.logprob for t, lp in e.items()}
                                       for e in want.prompt_logprobs])


def test_next_step_counts_a_cached_prefix_as_free() -> None:
    """The speculation policy and the ITL cap plan from next_step(): a waiting request's
    cached prefix adds no prefill tokens there."""
    engine = make_engine(max_num_batched_tokens=256)
    finish(engine, {"a": SYSTEM})
    engine.add_request("b", SYSTEM + QUESTIONS[1], GREEDY)
    assert engine.scheduler.next_step().num_prefill_tokens == len(SYSTEM) + 9 - 40
    engine.add_request("c", QUESTIONS[1], GREEDY)
    assert engine.scheduler.next_step().num_prefill_tokens == len(SYSTEM) + 9 - 40 + 9


def test_a_preempted_request_refinds_its_blocks() -> None:
    """Prompts that share nothing, a pool too small for all: a preempted request is
    re-admitted past the blocks it computed before (they were not evicted yet)."""
    many = {f"u{i}": random_ids(60, seed=300 + i) for i in range(4)}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = finish(make_engine(enable_prefix_caching=False), many, params)
    engine = make_engine(num_kv_blocks=40, max_model_len=104, max_num_batched_tokens=32)
    got = finish(engine, many, params)
    assert {rid: t for rid, (t, _) in got.items()} == {rid: t for rid, (t, _) in want.items()}
    assert engine.stats.num_preemptions > 0
    assert all(c == 0 for _, c in got.values())  # the first admissions found nothing
    assert engine.stats.prefix_cache_hits > 0  # the re-admissions did


def test_aborting_a_sharer_leaves_the_others_intact() -> None:
    engine = make_engine(max_num_batched_tokens=32)
    ids = {f"s{i}": SYSTEM + QUESTIONS[i] for i in range(3)}
    for rid, prompt in ids.items():
        engine.add_request(rid, prompt, GREEDY)
    for _ in range(4):
        engine.step()
    engine.abort("s0")  # the first: the others share the blocks it published
    done = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done() if o.finished}
    want = finish(make_engine(enable_prefix_caching=False), {k: ids[k] for k in ("s1", "s2")})
    assert done == {rid: t for rid, (t, _) in want.items()}
    engine.scheduler.check_invariants()
    assert engine.blocks.num_used_blocks == 0 and engine.blocks.num_cached_blocks > 0
