"""Batch sampler over sampling rows, vectorized with torch ops.

A sampling row is one row of logits: one per request for a plain decode, several per request
for a speculative verification window. Everything here is per row; the caller repeats a
request's params and seed for each of its rows and gives each row the output tokens that
precede it (including the drafts before it in the window). The number of those tokens is
the row's output position.

Order of processing, as in vLLM V1:
  raw logits -> (logprobs are taken here: log_softmax of the raw model output)
  -> logit_bias -> repetition/frequency/presence penalties, min_tokens stop suppression
  -> allowed tokens (a row's allowed_token_ids, and the tokens its grammar state allows)
  -> greedy rows: argmax
  -> random rows: temperature -> min_p -> top_k -> top_p -> softmax -> inverse-CDF draw.

Position-keyed randomness: a random row draws its token from one uniform number that is a
pure function of (request seed, output position, stream) (`keyed_uniform`, a counter-based
hash), never from a generator's state. So a request's token at position i does not depend
on the batch, on how many drafts a verification window had, or on preemption; and a draft
model that samples with the same number (a coupled draft) predicts the target's own sample.
The draw is the inverse CDF of the row's distribution in token-id order: one number per row
(an exponential race would need one per vocabulary entry, 152k of them here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from braid.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_NEUTRAL = SamplingParams()  # greedy rows get neutral random-only params
_MASK64 = (1 << 64) - 1

# Streams of keyed numbers: the token at a position (the target's, and a coupled draft's),
# an independently sampled draft's, and rejection sampling's acceptance and residual draws.
SAMPLE, DRAFT, ACCEPT, RESIDUAL = range(4)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (numpy's unsigned arithmetic wraps mod 2^64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_uniform_array(seeds: Sequence[int], positions: Sequence[int],
                        stream: int | Sequence[int] = SAMPLE) -> np.ndarray:
    """Uniform numbers in [0, 1), float64, each a function of (seed, position, stream) only:
    splitmix64 chained over the three (the final hash's top 53 bits)."""
    seed = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)
    h = _splitmix64(_splitmix64(seed) + np.array(positions, dtype=np.uint64))
    h = _splitmix64(h + np.array(stream, dtype=np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def keyed_uniform(seed: int, position: int, stream: int = SAMPLE) -> float:
    return float(keyed_uniform_array([seed], [position], stream)[0])


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling tensors, built once per step. Optional fields are None when no row
    needs them, and the matching step is skipped."""

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows (never divided by 0)
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool; None when all_greedy or all_random
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; V means off
    max_top_k: int  # largest top-k over random rows; V when some random row has none
    top_p: torch.Tensor | None  # [B] float32; 1.0 means off
    min_p: torch.Tensor | None  # [B] float32; 0.0 means off
    presence_penalty: torch.Tensor | None  # [B] float32; the three penalties come together
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32
    output_token_counts: torch.Tensor | None  # [B, V] float32, counts of output tokens
    prompt_token_mask: torch.Tensor | None  # [B, V] bool; only with a repetition penalty
    suppressed: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, biases)
    seeds: list[int]  # per row, its request's seed
    positions: list[int]  # per row, its output position (output tokens before it)
    uniforms: torch.Tensor | None  # [B] float64 keyed numbers of the draw; None if all greedy
    # (rows, their allowed tokens [R, V] bool) of rows under a grammar or allowed_token_ids
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # What a row whose constraints leave no token at all takes: its end (see apply_penalties)
    fallback_token: int = 0

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        stream: int | Sequence[int] = SAMPLE,
        allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """`seeds[i]` is row i's request seed (the request's `seed`, or one the engine drew
        for it); row i's draw uses `keyed_uniform(seeds[i], len(output_token_ids[i]),
        stream)` (`stream` one for all rows or one per row). `allowed` (rows, [R, V] bool)
        restricts those rows to a grammar's tokens; allowed_token_ids join it."""
        if not len(params) == len(prompt_token_ids) == len(output_token_ids) == len(seeds):
            raise ValueError("params, token ids and seeds must have one entry per row")
        greedy = [p.greedy for p in params]
        positions = [len(out) for out in output_token_ids]
        random_params = [_NEUTRAL if g else p for p, g in zip(params, greedy, strict=True)]
        temps = [p.temperature for p in random_params]
        top_k, max_top_k = _top_k_per_row(params, vocab_size)
        penalties = _penalty_fields(params, prompt_token_ids, output_token_ids, vocab_size, device)
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            greedy_mask=None
            if all(greedy) or not any(greedy)
            else torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=_optional(top_k, vocab_size, torch.int64, device),
            max_top_k=max_top_k,
            top_p=_optional([p.top_p for p in random_params], 1.0, torch.float32, device),
            min_p=_optional([p.min_p for p in random_params], 0.0, torch.float32, device),
            **penalties,
            suppressed=_suppressed(params, output_token_ids, eos_token_ids, vocab_size, device),
            logit_bias=_logit_bias(params, vocab_size, device),
            seeds=list(seeds),
            positions=positions,
            uniforms=None if all(greedy) else torch.from_numpy(
                keyed_uniform_array(seeds, positions, stream)).to(device),
            allowed=_with_allowed_ids(allowed, params, vocab_size, device),
            fallback_token=min(eos_token_ids, default=0),
        )


def _top_k_per_row(params: Sequence[SamplingParams], vocab_size: int) -> tuple[list[int], int]:
    """Per-row k in [1, V] (V = off) and the largest k over random rows. Greedy rows take that
    largest k, so they never force the full-sort path on their own."""
    ks = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
    max_top_k = max(
        (k for k, p in zip(ks, params, strict=True) if not p.greedy), default=vocab_size
    )
    return [max_top_k if p.greedy else k for k, p in zip(ks, params, strict=True)], max_top_k


def _optional(
    values: list[float] | list[int], neutral: float, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | None:
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def _penalty_fields(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> dict[str, torch.Tensor | None]:
    """Penalty tensors, all None when no row uses a penalty. Greedy rows are penalized too."""
    fields: dict[str, torch.Tensor | None] = dict.fromkeys(
        (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "output_token_counts",
            "prompt_token_mask",
        )
    )
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    uses_repetition = any(r != 1.0 for r in repetition)
    if not uses_repetition and not any(presence) and not any(frequency):
        return fields
    for name, values in (
        ("presence_penalty", presence),
        ("frequency_penalty", frequency),
        ("repetition_penalty", repetition),
    ):
        fields[name] = torch.tensor(values, dtype=torch.float32, device=device)
    fields["output_token_counts"] = _token_counts(output_token_ids, vocab_size, device)
    if uses_repetition:
        fields["prompt_token_mask"] = _token_counts(prompt_token_ids, vocab_size, device) > 0
    return fields


def _token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[B, V] float32 occurrence counts; ids are padded with `vocab_size` (a spill column)."""
    width = max((len(ids) for ids in token_ids), default=0)
    padded = torch.tensor(
        [list(ids) + [vocab_size] * (width - len(ids)) for ids in token_ids],
        dtype=torch.int64,
        device=device,
    ).view(len(token_ids), width)  # [B, L]
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _suppressed(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: set[int] | frozenset[int],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs a row may not sample now: its stop ids (and eos unless ignore_eos)
    while it has fewer than min_tokens output tokens, and the last token of each bad word
    whose other tokens end its output."""
    rows: list[int] = []
    tokens: list[int] = []
    for row, (p, out) in enumerate(zip(params, output_token_ids, strict=True)):
        banned: set[int] = set()
        if len(out) < p.min_tokens:
            banned |= set(p.stop_token_ids or []) | (
                set() if p.ignore_eos else set(eos_token_ids))
        for word in p.bad_words_token_ids or ():
            if word and list(out[max(0, len(out) - len(word) + 1):]) == word[:-1]:
                banned.add(word[-1])
        banned = {t for t in banned if t < vocab_size}
        rows += [row] * len(banned)
        tokens += sorted(banned)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(tokens, dtype=torch.int64, device=device),
    )


def _logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(row, token, bias) triples of every row's logit_bias (ids past the vocabulary, which
    the engine refuses at admission, are skipped)."""
    triples = [(row, token, bias) for row, p in enumerate(params)
               for token, bias in (p.logit_bias or {}).items() if token < vocab_size]
    if not triples:
        return None
    rows, tokens, biases = zip(*triples, strict=True)
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def _with_allowed_ids(
    grammar: tuple[torch.Tensor, torch.Tensor] | None, params: Sequence[SamplingParams],
    vocab_size: int, device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The grammar masks (rows, [R, V] bool) with each row's allowed_token_ids joined in: a
    row may take the tokens both allow."""
    with_ids = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if not with_ids:
        return grammar
    rows = sorted(set(with_ids) | set(() if grammar is None else grammar[0].tolist()))
    at = {row: i for i, row in enumerate(rows)}
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    if grammar is not None:
        mask[[at[row] for row in grammar[0].tolist()]] = grammar[1]
    for row in with_ids:
        ids = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        ids[[t for t in params[row].allowed_token_ids or [] if t < vocab_size]] = True
        mask[at[row]] &= ids
    return torch.tensor(rows, dtype=torch.int64, device=device), mask


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logit_bias, repetition/frequency/presence penalties (vLLM semantics), min_tokens
    suppression and grammar masks: everything a greedy argmax sees. Never modifies `logits`
    [B, V] (may return it as is)."""
    if meta.logit_bias is not None:
        rows, tokens, biases = meta.logit_bias
        logits = logits.index_put((rows, tokens), biases, accumulate=True)
    if meta.repetition_penalty is not None:
        assert meta.output_token_counts is not None
        assert meta.presence_penalty is not None and meta.frequency_penalty is not None
        counts = meta.output_token_counts  # [B, V]
        seen = counts > 0  # [B, V]
        if meta.prompt_token_mask is not None:
            rep = meta.repetition_penalty.unsqueeze(1)  # [B, 1]
            rep = torch.where(seen | meta.prompt_token_mask, rep, 1.0)  # [B, V]
            logits = torch.where(logits > 0, logits / rep, logits * rep)
        logits = logits - meta.frequency_penalty.unsqueeze(1) * counts
        logits = logits - meta.presence_penalty.unsqueeze(1) * seen
    if meta.suppressed is not None:
        logits = logits.index_put(meta.suppressed, torch.tensor(_NEG_INF, device=logits.device))
    if meta.allowed is not None:  # last, so no bias or penalty brings a refused token back
        rows, allowed = meta.allowed
        logits = logits.index_put((rows,), logits[rows].masked_fill(~allowed, _NEG_INF))
    if meta.allowed is not None or meta.suppressed is not None:
        # Constraints that contradict each other (allowed_token_ids, bad_words, min_tokens, a
        # grammar) can leave a row no token: it takes its end token (the first eos), so the
        # request ends there instead of drawing from nothing (an id past the vocabulary).
        dead = logits.amax(dim=-1) == _NEG_INF  # [B]
        if bool(dead.any()):
            logits = logits.index_put((dead.nonzero().squeeze(1),
                                       torch.tensor(meta.fallback_token, device=logits.device)),
                                      torch.tensor(0.0, device=logits.device))
    return logits


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def _apply_top_k_top_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """top-k then top-p on the rows sorted in descending order. When every random row has a
    top-k, only the `max_top_k` highest logits are kept and sorted (topk instead of a sort),
    unless a row's ties with its k-th logit reach past them (the next value equals it): top-k
    keeps every tie, so a row keeps the same tokens whatever K the rest of the batch makes."""
    width, k = logits.shape[1], meta.max_top_k
    if k < width:
        values, order = logits.topk(k + 1, dim=-1)  # [B, K + 1] descending
        if meta.top_k is None or not bool((values[:, k:] == _kth(values, meta.top_k)).any()):
            values, order = values[:, :k], order[:, :k]
        else:
            values, order = logits.sort(dim=-1, descending=True)  # [B, V]
    else:
        values, order = logits.sort(dim=-1, descending=True)  # [B, V]
    values = _mask_sorted(values, meta.top_k, meta.top_p)
    return torch.full_like(logits, _NEG_INF).scatter_(1, order, values)


def _kth(values: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Each row's k-th largest value [B, 1] of its descending `values` [B, K]."""
    return values.gather(1, (top_k.clamp(max=values.shape[1]) - 1).unsqueeze(1))


def _mask_sorted(
    values: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks descending `values` [B, K] in place. top-k keeps every tie with the k-th logit;
    top-p keeps the smallest prefix whose mass reaches p (drops a token once the mass of the
    tokens above it is >= p), so the top token always survives, and every tie with the last
    token it keeps. Both read a row's leading columns only, summed in order (cumsum), so a
    row's result does not depend on K."""
    if top_k is not None:
        values.masked_fill_(values < _kth(values, top_k), _NEG_INF)
    if top_p is not None:
        weights = (values - values[:, :1]).exp()  # [B, K], 0 where dropped
        cumulative = weights.cumsum(dim=-1)
        mass_above = (cumulative - weights) / cumulative[:, -1:]
        kept = (mass_above < top_p.unsqueeze(1)).sum(dim=-1)  # a prefix, at least 1
        # rows with top_p == 1 are off; rounding could otherwise push mass_above to 1
        drop = (values < _kth(values, kept)) & (top_p < 1).unsqueeze(1)
        values.masked_fill_(drop, _NEG_INF)
    return values


def filtered_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalized logits [B, V] after temperature, min_p, top_k, top_p; dropped entries -inf.
    Greedy rows get temperature 1 and no filter but the batch's loosest top-k, so their
    argmax is the greedy token (`target_probs` turns them into one-hots)."""
    logits = logits / meta.temperature.unsqueeze(1)  # a new tensor, safe to fill in place
    if meta.min_p is not None:
        logits = _apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = _apply_top_k_top_p(logits, meta)
    return logits


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from, [B, V] float32; dropped entries are 0.

    Greedy rows get a one-hot at the argmax of the penalized logits, so the rejection
    sampler's accept/recover rule reduces to exact greedy verification on those rows.
    """
    penalized = apply_penalties(logits, meta)  # [B, V]
    if meta.all_greedy:
        return _one_hot_argmax(penalized)
    probs = filtered_logits(penalized, meta).softmax(dim=-1)  # [B, V]
    if meta.greedy_mask is None:
        return probs
    return torch.where(meta.greedy_mask.unsqueeze(1), _one_hot_argmax(penalized), probs)


def _one_hot_argmax(scores: torch.Tensor) -> torch.Tensor:
    one_hot = torch.zeros_like(scores, dtype=torch.float32)  # [B, V]
    return one_hot.scatter_(1, scores.argmax(dim=-1, keepdim=True), 1.0)


_CDF_BLOCK = 1024  # inverse_cdf finds the block first, then the token inside it


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [B, V] (unnormalized, >= 0): the first token whose
    cumulative mass (token-id order, float64) exceeds u * total. Two levels, so no pass runs
    a sequential cumulative sum over the whole vocabulary: the block whose running total
    passes the threshold, then the token inside that block. Every row is computed on its own
    (the same result in any batch). A zero-mass token is never drawn. Returns [B] int64."""
    rows, width = probs.shape
    size = min(_CDF_BLOCK, width)
    blocks = F.pad(probs, (0, (-width) % size)).view(rows, -1, size)  # [B, nb, size]
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [B, nb]
    threshold = uniforms * block_cdf[:, -1]  # [B]
    block = torch.searchsorted(block_cdf, threshold.unsqueeze(1), right=True).squeeze(1)
    block = block.clamp_(max=block_cdf.shape[1] - 1)  # [B]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1))
                         .squeeze(1), 0.0)  # [B] mass of the blocks before
    inner = blocks[torch.arange(rows, device=probs.device), block].double().cumsum(dim=-1)
    # the block's own running total may round below the threshold: stay inside its mass
    rest = torch.minimum(threshold - before, inner[:, -1] * (1 - 2.0**-40))  # [B]
    token = torch.searchsorted(inner, rest.clamp(min=0).unsqueeze(1), right=True).squeeze(1)
    return block * size + token.clamp_(max=size - 1)


def keyed_uniforms(meta: SamplingMetadata, stream: int, device: torch.device) -> torch.Tensor:
    """[B] float64: every row's keyed number in another stream than the draw's."""
    return torch.from_numpy(keyed_uniform_array(meta.seeds, meta.positions, stream)).to(device)


def sample_rows(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor,
                                                                        torch.Tensor | None]:
    """Each row's token [B] int64 and, unless every row is greedy, the distributions it was
    drawn from [B, V] (`target_probs`). Greedy rows take the penalized argmax."""
    logits = logits.float()
    if meta.all_greedy:
        return apply_penalties(logits, meta).argmax(dim=-1), None
    probs = target_probs(logits, meta)  # [B, V], greedy rows one-hot
    assert meta.uniforms is not None
    return inverse_cdf(probs, meta.uniforms), probs


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of the raw model output (log_softmax before penalties and temperature, like
    vLLM's default). Column 0 is the sampled token, columns 1..n the row's top-n (a row that
    asked for fewer than n uses only its first columns)."""

    token_ids: torch.Tensor  # [B, 1 + n] int64
    logprobs: torch.Tensor  # [B, 1 + n] float32


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Sampled token's logprob and the top-`num_logprobs` of each row of `raw_logprobs`."""
    sampled_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1))  # [B, 1]
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)  # [B, n]
    return LogprobsTensors(
        token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
    )

