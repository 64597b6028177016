from __future__ import annotations

import dataclasses

import pytest
import torch

from braid.sampling_params import SamplingParams
from braid.worker.sampler import (
    SamplingMetadata,
    inverse_cdf,
    keyed_uniform_array,
    sample_rows,
    target_probs,
)
from braid.worker.verify import verify
from tests.worker.test_sampler import V, build

TV_TOLERANCE = 0.01


def same_params_meta(
    params: SamplingParams, seeds: list[int], positions: list[int], vocab_size: int = V
) -> SamplingMetadata:
    """`build([params] * rows)` without its per-row tensor work (seconds at 600k rows): one
    row's tensors, expanded; row i keyed by (seeds[i], positions[i]). Only for params without
    min_tokens or penalties."""
    one = build([params], vocab_size=vocab_size)
    assert one.suppressed is None and one.penalized is None
    rows = len(seeds)
    fields = {f.name: getattr(one, f.name) for f in dataclasses.fields(one)}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            fields[name] = value.expand(rows, *value.shape[1:])
    fields.update(seeds=seeds, positions=positions)
    if not params.greedy:
        fields["uniforms"] = torch.from_numpy(keyed_uniform_array(seeds, positions))
    return SamplingMetadata(**fields)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, seed: int, vocab_size: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=gen(seed)) * 2


def random_probs(rows: int, seed: int, vocab_size: int) -> torch.Tensor:
    return (torch.randn(rows, vocab_size, generator=gen(seed)) * 1.5).softmax(dim=-1)


def tv_distance(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Total variation between the empirical distribution of `samples` and `probs` [V]."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * (counts / samples.numel() - probs.double()).abs().sum().item()


# Stochastic losslessness. A two-token "model" over V_SMALL tokens: the target's first token
# has logits A, its second token logits B[t1]; the draft proposes d1 ~ q1, d2 ~ Q2[d1]. A window
# of 2 drafts verifies rows [A, B[d1], B[d2]]; a window that emitted one token gets its second
# from a plain decode (k = 0) on row B[t1], as the next engine step would. The joint of the
# first two emitted tokens must be p_A(t1) * p_B(t2 | t1) after temperature/top-k/top-p.
# Window w is a request with seed w: its rows are output positions 0, 1, 2.

V_SMALL = 8
NUM_WINDOWS = 200_000
LOSSLESS_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
]
# (verification, how the drafts were drawn, whether verification sees their q)
MODES = {
    "coupled_independent_drafts": ("coupled", "independent", False),
    "coupled_coupled_drafts": ("coupled", "coupled", False),
    "rejection_one_hot_q": ("rejection", "independent", False),
    "rejection_full_q": ("rejection", "independent", True),
    "rejection_coupled_drafts": ("rejection", "coupled", True),
}


def two_token_model(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    first = random_logits(1, seed, V_SMALL)  # [1, V]
    second = random_logits(V_SMALL, seed + 1, V_SMALL)  # [V, V], row = previous token
    q1 = random_probs(1, seed + 2, V_SMALL)  # [1, V]
    q2 = random_probs(V_SMALL, seed + 3, V_SMALL)  # [V, V]
    return first, second, q1, q2


def draw_drafts(q1: torch.Tensor, q2: torch.Tensor, how: str, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """[W] d1 ~ q1 and d2 ~ q2[d1]: with the target's keyed numbers of positions 0 and 1
    (coupled) or a generator of their own."""
    if how == "coupled":
        u = [torch.from_numpy(keyed_uniform_array(range(NUM_WINDOWS), [pos] * NUM_WINDOWS))
             for pos in (0, 1)]
        d1 = inverse_cdf(q1.expand(NUM_WINDOWS, -1), u[0])
        return d1, inverse_cdf(q2[d1], u[1])
    g = gen(seed + 4)
    d1 = torch.multinomial(q1.expand(NUM_WINDOWS, -1), 1, generator=g).squeeze(1)  # [W]
    return d1, torch.multinomial(q2[d1], 1, generator=g).squeeze(1)


def sample_two_tokens(params: SamplingParams, mode: str, seed: int) -> torch.Tensor:
    """[NUM_WINDOWS, 2] first two emitted tokens, from one vectorized call per step."""
    verification, how, full_q = MODES[mode]
    first, second, q1, q2 = two_token_model(seed)
    d1, d2 = draw_drafts(q1, q2, how, seed)
    rows = torch.stack([first.expand(NUM_WINDOWS, -1), second[d1], second[d2]], dim=1)
    q = torch.stack([q1.expand(NUM_WINDOWS, -1), q2[d1]], dim=1)  # [W, 2, V]
    windows = range(NUM_WINDOWS)
    meta = same_params_meta(params, [w for w in windows for _ in range(3)],
                            [0, 1, 2] * NUM_WINDOWS, V_SMALL)
    out = verify(rows.reshape(-1, V_SMALL), torch.stack([d1, d2], dim=1).tolist(), meta,
                 list(q) if full_q else None, [verification == "rejection"] * NUM_WINDOWS)
    tokens = out.output_token_ids[:, :2].clone()  # [W, 2]
    short = (out.num_accepted == 0).nonzero().squeeze(1)  # windows that emitted one token
    next_step = verify(second[tokens[short, 0]], [[] for _ in range(short.numel())],
                       same_params_meta(params, short.tolist(), [1] * short.numel(), V_SMALL))
    tokens[short, 1] = next_step.output_token_ids[:, 0]
    return tokens


def reference_joint(params: SamplingParams, seed: int) -> torch.Tensor:
    """[V * V] target probability of (t1, t2), flattened as t1 * V + t2."""
    first, second, _, _ = two_token_model(seed)
    p1 = target_probs(first, build([params], vocab_size=V_SMALL))  # [1, V]
    p2 = target_probs(second, build([params] * V_SMALL, vocab_size=V_SMALL))  # [V, V]
    return (p1.T * p2).flatten()


CASES = [(LOSSLESS_PARAMS[0], mode) for mode in MODES] + [
    (params, mode) for params in LOSSLESS_PARAMS[1:]
    for mode in ("coupled_coupled_drafts", "rejection_full_q")]


@pytest.mark.parametrize(("params", "mode"), CASES,
                         ids=[f"t{p.temperature}_{p.top_k}_{p.top_p}-{m}" for p, m in CASES])
def test_first_two_tokens_follow_target(params: SamplingParams, mode: str) -> None:
    tokens = sample_two_tokens(params, mode, seed=10)
    joint = reference_joint(params, seed=10)
    first = joint.view(V_SMALL, V_SMALL).sum(dim=1)
    tv_first = tv_distance(tokens[:, 0], first)
    tv_joint = tv_distance(tokens[:, 0] * V_SMALL + tokens[:, 1], joint)
    print(f"TV first={tv_first:.4f} joint={tv_joint:.4f}")
    assert tv_first < TV_TOLERANCE
    assert tv_joint < TV_TOLERANCE


def test_coupled_drafts_accept_more_than_independent_ones() -> None:
    """Drafts drawn with the target's own numbers match its draw far more often when q is
    close to p (here q = p at a slightly different temperature)."""
    params = SamplingParams(temperature=1.0)
    logits = random_logits(1, seed=20, vocab_size=V_SMALL)
    p = target_probs(logits, build([params], vocab_size=V_SMALL))[0]
    q = (logits[0] / 1.1).softmax(dim=-1)
    n = 20_000
    u = torch.from_numpy(keyed_uniform_array(range(n), [0] * n))
    rows = logits.expand(2 * n, -1)
    meta = same_params_meta(params, [w for w in range(n) for _ in range(2)], [0, 1] * n, V_SMALL)
    rates = {}
    for how, drafts in (("coupled", inverse_cdf(q.expand(n, -1), u)),
                        ("independent", torch.multinomial(q, n, replacement=True,
                                                          generator=gen(21)))):
        out = verify(rows, drafts.unsqueeze(1).tolist(), meta)
        rates[how] = out.num_accepted.float().mean().item()
    overlap = torch.minimum(p, q).sum().item()
    assert rates["independent"] == pytest.approx((p * q).sum().item(), abs=0.01)
    assert rates["coupled"] > 0.85 * overlap > rates["independent"]


@pytest.mark.parametrize("draft", [3, 7], ids=["likely_draft", "any_draft"])
@pytest.mark.parametrize("verification", ["coupled", "rejection"])
def test_fixed_draft_token_first_token_follows_target(draft: int, verification: str) -> None:
    """One-hot q with the same draft in every window (an n-gram hit), 32-token vocab."""
    params = SamplingParams(temperature=0.8, top_k=10)
    logits = random_logits(2, seed=3)  # [2, V]: draft row, bonus row
    logits[0, 3] += 4.0  # make token 3 likely so both accept and reject paths run
    n = 100_000
    meta = same_params_meta(params, [w for w in range(n) for _ in range(2)], [0, 1] * n)
    out = verify(logits.repeat(n, 1), [[draft]] * n, meta, None,
                 [verification == "rejection"] * n)
    expected = target_probs(logits[:1], build([params]))[0]
    tv = tv_distance(out.output_token_ids[:, 0], expected)
    print(f"TV first token, fixed draft {draft}: {tv:.4f}")
    assert tv < TV_TOLERANCE
    assert out.num_accepted.float().mean().item() == pytest.approx(expected[draft].item(), abs=0.01)


def test_unnormalized_q_falls_back_to_target() -> None:
    """q = 2p leaves no residual mass on rejection: the window samples p itself."""
    params = SamplingParams()
    n = 50_000
    logits = random_logits(2, seed=4, vocab_size=V_SMALL)
    p = target_probs(logits[:1], build([params], vocab_size=V_SMALL))[0]  # [V]
    drafts = torch.multinomial(p, n, replacement=True, generator=gen(5))  # [n]
    out = verify(
        logits.repeat(n, 1),
        drafts.unsqueeze(1).tolist(),
        same_params_meta(params, [w for w in range(n) for _ in range(2)], [0, 1] * n, V_SMALL),
        [2 * p.unsqueeze(0)] * n,
        [True] * n,
    )
    assert out.num_accepted.float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert tv_distance(out.output_token_ids[:, 0], p) < TV_TOLERANCE


# Greedy: exact, and equal to the plain sampler row by row, penalties included.


def greedy_token(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> int:
    meta = build([params], outputs=[output], prompts=[prompt])
    return int(sample_rows(logits.unsqueeze(0), meta)[0][0])


def greedy_case(
    ks: list[int], accept_upto: list[int], params: list[SamplingParams], seed: int
) -> tuple[torch.Tensor, list[list[int]], SamplingMetadata, list[list[int]]]:
    """Windows whose first accept_upto[i] drafts are the greedy tokens and the next is wrong.
    Returns logits, drafts, per-row meta and each window's expected emitted tokens."""
    logits = random_logits(sum(ks) + len(ks), seed)
    rows, row = [], 0
    row_params, row_prompts, row_outputs = [], [], []
    drafts, expected = [], []
    for i, (k, m) in enumerate(zip(ks, accept_upto, strict=True)):
        prompt = [5 + i, 6, 7]
        earlier = logits[row : row + k + 1].argmax(dim=-1)[:2].tolist()  # penalize raw winners
        window: list[int] = []
        for j in range(k + 1):
            out = earlier + window
            best = greedy_token(logits[row + j], params[i], prompt, out)
            rows.append(best)
            row_params.append(params[i])
            row_prompts.append(prompt)
            row_outputs.append(out)
            if j == min(m, k):
                expected.append(window[:] + [best])
            if j < k:
                window.append(best if j < m else (best + 1) % V)
        drafts.append(window)
        row += k + 1
    meta = build(row_params, outputs=row_outputs, prompts=row_prompts)
    return logits, drafts, meta, expected


GREEDY_PENALIZED = [
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=1.0),
    SamplingParams(top_k=1, repetition_penalty=1.5, frequency_penalty=2.0),
    SamplingParams(temperature=0),
]


@pytest.mark.parametrize("full_q", [False, True], ids=["one_hot_q", "full_q"])
def test_greedy_equals_plain_sampler_with_penalties(full_q: bool) -> None:
    ks = [3, 0, 2, 3, 1, 4]
    accept_upto = [1, 0, 2, 3, 0, 2]
    params = [GREEDY_PENALIZED[i % 4] for i in range(len(ks))]
    logits, drafts, meta, expected = greedy_case(ks, accept_upto, params, seed=7)
    penalized_differs = (
        logits.argmax(dim=-1)
        != torch.tensor(
            [t for d, e in zip(drafts, expected, strict=True) for t in (d + e)[: len(d) + 1]]
        )
    ).any()
    assert penalized_differs  # the case is only meaningful if penalties move an argmax
    q = random_probs(sum(ks), seed=8, vocab_size=V) if full_q else None
    per_window = None if q is None else list(q.split(ks))
    out = verify(logits, drafts, meta, per_window, [True] * len(ks))
    assert out.num_accepted.tolist() == verify(logits, drafts, meta).num_accepted.tolist()
    assert out.num_accepted.tolist() == [min(m, k) for m, k in zip(accept_upto, ks, strict=True)]
    for i, tokens in enumerate(expected):
        row = out.output_token_ids[i].tolist()
        assert row == tokens + [-1] * (max(ks) + 1 - len(tokens))


def test_greedy_windows_exact_in_a_mixed_batch() -> None:
    ks = [2, 3, 0, 3]
    accept_upto = [2, 1, 0, 3]
    params = [GREEDY_PENALIZED[0], SamplingParams(temperature=0.9), GREEDY_PENALIZED[1]]
    params.append(SamplingParams(temperature=1.0, top_p=0.9))
    logits, drafts, meta, expected = greedy_case(ks, accept_upto, params, seed=9)
    assert not meta.all_greedy and not meta.all_random
    for seed in range(5):
        meta.uniforms = torch.rand(meta.temperature.shape[0], dtype=torch.float64,
                                   generator=gen(seed))
        out = verify(logits, drafts, meta, None, [seed % 2 == 1] * len(ks))
        for i in (0, 2):
            assert out.num_accepted[i].item() == min(accept_upto[i], ks[i])
            emitted = out.output_token_ids[i, : out.num_accepted[i] + 1].tolist()
            assert emitted == expected[i]


# Bookkeeping, seeds, k = 0.


def test_num_accepted_on_hand_built_windows() -> None:
    """p(x) = 0 always rejects, q = p always accepts, q(x) = 0 < p(x) accepts."""
    params = SamplingParams(temperature=1.0, top_k=4)
    ks = [3, 0, 3, 3, 0]
    logits = random_logits(sum(ks) + len(ks), seed=11)
    p = target_probs(logits, build([params] * logits.shape[0]))  # [N, V]
    top = p.argmax(dim=-1).tolist()  # in the top-k of each row
    outside = p.argmin(dim=-1).tolist()  # p = 0 (outside the top 4)
    starts = [0, 4, 5, 9, 13]  # first target row of each window
    drafts = [
        [top[0], top[1], outside[2]],  # rejected at 2
        [],
        [outside[5], top[6], top[7]],  # rejected at 0
        [top[9], top[10], top[11]],  # all accepted, bonus from row 12
        [],
    ]
    q = [p[s : s + len(d)].clone() for s, d in zip(starts, drafts, strict=True)]  # q = p
    q[0][1, drafts[0][1]] = 0.0  # q(x) = 0 < p(x): accepted, no division by zero
    for seed in range(10):
        meta = build([params] * logits.shape[0], seeds=[seed] * logits.shape[0])
        out = verify(logits, drafts, meta, list(q), [True] * 5)
        assert out.num_accepted.tolist() == [2, 0, 0, 3, 0]
        tokens = out.output_token_ids
        assert tokens.shape == (5, 4)
        assert tokens[0, :2].tolist() == drafts[0][:2] and tokens[0, 2] != drafts[0][2]
        assert tokens[3, :3].tolist() == drafts[3]
        for w, n in enumerate([2, 0, 0, 3, 0]):
            assert p[starts[w] + n, tokens[w, n]] > 0  # emitted from the right row's support
            assert (tokens[w, n + 1 :] == -1).all()


def window_meta(params: SamplingParams, seed: int, k: int, first: int = 0) -> SamplingMetadata:
    """The k + 1 rows of one request's window, its output positions first..first + k."""
    return build([params] * (k + 1), outputs=[[9] * (first + j) for j in range(k + 1)],
                 seeds=[seed] * (k + 1))


@pytest.mark.parametrize("verification", ["coupled", "rejection"])
def test_window_independent_of_batch(verification: str) -> None:
    params = SamplingParams(temperature=1.0, seed=123)
    drafts_alone = [[4, 9, 4]]
    logits_alone = random_logits(4, seed=12)
    q_alone = random_probs(3, seed=13, vocab_size=V)
    other_logits = random_logits(6, seed=14)
    other_q = random_probs(4, seed=15, vocab_size=V)
    rejection = verification == "rejection"
    for seed in range(20):
        alone = verify(logits_alone, drafts_alone, window_meta(params, seed, 3), [q_alone],
                       [rejection])
        # the same window behind a k = 4 window and a k = 0 window of other requests
        meta = build([params] * 10, outputs=[[9] * j for j in range(5)] + [[9] * 7] +
                     [[9] * j for j in range(4)], seeds=[seed + 1] * 5 + [seed + 2] + [seed] * 4)
        batch = verify(torch.cat([other_logits, logits_alone]), [[1, 2, 3, 4], [], *drafts_alone],
                       meta, [other_q, None, q_alone], [rejection, False, rejection])
        assert batch.num_accepted[2] == alone.num_accepted[0]
        assert batch.output_token_ids[2, :4].tolist() == alone.output_token_ids[0].tolist()


def test_coupled_window_emits_what_plain_decoding_emits_for_any_k() -> None:
    """A seeded request's tokens at positions 0..5: sampled one by one (k = 0 each step) and
    through windows of any k with any drafts, the coupled windows emit the same tokens."""
    params = SamplingParams(temperature=1.1, top_p=0.95, seed=77)
    table = random_logits(V, seed=30) / 2  # next-token logits given the previous token
    plain = [3]
    for _ in range(6):
        meta = build([params], outputs=[plain[1:]], seeds=[77])
        plain.append(int(sample_rows(table[plain[-1]].unsqueeze(0), meta)[0][0]))
    for k in (1, 2, 3, 5):
        for wrong_at in (None, 0, 1):
            emitted = [3]
            while len(emitted) < 7:
                drafts = plain[len(emitted) : len(emitted) + k]
                if wrong_at is not None and wrong_at < len(drafts):
                    drafts = drafts[:wrong_at] + [(drafts[wrong_at] + 1) % V]
                context = emitted + drafts
                logits = table[torch.tensor(context[len(emitted) - 1 :])]
                out = verify(logits, [drafts], window_meta(params, 77, len(drafts),
                                                           len(emitted) - 1))
                n = int(out.num_accepted[0]) + 1
                emitted += out.output_token_ids[0, :n].tolist()
            assert emitted[:7] == plain, (k, wrong_at)


def test_k0_window_samples_like_plain_sampler() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    logits = random_logits(3, seed=16)
    for seed in range(10):
        meta = build([params] * 3, seeds=[seed + row for row in range(3)])
        plain = sample_rows(logits, meta)[0]
        out = verify(logits, [[], [], []], meta)
        assert out.output_token_ids[:, 0].tolist() == plain.tolist()
        assert out.num_accepted.tolist() == [0, 0, 0]


def test_rejects_mismatched_inputs() -> None:
    meta = build([SamplingParams()] * 3)
    with pytest.raises(ValueError, match="target_logits"):
        verify(random_logits(3, 0), [[1, 2, 3]], meta)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(random_logits(3, 0), [[1, 2]], meta, [torch.ones(1, V)], [True])
    with pytest.raises(ValueError, match="draft_probs"):
        verify(random_logits(3, 0), [[1, 2]], meta, [], [True])
