"""The engine as a Ray actor, on whichever node of the cluster has the CPUs it asks for.

`RayEngine` is `EngineProcess` with Ray's actor calls where the pipes were: the actor runs
the same `EngineSide` loop (steps on its own while it has work, reads calls between steps)
in a thread, `call` puts a call in its inbox and `receive` hands over every message of its
outbox (waiting up to a second for one). The client waits for each `call` to be queued
before the next: Ray does not keep a threaded actor's calls in order. Joining the cluster
is `ray.init(address="auto")` where `ray start` ran on this machine, else a local cluster
(docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from typing import Any

from braid.config import EngineConfig
from braid.engine.process import EngineDied, EngineProcess, EngineSide, build_engine
from braid.worker.cluster import join_cluster
from braid.worker.lifetime import exit_on_failure

RECEIVE_WAIT_S = 1.0  # how long one `receive` waits for a message before returning none


class _EngineActor:
    """The actor's side (made a Ray actor class in `_actor_class`)."""

    def __init__(self, config: EngineConfig, label: str | None) -> None:
        import logging
        import sys

        tag = f"[{label}] " if label else ""
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format=f"%(asctime)s %(levelname)s {tag}%(message)s")
        self.inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        engine, self.first = build_engine(config)
        self.thread: threading.Thread | None = None
        if engine is not None:
            side = EngineSide(engine, self.inbox, self.outbox, server_pid=None)
            self.thread = threading.Thread(target=exit_on_failure,
                                           args=("the engine's loop", side.run),
                                           name="braid-engine", daemon=True)
            self.thread.start()

    def info(self) -> tuple:
        return self.first

    def call(self, message: tuple) -> None:
        self.inbox.put(message)

    def join(self, timeout: float) -> None:
        """Wait for the engine's loop to end (after a stop call)."""
        if self.thread is not None:
            self.thread.join(timeout)

    def receive(self) -> list[tuple]:
        try:
            messages = [self.outbox.get(timeout=RECEIVE_WAIT_S)]
        except queue.Empty:
            return []
        with contextlib.suppress(queue.Empty):
            while True:
                messages.append(self.outbox.get_nowait())
        return messages


def _actor_class() -> Any:
    import ray

    return ray.remote(_EngineActor)


class RayEngine(EngineProcess):
    def __init__(self, config: EngineConfig, label: str | None = None) -> None:
        ray = join_cluster()
        self._ray = ray
        self._pending: deque[tuple] = deque()
        # threads: its torch threads, the calls' and receives' (max_concurrency)
        self._actor = _actor_class().options(
            num_cpus=config.threads, max_concurrency=4, name=None).remote(config, label)
        try:
            self._pending.append(self._ray_get(self._actor.info.remote()))
            self._start()
        except BaseException:  # its load failed: the actor goes with it
            self.kill()
            raise

    def shutdown(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(Exception):  # the loop ends, the engine's shutdown with it
            self._ray_get(self._actor.call.remote(("stop",)), timeout)
            self._ray_get(self._actor.join.remote(timeout), timeout + 5)
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self._ray.kill(self._actor)

    def log_idle_stats(self) -> None:
        """Nothing: a dead actor is noticed at the next call."""

    def _put(self, message: tuple) -> None:
        self._ray_get(self._actor.call.remote(message))

    def _has_message(self) -> bool:
        return bool(self._pending)

    def _get(self) -> tuple:
        while not self._pending:
            self._pending.extend(self._ray_get(self._actor.receive.remote()))
        return self._pending.popleft()

    def _ray_get(self, ref: Any, timeout: float | None = None) -> Any:
        try:
            return self._ray.get(ref, timeout=timeout)
        except self._ray.exceptions.RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise EngineDied(f"the engine's Ray actor died: {first}") from None
