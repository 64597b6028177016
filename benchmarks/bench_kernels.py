"""Quantized products alone: the default pair's own GGUF tensors through each kernel set this
CPU has (panels on AVX512-VNNI, row by row on AVX2), 1 to 64 activation rows, weights in
cache (one tensor again and again) and streamed from memory (~200 MB of different tensors).

    python benchmarks/bench_kernels.py [--rows 1,4,8,16,64] [--out docs/benchmarks/kernels.json]

Prints ms per product of a cached tensor and GB/s of weights streamed, per format; saves JSON
and a plot of streamed GB/s against rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from braid.config import DEFAULT_DRAFT, DEFAULT_TARGET, comma_list, positive_int
from braid.kernels import quant_ops
from braid.models.gguf_index import read_tensors
from braid.models.quant import QuantWeight
from braid.models.registry import registry_gguf_path

FORMATS = (Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0)
STREAM_BYTES = 200e6


def tensors_of(qtype: Q) -> list[QuantWeight]:
    """The default pair's 2-D tensors in this format (embeddings left out), ~STREAM_BYTES."""
    found: list[QuantWeight] = []
    for model in (DEFAULT_TARGET, DEFAULT_DRAFT):
        for t in read_tensors(registry_gguf_path(model)):
            if t.tensor_type == qtype and len(t.shape) == 2 and "token_embd" not in t.name:
                found.append(QuantWeight(torch.from_numpy(t.data.copy()), qtype,
                                         int(t.shape[0])))
            if sum(w.data.numel() for w in found) >= STREAM_BYTES:
                return found
    return found


def layouts(ops, w: QuantWeight) -> dict[str, tuple[str, torch.Tensor, int]]:
    """Kernel set -> (isa, weight data, layout) for the sets this CPU runs."""
    out = {}
    if ops.Isa().vnni and w.rows % ops.PANEL_ROWS == 0:
        out["panels"] = ("avx512-vnni", ops.repack_panels(w.data, int(w.qtype), w.cols),
                         ops.PANEL + int(w.qtype))
    rows = ops.repack_q4_k(w.data, w.cols) if w.qtype == Q.Q4_K else w.data
    out["rows"] = ("avx2", rows, ops.Q4_K_UNPACKED if w.qtype == Q.Q4_K else int(w.qtype))
    return out


def best_seconds(ops, xq: torch.Tensor, weights: list[tuple[torch.Tensor, int, int]], isa,
                 repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for data, layout, cols in weights:
            ops.qgemm(xq, data, layout, cols, isa)
        best = min(best, time.perf_counter() - start)
    return best


def measure(ops, qtype: Q, rows: list[int]) -> list[dict]:
    found = tensors_of(qtype)
    if not found:
        return []
    results = []
    sets = [layouts(ops, w) for w in found]
    for name in sets[0]:
        isa = ops.Isa(sets[0][name][0])
        streamed = [(s[name][1], s[name][2], w.cols) for s, w in zip(sets, found, strict=True)
                    if name in s]
        same_k = [s for s in streamed if s[2] == found[0].cols]  # one activation width
        small = min(same_k, key=lambda s: s[0].numel())  # the cached one
        stream_gb = sum(d.numel() for d, _, _ in same_k) / 1e9
        for m in rows:
            xq = ops.quantize_activations(torch.randn(m, found[0].cols), int(qtype), isa)
            cached = best_seconds(ops, xq, [small] * 8, isa) / 8
            stream = best_seconds(ops, xq, same_k, isa)
            results.append({"format": qtype.name, "kernels": name, "rows": m,
                            "cached_ms": cached * 1e3, "stream_gb_s": stream_gb / stream,
                            "cached_tensor": list(small[0].shape), "streamed_gb": stream_gb})
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({(r["format"], r["kernels"]) for r in results}):
        pts = [r for r in results if (r["format"], r["kernels"]) == key]
        ax.plot([r["rows"] for r in pts], [r["stream_gb_s"] for r in pts], marker="o",
                label=f"{key[0]} {key[1]}")
    ax.set(xscale="log", xlabel="activation rows", ylabel="weights streamed, GB/s",
           title="Quantized products from memory, 2 threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=comma_list(positive_int), default=[1, 4, 8, 16, 64],
                        help="activation rows per product, comma-separated")
    parser.add_argument("--out", default="docs/benchmarks/kernels.json")
    args = parser.parse_args()
    ops = quant_ops()
    if ops is None:
        raise SystemExit("the compiled kernels are unavailable here")
    rows = args.rows
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}", flush=True)
    print("| format | kernels | rows | ms, one cached tensor | GB/s streamed |")
    print("|---|---|---|---|---|")
    results = []
    for qtype in FORMATS:
        for r in measure(ops, qtype, rows):
            results.append(r)
            print(f"| {r['format']} | {r['kernels']} | {r['rows']} | {r['cached_ms']:.2f} | "
                  f"{r['stream_gb_s']:.1f} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.machine(), "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
