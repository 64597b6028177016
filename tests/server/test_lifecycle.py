"""Overload (503 + Retry-After, then recovery) and SIGTERM (drain, exit 0), each on its own
server: both need a server in a particular state."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ENGINE_FLAGS, ServerProcess, engine_pid, tls_flags
from tests.server.metrics_util import wait_until_in_engine


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


def test_a_burst_within_the_waiting_limit_is_always_admitted(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """As many requests at once as may wait, again and again: never a 503. A request used to
    count twice for a moment (sent, and already waiting in the engine's figures), so such a
    burst got 503s that reported more requests waiting than there were."""
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("burst"), *ENGINE_FLAGS,
                           "--max-num-seqs", "2", "--max-waiting-requests", "6")
    try:
        with ThreadPoolExecutor(6) as pool:
            for _ in range(5):
                codes = [r.status_code for r in pool.map(
                    lambda _: _long_completion(server.url, server.model, 3), range(6))]
                assert codes == [200] * 6, codes
                time.sleep(0.3)
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_sigterm_drains_in_flight_streams_and_exits_0(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, tls: bool) -> None:
    """Over TLS too: the streams end whole, and an idle keep-alive connection does not hold
    the exit (asyncio would wait up to 30 s for its TLS goodbye)."""
    # One running at a time: the later streams are still waiting in the engine when SIGTERM
    # comes, so the drain lasts long enough to see new connections refused.
    folder = tmp_path_factory.mktemp("sigterm")
    server = ServerProcess(tiny_model_dir, folder, *ENGINE_FLAGS, "--max-num-seqs", "1",
                           "--shutdown-timeout", "60", *(tls_flags(folder) if tls else []))
    idle = httpx.Client(verify=server.verify)
    assert idle.get(f"{server.url}/health").status_code == 200  # then kept open, idle
    streams = [_Stream(server) for _ in range(4)]
    try:
        for stream in streams:
            stream.thread.start()
        assert streams[0].started.wait(30), server.log()
        wait_until_in_engine(server.url, len(streams), server.log(), done=lambda: sum(
            "data: [DONE]" in s.events for s in streams), verify=server.verify)
        server.terminate()
        refused = _new_connections_refused(server, streams)
        for stream in streams:
            stream.thread.join(60)
        drained = time.monotonic()
        assert server.proc.wait(60) == 0, server.log()
        assert time.monotonic() - drained < 10, server.log()
    finally:
        server.stop()
        idle.close()
    for stream in streams:
        assert not stream.thread.is_alive()
        assert stream.events[-1] == "data: [DONE]", stream.events[-3:]
        usage = json.loads(stream.events[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 200
    assert refused, "a new connection was accepted while draining"


def test_force_quit_ends_every_request_with_an_error_and_no_traceback(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Ctrl+C during the drain (SIGTERM, then SIGINT): the requests still in flight end at
    once, streams with an error event and [DONE], others with a 503, where uvicorn alone cut
    them mid-response and logged a CancelledError traceback each."""
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("force"), *ENGINE_FLAGS,
                           "--max-num-seqs", "1", "--shutdown-timeout", "60")
    streams = [_Stream(server) for _ in range(4)]
    with ThreadPoolExecutor(2) as pool:
        try:
            for stream in streams:
                stream.thread.start()
            plain = [pool.submit(_long_completion, server.url, server.model, 200)
                     for _ in range(2)]
            wait_until_in_engine(server.url, len(streams) + len(plain), server.log(),
                                 done=lambda: sum("data: [DONE]" in s.events for s in streams))
            server.terminate()
            time.sleep(0.2)
            server.proc.send_signal(signal.SIGINT)
            assert server.proc.wait(10) is not None, server.log()
            for stream in streams:
                stream.thread.join(10)
            answers = [f.result(10) for f in plain]
        finally:
            server.stop()
    cut = [s for s in streams if "force quit" in s.events[-2]]
    assert cut, [s.events[-2:] for s in streams]
    for stream in streams:
        assert stream.events[-1] == "data: [DONE]", stream.events[-3:]
    assert all(r.status_code in (200, 503) for r in answers), [r.text for r in answers]
    assert any(r.status_code == 503 and "force quit" in r.text for r in answers)
    assert "Traceback" not in server.log_path.read_text(errors="replace"), server.log()


def test_a_body_still_arriving_at_the_shutdown_deadline_gets_a_503(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Clients that sent half a body when the server was told to stop: at --shutdown-timeout
    each gets a JSON 503 and the server exits, where uvicorn cancelled them a few seconds
    later with a plain-text 500 and a traceback each. Streams in flight still end with their
    error event and [DONE] (their disconnect listeners read the same receive channel)."""
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("halfbody"), *ENGINE_FLAGS,
                           "--max-num-seqs", "1", "--shutdown-timeout", "1")
    streams = [_Stream(server) for _ in range(16)]  # one at a time: seconds in all
    sockets = []
    try:
        for stream in streams:
            stream.thread.start()
        assert streams[0].started.wait(30), server.log()
        # every stream in the engine before the stop (a thread that connects after it is
        # refused, which is not what this test is about)
        wait_until_in_engine(server.url, len(streams), server.log(), done=lambda: sum(
            bool(s.events) and s.events[-1] == "data: [DONE]" for s in streams))
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        for _ in range(3):
            sock = socket.create_connection((host, int(port)), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
            sockets.append(sock)
        time.sleep(0.3)
        server.terminate()
        assert server.proc.wait(30) == 0, server.log()
        for sock in sockets:
            answer = sock.recv(4096).decode()
            assert answer.startswith("HTTP/1.1 503"), answer
            error = json.loads(answer.split("\r\n\r\n", 1)[1])["error"]
            assert error["message"] == "server shutting down (--shutdown-timeout 1 s)"
        for stream in streams:
            stream.thread.join(10)
            assert stream.events[-1] == "data: [DONE]", stream.events[-3:]
        assert any("shutting down" in s.events[-2] for s in streams)
    finally:
        for sock in sockets:
            sock.close()
        server.stop()
    assert "Traceback" not in server.log_path.read_text(errors="replace"), server.log()


class _Stream:
    """A streaming completion read to the end in a thread."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.events: list[str] = []
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._read)

    def _read(self) -> None:
        body = {"model": self.server.model, "prompt": "drain me", "max_tokens": 200,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.server.url}/v1/completions", json=body,
                          timeout=60, verify=self.server.verify) as r:
            for line in r.iter_lines():
                if line:
                    self.events.append(line)
                    self.started.set()


def _new_connections_refused(server: ServerProcess, streams: list[_Stream]) -> bool:
    """While in-flight streams drain, new connections must fail (bounded polling)."""
    deadline = time.monotonic() + 10
    while any(s.thread.is_alive() for s in streams) and time.monotonic() < deadline:
        try:
            httpx.get(f"{server.url}/health", timeout=1, verify=server.verify)
        except httpx.TransportError:
            return True
        time.sleep(0.02)
    return False


def test_the_engine_runs_in_its_own_process_and_its_death_is_reported(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The engine process dies mid-stream: the stream ends with an error event, /health says
    503, a new request gets 503; SIGTERM still ends the server with 0, and no process of it
    is left."""
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("engine-dies"),
                           *ENGINE_FLAGS)
    try:
        engine = engine_pid(server)
        stream = _Stream(server)
        stream.thread.start()
        assert stream.started.wait(30), server.log()
        os.kill(engine, signal.SIGKILL)
        stream.thread.join(30)
        assert stream.events[-1] == "data: [DONE]", stream.events[-3:]
        assert '"error"' in stream.events[-2], stream.events[-3:]
        assert httpx.get(f"{server.url}/health").status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503, r.text
    finally:
        assert server.stop() == 0, server.log()
    assert not Path(f"/proc/{engine}").exists()
