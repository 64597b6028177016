"""Overload (503 + Retry-After, then recovery) and SIGTERM (drain, exit 0), each on its own
server: both need a server in a particular state."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ENGINE_FLAGS, ServerProcess


def _long_completion(url: str, model: str, max_tokens: int) -> httpx.Response:
    body = {"model": model, "prompt": "busy", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_overload_returns_503_then_recovers(tiny_model_dir: Path,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("overload"), *ENGINE_FLAGS,
                           "--max-num-seqs", "1", "--max-waiting-requests", "2")
    try:
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(
                lambda _: _long_completion(server.url, server.model, 40), range(8)))
        rejected = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert len(rejected) + len(served) == 8, [r.text for r in responses]
        assert rejected and len(served) >= 2
        assert int(rejected[0].headers["retry-after"]) >= 1
        assert rejected[0].json()["error"]["type"] == "service_unavailable_error"
        assert all(r.json()["usage"]["completion_tokens"] == 40 for r in served)
        assert _long_completion(server.url, server.model, 4).status_code == 200
    finally:
        assert server.stop() == 0, server.log()


def test_sigterm_drains_in_flight_stream_and_exits_0(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("sigterm"), *ENGINE_FLAGS,
                           "--shutdown-timeout", "60")
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": server.model, "prompt": "drain me", "max_tokens": 120,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(30), server.log()
        server.terminate()
        refused = _new_connections_refused(server.url, reader)
        reader.join(60)
        assert server.proc.wait(60) == 0, server.log()
    finally:
        server.stop()
    assert not reader.is_alive()
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 120
    assert refused, "a new connection was accepted while draining"


def _new_connections_refused(url: str, reader: threading.Thread) -> bool:
    """While the in-flight stream drains, new connections must fail (bounded polling)."""
    deadline = time.monotonic() + 10
    while reader.is_alive() and time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.TransportError:
            return True
        time.sleep(0.05)
    return False
