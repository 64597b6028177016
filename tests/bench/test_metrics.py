"""Metric computation on known timings (recorded chunk times stand in for a clock)."""

from __future__ import annotations

import pytest

from braid.bench.metrics import (
    RequestRecord,
    distribution_ms,
    failed_record,
    meets_slos,
    parse_goodput,
    record_from_chunks,
    summarize,
)


def test_record_from_chunks_ttft_itl_tpot_latency() -> None:
    # sent at 1.0; chunks at 1.5, 1.7, 2.0, 2.1; stream ends 2.2; usage says 5 tokens
    r = record_from_chunks(1.0, [1.5, 1.7, 2.0, 2.1], 2.2, output_tokens=5, prompt_tokens=7)
    assert r.success and r.output_tokens == 5 and r.prompt_tokens == 7
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.2, 0.3, 0.1])
    assert r.latency == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 4)


def test_chunks_count_as_tokens_without_usage_and_no_chunk_is_a_failure() -> None:
    assert record_from_chunks(0.0, [0.1, 0.2], 0.3).output_tokens == 2
    empty = record_from_chunks(0.0, [], 0.3)
    assert not empty.success and empty.error == "no output tokens" and empty.tpot is None
    assert record_from_chunks(0.0, [0.4], 0.5, output_tokens=1).tpot == 0.0


def test_distribution_percentiles_are_exact() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    d = distribution_ms(values)
    assert d["mean"] == pytest.approx(50.5)
    assert d["median"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert distribution_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def _records() -> list[RequestRecord]:
    return [
        # ttft 0.1, tpot (1.1-0.1)/10 = 0.1, latency 1.1
        record_from_chunks(0.0, [0.1 + 0.1 * i for i in range(11)], 1.1, 11, 10),
        # ttft 0.5, tpot (2.5-0.5)/4 = 0.5, latency 2.5
        record_from_chunks(1.0, [1.5, 2.0, 2.5, 3.0, 3.5], 3.5, 5, 20),
        failed_record(2.0, "HTTP 400: too long"),
        failed_record(3.0, "HTTP 400: too long"),
    ]


def test_summarize_throughput_failures_and_distributions() -> None:
    s = summarize(_records(), duration_s=4.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert s["failure_reasons"] == {"HTTP 400: too long": 2}
    assert s["total_output_tokens"] == 16 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(46 / 4)
    assert s["goodput"] is None
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert s["ttft_ms"]["median"] == pytest.approx(300.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(300.0)
    assert s["e2el_ms"]["p99"] == pytest.approx(1100 + 0.99 * 1400)
    # 10 gaps of 100 ms and 4 of 500 ms
    assert s["itl_ms"]["mean"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert s["itl_ms"]["median"] == pytest.approx(100.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = _records()
    assert summarize(records, 4.0, {"ttft": 200})["goodput"] == pytest.approx(0.25)
    assert summarize(records, 4.0, {"ttft": 600, "tpot": 400})["goodput"] == pytest.approx(0.25)
    assert summarize(records, 4.0, {"ttft": 600, "tpot": 500})["goodput"] == pytest.approx(0.5)
    assert summarize(records, 4.0, {"e2el": 1000})["goodput"] == 0.0
    assert not meets_slos(records[2], {"ttft": 1e9})


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["tpot:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
