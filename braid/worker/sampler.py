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

One request cannot make the others pay or fail: its long lists are tensors built once
(constraints.py), penalties touch only the tokens of its prompt and output, a filter runs on
the rows that ask for it, and a row whose logits are not finite takes its greedy token
(`_finite_rows`) instead of drawing from NaN. Parameters whose float32 arithmetic would
degenerate never get here (SamplingParams moves them onto safe bounds, see SAMPLING_EPS).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from braid.sampling_params import SamplingParams
from braid.worker.constraints import (
    PenaltyPairs,
    RequestConstraints,
    allowed_masks,
    build_constraints,
    logit_bias_triples,
    penalty_pairs,
    suppressed_pairs,
)

logger = logging.getLogger("braid")

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
    max_top_k: int  # largest top-k over the filtering random rows; V if one has none
    top_p: torch.Tensor | None  # [B] float32; 1.0 means off
    min_p: torch.Tensor | None  # [B] float32; 0.0 means off
    presence_penalty: torch.Tensor | None  # [B] float32; with frequency_penalty and penalized
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32; None when no row has one
    penalized: PenaltyPairs | None  # the (row, token) pairs the penalties change
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
        constraints: Sequence[RequestConstraints] | None = None,
    ) -> SamplingMetadata:
        """`seeds[i]` is row i's request seed (the request's `seed`, or one the engine drew
        for it); row i's draw uses `keyed_uniform(seeds[i], len(output_token_ids[i]),
        stream)` (`stream` one for all rows or one per row). `allowed` (rows, [R, V] bool)
        restricts those rows to a grammar's tokens; allowed_token_ids join it.
        `constraints[i]` is row i's request's lists as tensors (built here when not given)."""
        if not len(params) == len(prompt_token_ids) == len(output_token_ids) == len(seeds):
            raise ValueError("params, token ids and seeds must have one entry per row")
        if constraints is None:
            constraints = build_constraints(params, prompt_token_ids)
        greedy = [p.greedy for p in params]
        positions = [len(out) for out in output_token_ids]
        random_params = [_NEUTRAL if g else p for p, g in zip(params, greedy, strict=True)]
        temps = [p.temperature for p in random_params]
        top_k, max_top_k = _top_k_per_row(params, vocab_size)
        penalties = _penalty_fields(params, constraints, output_token_ids, vocab_size, device)
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
            suppressed=suppressed_pairs(params, constraints, output_token_ids, eos_token_ids,
                                        vocab_size, device),
            logit_bias=logit_bias_triples(constraints, vocab_size, device),
            seeds=list(seeds),
            positions=positions,
            uniforms=None if all(greedy) else torch.from_numpy(
                keyed_uniform_array(seeds, positions, stream)).to(device),
            allowed=allowed_masks(allowed, constraints, vocab_size, device),
            fallback_token=min(eos_token_ids, default=0),
        )

    @property
    def shapes_logits(self) -> bool:
        """Whether `apply_penalties` changes any logit."""
        return not (self.logit_bias is None and self.penalized is None
                    and self.suppressed is None and self.allowed is None)


def _top_k_per_row(params: Sequence[SamplingParams], vocab_size: int) -> tuple[list[int], int]:
    """Per-row k in [1, V] (V = off) and the largest k over the random rows that filter (a
    top-k or a top-p: the rows `filtered_logits` sorts). Greedy rows take that largest k, so
    they never force the full-sort path on their own."""
    ks = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
    max_top_k = max((k for k, p in zip(ks, params, strict=True)
                     if not p.greedy and (k < vocab_size or p.top_p < 1)), default=vocab_size)
    return [max_top_k if p.greedy else k for k, p in zip(ks, params, strict=True)], max_top_k


def _optional(
    values: list[float] | list[int], neutral: float, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | None:
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def _penalty_fields(
    params: Sequence[SamplingParams],
    constraints: Sequence[RequestConstraints],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> dict[str, Any]:
    """Penalty tensors, all None when no row uses a penalty. Greedy rows are penalized too."""
    fields: dict[str, Any] = dict.fromkeys(
        ("presence_penalty", "frequency_penalty", "repetition_penalty", "penalized"))
    presence = [p.presence_penalty for p in params]
    frequency = [p.frequency_penalty for p in params]
    repetition = [p.repetition_penalty for p in params]
    uses_repetition = any(r != 1.0 for r in repetition)
    if not uses_repetition and not any(presence) and not any(frequency):
        return fields
    fields["presence_penalty"] = torch.tensor(presence, dtype=torch.float32, device=device)
    fields["frequency_penalty"] = torch.tensor(frequency, dtype=torch.float32, device=device)
    if uses_repetition:
        fields["repetition_penalty"] = torch.tensor(repetition, dtype=torch.float32,
                                                    device=device)
    fields["penalized"] = penalty_pairs(constraints, output_token_ids, vocab_size, device)
    return fields


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logit_bias, repetition/frequency/presence penalties (vLLM semantics), min_tokens
    suppression and grammar masks: everything a greedy argmax sees. Never modifies `logits`
    [B, V] (returns it as is when nothing applies; else one copy, changed in place)."""
    if not meta.shapes_logits:
        return logits
    logits = logits.clone()
    if meta.logit_bias is not None:
        rows, tokens, biases = meta.logit_bias
        logits.index_put_((rows, tokens), biases, accumulate=True)
    if meta.penalized is not None:
        _penalize(logits, meta, meta.penalized)
    if meta.suppressed is not None:
        logits.index_put_(meta.suppressed, torch.tensor(_NEG_INF, device=logits.device))
    if meta.allowed is not None:  # last, so no bias or penalty brings a refused token back
        rows, allowed = meta.allowed
        logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)
    if meta.allowed is not None or meta.suppressed is not None:
        # Constraints that contradict each other (allowed_token_ids, bad_words, min_tokens, a
        # grammar) can leave a row no token: it takes its end token (the first eos), so the
        # request ends there instead of drawing from nothing (an id past the vocabulary).
        dead = logits.amax(dim=-1) == _NEG_INF  # [B]
        if bool(dead.any()):
            logits[dead.nonzero().squeeze(1), meta.fallback_token] = 0.0
    return logits


def _penalize(logits: torch.Tensor, meta: SamplingMetadata, pairs: PenaltyPairs) -> None:
    """The penalties on the pairs they change, in place: the same float32 operations, in the
    same order, as on the whole [B, V] table, where every other entry would keep its value."""
    assert meta.presence_penalty is not None and meta.frequency_penalty is not None
    rows, tokens = pairs.rows, pairs.tokens
    values = logits[rows, tokens]  # [P]
    if meta.repetition_penalty is not None:
        rep = meta.repetition_penalty[rows]  # [P]
        values = torch.where(values > 0, values / rep, values * rep)
    values = values - meta.frequency_penalty[rows] * pairs.counts
    values = values - meta.presence_penalty[rows] * (pairs.counts > 0)
    logits[rows, tokens] = values


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None, max_top_k: int) -> torch.Tensor:
    """top-k then top-p on the rows sorted in descending order. When every row has a top-k,
    only the `max_top_k` highest logits are kept and sorted (topk instead of a sort), unless
    a row's ties with its k-th logit reach past them (the next value equals it): top-k keeps
    every tie, so a row keeps the same tokens whatever K the rest of the batch makes."""
    width, k = logits.shape[1], max_top_k
    if k < width:
        values, order = logits.topk(k + 1, dim=-1)  # [B, K + 1] descending
        if top_k is None or not bool((values[:, k:] == _kth(values, top_k)).any()):
            values, order = values[:, :k], order[:, :k]
        else:
            values, order = logits.sort(dim=-1, descending=True)  # [B, V]
    else:
        values, order = logits.sort(dim=-1, descending=True)  # [B, V]
    values = _mask_sorted(values, top_k, top_p)
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
        # a prefix, at least the top token (also for a p that rounds to 0 in float32)
        kept = (mass_above < top_p.unsqueeze(1)).sum(dim=-1).clamp_(min=1)
        # rows with top_p == 1 are off; rounding could otherwise push mass_above to 1
        drop = (values < _kth(values, kept)) & (top_p < 1).unsqueeze(1)
        values.masked_fill_(drop, _NEG_INF)
    return values


def filtered_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalized logits [B, V] after temperature, min_p, top_k, top_p; dropped entries -inf.
    Each filter runs on the rows that ask for it only (a sort of the whole batch would make
    every row pay for one row's top-p). Greedy rows get temperature 1 and no filter, so their
    argmax is the greedy token (`target_probs` turns them into one-hots)."""
    logits = logits / meta.temperature.unsqueeze(1)  # a new tensor, safe to fill in place
    if meta.min_p is not None:
        rows = _rows(meta.min_p > 0)  # greedy rows have min_p 0
        logits[rows] = _apply_min_p(logits[rows], meta.min_p[rows])
    if meta.top_k is not None or meta.top_p is not None:
        rows = _rows(_filtering(meta, logits.shape[1]))
        logits[rows] = _apply_top_k_top_p(
            logits[rows], None if meta.top_k is None else meta.top_k[rows],
            None if meta.top_p is None else meta.top_p[rows], meta.max_top_k)
    return logits


def _filtering(meta: SamplingMetadata, vocab_size: int) -> torch.Tensor:
    """[B] bool: the random rows with a top-k or a top-p."""
    wants = torch.zeros_like(meta.temperature, dtype=torch.bool)
    if meta.top_k is not None:
        wants |= meta.top_k < vocab_size
    if meta.top_p is not None:
        wants |= meta.top_p < 1
    return wants if meta.greedy_mask is None else wants & ~meta.greedy_mask


def _rows(mask: torch.Tensor) -> torch.Tensor | slice:
    """The rows where `mask` [B] holds: every row as a slice (no copy), else their indices."""
    return slice(None) if bool(mask.all()) else mask.nonzero().squeeze(1)


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from, [B, V] float32; dropped entries are 0.

    Greedy rows get a one-hot at the argmax of the penalized logits, so the rejection
    sampler's accept/recover rule reduces to exact greedy verification on those rows. So do
    rows whose distribution is not finite (see `_finite_rows`).
    """
    penalized = apply_penalties(logits, meta)  # [B, V]
    if meta.all_greedy:
        return _one_hot(greedy_tokens(penalized, meta.fallback_token), penalized.shape[1])
    probs = filtered_logits(penalized, meta).softmax(dim=-1)
    if meta.greedy_mask is not None:
        rows = meta.greedy_mask.nonzero().squeeze(1)
        probs[rows] = _one_hot(greedy_tokens(penalized[rows], meta.fallback_token),
                               probs.shape[1])
    return _finite_rows(probs, penalized, meta)


def _finite_rows(probs: torch.Tensor, penalized: torch.Tensor, meta: SamplingMetadata
                 ) -> torch.Tensor:
    """`probs` [B, V] with each row whose mass is not finite (its logits hold +inf or NaN:
    from the model, since no request's parameters can make them) replaced by the one-hot of
    its greedy token, with a warning: such a row never draws an id outside the vocabulary
    and never fails the rest of the batch."""
    broken = ~probs.sum(dim=-1).isfinite()  # [B]
    if not bool(broken.any()):
        return probs
    rows = broken.nonzero().squeeze(1)
    logger.warning("sampling rows %s have non-finite logits: they take their greedy token",
                   rows.tolist())
    probs[rows] = _one_hot(greedy_tokens(penalized[rows], meta.fallback_token), probs.shape[1])
    return probs


def greedy_tokens(scores: torch.Tensor, fallback_token: int) -> torch.Tensor:
    """Each row's argmax [B] int64 of `scores` [B, V]. NaN entries count as -inf (argmax
    would pick them), and a row with nothing above -inf takes the fallback token."""
    tokens = scores.argmax(dim=-1)  # [B]
    best = scores.gather(1, tokens.unsqueeze(1)).squeeze(1)  # [B]; NaN if the row has one
    broken = best.isnan() | (best == _NEG_INF)
    if bool(broken.any()):
        rows = broken.nonzero().squeeze(1)
        clean = scores[rows].nan_to_num(nan=_NEG_INF)  # [R, V]
        tokens[rows] = torch.where(clean.amax(dim=-1) > _NEG_INF, clean.argmax(dim=-1),
                                   fallback_token)
    return tokens


def _one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 one-hot rows at `tokens` [B]."""
    one_hot = torch.zeros(tokens.shape[0], vocab_size, dtype=torch.float32,
                          device=tokens.device)
    return one_hot.scatter_(1, tokens.unsqueeze(1), 1.0)


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
    # a row without mass (never from target_probs) would land in the last block's padding
    return (block * size + token.clamp_(max=size - 1)).clamp_(max=width - 1)


def keyed_uniforms(meta: SamplingMetadata, stream: int, device: torch.device) -> torch.Tensor:
    """[B] float64: every row's keyed number in another stream than the draw's."""
    return torch.from_numpy(keyed_uniform_array(meta.seeds, meta.positions, stream)).to(device)


def sample_rows(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor,
                                                                        torch.Tensor | None]:
    """Each row's token [B] int64 and, unless every row is greedy, the distributions it was
    drawn from [B, V] (`target_probs`). Greedy rows take the penalized argmax."""
    logits = logits.float()
    if meta.all_greedy:
        return greedy_tokens(apply_penalties(logits, meta), meta.fallback_token), None
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

