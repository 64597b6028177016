"""Quantized vs float weights on the default pair: load time, memory, single-request decode and
the 8-prompt HumanEval workload (prompts 0-7, greedy, 128 tokens, ignore EOS, all at once,
then prompt 0 alone), each mode in a fresh process.

    python benchmarks/bench_quant.py [--modes auto,auto+goodput,auto+k3,none] [--out F.json]

Modes: `auto` / `none` (--quantization), `+goodput` (0.5B draft, goodput policy, k <= 3),
`+k3` (0.5B draft, fixed k = 3); a `:N` suffix limits the draft's vocabulary to the first N
ids (`draft_vocab_size`), e.g. `auto+goodput:32768`. Prints a markdown table and saves JSON
and a bar plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from braid.config import QUANTIZATIONS, positive_int

SPECS = {
    "goodput": {"method": "draft_model", "num_speculative_tokens": 3, "policy": "goodput"},
    "k3": {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"},
}


def mode_config(mode: str) -> tuple[str, dict[str, Any] | None]:
    """A mode's --quantization and speculative config; a ValueError for a mode this
    benchmark does not know."""
    quantization, plus, spec = mode.partition("+")
    spec, colon, vocab = spec.partition(":")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"{mode}: starts with a --quantization ({', '.join(QUANTIZATIONS)})")
    if plus and spec not in SPECS:
        raise ValueError(f"{mode}: +{spec} is not one of +{', +'.join(SPECS)}")
    spec_config = SPECS.get(spec)
    if colon:
        if spec_config is None or not vocab.isdigit() or int(vocab) < 1:
            raise ValueError(f"{mode}: a draft vocabulary limit is +goodput:N or +k3:N, N >= 1")
        spec_config = {**spec_config, "draft_vocab_size": int(vocab)}
    return quantization, spec_config


def run_mode(mode: str, num_prompts: int, max_tokens: int) -> dict:
    """One mode, in this process: load, decode alone, the batch, prompt 0 alone."""
    import torch

    from braid.bench.datasets import humaneval
    from braid.llm import LLM
    from braid.sampling_params import SamplingParams

    quantization, spec_config = mode_config(mode)
    start = time.perf_counter()
    llm = LLM(quantization=quantization, speculative_config=spec_config,
              kv_cache_gib=1.0, log_stats_interval=0)
    load_s = time.perf_counter() - start
    engine = llm.engine
    prompts = [p.prompt for p in humaneval(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    batch_s = time.perf_counter() - start
    start = time.perf_counter()
    single = llm.generate(prompts[:1], params)[0]
    single_s = time.perf_counter() - start
    spec_stats = engine.stats.spec_stats
    return {
        "mode": mode, "load_s": load_s, "threads": torch.get_num_threads(),
        "weight_gb": engine.runner.model.weight_bytes() / 1e9,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "kv_gb": engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() / 1e9,
        "batch_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / batch_s,
        "single_tok_s": len(single.outputs[0].token_ids) / single_s,
        "acceptance": spec_stats.acceptance_rate if spec_stats.num_drafts else None,
        "single_text": single.outputs[0].text,
    }


def run_in_child(mode: str, args: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--num-prompts",
                          str(args.num_prompts), "--max-tokens", str(args.max_tokens)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["mode"] == "none"), None)
    lines = ["| mode | load s | weights GB | peak RSS GB | prompt 0 alone tok/s | "
             "8 prompts tok/s | acceptance |", "|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f" ({r['single_tok_s'] / base['single_tok_s']:.2f}x none)" if base else ""
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        lines.append(f"| {r['mode']} | {r['load_s']:.1f} | {r['weight_gb']:.2f} | "
                     f"{r['peak_rss_gb']:.2f} | {r['single_tok_s']:.2f}{ratio} | "
                     f"{r['batch_tok_s']:.2f} | {acc} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["single_tok_s"] for r in results], 0.4, label="alone")
    ax.bar([i + 0.2 for i in x], [r["batch_tok_s"] for r in results], 0.4, label="8 at once")
    ax.set_xticks(list(x), [r["mode"] for r in results])
    ax.set(ylabel="output tok/s", title="HumanEval, 128 greedy tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="auto,auto+goodput,auto+k3,none")
    parser.add_argument("--num-prompts", type=positive_int, default=8)
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument("--out", default="docs/benchmarks/quant.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(args.child, args.num_prompts, args.max_tokens)))
        return
    modes = [m for m in args.modes.split(",") if m]
    if not modes:
        parser.error("--modes: name at least one mode")
    for mode in modes:
        try:
            mode_config(mode)
        except ValueError as e:
            parser.error(f"--modes: {e}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{cpu_flags()}", flush=True)
    results = []
    for mode in modes:
        print(f"running {mode} ...", flush=True)
        results.append(run_in_child(mode, args))
        r = results[-1]
        print(f"  {mode}: alone {r['single_tok_s']:.2f} tok/s, 8 at once "
              f"{r['batch_tok_s']:.2f} tok/s, load {r['load_s']:.1f} s", flush=True)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": cpu_flags(), "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))


def cpu_flags() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[-1].split("\n", 1)[0].split()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni") if f in flags)


if __name__ == "__main__":
    main()
