"""The paged attention kernel: each row equals float64 attention over its keys, and is the
same bits whatever else the call holds, on every code path the CPU has and for every cache
type (float32, float16, bfloat16)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.kernels.test_quant import threads

PATHS = ("avx512", "avx2", "scalar")
# (query heads, KV heads, head size): the default pair's shapes, no GQA, and sizes the
# AVX512 routines have no template for (they take the AVX2 path).
SHAPES = [(12, 2, 128), (14, 2, 64), (4, 4, 16), (6, 3, 96), (4, 2, 40), (2, 1, 8)]
SLOTS = 512
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@contextmanager
def attention_path(ops: ModuleType, path: str, d: int) -> Iterator[object]:
    """The instruction sets that run `path` for head size `d`; the test is skipped where this
    CPU or this head size does not have it."""
    isa = ops.Isa(path)
    if ops.attention_isa(d, isa) != path:
        pytest.skip(f"no {path} attention for head size {d} on this CPU")
    yield isa


def case(h: int, kvh: int, d: int, lens: list[int], seed: int = 0,
         dtype: torch.dtype = torch.float32):
    """Random caches of `dtype`; request r's positions at scattered slots; one query row
    per length."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(SLOTS, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(SLOTS, kvh, d, generator=g).to(dtype)
    kv_max = max(lens)
    kv_slots = torch.stack([torch.randperm(SLOTS, generator=g)[:kv_max] for _ in lens])
    q = torch.randn(len(lens), h, d, generator=g) * 2
    return q, k_cache, v_cache, kv_slots, torch.arange(len(lens)), torch.tensor(lens)


def reference(q, k_cache, v_cache, kv_slots, row_seq, row_len, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for i in range(q.shape[0]):
        slots = kv_slots[row_seq[i], : row_len[i]]
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


dtypes = pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=lambda t: str(t).split(".")[1])


@dtypes
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{h}-kv{k}-d{d}" for h, k, d in SHAPES])
def test_rows_are_attention_over_their_keys(ops: ModuleType, path: str, shape, dtype) -> None:
    """Over 16-bit caches too: the reference reads the same (exactly widened) values."""
    h, kvh, d = shape
    # tails of 4 and 16 keys, one key alone
    args = case(h, kvh, d, [1, 3, 4, 17, 64, 301], dtype=dtype)
    with attention_path(ops, path, d) as isa:
        out = ops.paged_attention_rows(*args, d ** -0.5, isa)
    torch.testing.assert_close(out.double(), reference(*args, d ** -0.5), rtol=1e-5, atol=2e-6)


@dtypes
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=[f"h{h}-kv{k}-d{d}" for h, k, d in SHAPES[:3]])
def test_a_row_does_not_depend_on_the_batch(ops: ModuleType, path: str, shape, dtype) -> None:
    """Alone, beside other requests, and as one row of a window over the same keys."""
    h, kvh, d = shape
    q, k_cache, v_cache, kv_slots, _, _ = case(h, kvh, d, [40, 40, 40, 9], dtype=dtype)
    window_seq, window_len = torch.tensor([0, 0, 0, 1, 2, 3]), torch.tensor([37, 38, 39, 40, 25, 9])
    qs = torch.cat([q[:1].repeat(3, 1, 1), q])[: len(window_seq)] + torch.arange(6).view(6, 1, 1)
    with attention_path(ops, path, d) as isa:
        together = ops.paged_attention_rows(qs, k_cache, v_cache, kv_slots, window_seq,
                                            window_len, 0.1, isa)
        for i in range(len(window_seq)):
            alone = ops.paged_attention_rows(qs[i : i + 1], k_cache, v_cache,
                                             kv_slots[window_seq[i] : window_seq[i] + 1],
                                             torch.tensor([0]), window_len[i : i + 1], 0.1, isa)
            assert torch.equal(alone[0], together[i]), f"row {i}"
        with threads(1):
            assert torch.equal(ops.paged_attention_rows(qs, k_cache, v_cache, kv_slots,
                                                        window_seq, window_len, 0.1, isa), together)


def test_every_path_reads_a_16_bit_cache_as_its_float32_values(ops: ModuleType) -> None:
    """A 16-bit cache gives the bits a float32 cache holding the same values gives, on each
    path: the widening is exact and the arithmetic after it is the float32 path's."""
    for path in PATHS:
        for dtype in CACHE_DTYPES[1:]:
            q, k_cache, v_cache, kv_slots, seq, lens = case(12, 2, 128, [5, 33, 70], dtype=dtype)
            with attention_path(ops, path, 128) as isa:
                narrow = ops.paged_attention_rows(q, k_cache, v_cache, kv_slots, seq, lens, 0.1,
                                                  isa)
                wide = ops.paged_attention_rows(q, k_cache.float(), v_cache.float(), kv_slots,
                                                seq, lens, 0.1, isa)
            assert torch.equal(narrow, wide), (path, dtype)


def test_caches_of_other_types_are_refused(ops: ModuleType, isa: object) -> None:
    q, k_cache, v_cache, kv_slots, seq, lens = case(4, 2, 16, [3])
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ops.paged_attention_rows(q, k_cache.half(), v_cache, kv_slots, seq, lens, 0.1, isa)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        ops.paged_attention_rows(q, k_cache.double(), v_cache.double(), kv_slots, seq, lens,
                                 0.1, isa)


def test_the_cpu_picks_the_widest_path(ops: ModuleType, isa: object) -> None:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.is_file() else ""
    want = ("avx512" if " avx512f" in flags and " avx512bw" in flags
            else "avx2" if " avx2" in flags else "scalar")
    assert ops.attention_isa(128, isa) == want
    assert ops.attention_isa(40, isa) == ("scalar" if want == "scalar" else "avx2")



@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(4, 2, 16), (4, 1, 256)], ids=["h4-kv2-d16", "h4-kv1-d256"])
def test_row_start_attends_from_a_window_s_first_key(ops: ModuleType, path: str, shape) -> None:
    """`row_start` (a sliding window's first position) makes a row attend to keys
    start..len-1: the same bits as a table that begins there, and float64 attention over
    those keys; a start outside 0..len-1 is refused."""
    h, kvh, d = shape
    q, k_cache, v_cache, kv_slots, seq, lens = case(h, kvh, d, [1, 9, 40, 300])
    start = (lens - 8).clamp(min=0)
    with attention_path(ops, path, d) as isa:
        got = ops.paged_attention_rows(q, k_cache, v_cache, kv_slots, seq, lens, 0.2, isa, start)
        shifted = torch.stack([torch.cat([kv_slots[i, s:], kv_slots[i, :s]])
                               for i, s in enumerate(start.tolist())])
        assert torch.equal(got, ops.paged_attention_rows(q, k_cache, v_cache, shifted, seq,
                                                         lens - start, 0.2, isa))
        torch.testing.assert_close(got.double(), reference(q, k_cache, v_cache, shifted, seq,
                                                           lens - start, 0.2),
                                   rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="no valid keys"):
            ops.paged_attention_rows(q, k_cache, v_cache, kv_slots, seq, lens, 0.2, isa, lens)
