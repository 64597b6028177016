"""Chunked prefill vs prefill-first, offline engine on ShareGPT prompts (default target).

    python benchmarks/bench_chunked.py --num-prompts 32 --request-rate 0.5 --max-output-len 64

Requests arrive open-loop (Poisson, seeded) while the engine steps; prints output tokens/s,
TTFT and inter-token latency (mean, p50, p99) for each mode.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from braid.bench.datasets import sharegpt
from braid.config import DEFAULT_TARGET, EngineConfig, positive_float, positive_int
from braid.engine.engine import LLMEngine
from braid.models.build import load_model
from braid.sampling_params import SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


def run(engine: LLMEngine, prompts: list[tuple[list[int], int]], rate: float,
        seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(rate)
    start = time.perf_counter()
    last: dict[str, float] = {}
    itl: list[float] = []
    ttft: list[float] = []
    generated, next_i = 0, 0
    while next_i < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_i < len(prompts) and arrivals[next_i] <= now:
            ids, out_len = prompts[next_i]
            engine.add_request(str(next_i), ids, SamplingParams(
                temperature=0, max_tokens=out_len, ignore_eos=True),
                arrival_time=time.monotonic() - (now - arrivals[next_i]))
            next_i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, arrivals[next_i] - now)))
            continue
        for out in engine.step():
            stamp = time.monotonic()
            rid = out.request_id
            if rid in last:
                itl.append(stamp - last[rid])
            elif out.metrics.first_token_time is not None:
                ttft.append(stamp - out.metrics.arrival_time)
            last[rid] = stamp
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    return {"tok_per_s": generated / seconds, "seconds": seconds,
            "ttft_mean": statistics.mean(ttft), "ttft_p99": percentile(ttft, 99),
            "itl_mean": statistics.mean(itl), "itl_p50": percentile(itl, 50),
            "itl_p99": percentile(itl, 99), "preemptions": engine.stats.num_preemptions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=positive_int, default=32)
    parser.add_argument("--request-rate", type=positive_float, default=0.5)
    parser.add_argument("--max-output-len", type=positive_int, default=64)
    parser.add_argument("--max-prompt-len", type=positive_int, default=512)
    parser.add_argument("--chunk", type=positive_int, default=128,
                        help="token budget when chunked")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model, tokenizer = load_model(DEFAULT_TARGET)
    items = sharegpt(args.num_prompts, seed=args.seed, tokenizer=tokenizer,
                     max_prompt_len=args.max_prompt_len)
    prompts = [(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": p.prompt}]), add_special_tokens=False),
        min(p.output_len, args.max_output_len)) for p in items]
    lens = [len(p) for p, _ in prompts]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(prompts)} "
          f"ShareGPT prompts ({min(lens)}-{max(lens)} tokens, mean {statistics.mean(lens):.0f})"
          f", outputs <= {args.max_output_len}, Poisson {args.request_rate} req/s", flush=True)
    for name, chunked in (("prefill-first", False), ("chunked", True)):
        engine = LLMEngine(EngineConfig(
            enable_chunked_prefill=chunked, max_model_len=2048, kv_cache_gib=1.5,
            max_num_batched_tokens=args.chunk if chunked else 2048, log_stats_interval=0),
            model=model, tokenizer=tokenizer)
        r = run(engine, prompts, args.request_rate, args.seed)
        print(f"{name:>13}: {r['tok_per_s']:6.2f} output tok/s | TTFT mean "
              f"{r['ttft_mean']:6.2f} s p99 {r['ttft_p99']:6.2f} s | ITL mean "
              f"{r['itl_mean'] * 1e3:6.0f} ms p50 {r['itl_p50'] * 1e3:6.0f} ms p99 "
              f"{r['itl_p99'] * 1e3:6.0f} ms | {r['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
