"""Verification of speculative windows, vectorized over the batch (vLLM V1 vocabulary).

A window is one request's k drafts plus the k + 1 target rows that score them (k may be 0:
a plain decode, which is how every sampled row goes through here). Two modes per window:

- coupled (always for seeded requests): every target row draws its token with that
  position's keyed number (sampler.py), exactly as decoding without speculation would;
  draft j is accepted iff it equals row j's token, and the first mismatch emits the
  target's token. So a window emits what plain decoding emits, token for token, whatever k
  is; for a one-hot draft the acceptance probability is p(draft), as in rejection sampling.
- rejection (Leviathan et al. 2023; the default for unseeded requests): draft j is accepted
  with probability min(1, p/q) (its own keyed ACCEPT number); at the first rejection the
  recovered token is drawn from normalize(max(p - q, 0)) of that row (its RESIDUAL number);
  when all k are accepted the bonus token is row k's own draw. Lossless in distribution,
  and for drafts sampled from a q of their own it accepts sum(min(p, q)), more than coupled
  verification accepts.

p is `target_probs` (penalties, temperature, min-p, top-k, top-p), so greedy rows are one-hot
at the penalized argmax: drafts are accepted while they equal it and the emitted token is
that argmax, bit for bit what the plain greedy sampler picks, in both modes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from braid.worker.sampler import (
    ACCEPT,
    RESIDUAL,
    SamplingMetadata,
    inverse_cdf,
    keyed_uniforms,
    sample_rows,
)


@dataclass(slots=True)
class VerifyOutput:
    output_token_ids: torch.Tensor  # [num_windows, max_k + 1] int64; -1 past the emitted tokens
    num_accepted: torch.Tensor  # [num_windows] int64, accepted draft tokens per window


@dataclass(slots=True)
class _Windows:
    """Host-built index tensors that place each window's rows in the flat inputs."""

    num_drafts: torch.Tensor  # [W] int64, k_i
    target_start: torch.Tensor  # [W] int64, first target row of each window
    draft_ids: torch.Tensor  # [W, max_k] int64, -1 padded
    valid: torch.Tensor  # [W, max_k] bool, j < k_i

    @property
    def max_k(self) -> int:
        return self.draft_ids.shape[1]

    def target_rows(self) -> torch.Tensor:
        """[W, max_k] the target row scoring each draft (0 where padded)."""
        positions = torch.arange(self.max_k, device=self.valid.device)
        return torch.where(self.valid, self.target_start.unsqueeze(1) + positions, 0)


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: list[list[int]],
    meta: SamplingMetadata,
    draft_probs: list[torch.Tensor | None] | None = None,
    rejection: list[bool] | None = None,
) -> VerifyOutput:
    """Verify every window's drafts and emit num_accepted + 1 tokens each.

    `target_logits` [sum(k_i + 1), V] holds window i's k_i + 1 rows consecutively and `meta`
    is built per row. `rejection[i]` puts window i in rejection mode (default: all coupled),
    with `draft_probs[i]` [k_i, V] its proposer's q, or None for a one-hot q (greedy and
    n-gram drafts)."""
    windows = _build_windows(draft_token_ids, target_logits)
    samples, probs = sample_rows(target_logits, meta)  # [N], [N, V] unless all greedy
    rows = windows.target_rows()  # [W, max_k]
    tokens = windows.draft_ids.clamp(min=0)  # [W, max_k]
    accepted = samples[rows] == tokens  # coupled: the draft is the target's own draw
    use_rejection = (rejection is not None and any(rejection) and probs is not None
                     and windows.max_k > 0)
    if use_rejection:
        assert rejection is not None and probs is not None
        mask = torch.tensor(rejection, device=accepted.device)  # [W]
        q = _draft_q(draft_probs, draft_token_ids, windows, probs.shape[1])  # [W, max_k, V] | None
        accepted = torch.where(mask.unsqueeze(1), _rejection_accepts(probs, q, meta, windows),
                               accepted)
    num_accepted = (accepted & windows.valid).long().cumprod(dim=1).sum(dim=1)  # [W]
    final_rows = windows.target_start + num_accepted  # [W]
    final = samples[final_rows]  # [W]: the bonus token, or coupled mode's emitted sample
    if use_rejection:
        assert probs is not None
        recovered = _recovered(probs, q, meta, windows, num_accepted, final_rows)  # [W]
        rejected = mask & (num_accepted < windows.num_drafts)
        final = torch.where(rejected, recovered, final)
    return VerifyOutput(_emitted(windows, num_accepted, final), num_accepted)


def _build_windows(draft_token_ids: list[list[int]], target_logits: torch.Tensor) -> _Windows:
    ks = [len(drafts) for drafts in draft_token_ids]
    if target_logits.shape[0] != sum(ks) + len(ks):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, want sum(k_i + 1)")
    device = target_logits.device
    num_drafts = torch.tensor(ks, dtype=torch.int64, device=device)  # [W]
    draft_start = num_drafts.cumsum(0) - num_drafts  # [W]
    max_k = max(ks, default=0)
    padded = [d + [-1] * (max_k - len(d)) for d in draft_token_ids]
    return _Windows(
        num_drafts=num_drafts,
        target_start=draft_start + torch.arange(len(ks), device=device),
        draft_ids=torch.tensor(padded, dtype=torch.int64, device=device).view(len(ks), max_k),
        valid=torch.arange(max_k, device=device) < num_drafts.unsqueeze(1),
    )


def _draft_q(
    draft_probs: list[torch.Tensor | None] | None,
    draft_token_ids: list[list[int]],
    windows: _Windows,
    vocab_size: int,
) -> torch.Tensor | None:
    """[W, max_k, V] float32 q per draft (one-hot rows for windows without q), or None when
    every q is one-hot."""
    if draft_probs is None:
        return None
    if len(draft_probs) != len(draft_token_ids):
        raise ValueError("draft_probs must have one entry per window")
    if all(q is None for q in draft_probs):
        return None
    rows = []
    for w, (probs, drafts) in enumerate(zip(draft_probs, draft_token_ids, strict=True)):
        if probs is None:
            probs = torch.zeros(len(drafts), vocab_size, device=windows.valid.device)
            probs[torch.arange(len(drafts)), torch.tensor(drafts, dtype=torch.int64)] = 1.0
        elif probs.shape[0] != len(drafts):
            raise ValueError(f"draft_probs[{w}] has {probs.shape[0]} rows, want {len(drafts)}")
        rows.append(probs.float())
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [W, max_k, V]


def _rejection_accepts(
    probs: torch.Tensor, q: torch.Tensor | None, meta: SamplingMetadata, windows: _Windows
) -> torch.Tensor:
    """[W, max_k] bool: u < p(x) / q(x) per draft x, with u its row's ACCEPT number."""
    rows = windows.target_rows()
    tokens = windows.draft_ids.clamp(min=0)
    p = probs[rows, tokens]  # [W, max_k]
    q_x = (torch.ones_like(p) if q is None
           else q.gather(2, tokens.unsqueeze(2)).squeeze(2))  # [W, max_k]
    u = keyed_uniforms(meta, ACCEPT, probs.device)[rows].float()  # [W, max_k]
    # u * q < p without dividing: q = 0 accepts whenever p > 0; p == 1 always accepts, so a
    # greedy row (p one-hot) accepts exactly when the draft is its argmax.
    return (u * q_x < p) | (p >= 1)


def _recovered(
    probs: torch.Tensor,
    q: torch.Tensor | None,
    meta: SamplingMetadata,
    windows: _Windows,
    num_accepted: torch.Tensor,
    final_rows: torch.Tensor,
) -> torch.Tensor:
    """[W] the recovered token of each window's first rejected row: a draw (RESIDUAL number)
    from max(p - q, 0) there (p itself where that has no mass). Meaningless for windows that
    accepted everything (the caller keeps their bonus token)."""
    final_p = probs[final_rows]  # [W, V]
    at = num_accepted.clamp(max=max(windows.max_k - 1, 0)).unsqueeze(1)  # [W, 1]
    if q is None:  # one-hot q: max(p - q, 0) is p with the rejected draft token zeroed
        residual = final_p.scatter(1, windows.draft_ids.gather(1, at).clamp(min=0), 0.0)
    else:
        q_at = q[torch.arange(q.shape[0], device=q.device), at.squeeze(1)]  # [W, V]
        residual = (final_p - q_at).clamp(min=0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, final_p)
    u = keyed_uniforms(meta, RESIDUAL, probs.device)[final_rows]  # [W]
    return inverse_cdf(residual, u)


def _emitted(windows: _Windows, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[W, max_k + 1] int64: accepted drafts, then the recovered or bonus token, then -1."""
    num_windows = num_accepted.shape[0]
    pad = torch.full((num_windows, 1), -1, dtype=torch.int64, device=num_accepted.device)
    tokens = torch.cat([windows.draft_ids, pad], dim=1)  # [W, max_k + 1]
    positions = torch.arange(windows.max_k + 1, device=tokens.device)  # [max_k + 1]
    tokens = torch.where(positions < num_accepted.unsqueeze(1), tokens, -1)
    at_final = positions == num_accepted.unsqueeze(1)  # [W, max_k + 1]
    return torch.where(at_final, final.unsqueeze(1), tokens)

