"""Arrival statistics, and the load generator against a real braid server (tiny model)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from braid.bench.datasets import BenchPrompt, random_prompts
from braid.bench.loadgen import LoadConfig, arrival_times, request_body, run_load
from braid.bench.serve import benchmark, save_json
from braid.bench.server_process import free_port
from tests.server.conftest import ServerProcess

N = 20_000


@pytest.mark.parametrize("rate", [0.2, 4.0])
def test_poisson_arrivals_have_the_rate_and_are_reproducible(rate: float) -> None:
    times = arrival_times(N, rate, seed=3)
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps > 0)
    # exponential gaps: mean 1/rate, coefficient of variation 1 (tolerance ~5 sigma at N=20k)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    assert np.array_equal(times, arrival_times(N, rate, seed=3))
    assert not np.array_equal(times, arrival_times(N, rate, seed=4))


def test_burstiness_keeps_the_mean_and_changes_the_spread() -> None:
    gaps = np.diff(arrival_times(N, 2.0, burstiness=0.25, seed=0))
    assert gaps.mean() == pytest.approx(0.5, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.06)  # gamma CV = 1/sqrt(shape)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert np.array_equal(arrival_times(5, math.inf), np.zeros(5))
    assert len(arrival_times(0, 1.0)) == 0


def test_request_bodies_stream_with_usage_and_cap_tokens() -> None:
    prompt = BenchPrompt("hi", 100, (("user", "hello"),))
    chat = request_body(LoadConfig("http://x", "m", max_output_len=8), prompt)
    assert chat["messages"] == [{"role": "user", "content": "hello"}]
    assert chat["max_tokens"] == 8 and chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    completion = request_body(LoadConfig("http://x", "m", endpoint="completions"), prompt)
    assert completion["prompt"] == "hi" and completion["max_tokens"] == 100
    with pytest.raises(ValueError, match="--request-rate"):
        LoadConfig("http://x", "m", request_rate=0)


DIST_KEYS = {"mean", "median", "p90", "p99"}
TOP_KEYS = {"schema", "date", "config", "duration_s", "num_requests", "completed", "failed",
            "failure_reasons", "total_input_tokens", "total_output_tokens", "cached_input_tokens",
            "request_throughput",
            "output_throughput", "total_token_throughput", "goodput", "ttft_ms", "tpot_ms",
            "itl_ms", "e2el_ms", "spec", "requests"}
REQUEST_KEYS = {"send_time", "success", "error", "prompt_tokens", "output_tokens", "ttft",
                "latency", "itl", "tpot", "cached_tokens"}


def check_schema(result: dict) -> None:
    assert set(result) == TOP_KEYS and result["schema"] == "braid.bench.serve/1"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(result[key]) == DIST_KEYS
    assert len(result["requests"]) == result["num_requests"]
    for r in result["requests"]:
        assert set(r) == REQUEST_KEYS and isinstance(r["itl"], list)
    assert result["completed"] + result["failed"] == result["num_requests"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_benchmark_against_a_real_server(server: ServerProcess, tmp_path: Path,
                                         endpoint: str) -> None:
    prompts = random_prompts(4, input_len=6, output_len=12, seed=1)
    cfg = LoadConfig(server.url, server.model, endpoint=endpoint, request_rate=50.0,
                     progress=False)
    result = benchmark(cfg, prompts, {"ttft": 60_000, "tpot": 60_000})
    save_json(result, tmp_path / "r.json")
    result = json.loads((tmp_path / "r.json").read_text())
    check_schema(result)
    assert result["completed"] == 4 and result["failed"] == 0
    assert result["total_output_tokens"] == 4 * 12  # from usage (ignore_eos)
    assert all(r["prompt_tokens"] > 0 and r["ttft"] > 0 for r in result["requests"])
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    assert result["ttft_ms"]["p99"] >= result["ttft_ms"]["median"] > 0
    assert result["spec"]["num_drafts"] == 0 and result["config"]["request_rate"] == 50.0


def test_failed_requests_are_counted_with_their_reason(server: ServerProcess) -> None:
    short = random_prompts(2, input_len=6, output_len=4, seed=0)
    too_long = BenchPrompt("x" * 400, 4)  # byte tokenizer: 400+ tokens > max-model-len 256
    cfg = LoadConfig(server.url, server.model, endpoint="completions", progress=False)
    result = benchmark(cfg, [short[0], too_long, short[1]], warmup=False)
    assert (result["completed"], result["failed"]) == (2, 1)
    [reason] = result["failure_reasons"]
    assert reason.startswith("HTTP 400: prompt is") and "max_model_len 256" in reason
    assert result["requests"][1]["success"] is False
    assert result["goodput"] is None and result["total_output_tokens"] == 8


def test_unreachable_server_fails_every_request() -> None:
    cfg = LoadConfig(f"http://127.0.0.1:{free_port()}", "m", progress=False)
    records, _ = asyncio.run(run_load(cfg, random_prompts(3, 4, 4)))
    assert [r.success for r in records] == [False] * 3
    assert all(r.error.startswith("ConnectError") for r in records)


def test_a_failed_warm_up_stops_the_benchmark_and_the_command(server: ServerProcess,
                                                              capsys) -> None:
    """No server there, or a model it does not serve: nothing is measured, and `braid bench
    serve` says why and exits non-zero (it printed a table of failures and exited 0)."""
    from braid.bench.serve import WarmUpFailed
    from braid.cli import main

    prompts = random_prompts(2, 4, 4)
    for url, model in ((f"http://127.0.0.1:{free_port()}", server.model),
                       (server.url, "not-served")):
        with pytest.raises(WarmUpFailed, match="warm-up request"):
            benchmark(LoadConfig(url, model, progress=False), prompts)
        code = main(["bench", "serve", "--base-url", url, "--model", model, "--dataset",
                     "random", "--num-prompts", "2", "--no-progress"])
        assert code == 2 and "warm-up request" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--model", "m", "--num-prompts", "0"])
    assert "--num-prompts: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--max-output-len", "0", "must be >= 1, got 0"),  # was no cap at all
    ("--random-output-len", "0", "must be >= 1, got 0"),  # was a 400 for every request
    ("--random-input-len", "0", "must be >= 1, got 0"),
    ("--max-input-len", "-1", "must be >= 1, got -1"),
    ("--temperature", "-1", "must be a number >= 0, got -1"),
])
def test_bench_flags_are_checked_before_anything_is_sent(flag: str, value: str, message: str,
                                                         capsys) -> None:
    from braid.cli import main

    for command in ("serve", "sweep"):
        if command == "sweep" and flag == "--temperature":
            continue  # sweep measures greedy decoding only
        with pytest.raises(SystemExit):
            main(["bench", command, "--model", "m", flag, value])
        assert f"{flag}: {message}" in capsys.readouterr().err


def test_a_run_whose_every_request_failed_exits_1(server: ServerProcess, capsys) -> None:
    """Scripts read exit code 0 as a result: a run of failures (here a model the server does
    not serve, without the warm-up that would have caught it) is not one."""
    from braid.cli import main

    code = main(["bench", "serve", "--base-url", server.url, "--model", "not-served",
                 "--dataset", "random", "--num-prompts", "2", "--no-progress", "--no-warmup"])
    assert code == 1
    assert "braid bench serve: error: all 2 requests failed" in capsys.readouterr().err


def test_no_prompt_fitting_max_input_len_is_an_error_naming_it(capsys) -> None:
    """Nothing to send: `braid bench serve` printed a table of 0 requests and exited 0."""
    from braid.cli import main

    port = free_port()  # nothing listens: the check comes before any request
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                 "--max-input-len", "2", "--num-prompts", "3", "--no-progress"])
    assert code == 2
    assert "--max-input-len 2: no sharegpt prompt is that short" in capsys.readouterr().err


def test_max_concurrency_one_is_a_closed_loop(server: ServerProcess) -> None:
    cfg = LoadConfig(server.url, server.model, max_concurrency=1, progress=False)
    records, _ = asyncio.run(run_load(cfg, random_prompts(3, input_len=4, output_len=6)))
    assert all(r.success for r in records)
    for before, after in zip(records, records[1:], strict=False):
        assert after.send_time >= before.send_time + (before.latency or 0)


def test_send_one_collects_the_streamed_text_and_cached_tokens(server: ServerProcess) -> None:
    """What a multi-turn replay resends: the streamed text equals the non-streamed answer,
    and a repeated prompt reports its cached tokens from the usage chunk."""
    import httpx

    from braid.bench.loadgen import send_one

    cfg = LoadConfig(server.url, server.model, endpoint="completions", progress=False)
    prompt = BenchPrompt("the same words again and again " * 4, 6)

    async def twice() -> tuple[list, list[str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            text: list[str] = []
            records = [await send_one(client, cfg, request_body(cfg, prompt), lambda: 0.0, 0.0,
                                      text if i == 1 else None) for i in range(2)]
            return records, text

    records, text = asyncio.run(twice())
    plain = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": prompt.prompt, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}).json()
    assert "".join(text) == plain["choices"][0]["text"]
    assert records[1].cached_tokens > 0
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == records[1].cached_tokens


@pytest.fixture(scope="module")
def long_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A tiny model with room for the agentic sessions' growing conversations (bytes as
    tokens)."""
    from tests.tiny import save_tiny_model

    folder = save_tiny_model(tmp_path_factory.mktemp("long-model"), max_position_embeddings=8192)
    proc = ServerProcess(folder, tmp_path_factory.mktemp("long-log"), "--max-model-len", "8192",
                         "--num-kv-blocks", "2048", "--block-size", "16")
    yield proc
    assert proc.stop() == 0, proc.log()


def test_agentic_sessions_run_closed_loop_turn_after_turn(long_server: ServerProcess,
                                                          tmp_path: Path) -> None:
    """`--dataset agentic`: each session's turns follow each other with the tools and their
    results in the conversation. A grammar makes the tiny model call a tool every turn, so
    every session runs its turns out and each turn's prompt is longer than the last."""
    from braid.bench.agentic import sessions
    from braid.bench.loadgen import run_sessions

    server = long_server
    call = r'\{"name": "get_weather", "arguments": \{"city": "Oslo", "date": "2026-07-0[1-9]"\}\}'
    cfg = LoadConfig(base_url=server.url, model=server.model, max_concurrency=2,
                     max_output_len=128, progress=False,
                     extra_body={"structured_outputs": {"regex": call}})
    made = sessions(3, max_turns=3)
    records, duration = asyncio.run(run_sessions(cfg, made))
    assert len(records) == 9 and all(r.success for r in records) and duration > 0
    assert all(len(s.replies) == 3 and s.num_calls == 3 for s in made)
    assert [m["role"] for m in made[0].messages][-2:] == ["assistant", "tool"]
    prompts = sorted(r.prompt_tokens for r in records)
    assert prompts[-1] > prompts[0]
    out = tmp_path / "agentic.json"
    from braid.cli import main

    code = main(["bench", "serve", "--base-url", server.url, "--model", server.model,
                 "--dataset", "agentic", "--num-prompts", "2", "--max-concurrency", "1",
                 "--max-output-len", "8", "--no-progress", "--result-json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["config"]["dataset"] == "agentic"
    assert result["completed"] == result["config"]["turns"] >= 2


def test_agentic_needs_the_chat_endpoint_and_is_not_swept(capsys) -> None:
    from braid.cli import main

    for argv in (["serve", "--endpoint", "completions"], ["sweep"]):
        with pytest.raises(SystemExit):
            main(["bench", *argv, "--model", "m", "--dataset", "agentic"])
        assert "--dataset agentic:" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_extraction_answers_follow_the_schema_on_both_endpoints(long_server: ServerProcess,
                                                                endpoint: str) -> None:
    """`--dataset extraction`: every request carries the schema (response_format on chat,
    structured_outputs on completions) and the server holds the answer to it: a JSON object
    whose first key is the schema's first property."""
    import httpx

    from braid.bench.datasets import EXTRACTION_SCHEMA, load_prompts
    from braid.bench.loadgen import send_one
    from braid.bench.metrics import RequestRecord

    server = long_server
    cfg = LoadConfig(server.url, server.model, endpoint=endpoint, max_output_len=64,
                     progress=False)
    prompts = load_prompts("extraction", 2)
    assert all(p.schema == EXTRACTION_SCHEMA and "```python" in p.prompt for p in prompts)

    async def answers() -> list[tuple[RequestRecord, str]]:
        out = []
        async with httpx.AsyncClient(timeout=120) as client:
            for p in prompts:
                text: list[str] = []
                record = await send_one(client, cfg, request_body(cfg, p), time.perf_counter,
                                        time.perf_counter(), text)
                out.append((record, "".join(text)))
        return out

    for record, text in asyncio.run(answers()):
        assert record.success, record.error
        assert re.match(r'\{\s*"name"\s*:', text), text
