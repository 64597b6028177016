"""A block table per layer group against one table, on a model that mixes global and
sliding-window layers (Gemma 3): how many blocks the same --kv-cache-gib holds, the KV one
long request holds at its peak, and decode speed, with the greedy tokens compared. Both
engines live in this process; their runs alternate (each goes first in turn), so drift hits
both. Prints a table.

    python benchmarks/bench_kv_groups.py --model gemma-3-270m --prompt-tokens 3000
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import textwrap
import time
from pathlib import Path

from braid.bench.sweep_report import machine_info
from braid.config import positive_int

LAYOUTS = {"groups": False, "one table": True}  # name -> --disable-hybrid-kv-cache-manager


def run(engine, prompt: list[int], new_tokens: int) -> tuple[list[int], float, int]:
    """Greedy tokens, seconds, and the most KV blocks in use while it ran."""
    from braid import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("r", prompt, params)
    start, most, tokens = time.perf_counter(), 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        most = max(most, engine.blocks.num_used_blocks)
    return tokens, time.perf_counter() - start, most


def main() -> None:
    from braid.config import EngineConfig
    from braid.engine.engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--prompt-tokens", type=positive_int, default=3000)
    ap.add_argument("--new-tokens", type=positive_int, default=64)
    ap.add_argument("--decode-tokens", type=positive_int, default=128)
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    engines = {}
    for name, disable in LAYOUTS.items():
        print(f"loading {args.model} ({name})", flush=True)
        engines[name] = LLMEngine(EngineConfig(
            model=args.model, kv_cache_gib=args.kv_cache_gib, enable_prefix_caching=False,
            max_model_len=args.prompt_tokens + args.new_tokens + 16, log_stats_interval=0,
            disable_hybrid_kv_cache_manager=disable))
    tokenizer = engines["groups"].tokenizer
    text = inspect.getsource(textwrap) * (1 + args.prompt_tokens // 2000)
    long_prompt = tokenizer.encode(text)[: args.prompt_tokens]
    short_prompt = tokenizer.encode("The history of the printing press begins")
    results: dict[str, dict] = {name: {"long_s": [], "decode_tok_s": []} for name in engines}
    for r in range(args.rounds + 1):  # round 0 pays first-call costs, untimed
        order = list(engines.items())
        for name, engine in order[::-1] if r % 2 else order:  # each goes first in turn
            tokens, seconds, most = run(engine, long_prompt, args.new_tokens)
            short, decode_s, _ = run(engine, short_prompt, args.decode_tokens)
            res = results[name]
            res |= {"tokens": tokens, "short_tokens": short, "peak_blocks": most}
            if r:
                res["long_s"].append(seconds)
                res["decode_tok_s"].append(args.decode_tokens / decode_s)
            print(f"round {r} {name}: long request {seconds:.1f} s, peak {most} blocks; "
                  f"decode {args.decode_tokens / decode_s:.1f} tok/s", flush=True)
    rows = []
    for name, engine in engines.items():
        res = results[name]
        per_block = engine.executor.runner.weight_and_kv_bytes[1] / engine.blocks.num_blocks
        rows.append({
            "layout": name, "blocks": engine.blocks.num_blocks,
            "layers_a_block": engine.executor.runner.layout.rows,
            "peak_kv_mib": res["peak_blocks"] * per_block / 2**20,
            "long_s": statistics.median(res["long_s"]),
            "decode_tok_s": statistics.median(res["decode_tok_s"]),
            "same_tokens": (res["tokens"] == results["groups"]["tokens"]
                            and res["short_tokens"] == results["groups"]["short_tokens"])})
    print(f"\n{args.model}, --kv-cache-gib {args.kv_cache_gib}, a {len(long_prompt)}-token "
          f"prompt and {args.new_tokens} new tokens; decode of {args.decode_tokens} tokens; "
          f"medians of {args.rounds} rounds")
    print("| layout | blocks | layers a block | peak KV of the long request | long request | "
          "decode | greedy tokens equal |\n|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['layout']} | {row['blocks']:,} | {row['layers_a_block']} | "
              f"{row['peak_kv_mib']:.1f} MiB | {row['long_s']:.1f} s | "
              f"{row['decode_tok_s']:.1f} tok/s | {row['same_tokens']} |")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine_info(), "args": vars(args) | {
            "out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
