"""Pipeline stages against one process: the step time of the default model with its layers in
P processes (--pipeline-parallel-size) and in one, decoding one request and eight, and
prefilling. Decodes go through the stages whole, one stage after another, so their
difference is the cost of passing the hidden states on (and of the stages' processes);
prefill chunks go as micro-batches that overlap across the stages (`--no-micro-batches`
sends them whole, for comparison). Each configuration is stages:threads (torch threads of
every stage). Prints a table.

    python benchmarks/bench_pipeline.py --configs 1:2,2:1,2:2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from braid.bench.sweep_report import machine_info
from braid.config import DEFAULT_TARGET, comma_list, positive_int

CASES = {  # name -> (prompts, prompt tokens, output tokens)
    "decode 1": (1, 32, 48),
    "decode 8": (8, 32, 48),
    "prefill 512": (1, 512, 1),
}


def measure(model: str, size: int, threads: int) -> dict[str, float]:
    """Median step time (ms) of each case's steps: decode steps for the decode cases, the
    prefill chunks for the prefill case."""
    from braid import LLM, SamplingParams

    llm = LLM(model, pipeline_parallel_size=size, max_num_batched_tokens=128,
              num_threads=threads, log_stats_interval=0)
    try:
        out = {}
        for name, (num, length, tokens) in CASES.items():
            prompts = [[(i * 131 + j * 7) % 20_000 + 200 for j in range(length)]
                       for i in range(num)]
            stats = llm.engine.stats
            before = stats.num_steps
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens,
                                                 ignore_eos=True), use_tqdm=False)
            steps = list(stats.recent)[len(stats.recent) - (stats.num_steps - before):]
            wanted = [s.step_time for s in steps
                      if (s.num_prefill_tokens == 0) == name.startswith("decode")]
            out[name] = 1000 * statistics.median(wanted)
            print(f"P={size} x {threads} threads {name}: {out[name]:.1f} ms per step "
                  f"({len(wanted)} steps)",
                  flush=True)
        return out
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--configs", type=comma_list(_config), default=[(1, 2), (2, 1)],
                        help="stages:threads to compare, in this order each repeat")
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--no-micro-batches", action="store_true",
                        help="send every forward through the stages whole")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    if args.no_micro_batches:
        from braid.worker import pipeline

        pipeline.MIN_PART_TOKENS = 1 << 30
    runs: dict[str, list[dict[str, float]]] = {f"{p}:{t}": [] for p, t in args.configs}
    for _ in range(args.repeats):
        for size, threads in args.configs:
            runs[f"{size}:{threads}"].append(measure(args.model, size, threads))
    print("| stages:threads | " + " | ".join(f"{c} (ms/step)" for c in CASES) + " |")
    print("|---|" + "---|" * len(CASES))
    for name, results in runs.items():
        cells = [min(r[c] for r in results) for c in CASES]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "m15_pipeline_whole.json" if args.no_micro_batches else "m15_pipeline.json"
    (args.out / name).write_text(json.dumps(
        {"machine": machine_info(), "model": args.model, "runs": runs}, indent=1))


def _config(text: str) -> tuple[int, int]:
    """stages:threads, e.g. 2:1."""
    stages, _, threads = text.partition(":")
    return positive_int(stages), positive_int(threads or "1")


if __name__ == "__main__":
    main()
