"""prompt_logprobs come from prompt positions only (the transformers reference on the same
weights), whatever the chunking, preemption or speculation; logit_bias steers sampling."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from braid.engine.engine import LLMEngine, RequestError
from braid.outputs import Logprob, PromptLogprobs
from braid.sampling_params import SamplingParams
from tests.engine.test_engine import CFG, STAGGERED, make_engine, prompts
from tests.spec_decode.test_spec_engine import spec_engine
from tests.tiny import hf_model

TOP = 3
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def reference_logprobs() -> list[torch.Tensor]:
    """Per prompt: transformers' logprobs [L, V] at every position."""
    model = hf_model(CFG, seed=0)
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float().log_softmax(-1) for ids in prompts()]


@pytest.fixture(scope="module")
def reference(reference_logprobs) -> list[list[dict[int, float] | None]]:
    """Per prompt: None, then {prompt token: logprob, top-3...} from transformers."""
    out = []
    for ids, logprobs in zip(prompts(), reference_logprobs, strict=True):
        entries: list[dict[int, float] | None] = [None]
        for p in range(len(ids) - 1):
            top = logprobs[p].topk(TOP)
            entries.append({ids[p + 1]: logprobs[p, ids[p + 1]].item(),
                            **dict(zip(top.indices.tolist(), top.values.tolist(),
                                       strict=True))})
        out.append(entries)
    return out


def run_all(engine: LLMEngine) -> dict[int, PromptLogprobs]:
    """Each request's prompt logprobs."""
    ps, got, step = prompts(), {}, 0
    while step <= max(STAGGERED) or engine.has_unfinished_requests():
        for i in STAGGERED.get(step, []):
            engine.add_request(str(i), ps[i], PARAMS)
        for out in engine.step():
            if out.finished:
                assert out.prompt_logprobs is not None
                got[int(out.request_id)] = out.prompt_logprobs
        engine.blocks.check_invariants()
        step += 1
    return got


def assert_close(got: PromptLogprobs, want: list[dict[int, float] | None]) -> None:
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g is not None and w is not None and g.keys() == w.keys()
        assert all(math.isclose(g[t].logprob, w[t], abs_tol=1e-3) for t in w)


def assert_ranked(entry: dict[int, Logprob], token: int, row: torch.Tensor) -> None:
    """`token`'s vocabulary rank is 1 + the tokens transformers' `row` finds more likely
    (within the logprobs' tolerance, so a near tie may go either way); the other entries,
    the top-n, rank 1..n in order."""
    rank = entry[token].rank
    surely_above = int((row > row[token] + 1e-3).sum()) + 1
    maybe_above = int((row > row[token] - 1e-3).sum()) + 1
    assert rank is not None and surely_above <= rank <= maybe_above
    top = [lp for t, lp in entry.items() if t != token]
    assert [lp.rank for lp in top] == [r for r in range(1, TOP + 1) if r != rank][:len(top)]


def scoring_in_cuts(rows: int) -> LLMEngine:
    engine = make_engine(max_num_batched_tokens=256)
    engine.scheduler.max_scored_rows = rows
    return engine


ENGINES = {
    "one chunk": lambda: make_engine(max_num_batched_tokens=256),
    "scored 3 positions a step beside decodes": lambda: scoring_in_cuts(3),
    "chunks of 16": lambda: make_engine(max_num_batched_tokens=16),
    "preempted": lambda: make_engine(num_kv_blocks=40, max_model_len=160,
                                     max_num_batched_tokens=32),
    "ngram speculation": lambda: spec_engine("ngram", 3, max_num_batched_tokens=32),
    "draft speculation": lambda: spec_engine("draft_model", 3, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("name", list(ENGINES))
def test_prompt_logprobs_match_transformers(reference, name: str) -> None:
    engine = ENGINES[name]()
    got = run_all(engine)
    assert sorted(got) == list(range(len(reference)))
    for i, want in enumerate(reference):
        assert_close(got[i], want)
    if name == "preempted":
        assert engine.stats.num_preemptions > 0


@pytest.mark.parametrize("name", ["chunks of 16", "preempted", "draft speculation"])
def test_prompt_token_ranks_match_transformers(reference_logprobs, name: str) -> None:
    """Each prompt token's vocabulary rank (vLLM's Logprob.rank), as transformers ranks it."""
    got = run_all(ENGINES[name]())
    for i, ids in enumerate(prompts()):
        assert len(got[i]) == len(ids) and got[i][0] is None
        for p, entry in enumerate(got[i][1:]):
            assert entry is not None
            assert_ranked(entry, ids[p + 1], reference_logprobs[i][p])


def test_no_prompt_logprobs_unless_asked() -> None:
    engine = make_engine()
    engine.add_request("a", prompts()[1], SamplingParams(temperature=0, max_tokens=2))
    outs = [o for o in engine.run_until_done() if o.finished]
    assert outs[0].prompt_logprobs is None


def test_logit_bias_forces_a_token_greedy_and_sampled() -> None:
    engine = make_engine()
    for i, temperature in enumerate([0.0, 1.0]):
        engine.add_request(str(i), prompts()[0], SamplingParams(
            temperature=temperature, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}))
    done = [o for o in engine.run_until_done() if o.finished]
    assert [o.outputs[0].token_ids for o in done] == [[42] * 6] * 2


def test_logit_bias_with_speculation_is_lossless() -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            logit_bias={7: 5.0, 9: -100.0, 11: 3.0})
    outputs = []
    for engine in (make_engine(), spec_engine("draft_model", 3), spec_engine("ngram", 2)):
        for i, ids in enumerate(prompts()[:4]):
            engine.add_request(str(i), ids, params)
        outputs.append({o.request_id: o.outputs[0].token_ids
                        for o in engine.run_until_done() if o.finished})
    assert outputs[0] == outputs[1] == outputs[2]
    assert all(9 not in tokens for tokens in outputs[0].values())


def test_allowed_token_ids_restrict_output_with_and_without_speculation() -> None:
    """vLLM's allowed_token_ids: every output token among them, greedy and sampled, over
    several batches; greedy speculation equals greedy without it."""
    allowed = [5, 9, 17, 23, 42]
    outputs = []
    for engine in (make_engine(), spec_engine("draft_model", 3), spec_engine("ngram", 2)):
        for batch in range(2):  # a second batch after the engine went idle
            for i, ids in enumerate(prompts()[:4]):
                engine.add_request(f"{batch}-{i}", ids, SamplingParams(
                    temperature=0 if i % 2 == 0 else 1.0, seed=i, max_tokens=10,
                    ignore_eos=True, allowed_token_ids=allowed))
            outputs.append({o.request_id: o.outputs[0].token_ids
                            for o in engine.run_until_done() if o.finished})
    assert all(set(t) <= set(allowed) and len(t) == 10
               for out in outputs for t in out.values())
    greedy = [{k: v for k, v in out.items() if int(k[-1]) % 2 == 0} for out in outputs]
    assert all(g == greedy[0] for g in greedy[::2]) and all(g == greedy[1] for g in greedy[1::2])
    plain = make_engine()
    plain.add_request("free", prompts()[0], SamplingParams(temperature=0, max_tokens=10,
                                                           ignore_eos=True))
    free = next(o for o in plain.run_until_done() if o.finished).outputs[0].token_ids
    assert not set(free) <= set(allowed)  # the restriction did something


@pytest.mark.parametrize("allowed", [[], [-1], [CFG.vocab_size], [True]])
def test_bad_allowed_token_ids_are_refused(allowed: list[int]) -> None:
    with pytest.raises((RequestError, ValueError), match="allowed_token_ids"):
        make_engine().add_request("a", [1, 2], SamplingParams(allowed_token_ids=allowed))


@pytest.mark.parametrize("bias", [{CFG.vocab_size: 1.0}, {-1: 1.0}, {3: 101.0}])
def test_bad_logit_bias_is_refused(bias: dict[int, float]) -> None:
    with pytest.raises((RequestError, ValueError), match="logit_bias"):
        make_engine().add_request("a", [1, 2], SamplingParams(logit_bias=bias))


@pytest.mark.parametrize("name", ["one chunk", "ngram speculation", "draft speculation"])
def test_sampled_logprobs_match_transformers(name: str) -> None:
    """Each emitted token's logprob, rank and the top-n are the raw model's at its position,
    also for tokens that came from accepted drafts, and `cumulative_logprob` is their sum; a
    request that asks for none gets None for both."""
    engine = ENGINES[name]()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP)
    ps = prompts()[:4]
    for i, ids in enumerate(ps):
        engine.add_request(str(i), ids, params)
    engine.add_request("plain", ps[0], SamplingParams(temperature=0, max_tokens=4))
    done = {o.request_id: o.outputs[0] for o in engine.run_until_done() if o.finished}
    assert done["plain"].logprobs is None and done["plain"].cumulative_logprob is None
    model = hf_model(CFG, seed=0)
    for i, ids in enumerate(ps):
        out = done[str(i)]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 8
        with torch.no_grad():
            full = model(torch.tensor([ids + out.token_ids])).logits[0].float().log_softmax(-1)
        rows = full[len(ids) - 1: len(ids) - 1 + len(out.token_ids)]
        total = rows.gather(1, torch.tensor(out.token_ids)[:, None]).sum().item()
        assert out.cumulative_logprob is not None
        assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-3)
        for j, (token, got) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = full[len(ids) - 1 + j]
            top = row.topk(TOP)
            want = {token: row[token].item(),
                    **dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))}
            assert got.keys() == want.keys()
            assert all(math.isclose(got[t].logprob, want[t], abs_tol=1e-3) for t in want)
            assert_ranked(got, token, row)


def test_a_scoring_prompt_goes_in_small_chunks_beside_decodes() -> None:
    """Each scored position is a vocabulary-wide log-softmax and ranking: beside decodes a
    prompt that asks for logprobs computes max_scored_rows positions a step (their steps stay
    near a decode step's cost); alone, as much as the budget allows."""
    ps = prompts()
    engine = scoring_in_cuts(5)
    engine.add_request("decoding", ps[0], replace(PARAMS, max_tokens=60, prompt_logprobs=None))
    engine.step()
    engine.add_request("scoring", ps[1], PARAMS)
    chunks = []
    while engine.requests["scoring"].is_prefilling:
        before = engine.requests["scoring"].num_computed_tokens
        engine.step()
        assert not engine.requests["decoding"].is_prefilling
        chunks.append(engine.requests["scoring"].num_computed_tokens - before)
    assert len(ps[1]) > 10 and max(chunks) == 5
    alone = scoring_in_cuts(5)
    alone.add_request("scoring", ps[1], PARAMS)
    alone.step()
    assert alone.requests["scoring"].num_computed_tokens == len(ps[1])


def test_n_choices_of_a_prompt_score_it_once(reference) -> None:
    """The choices of one group with the same prompt: the first scores it, the others wait
    until it has, then share its entries and its cached prefix (16 choices scored a
    1,900-token prompt 16 times: 207 s and 47 MB)."""
    engine = make_engine(enable_prefix_caching=True)
    prompt = prompts()[1]
    sampled = SamplingParams(temperature=1, max_tokens=4, prompt_logprobs=TOP)
    for j in range(4):
        engine.add_request(f"c{j}", prompt, replace(sampled, seed=j), group="g")
    out = {o.request_id: o for o in engine.run_until_done() if o.finished}
    for j in range(4):
        assert out[f"c{j}"].prompt_logprobs is not None
        assert_close(out[f"c{j}"].prompt_logprobs, reference[1])
    assert out["c0"].num_cached_tokens == 0
    assert all(out[f"c{j}"].num_cached_tokens > 0 for j in (1, 2, 3))  # the scorer's blocks


def test_choices_score_the_prompt_themselves_when_their_scorer_is_gone(reference) -> None:
    engine = make_engine(enable_prefix_caching=True)
    prompt = prompts()[1]
    for j in range(3):
        engine.add_request(f"c{j}", prompt, PARAMS, group="g")
    engine.abort("c0")  # before it scored anything
    out = {o.request_id: o for o in engine.run_until_done() if o.finished}
    assert set(out) == {"c1", "c2"}
    for o in out.values():
        assert o.prompt_logprobs is not None
        assert_close(o.prompt_logprobs, reference[1])
