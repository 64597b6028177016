"""`braid bench serve`: one load-generator run against a server, as a table and a JSON result.

Result JSON (schema "braid.bench.serve/1"): `schema`, `date`, `config` (the run's settings),
the figures of `metrics.summarize` (duration_s, num_requests, completed, failed,
failure_reasons, token totals, request/output/total-token throughput, goodput, and
ttft_ms / tpot_ms / itl_ms / e2el_ms each with mean, median, p90, p99), `spec` (the server's
speculation figures for the run, or null) and `requests` (one record per prompt; with
`--dataset agentic`, per turn of the multi-turn tool-calling sessions, run closed-loop at
`--max-concurrency` sessions, the config then counting turns and tool calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from braid.bench import agentic
from braid.bench.datasets import BenchPrompt, load_prompts, tokenizer_for
from braid.bench.loadgen import LoadConfig, run_load, run_sessions, warm_up
from braid.bench.metrics import parse_goodput, summarize
from braid.bench.report import print_table
from braid.bench.server_metrics import scrape, spec_figures

logger = logging.getLogger("braid.bench")
SCHEMA = "braid.bench.serve/1"


class WarmUpFailed(ValueError):
    """The warm-up request failed: the load would fail the same way (no server there, a
    model it does not serve), so nothing is measured."""


def benchmark(cfg: LoadConfig, prompts: list[BenchPrompt], slos: dict[str, float] | None = None,
              warmup: bool = True, info: dict[str, Any] | None = None,
              sessions: list[agentic.Session] | None = None) -> dict[str, Any]:
    """Warm up, scrape /metrics, run the load, scrape again; the result as a JSON-able dict.
    With `sessions` (agentic), the load is those sessions run closed-loop, one record per
    turn. WarmUpFailed where the warm-up request fails (as vLLM's benchmark stops on its
    first)."""
    if warmup and prompts:
        first = asyncio.run(warm_up(cfg, prompts[0]))
        if not first.success:
            raise WarmUpFailed(f"the warm-up request to {cfg.base_url} (model {cfg.model!r}) "
                               f"failed: {first.error}")
    before = scrape(cfg.base_url)
    records, duration = asyncio.run(run_sessions(cfg, sessions) if sessions is not None
                                    else run_load(cfg, prompts))
    after = scrape(cfg.base_url)
    config = {**asdict(cfg), **(info or {}), "num_prompts": len(prompts), "goodput_slos_ms": slos}
    if sessions is not None:
        config.update(turns=sum(len(s.replies) for s in sessions),
                      tool_calls=sum(s.num_calls for s in sessions))
    del config["api_key"]
    config["request_rate"] = _rate(cfg.request_rate)
    return {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        **summarize(records, duration, slos),
        "spec": spec_figures(before, after),
        "requests": [r.as_dict() for r in records],
    }


def _rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def save_json(result: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")


def load_config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint,
        request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, seed=args.seed,
        max_output_len=args.max_output_len, ignore_eos=args.ignore_eos,
        temperature=args.temperature, progress=not args.no_progress, api_key=args.api_key)


def dataset_prompts(args: argparse.Namespace, model: str) -> list[BenchPrompt]:
    tokenizer = tokenizer_for(model, args.tokenizer) if args.dataset == "sharegpt" else None
    prompts = load_prompts(args.dataset, args.num_prompts, args.seed, args.random_input_len,
                           args.random_output_len, args.max_input_len, tokenizer)
    if len(prompts) < args.num_prompts:  # ShareGPT's that fit --max-input-len ran out
        if not prompts:
            raise ValueError(f"--max-input-len {args.max_input_len}: no {args.dataset} prompt "
                             "is that short")
        logger.warning("--num-prompts %d: only %d %s prompts fit --max-input-len %d",
                       args.num_prompts, len(prompts), args.dataset, args.max_input_len)
    return prompts


def dataset_info(args: argparse.Namespace) -> dict[str, Any]:
    return {"dataset": args.dataset, "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len, "max_input_len": args.max_input_len}


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.dataset == "agentic" and args.endpoint != "chat":
        args.command_parser.error("--dataset agentic: its sessions call tools, on --endpoint "
                                  "chat")
    cfg = load_config(args)
    slos = parse_goodput(args.goodput)
    prompts = dataset_prompts(args, args.model)
    sessions = (agentic.sessions(args.num_prompts, seed=args.seed)
                if args.dataset == "agentic" else None)
    result = benchmark(cfg, prompts, slos, warmup=not args.no_warmup, info=dataset_info(args),
                       sessions=sessions)
    print_table(result)
    if args.result_json:
        save_json(result, args.result_json)
        print(f"saved {args.result_json}")
    if not result["completed"]:  # scripts must not read a run of failures as a result
        print(f"braid bench serve: error: all {result['failed']} requests failed",
              file=sys.stderr)
        return 1
    return 0
