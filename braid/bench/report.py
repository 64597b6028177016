"""Results as text: the `bench serve` table (vLLM's layout), and a sweep's markdown and plots."""

from __future__ import annotations

from typing import Any

WIDTH = 50
_DISTS = (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
          ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency"))
_STATS = {"mean": "Mean", "median": "Median", "p90": "P90", "p99": "P99"}


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _row(label: str, value: Any, digits: int = 2) -> str:
    return f"{label + ':':<40}{_num(value, digits):>10}"


def table_lines(result: dict[str, Any]) -> list[str]:
    r = result
    lines = [" Serving Benchmark Result ".center(WIDTH, "="),
             _row("Successful requests", r["completed"]),
             _row("Failed requests", r["failed"]),
             _row("Benchmark duration (s)", r["duration_s"]),
             _row("Total input tokens", r["total_input_tokens"]),
             _row("Total generated tokens", r["total_output_tokens"]),
             _row("Request throughput (req/s)", r["request_throughput"], 3),
             _row("Output token throughput (tok/s)", r["output_throughput"]),
             _row("Total token throughput (tok/s)", r["total_token_throughput"])]
    if r["goodput"] is not None:
        lines.append(_row("Request goodput (req/s)", r["goodput"], 3))
    for key, title in _DISTS:
        lines.append(f" {title} ".center(WIDTH, "-"))
        short = key.split("_")[0].upper()
        for stat, label in _STATS.items():
            lines.append(_row(f"{label} {short} (ms)", r[key][stat]))
    lines += _spec_lines(r.get("spec")) + _failure_lines(r["failure_reasons"])
    return [*lines, "=" * WIDTH]


def _spec_lines(spec: dict[str, Any] | None) -> list[str]:
    if not spec or not (spec["num_draft_tokens"] or spec["chosen_k"]):
        return []
    lines = [" Speculative Decoding (server /metrics) ".center(WIDTH, "-"),
             _row("Drafts", spec["num_drafts"]),
             _row("Draft tokens", spec["num_draft_tokens"]),
             _row("Accepted tokens", spec["num_accepted_tokens"]),
             _row("Acceptance rate", spec["acceptance_rate"], 3),
             _row("Mean acceptance length", spec["mean_acceptance_length"], 3)]
    if spec["chosen_k"]:
        by_k = sorted(spec["chosen_k"].items(), key=lambda item: int(item[0]))
        dist = " ".join(f"{k}:{n}" for k, n in by_k)
        lines.append(f"{'Chosen k (k:count)':<20}{dist:>30}")
    return lines


def _failure_lines(reasons: dict[str, int]) -> list[str]:
    if not reasons:
        return []
    return [" Failures ".center(WIDTH, "-"), *(f"{n:>5} x {reason}" for reason, n in
                                               sorted(reasons.items(), key=lambda x: -x[1]))]


def print_table(result: dict[str, Any]) -> None:
    print("\n".join(table_lines(result)))
