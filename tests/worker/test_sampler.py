from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from braid.bad_words import BadWordIndex
from braid.sampling_params import SamplingParams
from braid.worker.sampler import (
    DRAFT,
    SAMPLE,
    SamplingMetadata,
    apply_penalties,
    filtered_logits,
    gather_logprobs,
    inverse_cdf,
    keyed_uniform,
    sample_rows,
    target_probs,
)

V = 32
EOS = 0


def build(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    seeds: list[int] | None = None,
    vocab_size: int = V,
) -> SamplingMetadata:
    """Rows without a given seed get one from torch's global generator (as the engine draws
    one for each unseeded request), so `torch.manual_seed` fixes a test's draws."""
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[1, 2, 3]] * n,
        outputs if outputs is not None else [[]] * n,
        seeds if seeds is not None else torch.randint(0, 2**62, (n,)).tolist(),
        vocab_size,
        "cpu",
        eos_token_ids={EOS},
    )


def random_logits(rows: int, seed: int, vocab_size: int = V) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab_size, generator=gen) * 3


# Plain per-row references, written for readability, not speed.


def ref_penalize(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    out = logits.clone().double()
    for tok in range(out.numel()):
        count = output.count(tok)
        if tok in prompt or count:
            rp = p.repetition_penalty
            out[tok] = out[tok] / rp if out[tok] > 0 else out[tok] * rp
        out[tok] -= p.frequency_penalty * count
        if count:
            out[tok] -= p.presence_penalty
    if len(output) < p.min_tokens:
        for tok in set(p.stop_token_ids or []) | (set() if p.ignore_eos else {EOS}):
            out[tok] = -math.inf
    return out


def ref_filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature -> min_p -> top_k -> top_p on one row (float64)."""
    x = logits.double() / p.temperature
    probs = x.softmax(-1)
    if p.min_p > 0:
        x[probs < p.min_p * probs.max()] = -math.inf
    if p.top_k > 0:
        kth = sorted(x.tolist(), reverse=True)[min(p.top_k, x.numel()) - 1]
        x[x < kth] = -math.inf
    if p.top_p < 1:
        probs = x.softmax(-1)
        keep, mass = set(), 0.0
        for tok in sorted(range(x.numel()), key=lambda t: -probs[t].item()):
            keep.add(tok)
            mass += probs[tok].item()
            if mass >= p.top_p:
                break
        for tok in range(x.numel()):
            if tok not in keep:
                x[tok] = -math.inf
    return x


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(actual[finite].double(), expected[finite], atol=1e-4, rtol=1e-4)


FILTER_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.5, top_p=0.5),
    SamplingParams(top_p=0.9, top_k=10),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.7, min_p=0.05, top_k=8, top_p=0.8),
    SamplingParams(top_k=V + 5),
    SamplingParams(top_k=-1, top_p=0.3),
    SamplingParams(top_p=1e-8),  # 1 - p rounds to 1 in float32: only the top token survives
]


def test_filters_match_reference() -> None:
    logits = random_logits(len(FILTER_PARAMS), seed=0)
    meta = build(FILTER_PARAMS)
    actual = filtered_logits(apply_penalties(logits, meta), meta)
    for row, p in enumerate(FILTER_PARAMS):
        assert_same_logits(actual[row], ref_filter(logits[row], p))


def test_top_k_fast_path_matches_reference() -> None:
    params = [
        SamplingParams(top_k=3),
        SamplingParams(top_k=9, top_p=0.6, temperature=0.8),
        SamplingParams(top_k=5, min_p=0.2),
        SamplingParams(temperature=0),
    ]
    logits = random_logits(len(params), seed=11)
    meta = build(params)
    assert meta.max_top_k == 9  # every random row has a top-k: topk instead of a full sort
    actual = filtered_logits(apply_penalties(logits, meta), meta)
    for row, p in enumerate(params[:-1]):
        assert_same_logits(actual[row], ref_filter(logits[row], p))
    assert int(actual[-1].argmax()) == int(logits[-1].argmax())
    assert int(target_probs(logits, meta)[-1].argmax()) == int(logits[-1].argmax())


def test_ties_keep_a_rows_distribution_whatever_else_the_batch_holds() -> None:
    """Ties with a row's k-th logit, or across its top-p boundary, give the same
    distribution alone, beside a row with a larger top_k (the topk fast path, K = 12) and
    beside a row without one (a full sort): every tie of the k-th logit is kept, and tied
    tokens pass top-p together. The same logits, bit for bit."""
    torch.manual_seed(3)
    row = -torch.rand(V)
    row[4:14] = 0.5  # ten tied tokens that top_k=6 cuts through
    row[0] = 1.5
    tied_k = SamplingParams(top_k=6)
    # token 0 holds 0.21 of the mass, each tie 0.08: mass 0.3 is reached inside the tie
    tied_p = SamplingParams(top_k=8, top_p=0.3)
    for p in (tied_k, tied_p):
        shown = [filtered_logits(logits, meta)[0] for logits, meta in (
            (row[None], build([p])),
            (torch.stack([row, row]), build([p, SamplingParams(top_k=12)])),
            (torch.stack([row, row]), build([p, SamplingParams(temperature=0.5)])),
        )]
        assert all(torch.equal(shown[0], other) for other in shown[1:])
        kept = set(torch.nonzero(shown[0] > -math.inf).flatten().tolist())
        assert kept == {0} | set(range(4, 14)), kept


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.lists(
        st.tuples(
            st.sampled_from([0.3, 0.8, 1.0, 2.0]),
            st.sampled_from([0, -1, 2, 5, 20]),
            st.sampled_from([1.0, 0.95, 0.6, 0.2]),
            st.sampled_from([0.0, 0.02, 0.3]),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_filters_match_reference_property(
    seed: int, rows: list[tuple[float, int, float, float]]
) -> None:
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows]
    logits = random_logits(len(params), seed=seed)
    actual = filtered_logits(logits, build(params))
    for row, p in enumerate(params):
        assert_same_logits(actual[row], ref_filter(logits[row], p))


PENALTY_PARAMS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-0.5),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.1),
    SamplingParams(),
    SamplingParams(temperature=0, repetition_penalty=2.0),
]
PROMPTS = [[1, 2, 3, 3], [4], [], [5, 6, 7, 8, 9], [1, 2], [10, 11]]
OUTPUTS = [[3, 12, 12], [4, 4, 4, 13], [14, 14, 1], [], [7, 7], [10, 20, 20, 21]]


def test_penalties_match_reference() -> None:
    logits = random_logits(len(PENALTY_PARAMS), seed=1)
    meta = build(PENALTY_PARAMS, PROMPTS, OUTPUTS)
    original = logits.clone()
    actual = apply_penalties(logits, meta)
    assert torch.equal(logits, original), "apply_penalties must not modify its input"
    for row, p in enumerate(PENALTY_PARAMS):
        expected = ref_penalize(logits[row], p, PROMPTS[row], OUTPUTS[row])
        assert_same_logits(actual[row], expected)


def test_penalties_then_filters_match_reference() -> None:
    params = [
        SamplingParams(repetition_penalty=1.5, top_k=4, temperature=0.8),
        SamplingParams(frequency_penalty=1.0, top_p=0.7, min_p=0.05),
    ]
    logits = random_logits(2, seed=2)
    meta = build(params, PROMPTS[:2], OUTPUTS[:2])
    actual = filtered_logits(apply_penalties(logits, meta), meta)
    for row, p in enumerate(params):
        penalized = ref_penalize(logits[row], p, PROMPTS[row], OUTPUTS[row])
        assert_same_logits(actual[row], ref_filter(penalized, p))


def test_build_skips_unused_tensors() -> None:
    meta = build([SamplingParams(), SamplingParams(temperature=0, top_p=0.5)])
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.repetition_penalty is None and meta.penalized is None
    assert meta.suppressed is None and meta.logit_bias is None
    meta = build([SamplingParams(frequency_penalty=0.5)], outputs=[[]])
    assert meta.penalized is not None and meta.repetition_penalty is None
    assert meta.penalized.rows.numel() == 0  # no output yet, and the prompt does not count


def test_allowed_token_ids_join_the_grammar_masks() -> None:
    """A row may take what both its grammar and its allowed_token_ids allow; rows with only
    one of them, or neither, keep theirs."""
    params = [SamplingParams(allowed_token_ids=[1, 2, 3]), SamplingParams(),
              SamplingParams(allowed_token_ids=[4, 5]), SamplingParams()]
    grammar = torch.zeros(2, V, dtype=torch.bool)
    grammar[0, [2, 3, 9]] = True  # row 0
    grammar[1, [7, 8]] = True  # row 3
    meta = SamplingMetadata.build(params, [[1]] * 4, [[]] * 4, [0] * 4, V, "cpu",
                                  allowed=(torch.tensor([0, 3]), grammar))
    assert meta.allowed is not None and meta.allowed[0].tolist() == [0, 2, 3]
    finite = apply_penalties(torch.zeros(4, V), meta).isfinite()
    assert [finite[row].nonzero().flatten().tolist() for row in range(4)] == [
        [2, 3], list(range(V)), [4, 5], [7, 8]]


def test_greedy_is_argmax_after_penalties() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, repetition_penalty=3.0)]
    logits = random_logits(2, seed=3)
    logits[1, 12] = 100.0  # wins unpenalized; the penalty makes it lose
    logits[1, 13] = 50.0
    meta = build(params, prompts=[[], []], outputs=[[], [12]])
    out = sample_rows(logits, meta)[0]
    assert out.dtype == torch.int64 and out.shape == (2,)
    assert out.tolist() == [int(logits[0].argmax()), 13]


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_k=1)] * 4
    meta = build(params)
    torch.manual_seed(0)
    for seed in range(20):
        logits = random_logits(len(params), seed=seed)
        out = sample_rows(logits, meta)[0]
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        assert torch.equal(out[greedy_rows], logits[greedy_rows].argmax(-1))


def test_target_probs() -> None:
    params = FILTER_PARAMS + [SamplingParams(temperature=0)]
    logits = random_logits(len(params), seed=4)
    meta = build(params)
    probs = target_probs(logits, meta)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(params)))
    for row, p in enumerate(FILTER_PARAMS):
        expected = ref_filter(logits[row], p).softmax(-1).float()
        torch.testing.assert_close(probs[row], expected, atol=1e-5, rtol=1e-4)
    assert probs[-1].tolist() == torch.eye(V)[int(logits[-1].argmax())].tolist()
    all_greedy = target_probs(logits[:1], build([SamplingParams(temperature=0)]))
    assert all_greedy[0, int(logits[0].argmax())] == 1 and all_greedy.sum() == 1


def draws(
    params: list[SamplingParams], logits: torch.Tensor, seeds: list[int]
) -> list[list[int]]:
    """Tokens at output positions 0..39 (a row's position is its number of output tokens)."""
    return [sample_rows(logits, build(params, outputs=[[9] * pos] * len(params), seeds=seeds))[0]
            .tolist() for pos in range(40)]


@pytest.mark.parametrize("position", [0, 2, 4])
def test_seeded_rows_do_not_depend_on_the_batch(position: int) -> None:
    target = SamplingParams(temperature=1.2, top_p=0.95, seed=7)
    logits_row = random_logits(1, seed=5) / 3  # flat enough that draws vary
    alone = [step[0] for step in draws([target], logits_row, [7])]
    assert len(set(alone)) > 5

    others = [SamplingParams(seed=1), SamplingParams(), SamplingParams(temperature=0)]
    others.append(SamplingParams(top_k=4, seed=99))
    params = others[:position] + [target] + others[position:]
    logits = random_logits(5, seed=6)
    logits[position] = logits_row[0]
    seeds = [1, 123 + position, 5, 99]  # the unseeded rows' seeds differ between the runs
    seeds = seeds[:position] + [7] + seeds[position:]
    in_batch = [step[position] for step in draws(params, logits, seeds)]
    assert in_batch == alone


def test_keyed_uniforms_are_a_function_of_seed_position_and_stream() -> None:
    u = keyed_uniform(7, 3)
    assert u == keyed_uniform(7, 3, SAMPLE) and 0 <= u < 1
    others = {keyed_uniform(8, 3), keyed_uniform(7, 4), keyed_uniform(7, 3, DRAFT),
              keyed_uniform(-1, 3), keyed_uniform(2**64 - 1, 3)}
    assert u not in others and len(others) == 4  # -1 and 2**64 - 1 are the same 64 bits
    values = torch.tensor([keyed_uniform(seed, pos) for seed in range(100) for pos in range(100)])
    assert abs(values.mean().item() - 0.5) < 0.01 and values.min() >= 0 and values.max() < 1


def test_inverse_cdf_never_draws_a_zero_mass_token() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([0.0, 0.4999, 0.5, 0.999999], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3]
    unnormalized = torch.tensor([[0.0, 2.0, 0.0, 6.0]])
    assert inverse_cdf(unnormalized, torch.tensor([0.3], dtype=torch.float64)).tolist() == [3]


def test_inverse_cdf_over_a_real_vocabulary_matches_one_cumulative_sum() -> None:
    """Two-level search over 151,936 tokens (blocks, then a token): the same tokens as one
    float64 cumulative sum, row by row the same in any batch, and never a zero-mass token
    (mass only at a few tokens, some on block edges)."""
    vocab = 151_936
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(16, vocab, generator=gen).pow(8).softmax(dim=-1)
    sparse = torch.zeros(4, vocab)
    sparse[:, [0, 1023, 1024, 70_000, vocab - 1]] = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    probs = torch.cat([probs, sparse])
    u = torch.rand(probs.shape[0], generator=gen, dtype=torch.float64)
    u[-4:] = torch.tensor([0.0, 0.1, 0.3, 0.9999999], dtype=torch.float64)
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    tokens = inverse_cdf(probs, u)
    assert torch.equal(tokens, expected)
    assert tokens[-4:].tolist() == [0, 1023, 1024, vocab - 1]
    alone = torch.cat([inverse_cdf(probs[i : i + 1], u[i : i + 1]) for i in range(len(u))])
    assert torch.equal(alone, tokens)


def empirical(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).double() / tokens.numel()


# With N = 20000 draws the standard error of a frequency is at most 0.0036; 0.015 is > 4 sigma.
N = 20_000
TOL = 0.015


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(top_p=0.8, min_p=0.05),
    ],
)
def test_empirical_distribution_matches(params: SamplingParams) -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.3, -1.0, 1.5]])
    expected = ref_filter(logits[0], params).softmax(-1)
    torch.manual_seed(0)
    tokens = sample_rows(logits.expand(N, -1), build([params] * N, vocab_size=8))[0]
    torch.testing.assert_close(empirical(tokens, 8), expected, atol=TOL, rtol=0)


def test_empirical_distribution_of_seeded_rows_matches() -> None:
    params = SamplingParams(temperature=0.8, seed=0)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.3, -1.0, 1.5]])
    n = 5000  # seeds 0..n-1 at position 0; standard error <= 0.0071, tolerance 0.03 > 4 sigma
    meta = build([params] * n, seeds=list(range(n)), vocab_size=8)
    tokens = sample_rows(logits.expand(n, -1), meta)[0]
    expected = (logits[0].double() / 0.8).softmax(-1)
    torch.testing.assert_close(empirical(tokens, 8), expected, atol=0.03, rtol=0)


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[5]),
        SamplingParams(min_tokens=3, stop_token_ids=[5]),
        SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(min_tokens=3, stop_token_ids=[5], temperature=0),
    ]
    outputs = [[9, 9], [9, 9, 9], [9], []]
    logits = torch.zeros(4, V)
    logits[:, EOS] = 20.0
    logits[:, 5] = 19.0
    torch.manual_seed(0)
    for _ in range(50):
        out = sample_rows(logits, build(params, outputs=outputs))[0].tolist()
        assert out[0] not in (EOS, 5)
        assert out[2] != 5
        assert out[3] not in (EOS, 5)
    assert out[1] == EOS and out[2] == EOS  # past min_tokens / eos not a stop


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(4, seed=8)
    sampled = torch.tensor([3, 0, 7, 31])
    raw = logits.log_softmax(-1)
    lp = gather_logprobs(raw, sampled, 3)
    assert lp.token_ids.shape == lp.logprobs.shape == (4, 4)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, :1], raw.gather(1, sampled[:, None]))
    top = raw.topk(3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert gather_logprobs(raw, sampled, 0).token_ids.shape == (4, 1)


def test_sampler_does_not_modify_logits() -> None:
    params = PENALTY_PARAMS + [SamplingParams(top_k=3, top_p=0.5, min_p=0.1, min_tokens=9)]
    logits = random_logits(len(params), seed=10)
    original = logits.clone()
    sample_rows(logits, build(params, PROMPTS + [[]], OUTPUTS + [[]]))
    assert torch.equal(logits, original)


def test_build_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [], [[]], [0], V, "cpu")


def dense_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """The penalties as [B, V] float32 arithmetic over the whole table."""
    counts = torch.zeros(len(params), logits.shape[1])
    prompt_mask = torch.zeros(len(params), logits.shape[1], dtype=torch.bool)
    for row, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        prompt_mask[row, prompt] = True
        for token in out:
            counts[row, token] += 1
    column = {name: torch.tensor([getattr(p, name) for p in params]).unsqueeze(1)
              for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")}
    seen = counts > 0
    rep = torch.where(seen | prompt_mask, column["repetition_penalty"], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - column["frequency_penalty"] * counts
    return logits - column["presence_penalty"] * seen


def test_penalties_equal_the_dense_arithmetic_bit_for_bit() -> None:
    """Penalties change only the (row, token) pairs of a row's prompt and output: the same
    float32 values as the arithmetic over the whole [B, V] table."""
    logits = random_logits(len(PENALTY_PARAMS), seed=12)
    meta = build(PENALTY_PARAMS, PROMPTS, OUTPUTS)
    assert torch.equal(apply_penalties(logits, meta),
                       dense_penalties(logits, PENALTY_PARAMS, PROMPTS, OUTPUTS))


@settings(max_examples=80, deadline=None)
@given(words=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=12),
       outputs=st.lists(st.lists(st.integers(0, 5), max_size=5), min_size=1, max_size=4))
def test_bad_words_refuse_the_token_that_would_complete_one(
    words: list[list[int]], outputs: list[list[int]]
) -> None:
    """vLLM's bad words: a word's last token is refused where the output ends with the rest
    of it (a one-token word always)."""
    params = [SamplingParams(bad_words_token_ids=words)] * len(outputs)
    refused = apply_penalties(torch.zeros(len(outputs), V), build(params, outputs=outputs))
    for row, out in enumerate(outputs):
        expected = {w[-1] for w in words
                    if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]}
        assert set((refused[row] == -math.inf).nonzero().flatten().tolist()) == expected


def test_logit_bias_and_allowed_ids_apply_to_every_row_of_their_request() -> None:
    """Long lists apply to each row of a window alike; ids past the vocabulary (a draft
    model's may be smaller) are skipped."""
    bias = {t: t / 4 for t in range(0, V + 8, 3)}
    allowed = list(range(1, V + 8, 2))
    params = [SamplingParams(logit_bias=bias, allowed_token_ids=allowed)] * 2
    params.append(SamplingParams())
    logits = random_logits(3, seed=13)
    shaped = apply_penalties(logits, build(params))
    expected = logits[:2].clone()
    expected[:, list(range(0, V, 3))] += torch.tensor([t / 4 for t in range(0, V, 3)])
    expected[:, [t for t in range(V) if t % 2 == 0]] = -math.inf
    assert torch.equal(shaped[:2], expected) and torch.equal(shaped[2], logits[2])


def test_rows_with_non_finite_logits_take_their_greedy_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A row whose logits hold NaN or +inf (a broken model; no request's parameters can make
    them) takes its greedy token, NaN counting as -inf, with a warning; a row with nothing
    left takes its end token. The other rows draw what they draw alone, and no row gets an
    id past the vocabulary (1100 tokens: the inverse CDF's last block is padded)."""
    vocab = 1100
    logits = random_logits(6, seed=14, vocab_size=vocab)
    logits[0, 7] = math.nan
    logits[1, 1050] = math.inf
    logits[2] = math.nan
    logits[3, [3, 1090]] = math.inf
    params = [SamplingParams(seed=i) for i in range(5)] + [SamplingParams(temperature=0)]
    logits[5, 9] = math.nan
    seeds = list(range(6))
    with caplog.at_level("WARNING", logger="braid"):
        tokens, probs = sample_rows(logits, build(params, seeds=seeds, vocab_size=vocab))
    assert "non-finite" in caplog.text
    assert probs is not None and probs.sum(dim=-1).isfinite().all()
    alone = sample_rows(logits[4:5], build(params[4:5], seeds=seeds[4:5], vocab_size=vocab))
    assert tokens.tolist() == [int(logits[0].nan_to_num(nan=-math.inf).argmax()), 1050, EOS,
                               3, int(alone[0][0]),
                               int(logits[5].nan_to_num(nan=-math.inf).argmax())]


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token() -> None:
    """top_p 1e-300 is 0 in float32: the top token (and its ties) still survives, as for any
    tiny p. SamplingParams moves such a p onto MIN_TOP_P, which means the same."""
    from braid.sampling_params import MIN_TOP_P

    past_the_bound = SamplingParams()
    past_the_bound.top_p = 1e-300
    assert SamplingParams(top_p=1e-300).top_p == MIN_TOP_P
    logits = random_logits(2, seed=15)
    for p in (past_the_bound, SamplingParams(top_p=1e-300)):
        kept = filtered_logits(logits, build([p, SamplingParams(top_p=0.5)])).isfinite()
        assert kept[0].nonzero().flatten().tolist() == [int(logits[0].argmax())]


@pytest.mark.parametrize("degenerate", [
    {"temperature": 1e-300}, {"temperature": 1e-45}, {"top_p": 1e-300},
    {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e300}])
def test_degenerate_parameters_leave_the_other_rows_alone(degenerate: dict) -> None:
    """Values whose float32 arithmetic degenerates (a temperature or penalty that is 0 or
    inf in float32): the row draws a token of the vocabulary (a tiny temperature or top_p
    its greedy one) and the rows beside it draw what they draw alone."""
    vocab = 1100
    params = [SamplingParams(seed=1, **degenerate), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, seed=2)]
    logits = random_logits(3, seed=16, vocab_size=vocab)
    prompts, outputs = [[1, 2, 40]] * 3, [[5, 6, 700]] * 3
    tokens = sample_rows(logits, build(params, prompts, outputs, [1, 0, 2], vocab))[0]
    for row in (1, 2):
        alone = build(params[row:row + 1], prompts[:1], outputs[:1], [row], vocab)
        assert int(tokens[row]) == int(sample_rows(logits[row:row + 1], alone)[0][0])
    assert 0 <= int(tokens[0]) < vocab
    if "repetition_penalty" not in degenerate:
        assert int(tokens[0]) == int(logits[0].argmax())


def test_filters_run_on_the_rows_that_ask_for_them() -> None:
    """One row's top-p or min-p leaves the rows without a filter as they are (only the
    temperature divides them), and its own row is what it is alone."""
    params = [SamplingParams(top_p=0.5), SamplingParams(temperature=0.5),
              SamplingParams(temperature=0), SamplingParams(min_p=0.2, top_k=3)]
    logits = random_logits(4, seed=17)
    shown = filtered_logits(logits, build(params))
    assert torch.equal(shown[1], logits[1] / 0.5) and torch.equal(shown[2], logits[2])
    for row in (0, 3):
        alone = filtered_logits(logits[row:row + 1], build(params[row:row + 1]))
        assert torch.equal(shown[row], alone[0])


def test_a_bad_word_index_crosses_processes_as_it_was() -> None:
    """The index the server builds is what the engine's process reads: pickled, it finds the
    same words (and its words are the words it was built from, each once)."""
    words = [[1, 2, 3], [1, 2, 4], [2], [5, 1, 2], [1, 2, 3], [], [7, 7]]
    index = pickle.loads(pickle.dumps(BadWordIndex(words)))
    assert sorted(index) == sorted({tuple(w): w for w in words if w}.values())
    assert len(index) == 5
    found = {index.lasts(key).tolist()[0] if len(index.lasts(key)) == 1 else
             tuple(index.lasts(key)) for key in index.completing([9, 5, 1, 2])}
    assert found == {2, (3, 4)}
    params = [SamplingParams(bad_words_token_ids=index)]
    refused = apply_penalties(torch.zeros(1, V), build(params, outputs=[[5, 1, 2]]))
    assert set((refused[0] == -math.inf).nonzero().flatten().tolist()) == {2, 3, 4}
