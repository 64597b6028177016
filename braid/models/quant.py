"""Quantized weights: GGUF block rows kept as they are on disk, run by braid.kernels.

A `QuantWeight` is a matrix in one GGML block format ([rows, bytes per row], uint8). A
`QuantLinear` holds one or more of them stacked along the output (fused q/k/v or gate/up whose
parts may differ in format); `QuantEmbedding` looks rows up by dequantizing just those rows.
Formats without a kernel, and float checkpoints asked to be quantized, become Q8_0 (int8) or
Q4_0 (int4) blocks of 32.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from braid.kernels import kernel_isa, quant_ops

Q = GGMLQuantizationType
# Formats the kernels run; K-quants want rows of whole 256-value super-blocks.
KERNEL_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K,
                          Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS})
# Formats whose activations are Q8_K blocks (256 values), not Q8_0 ones (32).
K_QUANTS = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS})
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
QUANTIZATIONS = ("auto", "none", "int8", "int4")
_FLOAT_QUANT = {"int8": Q.Q8_0, "int4": Q.Q4_0}


@dataclass
class QuantWeight:
    data: torch.Tensor  # uint8 [rows, bytes per row], blocks in the layout below
    qtype: GGMLQuantizationType  # the values' format (what a GGUF calls the tensor's type)
    cols: int  # values per row (in_features)
    # The kernels' block layout: the GGML type's own, braid's unpacked Q4_K
    # (ops.Q4_K_UNPACKED) or its panels (ops.PANEL + type); see `as_kernel_format`.
    layout: int = -1

    def __post_init__(self) -> None:
        if self.layout < 0:
            self.layout = int(self.qtype)

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [rows, cols] (with `rows`: only those, in that order)."""
        ops = quant_ops()
        if ops is not None and runnable(self.qtype, self.cols):
            return ops.dequantize_rows(self.data, torch.arange(self.rows) if rows is None
                                       else rows, self.layout, self.cols)
        if rows is not None:
            return self.dequantize()[rows]
        assert self.layout == int(self.qtype), "a repacked weight needs the kernels"
        return torch.from_numpy(dequantize(self.data.numpy(), self.qtype)).reshape(
            self.rows, self.cols)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, cols] float32 -> x W^T [R, rows] through the kernels."""
        ops = quant_ops()
        assert ops is not None, "quantized products need the compiled kernels"
        out = torch.empty(x.shape[0], self.rows)
        isa = kernel_isa()
        ops.qgemm_into(ops.quantize_activations(x, int(self.qtype), isa), self.data, self.layout,
                       self.cols, out, 0, isa)
        return out

    def take_rows(self, ids: torch.Tensor) -> tuple[QuantWeight, torch.Tensor]:
        """Rows `ids` as a weight of the same layout (a panel layout's whole panels of 16),
        and where each id's row sits in it. Its products are bit-identical to those rows of
        the full weight's: every output is computed on its own (the kernels' batch
        invariance)."""
        ops = quant_ops()
        if ops is not None and self.layout > ops.PANEL:
            n = ops.PANEL_ROWS
            panels, where = torch.unique(ids // n, return_inverse=True)
            data = self.data.view(-1, n * self.data.shape[1])[panels].view(-1, self.data.shape[1])
            return QuantWeight(data, self.qtype, self.cols, self.layout), where * n + ids % n
        rows, where = torch.unique(ids, return_inverse=True)
        return QuantWeight(self.data[rows], self.qtype, self.cols, self.layout), where

    def requantized(self, qtype: GGMLQuantizationType, chunk_rows: int = 8192) -> QuantWeight:
        """The same matrix re-quantized to `qtype` (round to nearest from the dequantized
        values), a chunk of rows at a time so a large one never exists in float32 whole."""
        parts = [quantize_float(self.dequantize(torch.arange(a, min(a + chunk_rows, self.rows))),
                                qtype).data for a in range(0, self.rows, chunk_rows)]
        return QuantWeight(torch.cat(parts), qtype, self.cols)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, on 2 MB pages where _huge_page_buffer gives them, else torch's."""
    buffer = _huge_page_buffer(math.prod(shape) * dtype.itemsize)
    return (torch.zeros(shape, dtype=dtype) if buffer is None
            else buffer.view(dtype).view(shape))


def _huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """Zeroed uint8 [nbytes] in anonymous memory asked to be backed by 2 MB pages
    (MADV_HUGEPAGE: transparent huge pages in the usual "madvise" mode), or None for small
    buffers, systems without madvise and BRAID_HUGE_PAGES=0. A decode streams every weight
    byte once per step; with 4 KB pages each page costs a TLB walk, and on 2 MB ones the same
    decode ran ~13% faster (docs/benchmarks.md, Huge pages). Where the kernel has no huge
    page to give, the mapping gets small ones (the same bytes, only slower). Finding free 2 MB
    pages can stall on a fragmented machine (the kernel compacts memory: 5.5 s for the first
    1 GB once, 0.4 s after)."""
    if (nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE")
            or os.environ.get("BRAID_HUGE_PAGES") == "0"):
        return None
    # private (the default, MAP_SHARED, is shmem: no huge pages); zero pages; torch.frombuffer
    # keeps the mapping alive
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def runnable(qtype: GGMLQuantizationType, cols: int) -> bool:
    """Whether the kernels run rows of `cols` values in this format."""
    return qtype in KERNEL_TYPES and cols % GGML_QUANT_SIZES[qtype][0] == 0


def bits_per_value(qtype: GGMLQuantizationType) -> float:
    """Storage of one value in this block format, its scales included (Q4_0 4.5, Q8_0 8.5)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return 8 * size / block


def quantize_float(weight: torch.Tensor, qtype: GGMLQuantizationType) -> QuantWeight:
    """A float [rows, cols] matrix as blocks of `qtype` (Q8_0 / Q4_0 / Q5_0: round to nearest
    with one scale per 32 values, llama.cpp's reference quantizers)."""
    rows, cols = weight.shape
    data = quantize(weight.detach().float().numpy(), qtype)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(data)).view(rows, -1), qtype, cols)


def as_kernel_format(w: QuantWeight) -> QuantWeight:
    """A weight the kernels can run: its values re-quantized to Q8_0 (int8) where the kernels
    have no routine for its format; then, where the CPU has AVX512-VNNI, in panels of 16
    interleaved rows (`ops.PANEL` + its type); elsewhere Q4_K in the unpacked layout (the same
    values; its scales are not decoded every block, for 3% more bytes)."""
    if not runnable(w.qtype, w.cols):
        w = quantize_float(w.dequantize(), Q.Q8_0)
    ops = quant_ops()
    if ops is None or w.layout != int(w.qtype):
        return w
    if kernel_isa().vnni and w.rows % ops.PANEL_ROWS == 0:
        return QuantWeight(ops.repack_panels(w.data, int(w.qtype), w.cols), w.qtype, w.cols,
                           ops.PANEL + int(w.qtype))
    if w.qtype == Q.Q4_K:
        return QuantWeight(ops.repack_q4_k(w.data, w.cols), w.qtype, w.cols,
                           ops.Q4_K_UNPACKED)
    return w


def float_quant_type(quantization: str) -> GGMLQuantizationType | None:
    """The block format `--quantization int8 / int4` gives a float checkpoint's linears."""
    return _FLOAT_QUANT.get(quantization)


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored as quantized segments stacked along the output rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.segments: list[tuple[int, QuantWeight]] = []  # (first output row, weight)

    def set_rows(self, offset: int, weight: QuantWeight) -> None:
        if weight.cols != self.in_features or offset + weight.rows > self.out_features:
            raise ValueError(f"quantized rows [{offset}, {offset + weight.rows}) x "
                             f"{weight.cols} do not fit [{self.out_features}, "
                             f"{self.in_features}]")
        self.segments = _merged(sorted([*self.segments, (offset, as_kernel_format(weight))],
                                       key=lambda s: s[0]))

    def weight_bytes(self) -> int:
        return sum(w.data.numel() for _, w in self.segments)

    def forward(self, x: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; with `num_rows`, only the first that many outputs."""
        ops = quant_ops()
        assert ops is not None, "QuantLinear needs the compiled kernels"
        rows = self.out_features if num_rows is None else min(num_rows, self.out_features)
        x2 = (x if x.dim() == 2 else x.reshape(-1, self.in_features)).float()
        # A panel segment computes whole panels: room for the last one.
        panel = ops.PANEL_ROWS
        out = torch.empty(x2.shape[0], -(-rows // panel) * panel if rows < self.out_features
                          else rows)
        activations: dict[bool, torch.Tensor] = {}  # per activation format (K-quant or not)
        isa = kernel_isa()
        for offset, w in self.segments:
            if offset >= rows:
                break
            kind = w.qtype in K_QUANTS
            if kind not in activations:
                activations[kind] = ops.quantize_activations(x2, int(w.qtype), isa)
            data = w.data if offset + w.rows <= out.shape[1] else w.data[:out.shape[1] - offset]
            ops.qgemm_into(activations[kind], data, w.layout, w.cols, out, offset, isa)
        if rows < out.shape[1]:
            out = out[:, :rows]
        if self.bias is not None:
            out += self.bias[:rows]
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], rows)


def weights_to_huge_pages(modules: Iterable[nn.Module]) -> None:
    """Copy every QuantLinear's blocks (in their final, repacked and merged form) onto huge
    pages, one tensor at a time; those _huge_page_buffer gives none stay where they are."""
    seen: set[int] = set()  # a tied LM head shares its QuantWeight with the embedding
    for module in modules:
        if isinstance(module, QuantLinear):
            for _, w in module.segments:
                if id(w) in seen:
                    continue
                seen.add(id(w))
                buffer = _huge_page_buffer(w.data.numel() * w.data.element_size())
                if buffer is not None:
                    w.data = buffer.view(w.data.dtype).view(w.data.shape).copy_(w.data)


def _merged(segments: list[tuple[int, QuantWeight]]) -> list[tuple[int, QuantWeight]]:
    """Adjacent segments of one format become one (q and k of a fused projection: one
    kernel call instead of two)."""
    out: list[tuple[int, QuantWeight]] = []
    for offset, w in segments:
        if out and out[-1][1].layout == w.layout and out[-1][0] + out[-1][1].rows == offset:
            first, prev = out.pop()
            w = QuantWeight(torch.cat([prev.data, w.data]), w.qtype, w.cols, w.layout)
            offset = first
        out.append((offset, w))
    return out


class QuantEmbedding(nn.Module):
    """Embedding rows dequantized on lookup (only the rows a step needs)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.quant: QuantWeight | None = None

    def set_rows(self, offset: int, weight: QuantWeight) -> None:
        if offset or weight.rows != self.num_embeddings or weight.cols != self.embedding_dim:
            raise ValueError(f"embedding of {weight.rows} x {weight.cols} does not fit "
                             f"[{self.num_embeddings}, {self.embedding_dim}]")
        self.quant = as_kernel_format(weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ops = quant_ops()
        assert ops is not None and self.quant is not None
        w = self.quant
        return ops.dequantize_rows(w.data, ids, w.layout, w.cols).view(
            *ids.shape, self.embedding_dim)
