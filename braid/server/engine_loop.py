"""The engine's background thread and the asyncio bridge to it.

One thread owns the `LLMEngine` and is the only code that touches it. Handlers on the event
loop send it commands through a thread-safe queue (add, abort, stop), applied between steps;
the thread hands outputs back with one `loop.call_soon_threadsafe` per step, which puts them
on each HTTP request's asyncio queue. Neither side ever waits for the other: the queues are
unbounded and the thread blocks only when it has no work at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from braid import heap
from braid.core.stats import EngineStats
from braid.engine.process import IDLE_WAKEUP, EngineDied
from braid.outputs import RequestOutput
from braid.sampling_params import SamplingParams
from braid.server.metrics import ServerMetrics
from braid.spec_decode.speculator import SpeculatorFigures

logger = logging.getLogger("braid.server")



class EngineLike(Protocol):
    """What the loop needs of `LLMEngine` (tests drive the loop with a fake)."""

    def add_requests(self, requests: list[tuple]) -> list[Exception | None]: ...
    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput | None]: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def stats(self) -> EngineStats: ...
    def speculation_figures(self) -> SpeculatorFigures | None: ...
    def log_idle_stats(self) -> None: ...


@dataclass(slots=True)
class RequestFailed:
    """Delivered instead of an output when the engine failed this request."""

    request_id: str
    error: BaseException


class ShuttingDown(RuntimeError):
    """Why requests still in flight at the shutdown deadline fail."""


Delivery = RequestOutput | RequestFailed
OutputQueue = asyncio.Queue[Delivery]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    queue: OutputQueue
    admitted: asyncio.Future[None]
    priority: int = 0
    group: str | None = None
    rerouted: bool = False  # moved from a replica that died after admitting it


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Stop:
    pass


@dataclass(slots=True)
class _FailAll:
    error: BaseException


_Command = _Add | _Abort | _Stop | _FailAll


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Load figures published by the engine thread after every iteration."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_used_blocks: int = 0
    num_adds: int = 0  # requests the engine thread has added (or refused) so far


# Called on the engine thread when the engine died, with the requests it never answered
# (added but without output yet, or not yet added): the replicas route them elsewhere.
OnDeath = Callable[[list[_Add]], None]


class AsyncEngine:
    down_message = "the engine is not running; the server needs a restart"
    retry_after_s: int | None = None  # nothing starts it again: no Retry-After

    def __init__(self, engine: EngineLike, metrics: ServerMetrics | None = None,
                 log_requests: bool = False, on_death: OnDeath | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_requests = log_requests  # --enable-log-requests: a line as each one ends
        self.on_death = on_death
        self.snapshot = EngineSnapshot()
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._queues: dict[str, OutputQueue] = {}  # engine thread only
        self._unanswered: dict[str, _Add] = {}  # added, no output yet (engine thread only)
        self._left: list[_Command] = []  # taken from the inbox, not yet applied
        self._num_sent = 0  # requests sent to the engine thread so far (event loop only)
        self._num_applied = 0  # of those, added or refused so far (engine thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side --------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="braid-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, end the thread (blocking: call it after the server drained)."""
        self._inbox.put(_Stop())
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def load(self) -> int:
        """Requests in flight: running, waiting, and sent but not yet added."""
        return self.snapshot.num_running + self.num_waiting

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the engine plus those sent but not yet added. The snapshot
        counts both, so a request is never counted twice: it used to count as sent until
        its handler resumed, after the snapshot already had it waiting (a burst within the
        limit got 503s reporting more requests than there were)."""
        s = self.snapshot
        return s.num_waiting + self._num_sent - s.num_adds

    def add_all(self, requests: list[tuple[str, list[int], SamplingParams]], out: OutputQueue,
                arrival_time: float | None = None, priority: int = 0, group: str | None = None,
                abort: Callable[[str], None] | None = None
                ) -> Awaitable[list[BaseException | None]]:
        """Add requests (id, prompt ids, params) whose outputs go to `out`. They count in
        `num_waiting` from this call on (not from the first await), so a caller that checked
        the waiting limit just before cannot be overtaken. `group`: the API request they make
        up (the scheduler shares decode rows fairly between groups). The result holds, per request,
        None or what `engine.add_request` raised."""
        assert self._loop is not None, "start() first"
        if not self.is_alive:
            raise RuntimeError("the engine loop is not running")
        arrival = arrival_time or time.monotonic()
        futures = []
        for request_id, prompt, params in requests:
            admitted: asyncio.Future[None] = self._loop.create_future()
            self._inbox.put(_Add(request_id, prompt, params, arrival, out, admitted, priority,
                                 group))
            futures.append(admitted)
        self._num_sent += len(requests)
        return self._await_admission([r[0] for r in requests], futures, abort or self.abort)

    def left_behind(self) -> tuple[list[_Add], list[str]]:
        """After the engine died: the adds and aborts sent to it since its thread last
        looked (event loop only)."""
        adds, aborts = [], []
        for command in self._take_commands(block=False):
            if isinstance(command, _Add):
                adds.append(command)
            elif isinstance(command, _Abort):
                aborts.append(command.request_id)
        return adds, aborts

    def resubmit(self, adds: list[_Add]) -> None:
        """Requests another replica's engine took and never answered (event loop only)."""
        for add in adds:
            self._inbox.put(add)
        self._num_sent += len(adds)

    def record_admitted(self, num_prompts: int, n: int, max_tokens: list[int]) -> None:
        if self.metrics is not None:
            self.metrics.record_admitted(num_prompts, n, max_tokens)

    async def _await_admission(self, request_ids: list[str],
                               futures: list[asyncio.Future[None]],
                               abort: Callable[[str], None]) -> list[BaseException | None]:
        """`abort`: how a cancelled handler's requests are aborted (the replicas': a request
        may have moved to another replica meanwhile)."""
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            for request_id in request_ids:
                abort(request_id)  # applied after the adds: the inbox is FIFO
            raise
        return [r if isinstance(r, BaseException) else None for r in results]

    def fail_all(self, error: BaseException) -> None:
        """Fail and abort every request in the engine with `error` (the shutdown deadline)."""
        self._inbox.put(_FailAll(error))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    # ---- engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as e:
            died = isinstance(e, EngineDied)
            logger.exception("the engine %s; failing its requests",
                             "died" if died else "loop crashed")
            self._give_up(e if died else RuntimeError("the engine loop crashed"))
            if not died:
                raise

    def _give_up(self, error: BaseException) -> None:
        """The engine is gone: its unanswered requests go to `on_death` (or fail), the rest
        fail with `error`."""
        unanswered = list(self._unanswered.values())
        aborted = set()
        for command in [*self._left, *self._take_commands(block=False)]:
            if isinstance(command, _Add):
                unanswered.append(command)
            elif isinstance(command, _Abort):
                aborted.add(command.request_id)
        unanswered = [a for a in unanswered if a.request_id not in aborted]
        if self.on_death is not None:
            for add in unanswered:
                self._queues.pop(add.request_id, None)
            self.on_death(unanswered)
        else:
            self._call_soon(_settle_all, [(a.admitted, error) for a in unanswered])
        for request_id in list(self._queues):
            self._deliver_failure(request_id, error)

    def _loop_forever(self) -> None:
        worked = False  # since the heap was last trimmed
        while True:
            idle = not self.engine.has_unfinished_requests()
            if not self._apply(self._take_commands(block=idle)):
                return
            if self.engine.has_unfinished_requests():
                self._step()
                worked = True
            else:  # the stats line of the work that just ended, once its interval is up
                self.engine.log_idle_stats()
                if worked:
                    heap.trim()
                    worked = False
            self._publish()

    def _take_commands(self, block: bool) -> list[_Command]:
        """The commands sent so far; `block`: wait for one (or for a second to pass, so an
        idle engine still writes its last stats line)."""
        commands = []
        if block:
            with contextlib.suppress(queue.Empty):
                commands.append(self._inbox.get(timeout=IDLE_WAKEUP))
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[_Command]) -> bool:
        """Apply commands in order; False once asked to stop. Admissions are settled after
        the snapshot counts the new requests, so `num_waiting` never misses them. Until a
        command is applied it stays in `_left`: where the engine dies meanwhile, the adds
        there are among those it never answered."""
        settled: list[tuple[asyncio.Future[None], BaseException | None]] = []
        running = True
        self._left = commands
        try:
            # runs of adds and of aborts go to the engine as one call each (one message for
            # an engine in its own process)
            while self._left and running:
                kind = type(self._left[0])
                n = next((i for i, c in enumerate(self._left) if type(c) is not kind),
                         len(self._left))
                settled += self._apply_run(kind, self._left[:n])
                running = kind is not _Stop
                self._left = self._left[n:]
            self._publish()
        finally:
            if settled:
                self._call_soon(_settle_all, settled)
        return running

    def _apply_run(self, kind: type, run: list[_Command]
                   ) -> list[tuple[asyncio.Future[None], BaseException | None]]:
        """Apply a run of commands of one kind; the admissions it settles."""
        if kind is _Add:
            adds = [c for c in run if isinstance(c, _Add)]
            errors = self._add(adds)
            self._num_applied += len(adds)
            return list(zip([a.admitted for a in adds], errors, strict=True))
        if kind is _Abort:
            self._abort([c.request_id for c in run if isinstance(c, _Abort)])
        elif kind is _FailAll:
            for c in run:
                if isinstance(c, _FailAll):
                    self._abort_all(c.error)
        else:
            self._abort_all(ShuttingDown("server shutting down"))
        return []

    def _add(self, adds: list[_Add]) -> list[BaseException | None]:
        """Add each; per request None or its error (reported to its handler only)."""
        try:
            errors: list[BaseException | None] = list(self.engine.add_requests([
                (a.request_id, a.prompt, a.params, a.arrival_time, a.priority, a.group)
                for a in adds]))
        except EngineDied:
            raise  # the requests go to `on_death` with the rest (they are still in `_left`)
        except Exception as e:  # the call itself failed: each request's
            errors = [e] * len(adds)
        for add, error in zip(adds, errors, strict=True):
            if error is None:
                self._queues[add.request_id] = add.queue
                self._unanswered[add.request_id] = add
            elif add.rerouted:  # its handler was told it was admitted: it waits for outputs
                self._call_soon(_put_all, [(add.queue, RequestFailed(add.request_id, error))])
        return errors

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._queues.pop(request_id, None)
            self._unanswered.pop(request_id, None)
        try:
            outs = self.engine.abort_requests(request_ids)
        except EngineDied:
            raise
        except Exception:
            logger.exception("aborting requests %s failed", request_ids)
            return
        for request_id, out in zip(request_ids, outs, strict=True):
            if out is not None and self.log_requests:
                _log_finished(out, "aborted")
            if self.metrics is not None:
                self.metrics.forget(request_id)
                if out is not None:
                    self.metrics.record_finished(out)

    def _abort_all(self, error: BaseException) -> None:
        request_ids = list(self._queues)
        for request_id in request_ids:
            self._deliver_failure(request_id, error)
        self._abort(request_ids)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDied:
            raise  # nothing left to serve with: the loop ends, /health says so
        except Exception as e:
            # The step mixes every scheduled request in one forward, so it cannot be pinned
            # on one of them: fail the requests in the engine, keep serving new ones.
            logger.exception("engine step failed; failing %d request(s)", len(self._queues))
            self._abort_all(e)
            return
        if self.metrics is not None:
            self.metrics.record_outputs(outputs)
            self.metrics.record_stats(self.engine.stats, self.engine.speculation_figures())
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            self._unanswered.pop(out.request_id, None)
            if out.finished and self.log_requests:
                _log_finished(out, "finished")
            target = (self._queues.pop(out.request_id, None) if out.finished
                      else self._queues.get(out.request_id))
            if target is not None:
                batch.append((target, out))
        if batch:
            self._call_soon(_put_all, batch)

    def _deliver_failure(self, request_id: str, error: BaseException) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            self._call_soon(_put_all, [(target, RequestFailed(request_id, error))])

    def _publish(self) -> None:
        engine = self.engine
        self.snapshot = EngineSnapshot(
            num_running=engine.num_running, num_waiting=engine.num_waiting,
            kv_usage=engine.kv_usage, num_used_blocks=engine.num_used_blocks,
            num_adds=self._num_applied)
        if self.metrics is not None:
            s = self.snapshot
            self.metrics.set_load(s.num_running, s.num_waiting, s.kv_usage)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # A closed event loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)


def _settle_all(settled: list[tuple[asyncio.Future[None], BaseException | None]]) -> None:
    for future, error in settled:
        if future.done():  # the handler was cancelled meanwhile
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _put_all(batch: list[tuple[OutputQueue, Delivery]]) -> None:
    for target, item in batch:
        target.put_nowait(item)


def _log_finished(out: RequestOutput, how: str) -> None:
    """--enable-log-requests' line as a request leaves the engine."""
    c = out.outputs[0]
    m = out.metrics
    seconds = (m.finish_time or time.monotonic()) - m.arrival_time
    logger.info("%s request %s: %s, %d prompt + %d generated tokens in %.2f s%s",
                how.capitalize(), out.request_id, c.finish_reason, len(out.prompt_token_ids),
                len(c.token_ids), seconds,
                f", speculation {m.spec_stats}" if m.spec_stats else "")
