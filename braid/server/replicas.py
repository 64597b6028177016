"""Several engine replicas behind one endpoint (`--data-parallel-size`).

Each replica is an engine of its own (a local process, or a Ray actor on any node of a
cluster) driven by its own `AsyncEngine` thread. `Replicas` offers the server what one
`AsyncEngine` does (add, abort, load, health, shutdown) and routes each prompt of a request
with the router (braid/engine/router.py) by the replicas' loads at that moment.

A replica whose engine dies fails only the requests it had started answering (503 or a
stream's error event); those it had not answered yet go to the other replicas as if they
had been sent there; then it is started again (with back-off while its start fails) and
takes requests once its model is loaded. The router forgets what the dead one cached.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter

from braid.config import EngineConfig
from braid.engine.process import EngineProcess
from braid.engine.router import Route, Router
from braid.sampling_params import SamplingParams
from braid.server.engine_loop import AsyncEngine, OutputQueue, RequestFailed, _Add
from braid.server.metrics import ServerMetrics

logger = logging.getLogger("braid.server")

RESTART_BACKOFF_S = (1.0, 30.0)  # the wait after a failed start: first, and at most
RESTART_JOIN_S = 120.0  # how long a shutdown waits for a replica's start under way

StartEngine = Callable[[int], Any]  # replica index -> its engine (EngineLike, with shutdown)


class Replica:
    def __init__(self, index: int, engine: Any, front: AsyncEngine | None) -> None:
        self.index = index
        self.engine = engine  # the engine client (EngineProcess, RayEngine), to shut down
        self.front = front  # None while down
        self.restarts = 0


class Replicas:
    down_message = "no replica is running (they are being started again); retry later"
    retry_after_s = 5  # a replica's restart loads its model: seconds

    def __init__(self, engines: list[Any], router: Router, metrics: ServerMetrics,
                 start_engine: StartEngine, log_requests: bool = False) -> None:
        self.router, self.metrics = router, metrics
        self.start_engine, self.log_requests = start_engine, log_requests
        self.replicas = [Replica(i, e, None) for i, e in enumerate(engines)]
        self.routed = metrics.family(
            Counter, "braid:router_requests", "Engine requests routed, by replica and by "
            "why (prefix: the replica held the most of its prompt; load: the replicas were "
            "imbalanced; least_loaded; round_robin; rerouted: its replica died first)",
            ["model_name", "replica", "reason"])
        self.prefix_blocks = metrics.family(
            Counter, "braid:router_prefix_matched_blocks", "Prompt blocks the chosen "
            "replica held by the router's record, summed over routed prompts",
            ["model_name", "replica"])
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._restarts: list[threading.Thread] = []

    # ---- what the server calls (event loop) ---------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for replica in self.replicas:
            self._bring_up(replica, replica.engine)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and end every replica's thread (blocking, after the drain)."""
        self._stopping = True
        for replica in self.replicas:
            if replica.front is not None:
                replica.front.stop(timeout)

    def shutdown(self) -> None:
        """End the engines (after `stop`), once the starts under way have ended."""
        self._stopping = True
        for thread in self._restarts:
            thread.join(RESTART_JOIN_S)
        for replica in self.replicas:
            replica.engine.shutdown()

    @property
    def is_alive(self) -> bool:
        """At least one replica takes requests."""
        return any(f.is_alive for f in self._fronts())

    @property
    def num_waiting(self) -> int:
        return sum(f.num_waiting for f in self._fronts())

    def add_all(self, requests: list[tuple[str, list[int], SamplingParams]], out: OutputQueue,
                arrival_time: float | None = None, priority: int = 0, group: str | None = None
                ) -> Awaitable[list[BaseException | None]]:
        """As `AsyncEngine.add_all`; each prompt (its n choices together) is routed."""
        arrival = arrival_time or time.monotonic()
        parts = []
        for run in _by_prompt(requests):
            front = self._route(run[0][1], len(run))
            parts.append(front.add_all(run, out, arrival, priority, group, abort=self.abort))
        return _joined(parts)

    def abort(self, request_id: str) -> None:
        for front in self._fronts():  # an id a replica does not hold is nothing to it
            front.abort(request_id)

    def fail_all(self, error: BaseException) -> None:
        for front in self._fronts():
            front.fail_all(error)

    def record_admitted(self, num_prompts: int, n: int, max_tokens: list[int]) -> None:
        self.metrics.record_admitted(num_prompts, n, max_tokens)

    # ---- routing --------------------------------------------------------------------------

    def loads(self) -> list[int | None]:
        return [None if r.front is None or not r.front.is_alive else r.front.load
                for r in self.replicas]

    def _route(self, prompt: list[int], count: int) -> AsyncEngine:
        loads = self.loads()
        if all(load is None for load in loads):
            raise RuntimeError("no replica is running")
        route = self.router.route(prompt, loads)
        self._count(route, count)
        front = self.replicas[route.replica].front
        assert front is not None
        return front

    def _count(self, route: Route, count: int) -> None:
        model, replica = self.metrics.model_name, str(route.replica)
        self.routed.labels(model, replica, route.reason).inc(count)
        if route.matched_blocks:
            self.prefix_blocks.labels(model, replica).inc(route.matched_blocks)

    def _fronts(self) -> list[AsyncEngine]:
        return [r.front for r in self.replicas if r.front is not None]

    # ---- a replica's death and restart ------------------------------------------------------

    def _bring_up(self, replica: Replica, engine: Any) -> None:
        """Serve with `engine` from now on (event loop)."""
        replica.engine = engine
        index = replica.index

        front = AsyncEngine(engine, self.metrics.for_replica(index), self.log_requests)

        def died(unanswered: list[_Add]) -> None:  # the replica's engine thread
            self._call_soon(self._on_death, index, front, unanswered)

        front.on_death = died
        replica.front = front
        front.start()

    def _on_death(self, index: int, front: AsyncEngine, unanswered: list[_Add]) -> None:
        replica = self.replicas[index]
        replica.front = None
        self.router.forget(index)
        if front.metrics is not None:
            front.metrics.set_load(0, 0, 0.0)
        # what was sent to it after its thread gave up: aborts apply to the moved requests
        late, aborts = front.left_behind()
        unanswered = [a for a in unanswered + late if a.request_id not in set(aborts)]
        logger.error("replica %d's engine died: %d request(s) it had not answered go to the "
                     "other replicas%s", index, len(unanswered),
                     "" if self._stopping else "; starting it again")
        self._reroute(unanswered)
        if not self._stopping:
            thread = threading.Thread(target=self._restart, args=(replica,), daemon=True,
                                      name=f"braid-restart-{index}")
            self._restarts.append(thread)
            thread.start()

    def _reroute(self, adds: list[_Add]) -> None:
        for add in adds:
            add.rerouted = add.admitted.done()
            loads = self.loads()
            if all(load is None for load in loads):
                _fail(add, RuntimeError("no replica is running"))
                continue
            route = self.router.route(add.prompt, loads)
            self._count(Route(route.replica, "rerouted", route.matched_blocks), 1)
            front = self.replicas[route.replica].front
            assert front is not None
            front.resubmit([add])

    def _restart(self, replica: Replica) -> None:
        """Start the replica's engine again (its own thread: a model load takes a while)."""
        replica.engine.shutdown(timeout=1.0)
        wait = RESTART_BACKOFF_S[0]
        while not self._stopping:
            try:
                engine = self.start_engine(replica.index)
            except Exception:
                logger.exception("replica %d did not start; trying again in %g s",
                                 replica.index, wait)
                time.sleep(wait)
                wait = min(2 * wait, RESTART_BACKOFF_S[1])
                continue
            if self._stopping or not self._call_soon(self._bring_up, replica, engine):
                engine.shutdown()  # the server is going: nobody would end it
                return
            replica.restarts += 1
            logger.info("replica %d is back (restart %d)", replica.index, replica.restarts)
            return

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> bool:
        """False where the event loop closed (the server is gone)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True


def engine_starter(config: EngineConfig, size: int) -> StartEngine:
    """How replica i's engine starts: a local process on its share of this machine's cores
    (`--num-threads` each, by default the cores over the replicas), or a Ray actor asking the
    cluster for that many CPUs."""
    cores = sorted(os.sched_getaffinity(0))
    threads = config.num_threads or max(1, len(cores) // size)
    config = dataclasses.replace(config, num_threads=threads)
    if config.distributed_executor_backend == "ray":
        from braid.engine.ray_engine import RayEngine
        from braid.worker.cluster import join_cluster

        join_cluster()  # once, before the replicas start side by side
        return lambda i: RayEngine(config, label=f"replica {i}")
    share = len(cores) // size if size > 1 else 0  # pinned where each gets its threads' cores

    def start(i: int) -> EngineProcess:
        mine = cores[i * share:(i + 1) * share] if share >= threads else None
        return EngineProcess(config, cores=mine, label=f"replica {i}" if size > 1 else None)

    return start


def start_engines(start: StartEngine, size: int) -> list[Any]:
    """Every replica's engine, loading side by side; where one fails, the others end and
    its error is raised."""
    with concurrent.futures.ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(start, i) for i in range(size)]
        concurrent.futures.wait(futures)
    engines = [f.result() for f in futures if f.exception() is None]
    if len(engines) < size:
        for engine in engines:
            engine.shutdown()
        raise next(e for f in futures if (e := f.exception()) is not None)
    return engines


def _by_prompt(requests: list[tuple[str, list[int], SamplingParams]]
               ) -> list[list[tuple[str, list[int], SamplingParams]]]:
    """Runs of requests of one prompt (a prompt's n choices come one after another)."""
    runs: list[list[tuple[str, list[int], SamplingParams]]] = []
    for request in requests:
        if runs and runs[-1][0][1] is request[1]:
            runs[-1].append(request)
        else:
            runs.append([request])
    return runs


async def _joined(parts: list[Awaitable[list[BaseException | None]]]
                  ) -> list[BaseException | None]:
    results: list[BaseException | None] = []
    for part in await asyncio.gather(*parts):
        results += part
    return results


def _fail(add: _Add, error: BaseException) -> None:
    if add.admitted.done():
        add.queue.put_nowait(RequestFailed(add.request_id, error))
    else:
        add.admitted.set_exception(error)
