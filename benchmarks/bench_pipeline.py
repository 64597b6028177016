"""Pipeline stages against one process: the step time of the default model with its layers in
P processes (--pipeline-parallel-size) and in one, decoding one request and eight, and
prefilling. Without micro-batching the stages run one after another, so the difference is
the cost of passing the hidden states on (and of the stages' processes). Prints a table.

    python benchmarks/bench_pipeline.py --sizes 1,2 --repeats 2
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


def measure(model: str, size: int) -> dict[str, float]:
    """Median step time (ms) of each case's steps: decode steps for the decode cases, the
    prefill chunks for the prefill case."""
    from braid import LLM, SamplingParams

    llm = LLM(model, pipeline_parallel_size=size, max_num_batched_tokens=128,
              log_stats_interval=0)
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
            print(f"P={size} {name}: {out[name]:.1f} ms per step ({len(wanted)} steps)",
                  flush=True)
        return out
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--sizes", type=comma_list(positive_int), default=[1, 2],
                        help="pipeline sizes to compare, in this order each repeat")
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    runs: dict[int, list[dict[str, float]]] = {size: [] for size in args.sizes}
    for _ in range(args.repeats):
        for size in args.sizes:
            runs[size].append(measure(args.model, size))
    print("| stages | " + " | ".join(f"{c} (ms/step)" for c in CASES) + " |")
    print("|---|" + "---|" * len(CASES))
    for size, results in runs.items():
        cells = [min(r[c] for r in results) for c in CASES]
        print(f"| {size} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "m15_pipeline.json").write_text(json.dumps(
        {"machine": machine_info(), "model": args.model, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
