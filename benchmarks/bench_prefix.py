"""Prefix caching over a real server: multi-turn ShareGPT (each conversation replayed turn by
turn, each turn's prompt the conversation so far, with the server's own earlier answers) and
one ~1,000-token system prompt with short questions, open-loop at several rates, with caching
on and off and speculation on and off. Prints a markdown table; writes JSON and a plot.

    python benchmarks/bench_prefix.py                       # the default sizes (~1 h here)
    python benchmarks/bench_prefix.py --rates 0.05 --num-conversations 2 --modes cache,nocache

Conversations (or system-prompt requests) start at Poisson arrival times whatever the server's
progress; a conversation's next turn is sent when its previous answer has arrived.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from braid.bench.args import comma_choices
from braid.bench.datasets import (
    BenchPrompt,
    shared_system_prompt,
    sharegpt_conversations,
    tokenizer_for,
)
from braid.bench.loadgen import LoadConfig, arrival_times, request_body, send_one
from braid.bench.metrics import RequestRecord, summarize
from braid.bench.server_metrics import scrape
from braid.bench.server_process import ServerProcess, check_serve_flags
from braid.bench.sweep_report import machine_info
from braid.config import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    comma_list,
    positive_float,
    positive_int,
)

SPEC = {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"}
MODES = {  # name -> server flags
    "cache": [],
    "nocache": ["--no-enable-prefix-caching"],
    "cache+spec": ["--speculative-config", json.dumps(SPEC)],
    "nocache+spec": ["--no-enable-prefix-caching", "--speculative-config", json.dumps(SPEC)],
}
WORKLOADS = ("multiturn", "sysprompt")


async def replay(cfg: LoadConfig, sessions: list[list[BenchPrompt]]
                 ) -> tuple[list[RequestRecord], float]:
    """Each session's turns in order, sessions starting at the load's arrival times; a turn's
    history carries the server's own earlier answers, as a chat client resends them."""
    offsets = arrival_times(len(sessions), cfg.request_rate, cfg.burstiness, cfg.seed)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def session(turns: list[BenchPrompt], offset: float) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            records, answers = [], []
            for turn in turns:
                messages = list(turn.messages)
                for i, answer in enumerate(answers):  # messages alternate user, assistant
                    messages[2 * i + 1] = ("assistant", answer)
                text: list[str] = []
                body = request_body(cfg, replace(turn, messages=tuple(messages)))
                records.append(await send_one(client, cfg, body, time.perf_counter, t0, text))
                answers.append("".join(text))
            return records

        done = await asyncio.gather(*(session(s, float(o)) for s, o in
                                      zip(sessions, offsets, strict=True)))
        duration = time.perf_counter() - t0
    return [r for records in done for r in records], duration


def run(args: argparse.Namespace, url: str, sessions: list[list[BenchPrompt]], rate: float
        ) -> dict[str, Any]:
    cfg = LoadConfig(base_url=url, model=args.model, request_rate=rate, seed=args.seed,
                     max_output_len=args.max_output_len, progress=False)
    before = scrape(url) or {}
    records, duration = asyncio.run(replay(cfg, sessions))
    after = scrape(url) or {}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("braid:prefix_cache_queries_total")
    result = summarize(records, duration)
    result["prefix_cache_hit_rate"] = delta("braid:prefix_cache_hits_total") / queries \
        if queries else 0.0
    result["num_drafts"] = delta("braid:spec_decode_num_drafts_total")
    result["accepted"] = delta("braid:spec_decode_num_accepted_tokens_total")
    uncached = [r.ttft for r in records if r.success and r.cached_tokens == 0 and r.ttft]
    result["uncached_ttft_median_ms"] = float(np.median(uncached) * 1000) if uncached else None
    return result


def workloads(args: argparse.Namespace) -> dict[str, list[list[BenchPrompt]]]:
    tokenizer = tokenizer_for(args.model)
    out: dict[str, list[list[BenchPrompt]]] = {}
    if "multiturn" in args.workloads:
        out["multiturn"] = sharegpt_conversations(args.num_conversations, args.max_turns,
                                                  args.seed, tokenizer, args.max_prompt_len)
    if "sysprompt" in args.workloads:
        out["sysprompt"] = [[p] for p in shared_system_prompt(
            args.num_prompts, args.system_len, args.max_output_len, args.seed, tokenizer)]
    return out


def table(results: dict[str, Any]) -> str:
    lines = ["| workload | rate | mode | TTFT p50 / p99 (s) | ITL p99 (ms) | output tok/s | "
             "hit rate | failed |", "|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        workload, rate, mode = key.split("|")
        ttft = r["ttft_ms"]
        lines.append(
            f"| {workload} | {rate} | {mode} | {_s(ttft['median'])} / {_s(ttft['p99'])} | "
            f"{r['itl_ms']['p99'] or 0:.0f} | {r['output_throughput']:.2f} | "
            f"{r['prefix_cache_hit_rate']:.0%} | {r['failed']} |")
    return "\n".join(lines)


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f}"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({k.split("|")[0] for k in results})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, workload in zip(axes[0], names, strict=True):
        for mode in MODES:
            points = sorted((float(k.split("|")[1]), r["ttft_ms"]["median"] / 1000)
                            for k, r in results.items()
                            if k.startswith(workload + "|") and k.endswith("|" + mode)
                            and r["ttft_ms"]["median"] is not None)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        ax.set(title=f"{workload}: median TTFT", xlabel="arrival rate (sessions/s)",
               ylabel="seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def server_flags(args: argparse.Namespace, mode: str) -> list[str]:
    """A mode's `braid serve` flags, the draft named, then --server-args."""
    flags = [*MODES[mode], *shlex.split(args.server_args)]
    if "spec" in mode:
        i = flags.index("--speculative-config")
        flags[i + 1] = json.dumps({**SPEC, "model": args.draft_model})
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rates", type=comma_list(positive_float), default=[0.05, 0.1],
                        help="sessions per second (a conversation, or one system-prompt request)")
    parser.add_argument("--num-conversations", type=positive_int, default=5)
    parser.add_argument("--max-turns", type=positive_int, default=3)
    parser.add_argument("--max-prompt-len", type=positive_int, default=768)
    parser.add_argument("--num-prompts", type=positive_int, default=8,
                        help="system-prompt requests")
    parser.add_argument("--system-len", type=positive_int, default=1000)
    parser.add_argument("--max-output-len", type=positive_int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="")
    parser.add_argument("--out", default="docs/benchmarks")
    args = parser.parse_args()
    modes = comma_choices(parser, "--modes", args.modes, MODES)
    args.workloads = comma_choices(parser, "--workloads", args.workloads, WORKLOADS)
    for mode in modes:
        try:
            check_serve_flags(server_flags(args, mode), "--server-args", args.model)
        except ValueError as e:
            parser.error(str(e))
    rates = args.rates
    loads = workloads(args)
    for name, sessions in loads.items():
        print(f"{name}: {len(sessions)} sessions, {sum(map(len, sessions))} requests")
    results: dict[str, Any] = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="braid-prefix-logs-"))
    for mode in modes:
        flags = server_flags(args, mode)
        for name, sessions in loads.items():
            for rate in rates:  # a fresh server each run: nothing cached from the last one
                server = ServerProcess(args.model, log_dir, *flags, timeout_s=600)
                try:
                    asyncio.run(_warm(args, server.url))
                    start = time.monotonic()
                    r = run(args, server.url, sessions, rate)
                finally:
                    server.stop()
                results[f"{name}|{rate}|{mode}"] = r
                print(f"{mode:>13} {name:>9} @ {rate}/s: TTFT p50 "
                      f"{_s(r['ttft_ms']['median'])} s, p99 {_s(r['ttft_ms']['p99'])} s, "
                      f"{r['output_throughput']:.2f} tok/s, hit rate "
                      f"{r['prefix_cache_hit_rate']:.0%}, {r['failed']} failed "
                      f"({time.monotonic() - start:.0f} s)", flush=True)
                _save(out, args, results)
    print(table(results))
    plot(results, out / "prefix_cache.png")


async def _warm(args: argparse.Namespace, url: str) -> None:
    """One short request (kernels, first-step costs) before measuring; its prompt is a
    user message only, so it caches little beyond the chat template's default opening."""
    cfg = LoadConfig(base_url=url, model=args.model, progress=False)
    async with httpx.AsyncClient(timeout=600) as client:
        await send_one(client, cfg, request_body(cfg, BenchPrompt("warm up", 4), 4),
                       time.perf_counter, time.perf_counter())


def _save(out: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    (out / "prefix_cache.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine_info(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
