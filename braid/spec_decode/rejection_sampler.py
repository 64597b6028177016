"""Rejection sampler for speculative decoding, vectorized over verification windows.

A window is one request's k drafts plus the k + 1 target rows that score them (k may be 0:
a plain decode). Per window (Leviathan et al. 2023; vLLM V1 vocabulary):
  - draft j is accepted with probability min(1, p(x_j) / q(x_j)), left to right;
  - at the first rejection the recovered token is sampled from normalize(max(p - q, 0)) of
    that row (p itself when the residual is all zero) and the window stops;
  - when all k drafts are accepted, the bonus token is sampled from p of the last row.
So a window emits num_accepted + 1 tokens, distributed exactly as sampling from p one by one.

p is `target_probs` (penalties, temperature, min-p, top-k, top-p), so greedy rows are one-hot
at the penalized argmax: drafts are accepted while they equal it and the emitted token is that
argmax, bit for bit what the plain greedy `Sampler` picks.

Random numbers: a window with a generator draws its k uniforms and then one row of V
exponentials (the race that samples its recovered or bonus token) from that generator, so its
tokens do not depend on the rest of the batch; with k = 0 it draws exactly what the plain
`Sampler` would. Other windows share one batched draw. A greedy window never reads its
numbers (pass None for it, as `SamplingMetadata.build` leaves greedy rows out of its seeded
rows; a generator given anyway only advances). An all-greedy batch draws nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from braid.engine.sampler import SamplingMetadata, exponential_race, target_probs


@dataclass(slots=True)
class RejectionOutput:
    output_token_ids: torch.Tensor  # [num_windows, max_k + 1] int64; -1 past the emitted tokens
    num_accepted: torch.Tensor  # [num_windows] int64, accepted draft tokens per window


@dataclass(slots=True)
class _Windows:
    """Host-built index tensors that place each window's rows in the flat inputs."""

    ks: list[int]  # k_i on the host, for the seeded windows' draws
    num_drafts: torch.Tensor  # [W] int64, k_i
    target_start: torch.Tensor  # [W] int64, first target row of each window
    draft_start: torch.Tensor  # [W] int64, first draft row of each window
    draft_ids: torch.Tensor  # [W, max_k] int64, -1 padded
    valid: torch.Tensor  # [W, max_k] bool, j < k_i

    @property
    def max_k(self) -> int:
        return self.draft_ids.shape[1]


def rejection_sample(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    draft_probs: torch.Tensor | None,
    meta: SamplingMetadata,
    generators: Sequence[torch.Generator | None],
) -> RejectionOutput:
    """Verify every window's drafts against the target and emit num_accepted + 1 tokens each.

    `target_logits` [sum(k_i + 1), V] holds window i's k_i + 1 rows consecutively and `meta`
    is built per row. `draft_probs` [sum(k_i), V] is the proposer's q, or None for one-hot q
    (n-gram and greedy drafts). `generators[i]` is window i's request generator or None.
    """
    windows = _build_windows(draft_token_ids, target_logits, draft_probs, generators)
    probs = target_probs(target_logits.float(), meta)  # [N, V]
    uniforms = _uniforms(windows, generators, meta.all_greedy, probs.device)  # [W, max_k]
    num_accepted = _num_accepted(probs, draft_probs, windows, uniforms)  # [W]
    final_rows = windows.target_start + num_accepted  # [W]
    final_probs = _final_distribution(probs, draft_probs, windows, num_accepted)  # [W, V]
    final_tokens = _sample_final(final_probs, final_rows, meta, generators)  # [W]
    return RejectionOutput(_emitted(windows, num_accepted, final_tokens), num_accepted)


def _build_windows(
    draft_token_ids: list[list[int]],
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> _Windows:
    ks = [len(drafts) for drafts in draft_token_ids]
    if target_logits.shape[0] != sum(ks) + len(ks):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, want sum(k_i + 1)")
    if draft_probs is not None and draft_probs.shape[0] != sum(ks):
        raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows, want sum(k_i)")
    if len(generators) != len(ks):
        raise ValueError("generators must have one entry per window")
    device = target_logits.device
    num_drafts = torch.tensor(ks, dtype=torch.int64, device=device)  # [W]
    draft_start = num_drafts.cumsum(0) - num_drafts  # [W]
    max_k = max(ks, default=0)
    return _Windows(
        ks=ks,
        num_drafts=num_drafts,
        target_start=draft_start + torch.arange(len(ks), device=device),
        draft_start=draft_start,
        draft_ids=_padded_drafts(draft_token_ids, num_drafts, draft_start, max_k),
        valid=torch.arange(max_k, device=device) < num_drafts.unsqueeze(1),
    )


def _padded_drafts(
    draft_token_ids: list[list[int]],
    num_drafts: torch.Tensor,
    draft_start: torch.Tensor,
    max_k: int,
) -> torch.Tensor:
    """[W, max_k] int64 draft ids, -1 padded, scattered without a host sync."""
    device = num_drafts.device
    flat = torch.tensor(list(chain.from_iterable(draft_token_ids)), dtype=torch.int64)
    window = torch.arange(num_drafts.shape[0], device=device).repeat_interleave(
        num_drafts, output_size=flat.numel()
    )  # [sum(k_i)], each draft's window
    slot = window * max_k + torch.arange(flat.numel(), device=device) - draft_start[window]
    padded = torch.full((num_drafts.shape[0] * max_k,), -1, dtype=torch.int64, device=device)
    padded[slot] = flat.to(device)
    return padded.view(num_drafts.shape[0], max_k)


def _uniforms(
    windows: _Windows,
    generators: Sequence[torch.Generator | None],
    all_greedy: bool,
    device: torch.device,
) -> torch.Tensor:
    """[W, max_k] float32 in [0, 1). Greedy acceptance never reads them, so none are drawn
    for an all-greedy batch; a seeded window draws exactly its k_i."""
    uniforms = torch.zeros(windows.draft_ids.shape, dtype=torch.float32, device=device)
    if all_greedy or windows.max_k == 0:
        return uniforms
    seeded = [(w, g) for w, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        uniforms.uniform_()
    # One draw per seeded window, so its numbers do not depend on the rest of the batch.
    for w, generator in seeded:
        uniforms[w, : windows.ks[w]].uniform_(generator=generator)
    return uniforms


def _num_accepted(
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    windows: _Windows,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """[W] int64: length of each window's accepted prefix of drafts."""
    if windows.max_k == 0:
        return torch.zeros_like(windows.num_drafts)
    positions = torch.arange(windows.max_k, device=probs.device)  # [max_k]
    token = windows.draft_ids.clamp(min=0)  # [W, max_k]
    target_rows = torch.where(windows.valid, windows.target_start.unsqueeze(1) + positions, 0)
    p = probs[target_rows, token]  # [W, max_k]
    if draft_probs is None:
        q = torch.ones_like(p)
    else:
        draft_rows = torch.where(windows.valid, windows.draft_start.unsqueeze(1) + positions, 0)
        q = draft_probs.float()[draft_rows, token]  # [W, max_k]
    # u < p / q without dividing: q = 0 accepts whenever p > 0. p == 1 always accepts, so
    # greedy rows (p one-hot) accept exactly when the draft is the argmax, whatever u is.
    accepted = ((uniforms * q < p) | (p >= 1)) & windows.valid  # [W, max_k]
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _final_distribution(
    probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    windows: _Windows,
    num_accepted: torch.Tensor,
) -> torch.Tensor:
    """[W, V] unnormalized distribution of the last emitted token: the residual
    max(p - q, 0) at the rejected row, or p of the bonus row when every draft was accepted."""
    final_p = probs[windows.target_start + num_accepted]  # [W, V]
    if windows.max_k == 0:
        return final_p
    rejected = (num_accepted < windows.num_drafts).unsqueeze(1)  # [W, 1]
    at = num_accepted.clamp(max=windows.max_k - 1).unsqueeze(1)  # [W, 1]
    if draft_probs is None:
        # one-hot q: max(p - q, 0) is p with the rejected draft token zeroed
        rejected_token = windows.draft_ids.gather(1, at).clamp(min=0)  # [W, 1]
        residual = final_p.scatter(1, rejected_token, 0.0)
    else:
        draft_row = (windows.draft_start.unsqueeze(1) + at).clamp(max=draft_probs.shape[0] - 1)
        residual = (final_p - draft_probs.float()[draft_row.squeeze(1)]).clamp(min=0)
    # p == q leaves no residual mass (unreachable for normalized p, q): fall back to p
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, final_p)
    return torch.where(rejected, residual, final_p)


def _sample_final(
    final_probs: torch.Tensor,
    final_rows: torch.Tensor,
    meta: SamplingMetadata,
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """[W] int64. Greedy rows take the argmax of their one-hot (no random draw); random rows
    run the sampler's exponential race, seeded windows on their own generator."""
    greedy_tokens = final_probs.argmax(dim=-1)  # [W]
    if meta.all_greedy:
        return greedy_tokens
    seeded = {w: g for w, g in enumerate(generators) if g is not None}
    sampled = exponential_race(final_probs, seeded)  # [W]
    if meta.greedy_mask is None:
        return sampled
    return torch.where(meta.greedy_mask[final_rows], greedy_tokens, sampled)


def _emitted(
    windows: _Windows, num_accepted: torch.Tensor, final_tokens: torch.Tensor
) -> torch.Tensor:
    """[W, max_k + 1] int64: accepted drafts, then the recovered or bonus token, then -1."""
    num_windows = num_accepted.shape[0]
    pad = torch.full((num_windows, 1), -1, dtype=torch.int64, device=num_accepted.device)
    tokens = torch.cat([windows.draft_ids, pad], dim=1)  # [W, max_k + 1]
    positions = torch.arange(windows.max_k + 1, device=tokens.device)  # [max_k + 1]
    tokens = torch.where(positions < num_accepted.unsqueeze(1), tokens, -1)
    final = positions == num_accepted.unsqueeze(1)  # [W, max_k + 1]
    return torch.where(final, final_tokens.unsqueeze(1), tokens)
