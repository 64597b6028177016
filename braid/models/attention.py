"""Paged attention over one flat batch of query tokens from many requests (CPU, torch ops).

Attention contract (docs/architecture.md): request i contributes n_i query tokens at positions
[c_i, c_i + n_i); they attend to every cached position < c_i of that request and, causally,
to each other. Prefill chunks (n_i large), decodes (n_i = 1) and verification windows
(n_i = 1 + k) are the same case; nothing here knows which is which.

Requests are split into attention *groups*, built once per step and reused by every layer:
all requests with short query spans form one padded batch (one SDPA call), and each request
with a long span (a prefill chunk) is a group of its own. A per-long-request call is the
only per-request loop: padding a 512-token chunk together with 1-token decodes would multiply
the attention work by the number of requests, and the token budget keeps long spans few.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from braid.kernels import kernel_isa, quant_ops

# Query spans up to this length share one padded SDPA call (decodes, verification windows).
SHORT_QUERY_MAX = 16


@dataclass(slots=True)
class AttentionGroup:
    query_index: torch.Tensor  # [G, q_max] rows of the flat batch (padding rows repeat row 0)
    kv_slots: torch.Tensor  # [G, kv_max] cache slots of positions 0..seq_len-1 (padding: 0)
    mask: torch.Tensor | None  # [G, 1, q_max, kv_max] True = attend; None = attend to all
    out_rows: torch.Tensor  # [num_valid] flat rows this group writes
    out_select: torch.Tensor  # [num_valid] index into the group's flattened [G * q_max]
    q_pos: torch.Tensor  # [G, q_max] each query's position (padding rows: their request's last)
    seqs: torch.Tensor  # [G] its requests (rows of AttentionMetadata.kv_slots)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot where each query token's K/V goes
    groups: list[AttentionGroup]
    num_tokens: int
    # For the row-by-row kernel: cache slots of every request's positions [R, kv_max]
    # (padding 0), each query row's request [T] and the keys it attends to [T].
    kv_slots: torch.Tensor | None = None
    row_seq: torch.Tensor | None = None
    row_len: torch.Tensor | None = None
    row_start: torch.Tensor | None = None  # [T] a windowed layer's first key (None: 0)
    # The same step seen by sliding-window layers, by window (see `windowed`)
    windows: dict[int, AttentionMetadata] = field(default_factory=dict)
    # A hybrid model's layer groups 1.. (KVLayout): the step over their block tables
    kv_groups: list[AttentionMetadata] = field(default_factory=list)

    def for_layer(self, kv_group: int, window: int | None) -> AttentionMetadata:
        """This step for a layer of layer group `kv_group` attending in `window`."""
        return (self.kv_groups[kv_group - 1] if kv_group else self).windowed(window)

    def over_tables(self, group_tables: list[list[list[int]]], block_size: int
                    ) -> list[AttentionMetadata]:
        """The same step over other block tables (a hybrid model's further layer groups,
        KVLayout; `group_tables[g][i]`: group g's table of request i): the same queries and
        keys, their slots looked up in each group's tables, all groups at once."""
        assert self.kv_slots is not None and self.row_seq is not None and self.row_len is not None
        width = max((len(t) for tables in group_tables for t in tables), default=0)
        if width == 0:
            return [self] * len(group_tables)
        device = self.kv_slots.device
        # [G, R, width] (a released block, -1, named as block 0: no windowed query reads it)
        tables = torch.tensor([[t + [0] * (width - len(t)) for t in ts] for ts in group_tables],
                              dtype=torch.long).clamp_(min=0).to(device)
        pos = torch.arange(self.kv_slots.shape[1], device=device)
        seq_lens = torch.zeros(tables.shape[1], dtype=torch.long, device=device
                               ).scatter_reduce_(0, self.row_seq, self.row_len, "amax")
        kv_slots = torch.where(pos[None, :] < seq_lens[:, None],
                               tables[:, :, (pos // block_size).clamp(max=width - 1)]
                               * block_size + pos % block_size, 0)  # [G, R, kv_max]
        slot_mapping = kv_slots[:, self.row_seq, self.row_len - 1]  # [G, T]
        attn_groups = [kv_slots[:, g.seqs, : g.kv_slots.shape[1]] for g in self.groups]
        return [AttentionMetadata(
            slot_mapping[i],
            [AttentionGroup(g.query_index, slots[i], g.mask, g.out_rows, g.out_select, g.q_pos,
                            g.seqs) for g, slots in zip(self.groups, attn_groups, strict=True)],
            self.num_tokens, kv_slots[i], self.row_seq, self.row_len)
            for i in range(len(group_tables))]

    def windowed(self, window: int | None) -> AttentionMetadata:
        """This step for a layer whose queries attend only to the last `window` positions
        (their own included: key position > query position - window, as transformers'
        sliding-window mask and llama.cpp's SWA). The same slots are written; the row-by-row
        kernel gets each query row's first key, and each SDPA group a mask cut to the window.
        Built once per step and window, shared by every layer with that window."""
        if window is None or (self.kv_slots is not None and window >= self.kv_slots.shape[1]):
            return self  # (no sequence of the step reaches past the window)
        view = self.windows.get(window)
        if view is None:
            view = self.windows[window] = _windowed(self, window)
        return view


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Inputs for one step. Request i has `query_lens[i]` new tokens after `context_lens[i]`
    cached ones; `block_tables[i]` must cover `context_lens[i] + query_lens[i]` positions."""
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    slots = [_slots(table, s, block_size) for table, s in zip(block_tables, seq_lens, strict=True)]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slot_mapping = torch.cat(
        [s[c:] for s, c in zip(slots, context_lens, strict=True)]
    ) if slots else torch.empty(0, dtype=torch.long)
    short = [i for i, n in enumerate(query_lens) if n <= SHORT_QUERY_MAX]
    long = [i for i, n in enumerate(query_lens) if n > SHORT_QUERY_MAX]
    groups = [_group(idx, starts, query_lens, context_lens, slots) for idx in [short] if idx]
    groups += [_group([i], starts, query_lens, context_lens, slots) for i in long]
    kv_slots = torch.zeros(len(slots), max(seq_lens, default=0), dtype=torch.long)
    for i, seq_slots in enumerate(slots):
        kv_slots[i, : seq_slots.numel()] = seq_slots
    row_seq = torch.repeat_interleave(torch.arange(len(query_lens)),
                                      torch.tensor(query_lens, dtype=torch.long))
    first = torch.tensor(starts[:-1], dtype=torch.long)
    row_len = (torch.tensor(context_lens, dtype=torch.long)[row_seq] + 1
               + torch.arange(starts[-1]) - first[row_seq])  # causal: keys 0..position
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        groups=[_to_device(g, device) for g in groups],
        num_tokens=starts[-1],
        kv_slots=kv_slots.to(device), row_seq=row_seq.to(device), row_len=row_len.to(device),
    )


def _slots(block_table: list[int], seq_len: int, block_size: int) -> torch.Tensor:
    positions = torch.arange(seq_len)
    # (a released block, -1: positions no windowed query reads again, named as block 0)
    table = torch.tensor(block_table, dtype=torch.long).clamp(min=0)
    return table[positions // block_size] * block_size + positions % block_size


def _group(
    reqs: list[int],
    starts: list[int],
    query_lens: list[int],
    context_lens: list[int],
    slots: list[torch.Tensor],
) -> AttentionGroup:
    q_max = max(query_lens[i] for i in reqs)
    kv_max = max(context_lens[i] + query_lens[i] for i in reqs)
    q_off = torch.arange(q_max)
    n = torch.tensor([query_lens[i] for i in reqs])
    c = torch.tensor([context_lens[i] for i in reqs])
    start = torch.tensor([starts[i] for i in reqs])
    valid_q = q_off[None, :] < n[:, None]  # [G, q_max]
    query_index = torch.where(valid_q, start[:, None] + q_off[None, :], 0)
    kv_slots = torch.zeros(len(reqs), kv_max, dtype=torch.long)
    for g, i in enumerate(reqs):
        kv_slots[g, : slots[i].numel()] = slots[i]
    # Query j of request i sits at position c_i + j and sees keys at positions <= c_i + j.
    key_pos = torch.arange(kv_max)
    mask = key_pos[None, None, :] <= (c[:, None, None] + q_off[None, :, None])
    mask[:, :, 0] |= ~valid_q  # padding rows attend to key 0 so softmax has no empty row
    full = len(reqs) == 1 and query_lens[reqs[0]] == 1
    return AttentionGroup(
        query_index=query_index,
        kv_slots=kv_slots,
        mask=None if full else mask[:, None],
        out_rows=query_index[valid_q],
        out_select=torch.nonzero(valid_q.flatten()).squeeze(1),
        q_pos=torch.where(valid_q, c[:, None] + q_off[None, :], (c + n - 1)[:, None]),
        seqs=torch.tensor(reqs, dtype=torch.long),
    )


def _windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """`meta` with every query cut to the keys of its window (AttentionMetadata.windowed)."""
    groups = []
    for g in meta.groups:
        key_pos = torch.arange(g.kv_slots.shape[1], device=g.kv_slots.device)
        inside = ((key_pos[None, None, :] <= g.q_pos[:, :, None])
                  & (key_pos[None, None, :] > g.q_pos[:, :, None] - window))
        groups.append(AttentionGroup(g.query_index, g.kv_slots, inside[:, None], g.out_rows,
                                     g.out_select, g.q_pos, g.seqs))
    row_start = None if meta.row_len is None else (meta.row_len - window).clamp(min=0)
    return AttentionMetadata(meta.slot_mapping, groups, meta.num_tokens, meta.kv_slots,
                             meta.row_seq, meta.row_len, row_start)


def _to_device(g: AttentionGroup, device: torch.device | str) -> AttentionGroup:
    return AttentionGroup(
        query_index=g.query_index.to(device),
        kv_slots=g.kv_slots.to(device),
        mask=None if g.mask is None else g.mask.to(device),
        out_rows=g.out_rows.to(device),
        out_select=g.out_select.to(device),
        q_pos=g.q_pos.to(device),
        seqs=g.seqs.to(device),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D], caches [num_slots, KVH, D] -> output [T, H, D].

    Writes the new K/V into the caches first (rounded to the caches' dtype), then attends
    over the cache only."""
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    return attend_cached(q, k_cache, v_cache, meta, scale)


def attend_cached(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """q [T, H, D] over caches that already hold this step's keys and values -> [T, H, D]
    (scores scaled by `scale`, by default 1 / sqrt(D)).

    On the CPU with float32 queries the compiled row-by-row kernel computes each row the
    same way whatever the batch (see attention.cpp), over float32, float16 or bfloat16
    caches; elsewhere one SDPA call per group, the cache widened to the queries' dtype."""
    ops = quant_ops() if q.device.type == "cpu" and q.dtype == torch.float32 else None
    if ops is not None and meta.kv_slots is not None:
        return ops.paged_attention_rows(q, k_cache, v_cache, meta.kv_slots, meta.row_seq,
                                        meta.row_len, scale or q.shape[-1] ** -0.5, kernel_isa(),
                                        meta.row_start)
    out = torch.empty_like(q)
    for g in meta.groups:
        qg = q[g.query_index].transpose(1, 2)  # [G, H, q_max, D]
        kg = k_cache[g.kv_slots].to(q.dtype).transpose(1, 2)  # [G, KVH, kv_max, D]
        vg = v_cache[g.kv_slots].to(q.dtype).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True,
                                            scale=scale)
        og = og.transpose(1, 2).flatten(0, 1)  # [G * q_max, H, D]
        out[g.out_rows] = og[g.out_select]
    return out
