"""The quantized CPU kernels: dequantization equal to gguf's, products within the error of
int8 activations, rows independent of the batch on both code paths, malformed inputs refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
         Q.Q6_K, Q.IQ4_XS]
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
N, K, M = 40, 512, 7  # 40 weight rows: two full tiles of 16 and a partial one
# Activations are rounded to int8 with one scale (amax / 127) per block of 32 or 256 values.
# For Gaussian rows amax is ~2.5-3 sigma, so the rounding error (step / sqrt(12)) is ~0.7% of
# the row's norm, and a product with weights unrelated to that error carries the same relative
# error. 2e-2 leaves a ~3x margin; a wrong nibble, scale or min breaks it by far more.
GEMM_RTOL = 2e-2

by_type = pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])


# rms of random blocks' values in units of d: IQ4_NL's nibbles, IQ2_XXS's grid points times
# its 4-bit scales, Q1_0's signs
GRID_RMS = {Q.IQ4_NL: 66, Q.IQ2_XXS: 60, Q.Q1_0: 1}


def random_weight(qtype: Q, rows: int = N, cols: int = K, seed: int = 0, std: float = 1.0
                  ) -> torch.Tensor:
    """uint8 [rows, bytes per row] of values with about this std: llama.cpp's reference
    quantizer for the 32-value formats; random blocks for the K-quants (gguf cannot quantize
    to them) with small positive fp16 scales, so every value is finite."""
    rng = np.random.default_rng(seed)
    if qtype in GRID_RMS:  # d, then random indices into a grid (or signs)
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        d = std * rng.uniform(0.5, 1.5, (rows, cols // block, 1)) / GRID_RMS[qtype]
        raw[..., 0:2] = d.astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(rows, -1))
    if qtype not in K_QUANTS:
        data = quantize(std * rng.standard_normal((rows, cols), dtype=np.float32), qtype)
        return torch.from_numpy(np.ascontiguousarray(data))
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # Random bytes give values d * (6-bit scale) * (nibble) - dmin * (6-bit min) for Q4_K
    # (rms ~250 d; dmin = 7.5 d centres them), the same with 5-bit values for Q5_K (rms ~530 d,
    # dmin = 15.5 d), d * (int8 scale) * (6-bit value - 32) for Q6_K (rms ~1400 d) and
    # d * (6-bit scale - 32) * (3-bit value - 4) for Q3_K (rms ~43 d) and d * (4-bit scale) *
    # (2-bit value) - dmin * (4-bit min) for Q2_K (rms ~14 d, dmin = 1.5 d).
    d = std * rng.uniform(0.5, 1.5, (rows, cols // block, 1))
    if qtype == Q.IQ4_XS:  # d, 2 + 4 bytes of 6-bit scales, 128 of grid indices: ~1200 d
        raw[..., 0:2] = (d / 1200).astype(np.float16).view(np.uint8)
    elif qtype == Q.Q2_K:  # 16 bytes of 4-bit scales and mins, 64 of bit pairs, d, dmin
        raw[..., -4:] = np.concatenate([d / 14, 1.5 * d / 14], -1).astype(np.float16).view(
            np.uint8)
    elif qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin, 12 bytes of 6-bit scales and mins, [Q5_K: 32
        # bytes of high bits,] 128 bytes of nibbles
        rms, centre = (250, 7.5) if qtype == Q.Q4_K else (530, 15.5)
        raw[..., 0:4] = np.concatenate([d / rms, centre * d / rms], -1).astype(
            np.float16).view(np.uint8)
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high bits, 16 int8 scales, d; Q3_K: 32
        # bytes of high bits, 64 of low bit pairs, 12 of packed scales, d
        raw[..., -2:] = (d / (1400 if qtype == Q.Q6_K else 43)).astype(np.float16).view(
            np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def activations(rows: int = M, cols: int = K, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def qgemm(ops: ModuleType, x: torch.Tensor, w: torch.Tensor, qtype: Q, isa: object
          ) -> torch.Tensor:
    xq = ops.quantize_activations(x, int(qtype), isa)
    return ops.qgemm(xq, w, int(qtype), x.shape[1], isa)


def has_avx2(ops: ModuleType) -> bool:
    return ops.Isa("avx2").avx2


@contextmanager
def code_path(ops: ModuleType, path: str) -> Iterator[object]:
    """The instruction sets named `path` ("avx2", "scalar", "avx512-vnni", ...) for the ops a
    block calls; the test is skipped where this CPU lacks them."""
    isa = ops.Isa(path)
    if isa.name != path:
        pytest.skip(f"this CPU has no {path}")
    yield isa


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@by_type
def test_dequantize_rows_equals_gguf(ops: ModuleType, qtype: Q) -> None:
    w = random_weight(qtype)
    expected = torch.from_numpy(dequantize(w.numpy(), qtype))  # [N, K]
    assert expected.shape == (N, K) and torch.isfinite(expected).all()
    assert torch.equal(ops.dequantize_rows(w, torch.arange(N), int(qtype), K), expected)
    ids = torch.tensor([[7, 0], [N - 1, 7]])  # any shape, repeats allowed
    assert torch.equal(ops.dequantize_rows(w, ids, int(qtype), K), expected[ids.flatten()])


@by_type
def test_qgemm_is_the_float_product_up_to_int8_activations(ops: ModuleType, isa: object,
                                                           qtype: Q) -> None:
    w, x = random_weight(qtype), activations()
    reference = x.double() @ torch.from_numpy(dequantize(w.numpy(), qtype)).double().T
    got = qgemm(ops, x, w, qtype, isa)
    assert got.shape == (M, N) and got.dtype == torch.float32
    error = (got.double() - reference).norm() / reference.norm()
    assert error < GEMM_RTOL


@by_type
def test_qgemm_of_a_zero_row_is_zero(ops: ModuleType, isa: object, qtype: Q) -> None:
    x = activations()
    x[3] = 0
    got = qgemm(ops, x, random_weight(qtype), qtype, isa)
    assert torch.equal(got[3], torch.zeros(N)) and torch.isfinite(got).all()


@by_type
@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_rows_do_not_depend_on_the_batch(ops: ModuleType, qtype: Q, path: str) -> None:
    w, x = random_weight(qtype), activations()
    with code_path(ops, path) as isa:
        batch = qgemm(ops, x, w, qtype, isa)
        for i in range(M):
            assert torch.equal(qgemm(ops, x[i : i + 1], w, qtype, isa), batch[i : i + 1])
        assert torch.equal(qgemm(ops, x[2:6], w, qtype, isa), batch[2:6])
        with threads(1):
            assert torch.equal(qgemm(ops, x, w, qtype, isa), batch)
        # Written at a column offset of a wider output, as fused projections are.
        out = torch.full((M, N + 24), float("nan"))
        ops.qgemm_into(ops.quantize_activations(x, int(qtype), isa), w, int(qtype), K, out, 8, isa)
        assert torch.equal(out[:, 8 : 8 + N], batch)
        assert out[:, :8].isnan().all() and out[:, 8 + N :].isnan().all()


def both_paths(ops: ModuleType, qtype: Q) -> tuple[torch.Tensor, torch.Tensor]:
    w, x = random_weight(qtype), activations()
    with code_path(ops, "avx2") as isa:
        fast = qgemm(ops, x, w, qtype, isa)
    with code_path(ops, "scalar") as isa:
        slow = qgemm(ops, x, w, qtype, isa)
    return fast, slow


@by_type
def test_scalar_and_avx2_paths_agree(ops: ModuleType, qtype: Q) -> None:
    # The same integer block sums, scaled and summed in float in another order (AVX2 keeps 8
    # lanes): float rounding apart, ~1e-7 of the largest outputs.
    fast, slow = both_paths(ops, qtype)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5 * slow.abs().max().item())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=["q8_0", "q8_k"])
def test_activation_quantizers_agree_on_every_path(ops: ModuleType, qtype: Q) -> None:
    x = activations(5, 1024) * torch.tensor([1.0, 0.0, 1e-3, 50.0, -2.0])[:, None]
    x[4, 7] = 0.5 * x[4].abs().max() / 127 * 3  # exactly halfway between two int8 steps
    with code_path(ops, "avx2") as isa:
        fast = ops.quantize_activations(x, int(qtype), isa)
    with code_path(ops, "scalar") as isa:
        slow = ops.quantize_activations(x, int(qtype), isa)
    assert torch.equal(fast, slow)


def test_an_isa_holds_what_its_name_allows_on_this_cpu(ops: ModuleType) -> None:
    flags = set(Path("/proc/cpuinfo").read_text().split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw"} <= flags
    vnni = avx512 and {"avx512dq", "avx512_vnni"} <= flags
    best = ops.Isa()
    assert (best.avx2, best.avx512, best.vnni) == (avx2, avx512, vnni)
    assert ops.Isa("avx512-vnni").name == best.name
    scalar = ops.Isa("scalar")
    assert (scalar.avx2, scalar.avx512, scalar.vnni, scalar.name) == (False, False, False,
                                                                      "scalar")
    only_avx2 = ops.Isa("avx2")
    assert (only_avx2.avx2, only_avx2.avx512, only_avx2.vnni) == (avx2, False, False)
    assert ops.Isa("avx512").vnni is False and ops.Isa("avx512").avx512 == avx512
    with pytest.raises(ValueError, match="unknown ISA avx-9000"):
        ops.Isa("avx-9000")


def test_malformed_inputs_raise(ops: ModuleType, isa: object) -> None:
    t = int(Q.Q8_0)
    w, x = random_weight(Q.Q8_0), activations(2)
    xq = ops.quantize_activations(x, t, isa)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.qgemm(xq, w[:, :-1].contiguous(), t, K, isa)
    with pytest.raises(RuntimeError, match="bytes, expected"):
        ops.dequantize_rows(w[:, :-34].contiguous(), torch.arange(2), t, K)
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        ops.qgemm(xq, w[::2], t, K, isa)
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        ops.qgemm(xq, w.view(torch.int8), t, K, isa)
    with pytest.raises(RuntimeError, match="float32"):
        ops.quantize_activations(x.double(), t, isa)
    with pytest.raises(RuntimeError, match="row id out of range"):
        ops.dequantize_rows(w, torch.tensor([0, N]), t, K)
    with pytest.raises(RuntimeError, match="out is too small"):
        ops.qgemm_into(xq, w, t, K, torch.empty(2, N + 3), 4, isa)
    with pytest.raises(RuntimeError, match="unsupported GGML type 1"):
        ops.dequantize_rows(w, torch.arange(2), int(Q.F16), K)


@pytest.mark.parametrize("qtype, cols", [(Q.Q8_0, 48), (Q.Q4_0, 16), (Q.Q4_K, 288),
                                         (Q.Q5_K, 384), (Q.Q6_K, 128),
                                         (Q.Q3_K, 320), (Q.Q2_K, 272)])
def test_rows_of_partial_blocks_raise(ops: ModuleType, isa: object, qtype: Q, cols: int
                                     ) -> None:
    with pytest.raises(RuntimeError, match="not a multiple of the block"):
        ops.quantize_activations(activations(2, cols), int(qtype), isa)
    w = random_weight(qtype, cols=K)
    with pytest.raises(RuntimeError, match="not a multiple of the block"):
        ops.dequantize_rows(w, torch.arange(2), int(qtype), cols)
    with pytest.raises(RuntimeError, match="not a multiple of the block"):
        xq = ops.quantize_activations(activations(2), int(qtype), isa)
        ops.qgemm(xq, w, int(qtype), cols, isa)


def test_activations_that_do_not_match_the_weight_raise(ops: ModuleType, isa: object) -> None:
    # Q8_0 activations (640 bytes a row for K = 512) for a Q4_K weight (Q8_K: 584 bytes), the
    # other way round, a column slice, and a negative output column.
    rows = activations(2)
    q8_0, q8_k = (ops.quantize_activations(rows, int(t), isa) for t in (Q.Q8_0, Q.Q4_K))
    for xq, qtype in ((q8_0, Q.Q4_K), (q8_k, Q.Q8_0), (q8_0[:, :100], Q.Q8_0)):
        with pytest.raises(RuntimeError, match="activations must be"):
            ops.qgemm(xq, random_weight(qtype), int(qtype), K, isa)
    with pytest.raises(RuntimeError, match="col0"):
        ops.qgemm_into(q8_0, random_weight(Q.Q8_0), int(Q.Q8_0), K, torch.empty(2, N), -1, isa)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.quantize_activations(rows, int(Q.IQ3_S), isa)


@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_unpacked_q4_k_equals_the_gguf_layout(ops: ModuleType, path: str) -> None:
    """The layout Q4_K runs in (scales unpacked at load) holds the same values: products and
    dequantized rows are bit-identical to the GGUF layout's, for every number of rows."""
    if path == "avx2" and not has_avx2(ops):
        pytest.skip("no AVX2 on this CPU")
    w = random_weight(Q.Q4_K)
    unpacked = ops.repack_q4_k(w, K)
    assert unpacked.shape == (N, K // 256 * 148)
    ids = torch.arange(N)
    assert torch.equal(ops.dequantize_rows(unpacked, ids, ops.Q4_K_UNPACKED, K),
                       ops.dequantize_rows(w, ids, int(Q.Q4_K), K))
    with code_path(ops, path) as isa:
        for m in (1, 3, 8, 9):
            xq = ops.quantize_activations(activations(m), int(Q.Q4_K), isa)
            assert torch.equal(ops.qgemm(xq, unpacked, ops.Q4_K_UNPACKED, K, isa),
                               ops.qgemm(xq, w, int(Q.Q4_K), K, isa)), m


def test_rms_norm_matches_torch_and_ignores_the_batch(ops: ModuleType) -> None:
    x, w = activations(9, 1536) * 3, torch.randn(1536)
    out = ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (1536,), w, 1e-6),
                               rtol=1e-5, atol=1e-5)
    for r in range(9):
        assert torch.equal(ops.rms_norm(x[r : r + 1], w, 1e-6), out[r : r + 1])
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(x, torch.ones(7), 1e-6)


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_gated_activations_match_float64_and_ignore_the_batch(ops: ModuleType, path: str,
                                                              act: str) -> None:
    """silu(gate) * up and gelu_tanh(gate) * up (Gemma's) on each vector path the CPU has (a
    path it lacks runs the next one): within float32 rounding of float64, over the range a
    gate takes and past exp's limits, and every row the same bits alone as in a batch."""
    isa = ops.Isa(path)
    fn = getattr(ops, f"{act}_mul")
    gate = torch.cat([torch.linspace(-120, 120, 4801), torch.tensor([0.0, -0.0, 1e-30])])
    gate = torch.stack([gate, gate.flip(0) * 0.1, torch.randn(4804) * 4])  # [3, 4804]
    up = torch.randn(3, 4804)
    out = fn(torch.cat([gate, up], dim=1), isa)
    g64, u64 = gate.double(), up.double()
    if act == "silu":
        expected = g64 * torch.sigmoid(g64) * u64
    else:
        expected = torch.nn.functional.gelu(g64, approximate="tanh") * u64
    # (GELU's far negative tail underflows float32 to 0 sooner than float64's: below 1e-9)
    torch.testing.assert_close(out.double(), expected, rtol=2e-6 if act == "silu" else 2e-5,
                               atol=1e-30 if act == "silu" else 1e-9)
    for r in range(3):
        alone = fn(torch.cat([gate[r : r + 1], up[r : r + 1]], dim=1), isa)
        assert torch.equal(alone, out[r : r + 1])
    with pytest.raises(RuntimeError, match=f"{act}_mul"):
        fn(torch.zeros(2, 7), isa)


def test_rotate_is_the_torch_rotation_exactly(ops: ModuleType) -> None:
    from braid.models.qwen2 import RotaryEmbedding

    rope = RotaryEmbedding(64, 512, 1e6)
    cos, sin = rope.tables(torch.tensor([0, 5, 300, 301]))
    x = torch.randn(4, 6, 64)
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    got = x.clone()
    ops.rotate_(got, cos, sin)
    assert torch.equal(got, want)


def test_add_rms_norm_is_the_add_then_the_norm_exactly(ops: ModuleType) -> None:
    x, delta, w = activations(5, 1536), activations(5, 1536) * 2, torch.randn(1536)
    residual = x.clone()
    out = ops.add_rms_norm_(residual, delta, w, 1e-6)
    assert torch.equal(residual, x + delta)
    assert torch.equal(out, ops.rms_norm(x + delta, w, 1e-6))
    with pytest.raises(RuntimeError, match="shape"):
        ops.add_rms_norm_(x.clone(), delta[:2], w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
def test_rope_qkv_to_cache_is_the_split_rotation_and_cache_write(ops: ModuleType,
                                                                  dtype: torch.dtype) -> None:
    """A 16-bit cache gets the values torch's .to() rounds to (the module path's write)."""
    from braid.models.qwen2 import RotaryEmbedding

    heads, kv_heads, d = 6, 2, 64
    cos, sin = RotaryEmbedding(d, 512, 1e6).tables(torch.tensor([0, 5, 300, 301]))
    qkv = torch.randn(4, (heads + 2 * kv_heads) * d) * 30  # some beyond float16's precision
    slots = torch.tensor([3, 17, 9, 30])
    k_cache = torch.zeros(32, kv_heads, d, dtype=dtype)
    v_cache = torch.zeros(32, kv_heads, d, dtype=dtype)
    q = ops.rope_qkv_to_cache(qkv, cos, sin, k_cache, v_cache, slots, heads)
    qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], dim=-1)
    qk = qk.reshape(4, heads + kv_heads, d).contiguous()
    ops.rotate_(qk, cos, sin)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(k_cache[slots], qk[:, heads:].to(dtype))
    assert torch.equal(v_cache[slots], v.reshape(4, kv_heads, d).to(dtype))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="slot"):
        ops.rope_qkv_to_cache(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 2, 32]),
                              heads)


# ---- panels: sixteen rows interleaved, the AVX512-VNNI kernels' layout ----------------------

PANEL_N = 48  # three panels


def panels(ops: ModuleType, qtype: Q, cols: int = K) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(GGUF rows, the same rows as panels, the panel layout id)."""
    w = random_weight(qtype, rows=PANEL_N, cols=cols)
    return w, ops.repack_panels(w, int(qtype), cols), ops.PANEL + int(qtype)


@by_type
def test_panels_hold_the_gguf_values(ops: ModuleType, qtype: Q) -> None:
    w, p, layout = panels(ops, qtype)
    assert p.shape[0] == PANEL_N
    ids = torch.tensor([0, 15, 16, 47, 5, 5])
    assert torch.equal(ops.dequantize_rows(p, ids, layout, K),
                       ops.dequantize_rows(w, ids, int(qtype), K))


@by_type
def test_panel_products_are_the_float_product_up_to_int8_activations(
        ops: ModuleType, isa: object, qtype: Q) -> None:
    w, p, layout = panels(ops, qtype)
    x = activations(11)
    reference = x.double() @ torch.from_numpy(dequantize(w.numpy(), qtype)).double().T
    got = ops.qgemm(ops.quantize_activations(x, int(qtype), isa), p, layout, K, isa)
    assert ((got.double() - reference).norm() / reference.norm()) < GEMM_RTOL


@by_type
def test_panel_paths_agree_bit_for_bit(ops: ModuleType, isa: object, qtype: Q) -> None:
    """The scalar reference does the vector kernel's integer sums and float operations in the
    same order, one output at a time: the two give the same bits."""
    _, p, layout = panels(ops, qtype)
    xq = ops.quantize_activations(activations(11), int(qtype), isa)
    results = []
    for path in ("avx512-vnni", "scalar"):
        with code_path(ops, path) as isa:
            results.append(ops.qgemm(xq, p, layout, K, isa))
    assert torch.equal(*results)


@by_type
@pytest.mark.parametrize("path", ["avx512-vnni", "scalar"])
def test_panel_rows_do_not_depend_on_the_batch(ops: ModuleType, isa: object, qtype: Q,
                                               path: str) -> None:
    _, p, layout = panels(ops, qtype)
    x = activations(19)  # more than one pass of eight rows
    xq = ops.quantize_activations(x, int(qtype), isa)
    with code_path(ops, path) as isa:
        batch = ops.qgemm(xq, p, layout, K, isa)
        for i in range(19):
            assert torch.equal(ops.qgemm(xq[i : i + 1], p, layout, K, isa), batch[i : i + 1])
        assert torch.equal(ops.qgemm(xq[3:12], p, layout, K, isa), batch[3:12])
        with threads(1):
            assert torch.equal(ops.qgemm(xq, p, layout, K, isa), batch)
        out = torch.full((19, PANEL_N + 32), float("nan"))
        ops.qgemm_into(xq, p, layout, K, out, 16, isa)
        assert torch.equal(out[:, 16 : 16 + PANEL_N], batch)
        assert out[:, :16].isnan().all() and out[:, 16 + PANEL_N :].isnan().all()


def int8_activations(xq: torch.Tensor, qtype: Q) -> torch.Tensor:
    """float64 [M, K]: the values of quantized activations (Q8_K: d, 16 int16 sums, 256
    int8; Q8_0: d, an int32 sum, 32 int8), what the kernels multiply."""
    layout = ([("d", "<f4"), ("bsums", "<i2", 16), ("qs", "i1", 256)] if qtype in K_QUANTS
              else [("d", "<f4"), ("sum", "<i4"), ("qs", "i1", 32)])
    blocks = xq.numpy().view(np.dtype(layout))  # [M, blocks]
    values = blocks["qs"].astype(np.float64) * blocks["d"].astype(np.float64)[..., None]
    return torch.from_numpy(values.reshape(xq.shape[0], -1))


@by_type
def test_every_path_is_the_exact_product_up_to_float_rounding(ops: ModuleType, isa: object,
                                                              qtype: Q) -> None:
    """Rows (AVX2, scalar) and panels (AVX512-VNNI, scalar) against the float64 product of
    the same int8 activations and the same weights: only float32 rounding apart. The other
    product tests allow the activations' rounding (2e-2), which could hide a value decoded
    wrong in a rare position."""
    w, p, layout = panels(ops, qtype)
    xq = ops.quantize_activations(activations(11), int(qtype), isa)
    x = int8_activations(xq, qtype)
    weights = torch.from_numpy(dequantize(w.numpy(), qtype)).double()
    exact, scale = x @ weights.T, x.abs() @ weights.abs().T
    runs = [(path, w, int(qtype)) for path in ("avx2", "scalar")
            if path == "scalar" or has_avx2(ops)]
    runs += [(path, p, layout) for path in ("avx512-vnni", "scalar")
             if path == "scalar" or ops.Isa().vnni]
    for path, weight, kind in runs:
        with code_path(ops, path) as isa:
            got = ops.qgemm(xq, weight, kind, K, isa).double()
        assert ((got - exact).abs() <= 1e-5 * scale + 1e-30).all(), (path, kind)


def test_panels_need_whole_panels(ops: ModuleType, isa: object) -> None:
    w = random_weight(Q.Q8_0, rows=40)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        ops.repack_panels(w, int(Q.Q8_0), K)
    p = ops.repack_panels(random_weight(Q.Q8_0, rows=48), int(Q.Q8_0), K)
    xq = ops.quantize_activations(activations(2), int(Q.Q8_0), isa)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        ops.qgemm(xq, p[:40].contiguous(), ops.PANEL + int(Q.Q8_0), K, isa)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.repack_panels(random_weight(Q.Q8_0, rows=48), int(Q.IQ3_S), K)


def test_a_kernel_folder_that_cannot_be_made_falls_back(tmp_path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An unwritable BRAID_KERNEL_DIR (or home) means plain torch, with a warning: it raised,
    and even float models failed at their first forward."""
    from braid.kernels import quant_ops

    (tmp_path / "a-file").write_text("")
    monkeypatch.delenv("BRAID_NO_KERNELS", raising=False)
    monkeypatch.setenv("BRAID_KERNEL_DIR", str(tmp_path / "a-file" / "kernels"))
    assert quant_ops.__wrapped__() is None
    assert "quantized CPU kernels unavailable (" in caplog.text


def test_a_read_only_kernel_folder_with_a_finished_build_serves_it(
        ops: ModuleType, tmp_path: Path) -> None:
    """A kernel folder that cannot be written but holds the built extension (an image that
    ships it) serves it: the build lock could not be opened there, and every model fell back
    to float. Made read-only by its mode, or for root (who ignores modes) with `chattr +i`."""
    import shutil
    import subprocess
    import sys

    built = Path(ops.__file__)
    image = tmp_path / "kernels" / built.parent.name
    image.mkdir(parents=True)
    shutil.copy(built, image / built.name)  # the extension alone: no lock, no ninja files
    if os.geteuid() != 0:
        image.chmod(0o555)
        undo = ["chmod", "755", str(image)]
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(image)],
                                                   capture_output=True).returncode == 0:
        undo = ["chattr", "-i", str(image)]
    else:
        pytest.skip("root, and no chattr +i on this file system: nothing here is read-only")
    try:
        assert subprocess.run(["touch", str(image / "flock")], capture_output=True).returncode
        code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
                "from braid.kernels import quant_ops\n"
                "assert quant_ops() is not None")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "BRAID_KERNEL_DIR": str(
                                 tmp_path / "kernels"), "BRAID_NO_KERNELS": "0"})
        assert run.returncode == 0, run.stderr
        assert "CPU kernels loaded as built from" in run.stderr
    finally:
        subprocess.run(undo, check=True)


def test_kernel_isa_can_be_chosen(ops: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """BRAID_KERNEL_ISA picks the instruction sets every op is given (what an AVX2-only CPU
    runs, on any CPU that has AVX2: no AVX512 quantizer or attention either), once."""
    from braid.kernels import kernel_isa

    monkeypatch.setenv("BRAID_KERNEL_ISA", "scalar")
    assert kernel_isa.__wrapped__().name == "scalar"
    if has_avx2(ops):
        monkeypatch.setenv("BRAID_KERNEL_ISA", "avx2")
        isa = kernel_isa.__wrapped__()
        assert (isa.name, isa.avx512, isa.vnni) == ("avx2", False, False)
        assert "avx512" not in (ops.attention_isa(64, isa), ops.attention_isa(128, isa))
    monkeypatch.setenv("BRAID_KERNEL_ISA", "avx-9000")
    with pytest.raises(ValueError, match="BRAID_KERNEL_ISA"):
        kernel_isa.__wrapped__()
