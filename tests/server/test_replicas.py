"""Replicas in-process, over scripted fake engines: routing, a replica's death (what it had
answered fails, what it had not goes elsewhere), its restart, and the metrics' labels."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from braid.bench.server_process import child_pids
from braid.engine.process import EngineDied
from braid.engine.router import PrefixAwareRouter, RoundRobinRouter
from braid.outputs import RequestOutput
from braid.sampling_params import SamplingParams
from braid.server.engine_loop import OutputQueue, RequestFailed
from braid.server.metrics import ServerMetrics
from braid.server.replicas import Replicas
from tests.server.conftest import ENGINE_FLAGS, ServerProcess
from tests.server.metrics_util import scrape
from tests.server.test_engine_loop import FakeEngine

HOLD = [7, 7]  # a prompt whose request waits (no output) on replica 0's first engine


class MortalEngine(FakeEngine):
    """FakeEngine whose requests with prompt HOLD stay waiting, and that dies on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = threading.Event()
        self.served: list[str] = []  # request ids added
        self.holds = False  # HOLD's requests wait

    def add_requests(self, requests: list[tuple]) -> list[Exception | None]:
        self._alive()  # the call itself fails, as a pipe to a dead process does
        self.served += [r[0] for r in requests]
        return super().add_requests(requests)

    def step(self) -> list[RequestOutput]:
        self._alive()
        time.sleep(0.005)
        held = {r: v for r, v in self.requests.items() if v[0] == HOLD and self.holds}
        for request_id in held:
            del self.requests[request_id]
        try:
            return super().step()
        finally:
            self.requests.update(held)

    def log_idle_stats(self) -> None:
        self._alive()

    def _alive(self) -> None:
        if self.dead.is_set():
            raise EngineDied("the engine process ended (exit code -9)")

    def shutdown(self, timeout: float = 10.0) -> None:
        pass


class Cluster:
    def __init__(self, router: object, size: int = 2) -> None:
        self.engines = [MortalEngine() for _ in range(size)]
        self.engines[0].holds = True
        self.started: list[int] = []
        self.metrics = ServerMetrics("m", replica=0)
        self.replicas = Replicas(list(self.engines), router, self.metrics,  # type: ignore[arg-type]
                                 self._start)

    def _start(self, index: int) -> MortalEngine:
        engine = MortalEngine()
        self.started.append(index)
        self.engines[index] = engine
        return engine


async def _final(out: OutputQueue, request_id: str) -> RequestOutput | RequestFailed:
    while True:
        item = await asyncio.wait_for(out.get(), timeout=10)
        if item.request_id == request_id and (isinstance(item, RequestFailed) or item.finished):
            return item


async def _send(replicas: Replicas, request_id: str, prompt: list[int]) -> OutputQueue:
    out: OutputQueue = asyncio.Queue()
    [error] = await replicas.add_all([(request_id, prompt, SamplingParams())], out)
    assert error is None
    return out


async def _until(condition: object, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_a_dead_replica_fails_what_it_answered_and_its_waiting_requests_move() -> None:
    cluster = Cluster(RoundRobinRouter(2, 4))

    async def main() -> tuple:
        replicas = cluster.replicas
        replicas.start()
        try:
            doomed = cluster.engines[0]
            held = await _send(replicas, "held", HOLD)  # replica 0: waits, no output
            other = await _send(replicas, "other", [2])  # replica 1
            await _final(other, "other")
            long = await _send(replicas, "long", HOLD)  # replica 0 again
            # replica 0 answers "long" once: it started, it cannot move
            doomed.requests["long"] = ([1], [])
            await _until(lambda: "long" not in replicas.replicas[0].front._unanswered)
            doomed.requests["long"] = ([1], [97])  # one token out, two to go
            doomed.dead.set()
            results = await _final(held, "held"), await _final(long, "long")
            await _until(lambda: replicas.replicas[0].front is not None)
            after = [await _final(await _send(replicas, f"after{i}", [3]), f"after{i}")
                     for i in range(2)]
            return results, after
        finally:
            await asyncio.to_thread(replicas.stop)

    (held, long), after = asyncio.run(main())
    assert isinstance(held, RequestOutput) and held.finished  # rerouted to replica 1
    assert "held" in cluster.engines[1].served
    assert isinstance(long, RequestFailed) and isinstance(long.error, EngineDied)
    assert cluster.started == [0]  # started again
    assert all(isinstance(a, RequestOutput) and a.finished for a in after)
    assert {"after0", "after1"} & set(cluster.engines[0].served)  # it takes requests again


def test_a_replica_that_died_idle_is_noticed_and_requests_go_elsewhere() -> None:
    cluster = Cluster(RoundRobinRouter(2, 4))

    async def main() -> list:
        replicas = cluster.replicas
        replicas.start()
        try:
            cluster.engines[0].dead.set()
            return [await _final(await _send(replicas, f"r{i}", [1]), f"r{i}")
                    for i in range(4)]
        finally:
            await asyncio.to_thread(replicas.stop)

    results = asyncio.run(main())
    assert all(isinstance(r, RequestOutput) and r.finished for r in results)


def test_prompts_follow_their_prefix_and_metrics_name_the_replica() -> None:
    cluster = Cluster(PrefixAwareRouter(2, 4, capacity_blocks=100))
    prefix = list(range(100, 132))

    async def main() -> None:
        replicas = cluster.replicas
        replicas.start()
        try:
            for i in range(4):
                await _final(await _send(replicas, f"p{i}", [*prefix, i]), f"p{i}")
        finally:
            await asyncio.to_thread(replicas.stop)

    asyncio.run(main())
    served = [set(e.served) for e in cluster.engines]
    assert {"p0", "p1", "p2", "p3"} in served
    text = cluster.metrics.exposition().decode()
    assert 'braid:router_requests_total{model_name="m",reason="prefix",replica="' in text
    assert 'braid:generation_tokens_total{model_name="m",replica="1"}' in text


# ---- real servers: `braid serve --data-parallel-size 2` over the tiny model ----------------


def _completion(url: str, prompt: str, **fields: object) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **fields}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _texts(url: str, prompts: list[str], **fields: object) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _completion(url, p, **fields), prompts))
    return [a["choices"][0]["text"] for a in answers]


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[str | None, str | None]:
    """A long stream; its finish reason and the error event's message, if one came."""
    body = {"prompt": f"story number {i} " * 3, "max_tokens": 150, "temperature": 0,
            "ignore_eos": True, "stream": True}
    finish, error = None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                else:
                    finish = event["choices"][0]["finish_reason"] or finish
    return finish, error


def _kill_one_mid_stream(url: str, pids: Callable[[], list[int]]) -> list:
    """Four long streams over two replicas; one replica's engine is killed under them."""
    async def main() -> list:
        async with httpx.AsyncClient(timeout=120) as client:
            names = [f"braid:generation_tokens_total{{replica={i}}}" for i in range(2)]
            before = scrape(url)
            streams = [asyncio.create_task(_stream(client, url, i)) for i in range(4)]
            deadline = time.monotonic() + 30
            while min(scrape(url).get(n, 0) - before.get(n, 0)
                      for n in names) < 8:  # both answered: none of their streams can move
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            os.kill(pids()[0], signal.SIGKILL)
            return await asyncio.gather(*streams)

    return asyncio.run(main())


def _check_one_replica_failed(results: list, server: ServerProcess) -> None:
    failed = [r for r in results if r[1] is not None]
    assert len(failed) == 2, results  # least loaded: two streams on each replica
    assert all("EngineDied" in error for _, error in failed), failed
    assert all(finish == "length" for finish, error in results if error is None), results
    deadline = time.monotonic() + 60
    while "is back" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    assert httpx.get(f"{server.url}/health").status_code == 200
    _texts(server.url, [f"after {i}" for i in range(4)])  # both take requests again


PROMPTS = [f"request {i}: tell me about the number {i * 37}" for i in range(6)]


@pytest.fixture(scope="module")
def replicas_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("replicas"), *ENGINE_FLAGS,
                         "--data-parallel-size", "2")
    yield proc
    assert proc.stop() == 0, proc.log()


def test_two_replicas_answer_as_one_engine(server: ServerProcess,
                                           replicas_server: ServerProcess) -> None:
    for fields in ({}, {"temperature": 0.8, "seed": 7}):
        assert _texts(replicas_server.url, PROMPTS, **fields) == _texts(server.url, PROMPTS,
                                                                        **fields)
    values = scrape(replicas_server.url)
    routed = [values.get(f"braid:router_requests_total{{reason=least_loaded,replica={i}}}", 0)
              for i in range(2)]
    assert min(routed) > 0, routed  # the load was shared


def test_a_shared_prefix_is_routed_to_the_replica_that_caches_it(
        replicas_server: ServerProcess) -> None:
    url = replicas_server.url
    before = scrape(url)
    system = "You are a careful assistant who answers in one short line. " * 2
    for i in range(4):
        _completion(url, f"{system}Question {i}?")
    after = scrape(url)
    prefix = sum(after.get(f"braid:router_requests_total{{reason=prefix,replica={i}}}", 0)
                 - before.get(f"braid:router_requests_total{{reason=prefix,replica={i}}}", 0)
                 for i in range(2))
    assert prefix == 3
    hits = after["braid:prefix_cache_hits_total"] - before.get("braid:prefix_cache_hits_total", 0)
    assert hits >= 3 * 40, hits


def test_a_replica_killed_mid_stream_fails_only_its_requests_and_restarts(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("replica-dies"),
                           *ENGINE_FLAGS, "--data-parallel-size", "2")
    try:
        results = _kill_one_mid_stream(server.url, lambda: _engine_pids(server))
        _check_one_replica_failed(results, server)
        assert len(_engine_pids(server)) == 2
        # both at once: 503s that say when to retry until one is back, then answers
        for pid in _engine_pids(server):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert "being started again" in r.json()["error"]["message"]
        while httpx.get(f"{server.url}/health").status_code != 200:
            assert time.monotonic() < deadline + 60, server.log()
            time.sleep(0.2)
        _texts(server.url, ["after both"])
    finally:
        assert server.stop() == 0, server.log()


def _engine_pids(server: ServerProcess) -> list[int]:
    return [pid for pid in child_pids(server.proc.pid)
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]


def test_ray_replicas_answer_as_one_engine_and_survive_a_killed_actor(
        server: ServerProcess, tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A local Ray cluster (the server starts one where `ray start` made none): replicas as
    actors, the same answers, and an actor's death handled as a process's."""
    ray_server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("ray"), *ENGINE_FLAGS,
                               "--data-parallel-size", "2",
                               "--distributed-executor-backend", "ray", timeout_s=180)
    try:
        assert _texts(ray_server.url, PROMPTS) == _texts(server.url, PROMPTS)
        results = _kill_one_mid_stream(ray_server.url, lambda: _actor_pids(ray_server))
        _check_one_replica_failed(results, ray_server)
    finally:
        assert ray_server.stop() == 0, ray_server.log()


def _actor_pids(server: ServerProcess, kind: bytes = b"ray::_EngineActor") -> list[int]:
    """The server's actors of `kind` (under the Ray cluster it started): its replicas'."""
    found, parents = [], [server.proc.pid]
    while parents:
        for pid in child_pids(parents.pop()):
            parents.append(pid)
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(kind):
                    found.append(pid)
    return sorted(found)


def test_pipeline_replicas_answer_as_one_process_restart_on_a_lost_stage_and_end_it(
        server: ServerProcess, tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--pipeline-parallel-size 2` behind the server, two replicas: each engine process
    starts its second stage, the answers are one process's; a stage killed mid-stream breaks
    its pipeline, its engine ends and is started again (it failed only what it answered);
    SIGTERM ends every process."""
    staged = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("pipeline"), *ENGINE_FLAGS,
                           "--pipeline-parallel-size", "2", "--data-parallel-size", "2")
    try:
        engines = _engine_pids(staged)
        assert len(engines) == 2 and len(_stage_pids(engines)) == 2
        assert _texts(staged.url, PROMPTS) == _texts(server.url, PROMPTS)
        results = _kill_one_mid_stream(staged.url, lambda: _stage_pids(engines))
        _check_one_replica_failed(results, staged)
        assert "the engine's executor broke" in staged.log_path.read_text(errors="replace")
        engines = _engine_pids(staged)
        stages = _stage_pids(engines)
        assert len(engines) == 2 and len(stages) == 2
    finally:
        assert staged.stop() == 0, staged.log()
    assert not any(Path(f"/proc/{pid}").exists() for pid in engines + stages)


def _stage_pids(engines: list[int]) -> list[int]:
    return [pid for engine in engines for pid in child_pids(engine)
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]


def test_a_ray_engine_runs_its_pipeline_stages_as_actors(
        server: ServerProcess, tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """`--distributed-executor-backend ray --pipeline-parallel-size 2`: the engine's actor
    starts its stage as an actor of its own (a thread each: the local cluster has this
    machine's 2 CPUs); one process's answers; SIGTERM ends both."""
    staged = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("ray-pipeline"),
                           *ENGINE_FLAGS, "--pipeline-parallel-size", "2", "--num-threads", "1",
                           "--distributed-executor-backend", "ray", timeout_s=180)
    try:
        assert len(_actor_pids(staged, b"ray::_StageActor")) == 1
        assert _texts(staged.url, PROMPTS) == _texts(server.url, PROMPTS)
    finally:
        assert staged.stop() == 0, staged.log()
