"""One hostile request at a time beside an innocent stream ([M16]): for each request of
braid/bench/hostile.py, what the server answered and how fast, and the innocent greedy
stream's slowest tokens/s while it was in flight against its median pace beside none.

    python benchmarks/bench_hostile.py [--model M] [--only SUBSTR,...] [--repeats 2]
                                       [--out F.json] [-- extra serve flags]

The innocent stream and a /health probe run in an observer process of their own (this
client's work on multi-MB bodies must not slow what it measures); each hostile request is
sent `--repeats` times in a row after a calm spell. Prints a markdown table and saves JSON
and a plot (the ratio per request, the goal of 2x marked).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from braid.bench.hostile import HOSTILE, Observer, encoded, paces, percentiles
from braid.bench.server_process import ServerProcess, check_serve_flags
from braid.bench.sweep_report import machine_info
from braid.config import positive_int
from braid.models.loader import load_config, model_folder

CALM_S = 4.0  # seconds of innocent streams alone before each hostile request


def run(server: ServerProcess, vocab: int, only: list[str], repeats: int) -> dict:
    body = {"model": server.model, "prompt": "def fibonacci(n):", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}
    watcher = Observer(server.url, body)
    spans: list[tuple[float, float, str]] = []
    answers: dict[str, list[str]] = {}
    chosen = [h for h in HOSTILE if not only or any(o in h.name for o in only)]
    with httpx.Client(base_url=server.url, timeout=900) as client:
        for i, hostile in enumerate(chosen):
            time.sleep(CALM_S)
            raw = encoded(hostile, server.model, vocab)
            start = time.monotonic()
            for _ in range(repeats):
                sent = time.monotonic()
                r = client.post(hostile.path, content=raw,
                                headers={"content-type": "application/json"})
                answers.setdefault(hostile.name, []).append(
                    f"{r.status_code} in {time.monotonic() - sent:.2f} s")
            spans.append((start, time.monotonic(), hostile.name))
            print(f"  {i + 1}/{len(chosen)} {hostile.name}: {answers[hostile.name]}", flush=True)
        time.sleep(CALM_S)
    health, streams = watcher.stop()
    calm, beside = paces(streams, spans)
    rows = []
    for hostile in chosen:
        mine = [p for names, p in beside if names == hostile.name]
        worst = min(mine, default=0.0)
        rows.append({"name": hostile.name, "answers": answers[hostile.name],
                     "streams_beside": len(mine), "worst_tok_s": round(worst, 1),
                     "ratio": round(calm / worst, 2) if worst else None})
    return {"calm_tok_s": round(calm, 1), "health_ms": percentiles(health), "rows": rows}


def table(result: dict) -> str:
    lines = [f"innocent stream alone: {result['calm_tok_s']} tok/s (median); /health "
             f"{result['health_ms']}", "",
             "| hostile request | answers | streams beside | slowest tok/s | calm / slowest |",
             "|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['name']} | {', '.join(row['answers'])} | "
                     f"{row['streams_beside']} | {row['worst_tok_s']} | {row['ratio']} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(rows) + 1.5))
    ax.barh([r["name"] for r in rows], [r["ratio"] for r in rows], color="tab:blue")
    ax.axvline(2.0, color="tab:red", linestyle="--", label="goal: 2x")
    ax.set_xlabel("innocent stream: calm pace / slowest pace beside the request")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--only", default="", help="comma-separated substrings of request names")
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("serve_flags", nargs="*", help="more `braid serve` flags (after --)")
    args = ap.parse_args()
    try:
        check_serve_flags(args.serve_flags, "serve flags", args.model)
    except ValueError as e:
        ap.error(str(e))
    vocab = load_config(model_folder(args.model)).vocab_size
    log_dir = Path("/tmp") / "braid-bench-hostile"
    log_dir.mkdir(exist_ok=True)
    print(f"starting braid serve --model {args.model} {' '.join(args.serve_flags)}", flush=True)
    server = ServerProcess(args.model, log_dir, *args.serve_flags, timeout_s=600)
    try:
        result = run(server, vocab, [o for o in args.only.split(",") if o], args.repeats)
    finally:
        server.stop()
    result = {"model": args.model, "machine": machine_info(), **result}
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        plot(result, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
