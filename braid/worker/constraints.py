"""A request's sampling lists as tensors and indexes, built once per request, and the step's
per-row tensors assembled from them with torch ops.

A request may carry long lists (150k logit_bias entries, 100k bad words, every token id in
allowed_token_ids): what a row does with them each step must not grow with their length in
Python. Each list is turned into tensors once (`RequestConstraints`); bad words are indexed by
their prefixes (braid/bad_words.py), so a row looks up only the words its output can still complete.
Penalties touch only the (row, token) pairs in the row's prompt or output, never a [B, V]
table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from braid.bad_words import BadWordIndex
from braid.sampling_params import SamplingParams

_EMPTY = torch.empty(0, dtype=torch.int64)


class BadWords:
    """A request's bad words as the sampler reads them: `banned(output)`, tensors of the
    tokens that would complete a word after `output` (braid/bad_words.py's index, each
    prefix's tensor made once)."""

    def __init__(self, words: BadWordIndex | Sequence[Sequence[int]]) -> None:
        self._index = words if isinstance(words, BadWordIndex) else BadWordIndex(words)
        self._ids: dict[tuple[int, int], torch.Tensor] = {}

    def banned(self, output: Sequence[int]) -> list[torch.Tensor]:
        found = []
        for key in self._index.completing(output):
            ids = self._ids.get(key)
            if ids is None:
                ids = self._ids[key] = torch.tensor(self._index.lasts(key), dtype=torch.int64)
            found.append(ids)
        return found


@dataclass(slots=True)
class RequestConstraints:
    """One request's lists as the sampler uses them (CPU tensors)."""

    bias: tuple[torch.Tensor, torch.Tensor] | None  # logit_bias: [n] int64 ids, [n] float32
    allowed: torch.Tensor | None  # [n] int64 distinct allowed_token_ids
    stop_ids: torch.Tensor  # [n] int64 distinct stop_token_ids (suppressed below min_tokens)
    bad_words: BadWords | None
    prompt_ids: torch.Tensor  # [n] int64 distinct prompt ids; empty without repetition penalty

    @classmethod
    def build(cls, params: SamplingParams, prompt_token_ids: Sequence[int]
              ) -> RequestConstraints:
        bias = None
        if params.logit_bias:
            bias = (torch.tensor(list(params.logit_bias), dtype=torch.int64),
                    torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(params.allowed_token_ids, dtype=torch.int64).unique()
        prompt = _EMPTY
        if params.repetition_penalty != 1.0:
            prompt = torch.tensor(prompt_token_ids, dtype=torch.int64).unique()
        return cls(bias=bias, allowed=allowed,
                   stop_ids=torch.tensor(params.stop_token_ids or [], dtype=torch.int64).unique(),
                   bad_words=BadWords(params.bad_words_token_ids)
                   if params.bad_words_token_ids else None,
                   prompt_ids=prompt)


def build_constraints(params: Sequence[SamplingParams],
                      prompt_token_ids: Sequence[Sequence[int]]) -> list[RequestConstraints]:
    """Per row, built once for the rows that share a request's params and prompt (the rows of
    one verification window)."""
    built: dict[tuple[int, int], RequestConstraints] = {}
    out = []
    for p, prompt in zip(params, prompt_token_ids, strict=True):
        key = (id(p), id(prompt))
        if key not in built:
            built[key] = RequestConstraints.build(p, prompt)
        out.append(built[key])
    return out


def _pairs(pieces: list[tuple[int, torch.Tensor]], vocab_size: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | slice]:
    """(rows, token ids) of (row, token ids) pieces, only the ids inside the vocabulary (a
    draft model's may be smaller than the target's), and which of the pieces' ids they are
    (to pick the values that go with them: [n] bool, or every one)."""
    tokens = torch.cat([ids for _, ids in pieces])
    sizes = torch.tensor([ids.numel() for _, ids in pieces])
    rows = torch.tensor([row for row, _ in pieces], dtype=torch.int64).repeat_interleave(sizes)
    if not tokens.numel() or int(tokens.max()) < vocab_size:
        return rows, tokens, slice(None)
    keep = tokens < vocab_size
    return rows[keep], tokens[keep], keep


def logit_bias_triples(constraints: Sequence[RequestConstraints], vocab_size: int,
                       device: torch.device | str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, token ids, biases) of every row's logit_bias."""
    with_bias = [(row, c.bias) for row, c in enumerate(constraints) if c.bias is not None]
    if not with_bias:
        return None
    rows, tokens, keep = _pairs([(row, bias[0]) for row, bias in with_bias], vocab_size)
    biases = torch.cat([bias[1] for _, bias in with_bias])[keep]
    return rows.to(device), tokens.to(device), biases.to(device)


def suppressed_pairs(params: Sequence[SamplingParams],
                     constraints: Sequence[RequestConstraints],
                     output_token_ids: Sequence[Sequence[int]],
                     eos_token_ids: set[int] | frozenset[int], vocab_size: int,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs a row may not sample now: its stop ids (and eos unless ignore_eos)
    while it has fewer than min_tokens output tokens, and the last token of each bad word
    whose other tokens end its output."""
    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
    pieces: list[tuple[int, torch.Tensor]] = []
    for row, (p, c, out) in enumerate(zip(params, constraints, output_token_ids, strict=True)):
        if len(out) < p.min_tokens:
            pieces.append((row, c.stop_ids))
            if not p.ignore_eos:
                pieces.append((row, eos))
        if c.bad_words is not None:
            pieces += [(row, ids) for ids in c.bad_words.banned(out)]
    if not pieces:
        return None
    rows, tokens, _ = _pairs(pieces, vocab_size)
    if not rows.numel():
        return None
    return rows.to(device), tokens.to(device)


def allowed_masks(grammar: tuple[torch.Tensor, torch.Tensor] | None,
                  constraints: Sequence[RequestConstraints], vocab_size: int,
                  device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The grammar masks (rows, [R, V] bool) with each row's allowed_token_ids joined in: a
    row may take the tokens both allow."""
    with_ids = [(row, c.allowed) for row, c in enumerate(constraints) if c.allowed is not None]
    if not with_ids:
        return grammar
    grammar_rows = [] if grammar is None else grammar[0].tolist()
    rows = sorted({row for row, _ in with_ids} | set(grammar_rows))
    at = {row: i for i, row in enumerate(rows)}
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
    if grammar is not None:
        mask[[at[row] for row in grammar_rows]] = grammar[1]
    ids_rows, ids, _ = _pairs([(at[row], allowed) for row, allowed in with_ids
                               if allowed is not None], vocab_size)
    ids_mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    ids_mask[ids_rows.to(device), ids.to(device)] = True
    listed = torch.tensor([at[row] for row, _ in with_ids], dtype=torch.int64, device=device)
    mask[listed] &= ids_mask[listed]
    return torch.tensor(rows, dtype=torch.int64, device=device), mask


@dataclass(slots=True)
class PenaltyPairs:
    """The (row, token) pairs a penalty can change: tokens in the row's output, and in its
    prompt when its request has a repetition penalty. Every other logit keeps its value (a
    repetition factor of 1, a count of 0)."""

    rows: torch.Tensor  # [P] int64
    tokens: torch.Tensor  # [P] int64
    counts: torch.Tensor  # [P] float32, the token's count in the row's output (0: prompt only)


def penalty_pairs(constraints: Sequence[RequestConstraints],
                  output_token_ids: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device | str) -> PenaltyPairs:
    """Distinct (row, token) keys `row * V + token` with their output counts, by torch's
    unique over the rows' output ids (and their prompts' distinct ids): the cost grows with
    the batch's tokens, not with B x V."""
    outputs = [torch.tensor(out, dtype=torch.int64) for out in output_token_ids]
    prompts = [c.prompt_ids for c in constraints]
    rows, tokens, keep = _pairs([*enumerate(outputs), *enumerate(prompts)], vocab_size)
    weights = torch.cat([torch.ones(sum(o.numel() for o in outputs)),
                         torch.zeros(sum(p.numel() for p in prompts))])[keep]
    keys, inverse = torch.unique(rows * vocab_size + tokens, return_inverse=True)
    counts = torch.zeros(keys.numel()).index_add_(0, inverse, weights)
    return PenaltyPairs(rows=(keys // vocab_size).to(device),
                        tokens=(keys % vocab_size).to(device), counts=counts.to(device))
