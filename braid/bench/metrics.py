"""Serving metrics as pure functions of recorded timings (seconds since the run started).

Definitions follow vLLM's benchmark_serving.py: TTFT = first content chunk - send; TPOT =
(latency - TTFT) / (output tokens - 1); ITL = gaps between a request's content chunks (with
speculation one chunk can carry several tokens, so ITL counts chunks, TPOT tokens); goodput =
successful requests meeting every SLO, per second of the run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the start of the run."""

    send_time: float
    success: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None  # send to end of stream
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.latency is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot": self.tpot}


def record_from_chunks(send_time: float, chunk_times: list[float], end_time: float,
                       output_tokens: int | None = None, prompt_tokens: int = 0,
                       cached_tokens: int = 0) -> RequestRecord:
    """A successful request from its content chunks' arrival times. Without a usage count the
    chunks are taken as one token each."""
    if not chunk_times:
        return RequestRecord(send_time, False, "no output tokens", prompt_tokens)
    tokens = output_tokens if output_tokens is not None else len(chunk_times)
    itl = np.diff(chunk_times).tolist() if len(chunk_times) > 1 else []
    return RequestRecord(send_time, True, "", prompt_tokens, tokens,
                         ttft=chunk_times[0] - send_time, latency=end_time - send_time, itl=itl,
                         cached_tokens=cached_tokens)


def failed_record(send_time: float, error: str, prompt_tokens: int = 0) -> RequestRecord:
    return RequestRecord(send_time, False, error, prompt_tokens)


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 in milliseconds (linear interpolation); None when empty."""
    keys = ["mean", "median", "p90", "p99"]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    pct = np.percentile(ms, PERCENTILES)
    return dict(zip(keys, [float(ms.mean()), *map(float, pct)], strict=True))


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:300"]` -> {"ttft": 500.0, "tpot": 300.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput: expected NAME:MS with NAME in {', '.join(SLO_METRICS)}, "
                             f"got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput: {name} must be > 0 ms")
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    return all((values[name] or 0.0) * 1000.0 <= limit for name, limit in slos.items())


def summarize(records: list[RequestRecord], duration_s: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """The run's figures (the JSON result's metric fields)."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "duration_s": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failure_reasons": dict(Counter(r.error for r in records if not r.success)),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "cached_input_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput": per_s(sum(meets_slos(r, slos) for r in ok)) if slos else None,
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None
                                    and r.output_tokens > 1]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "e2el_ms": distribution_ms([r.latency for r in ok if r.latency is not None]),
    }
