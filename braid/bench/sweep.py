"""`braid bench sweep`: each mode's server started here, the same prompts sent at each request
rate, then one markdown table, plots and a JSON of every run (see `sweep_report`)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from braid.bench.datasets import BenchPrompt
from braid.bench.loadgen import LoadConfig
from braid.bench.metrics import parse_goodput
from braid.bench.serve import (
    WarmUpFailed,
    benchmark,
    dataset_info,
    dataset_prompts,
    save_json,
)
from braid.bench.server_process import ServerProcess, check_serve_flags
from braid.bench.sweep_report import machine_info, report_stem, write_report

logger = logging.getLogger("braid.bench")
SCHEMA = "braid.bench.sweep/1"


def _spec(k: int, policy: str) -> dict[str, Any]:
    return {"method": "draft_model", "num_speculative_tokens": k, "policy": policy}


# mode -> (chunked prefill, speculative config or None)
MODES: dict[str, tuple[bool, dict[str, Any] | None]] = {
    "baseline": (False, None),
    "chunked": (True, None),
    "spec": (False, _spec(3, "fixed")),
    "chunked_fixed": (True, _spec(3, "fixed")),
    "chunked_dynamic": (True, _spec(5, "goodput")),
}


@dataclass(frozen=True)
class Sizing:
    request_rates: str
    num_prompts: int
    max_output_len: int


# Sized for the 2-core CPU box and the 1.5B target (~3.5 tok/s alone, ~15 tok/s at 8 running).
DEFAULT = Sizing("0.1,0.2,0.4", 12, 32)
QUICK = Sizing("0.2,0.4", 4, 16)


def mode_flags(mode: str, draft_model: str | None = None) -> list[str]:
    """The `braid serve` flags of a mode."""
    if mode not in MODES:
        raise ValueError(f"--modes: unknown mode {mode!r} (known: {', '.join(MODES)})")
    chunked, spec = MODES[mode]
    flags = ["--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill"]
    if spec is not None:
        spec = {**spec, "model": draft_model} if draft_model else spec
        flags += ["--speculative-config", json.dumps(spec)]
    return flags


def serve_flags(args: argparse.Namespace, mode: str) -> list[str]:
    """A mode's flags, then --server-args."""
    try:
        extra = shlex.split(args.server_args or "")
    except ValueError as e:  # an unclosed quote
        raise ValueError(f"--server-args {args.server_args!r}: {e}") from None
    if taken := [a for a in extra if a.split("=")[0] in ("--host", "--port")]:
        raise ValueError(f"--server-args {args.server_args!r}: {taken[0].split('=')[0]} is the "
                         "sweep's to choose (each server gets a free port on 127.0.0.1)")
    return [*mode_flags(mode, args.draft_model), *extra]


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--request-rates: expected numbers separated by commas, got {text!r}"
                         ) from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("--request-rates: every rate must be > 0 (inf: all at once)")
    return rates


def resolve_sizing(args: argparse.Namespace) -> None:
    """Fill the unset sizing options from --quick or the defaults."""
    base = QUICK if args.quick else DEFAULT
    for name in ("request_rates", "num_prompts", "max_output_len"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(base, name))


def run_mode(args: argparse.Namespace, mode: str, prompts: list[BenchPrompt],
             rates: list[float], log_dir: Path) -> dict[str, Any]:
    """Start the mode's server, run every rate against it, stop it."""
    flags = serve_flags(args, mode)
    entry: dict[str, Any] = {"server_flags": flags, "runs": [], "error": None}
    start = time.monotonic()
    try:
        server = ServerProcess(args.model, log_dir, *flags, timeout_s=args.server_timeout)
    except RuntimeError as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        entry["error"] = f"server did not start: {lines[0]} ... {lines[-1]}"[:500]
        logger.error("mode %s: %s (log in %s)", mode, entry["error"], log_dir)
        return entry
    entry["startup_s"] = time.monotonic() - start
    try:
        for i, rate in enumerate(rates):
            logger.info("mode %s, %s req/s: %d prompts", mode, rate, len(prompts))
            cfg = _load_config(args, server.url, rate, _api_key(flags))
            entry["runs"].append(benchmark(cfg, prompts, parse_goodput(args.goodput),
                                           warmup=i == 0, info=dataset_info(args)))
    except WarmUpFailed as e:
        entry["error"] = str(e)[:500]
        logger.error("mode %s: %s (log in %s)", mode, entry["error"], log_dir)
    finally:
        entry["exit_code"] = server.stop()
    entry["elapsed_s"] = time.monotonic() - start
    return entry


def _load_config(args: argparse.Namespace, url: str, rate: float, api_key: str | None
                 ) -> LoadConfig:
    return LoadConfig(base_url=url, model=args.model, endpoint=args.endpoint, request_rate=rate,
                      burstiness=args.burstiness, seed=args.seed,
                      max_output_len=args.max_output_len, progress=not args.no_progress,
                      api_key=api_key)


def _api_key(flags: list[str]) -> str | None:
    """The API key the mode's server asks for: its --api-key, else $BRAID_API_KEY (as `braid
    serve` reads them; the flags were checked before any server started)."""
    from braid.cli import build_parser

    return build_parser().parse_args(["serve", *flags]).api_key


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    resolve_sizing(args)
    rates = parse_rates(args.request_rates)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise ValueError("--modes: name at least one mode")
    # before any server starts: the model (named as --model), then each mode's flags
    check_serve_flags([], "--model", args.model)
    for mode in modes:
        check_serve_flags(serve_flags(args, mode), "--server-args", args.model)
    parse_goodput(args.goodput)
    prompts = dataset_prompts(args, args.model)
    log_dir = Path(tempfile.mkdtemp(prefix="braid-sweep-logs-"))
    out = Path(args.out)
    sweep: dict[str, Any] = {
        "schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": shlex.join(getattr(args, "command_line", ["braid", "bench", "sweep"])),
        "machine": machine_info(), "settings": _settings(args, rates, modes), "modes": {}}
    logger.info("sweep: %d modes x %d rates, server logs in %s", len(modes), len(rates), log_dir)
    for mode in modes:
        sweep["modes"][mode] = run_mode(args, mode, prompts, rates, log_dir)
        # partial results survive a crash
        save_json(sweep, out / f"{report_stem(sweep, args.dataset)}.json")
    sweep["report"] = str(write_report(sweep, out, args.dataset))
    return sweep


def _settings(args: argparse.Namespace, rates: list[float], modes: list[str]) -> dict[str, Any]:
    return {"model": args.model, "draft_model": args.draft_model, **dataset_info(args),
            "num_prompts": args.num_prompts,
            "request_rates": ["inf" if math.isinf(r) else r for r in rates],
            "burstiness": args.burstiness, "max_output_len": args.max_output_len,
            "endpoint": args.endpoint, "seed": args.seed, "goodput": args.goodput,
            "server_args": args.server_args, "modes": modes, "quick": args.quick}


def cmd_bench_sweep(args: argparse.Namespace) -> int:
    if args.dataset == "agentic":
        args.command_parser.error("--dataset agentic: its sessions run closed-loop, not at "
                                  "request rates; use braid bench serve --max-concurrency")
    start = time.monotonic()
    sweep = run_sweep(args)
    failed = [m for m, e in sweep["modes"].items() if e["error"]]
    print(f"sweep done in {time.monotonic() - start:.0f} s: {sweep['report']}")
    if failed:
        print(f"modes that failed: {', '.join(failed)}")
    return 1 if failed else 0
