"""`braid bench serve|sweep` flags (argparse only: the CLI imports this at start-up)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

from braid.bench.datasets import DATASETS
from braid.config import non_negative_float, positive_float, positive_int

MODES = "baseline,chunked,spec,chunked_fixed,chunked_dynamic"
# TTFT within 10 s, and at least 2 tokens a second once streaming (on a 2-core CPU the SLO
# fails once batching more than doubles the single-stream TPOT of the 1.5B target).
SWEEP_SLOS = ("ttft:10000", "tpot:500")

SWEEP_HELP = """\
Start `braid serve` once per mode, send the same seeded prompts at each request rate, and write
sweep_<dataset>.md (table, machine, versions, command), one PNG per plot and sweep_<dataset>.json
into --out.

Modes: baseline (no speculation, prefill-first), chunked (chunked prefill only), spec (draft
model, fixed k=3, prefill-first), chunked_fixed (chunked + fixed k=3), chunked_dynamic
(chunked + goodput policy, k up to 5).

Default sizing, for a 2-core CPU and the 1.5B target (~3.5 tok/s alone, ~15 tok/s with 8
running): rates 0.1,0.2,0.4 req/s, 12 prompts per rate, outputs capped at 32 tokens, prompts at
256 tokens. Offered load then goes from well under capacity (0.1 req/s x 32 tokens = 3 tok/s)
to near saturation (0.4 req/s = 13 tok/s); a rate takes about num_prompts / rate seconds plus
the drain (~120 + 60 + 30 s), so a mode takes ~5 min with server start-up and all five modes
~25-35 min. --quick: rates 0.2,0.4, 4 prompts, 16 output tokens: ~1-1.5 min a mode, under 10
min for all five. Explicit --request-rates, --num-prompts or --max-output-len override either.
Goodput SLOs default to ttft:10000 tpot:500 (ms).
"""


def comma_choices(parser: argparse.ArgumentParser, flag: str, value: str,
                  known: Iterable[str], allow_empty: bool = False) -> list[str]:
    """The comma-separated names of `value`, each one of `known`, at least one unless
    `allow_empty` (parser.error naming the flag otherwise)."""
    known = list(known)
    names = [n for n in (part.strip() for part in value.split(",")) if n]
    if not names and not allow_empty:
        parser.error(f"{flag}: name at least one of {', '.join(known)}")
    if unknown := [n for n in names if n not in known]:
        parser.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def _dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="sharegpt",
                   help="sharegpt (first turns, reference output lengths), humaneval, random, "
                   "agentic (tool-calling sessions), extraction (HumanEval functions described "
                   "as JSON of one schema)")
    g.add_argument("--random-input-len", type=positive_int, default=128,
                   help="words per random prompt")
    g.add_argument("--random-output-len", type=positive_int, default=128,
                   help="output tokens for random and humaneval prompts")
    g.add_argument("--max-input-len", type=positive_int, default=256,
                   help="ShareGPT prompts longer than this (tokens) are skipped")
    g.add_argument("--max-output-len", type=positive_int, default=None,
                   help="cap on each request's max_tokens (bench sweep: default 32, --quick 16)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder to count ShareGPT lengths (default: the model's if "
                   "braid finds it locally, else 4 characters a token)")
    g.add_argument("--seed", type=int, default=0, help="seeds prompt sampling and arrivals")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier")
    g.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=None,
                   help="SLOs for goodput, e.g. ttft:2000 tpot:500 (names: ttft, tpot, e2el)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--num-prompts", type=positive_int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, open loop (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (with rate inf: a closed loop)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY")
                   or os.environ.get("BRAID_API_KEY"),
                   help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY, else "
                   "$BRAID_API_KEY)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_tokens (equal work across servers and modes)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    p.add_argument("--result-json", default=None, help="save the result here")
    _dataset_args(p)


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    from braid.config import DEFAULT_TARGET

    p.add_argument("--model", default=DEFAULT_TARGET, help="target model for `braid serve`")
    p.add_argument("--draft-model", default=None,
                   help="draft model of the speculative modes (default: the server's)")
    p.add_argument("--modes", default=MODES, help="comma-separated modes to run")
    p.add_argument("--request-rates", default=None, help="comma-separated req/s (default 0.1,"
                   "0.2,0.4; --quick 0.2,0.4)")
    p.add_argument("--num-prompts", type=positive_int, default=None,
                   help="prompts per rate (default 12; --quick 4)")
    p.add_argument("--quick", action="store_true", help="the small sizing (under 10 minutes)")
    p.add_argument("--server-args", default="",
                   help='extra `braid serve` flags for every mode, e.g. "--max-model-len 2048"')
    p.add_argument("--server-timeout", type=positive_float, default=900.0,
                   help="seconds to wait for a server to become healthy")
    p.add_argument("--out", default="docs/benchmarks", help="folder for .md, .png, .json")
    _dataset_args(p)
    p.set_defaults(goodput=list(SWEEP_SLOS))


def add_bench_args(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="serving benchmarks (load generator, mode sweep)")
    which = bench.add_subparsers(dest="bench_command", required=True)
    serve = which.add_parser("serve", help="load-test a running OpenAI-compatible server",
                             description="Open-loop streaming load generator (like vLLM's "
                             "benchmark_serving.py): prints a table, saves JSON.")
    add_serve_args(serve)
    serve.set_defaults(func=_lazy("braid.bench.serve", "cmd_bench_serve"), command_parser=serve)
    sweep = which.add_parser("sweep", help="start braid in each mode and sweep request rates",
                             description=SWEEP_HELP,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(sweep)
    sweep.set_defaults(func=_lazy("braid.bench.sweep", "cmd_bench_sweep"), command_parser=sweep)


def _lazy(module: str, name: str):  # noqa: ANN202 - the command, imported when it runs
    def run(args: argparse.Namespace) -> int:
        import importlib
        import logging

        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise

        return int(getattr(importlib.import_module(module), name)(args))

    return run
