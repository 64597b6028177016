"""The engine in a process of its own, as the server runs it.

The server's process parses, tokenizes, validates and writes requests; its Python shares one
GIL. An engine in the same process needs that GIL back after every torch call of a step, so
a request whose handling is long Python work (a multi-megabyte /tokenize, n choices of
logprobs) slowed every stream's steps several times over. In a process of its own the engine
has its own interpreter and the two share only the cores, which the OS divides fairly.

`EngineProcess` is the server's side: the calls of `LLMEngine` the server's engine loop makes
(braid/server/engine_loop.py's `EngineLike`). The engine's side (`EngineSide`) steps on its
own while it has work, as vLLM's engine core does: it sends each step's outputs unasked and
reads the server's calls (adds and aborts, in batches) between steps, so a server whose
threads are busy delays only its own reading, never the steps. Every message carries the
engine's load figures, so reading them costs no message. Requests, outputs and errors cross
as pickles (plain records; prompt logprobs as `PackedLogprobs`); a RequestError stays one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from braid.config import EngineConfig
from braid.core.stats import EngineStats
from braid.engine.cores import CoreShare, cpu_seconds
from braid.outputs import RequestOutput
from braid.sampling_params import RequestOutputKind, SamplingParams
from braid.spec_decode.speculator import SpeculatorFigures
from braid.worker.lifetime import ExecutorBroken, follow_parent

logger = logging.getLogger("braid")

IDLE_WAKEUP = 1.0  # seconds an idle engine waits for a call before its idle work

# add_request's arguments: request id, prompt, params, arrival time, priority, group
AddArgs = tuple[str, "str | list[int]", SamplingParams, "float | None", int, "str | None"]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server needs to know of the engine it did not build itself."""

    config: EngineConfig  # finalized: max_model_len and the budgets set
    vocab_size: int
    eos_token_ids: frozenset[int]
    default_sampling: dict[str, Any]
    max_tokens_cap: int | None
    max_logprobs: int
    num_kv_blocks: int
    kv_cache_dtype: str
    kv_cache_bytes: int
    clock: tuple[str, float]  # the engine's machine (its boot) and monotonic time when sent


@dataclass(slots=True)
class Load:
    """The engine's figures after each call (what `EngineLike`'s properties read)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_used_blocks: int = 0
    has_unfinished: bool = False
    stats: EngineStats = field(default_factory=lambda: EngineStats(num_kv_blocks=0))
    speculation: SpeculatorFigures | None = None


class EngineDied(RuntimeError):
    """The engine's process ended: every request in it is lost."""


class EngineProcess:
    """The engine in a child process of this machine, reached through two pipes. `cores`:
    the CPUs it may run on (a replica's share); `label`: how its log lines name it."""

    def __init__(self, config: EngineConfig, cores: list[int] | None = None,
                 label: str | None = None) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        # one pipe each way: the engine's side reads calls in a thread of their own, so a
        # large call and a large step's outputs never wait on each other
        calls, self._calls = context.Pipe(duplex=False)
        self._conn, outputs = context.Pipe(duplex=False)
        # not a daemon: a pipeline's stages are its children (it ends with the server all
        # the same: `shutdown`, else its watch of its parent)
        self._process = context.Process(target=_serve, args=(config, calls, outputs, cores,
                                                             label),
                                        name=f"braid-{label or 'engine'}", daemon=False)
        self._process.start()
        calls.close()
        outputs.close()
        self._start()

    def _start(self) -> None:
        """The client's state, once the engine is reachable: its info is the first message."""
        self._steps: deque[tuple[bool, Any]] = deque()  # step messages not yet returned
        self._recent: deque = deque(maxlen=EngineStats(num_kv_blocks=0).num_recent)
        self.info: EngineInfo = self._receive()[2]
        # the engine's times are its machine's monotonic clock: this is what to add to read
        # them on this one's (0 on the same machine)
        self._clock_offset = clock_offset(self.info.clock)
        self._load = Load(stats=EngineStats(num_kv_blocks=self.info.num_kv_blocks))
        # cumulative requests' outputs so far, by id (None until the first)
        self._whole: dict[str, RequestOutput | None] = {}

    # ---- EngineLike ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    group: str | None = None) -> None:
        error = self.add_requests([(request_id, prompt, sampling_params or SamplingParams(),
                                    arrival_time, priority, group)])[0]
        if error is not None:
            raise error

    def add_requests(self, requests: list[AddArgs]) -> list[Exception | None]:
        """Add each, in one message; per request None or what refused it."""
        sent = []
        for request_id, prompt, params, arrival, *rest in requests:
            if params.output_kind == RequestOutputKind.CUMULATIVE:
                # the engine sends what is new, this side keeps the whole (a step's message
                # stays the size of the step, not of the request so far)
                params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
                self._whole[request_id] = None
            if arrival is not None:
                arrival -= self._clock_offset
            sent.append((request_id, prompt, params, arrival, *rest))
        errors: list[Exception | None] = self._call("add", sent)
        for (request_id, *_), error in zip(requests, errors, strict=True):
            if error is not None:
                self._whole.pop(request_id, None)
        return errors

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.abort_requests([request_id])[0]

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput | None]:
        outs: list[RequestOutput | None] = self._call("abort", request_ids)
        gone = set(request_ids)  # their outputs of steps before the abort are not news now
        self._steps = deque((ok, [o for o in value if o.request_id not in gone] if ok else value)
                            for ok, value in self._steps)
        for request_id, out in zip(request_ids, outs, strict=True):
            if out is None:
                self._whole.pop(request_id, None)
        return [None if out is None else self._as_asked(out) for out in outs]

    def step(self) -> list[RequestOutput]:
        """The outputs of the engine's steps since the last call (waiting for one if none
        came yet). A failed step raises here, after the outputs of the steps before it."""
        if not self._steps:
            self._next_message()
        while self._has_message():
            self._next_message()
        outputs: list[RequestOutput] = []
        while self._steps:
            ok, value = self._steps[0]
            if not ok and outputs:
                break
            self._steps.popleft()
            if not ok:
                raise value
            outputs += [self._as_asked(out) for out in value]
        return outputs

    def _as_asked(self, delta: RequestOutput) -> RequestOutput:
        """A cumulative request's output from the engine's delta: everything so far."""
        rid = delta.request_id
        if self._clock_offset and delta.metrics is not None:
            delta.metrics = delta.metrics.shifted(self._clock_offset)
        if rid not in self._whole:
            return delta
        whole = self._whole[rid]
        if whole is None:
            whole = self._whole[rid] = delta
        else:
            now, new = whole.outputs[0], delta.outputs[0]
            now.text += new.text
            now.token_ids += new.token_ids
            if new.logprobs is not None:
                now.logprobs = (now.logprobs or []) + new.logprobs
            now.cumulative_logprob = new.cumulative_logprob
            now.finish_reason, now.stop_reason = new.finish_reason, new.stop_reason
            whole.finished, whole.metrics = delta.finished, delta.metrics
            whole.num_cached_tokens = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:
                whole.prompt_logprobs = delta.prompt_logprobs
        if whole.finished:
            del self._whole[rid]
        # a copy, as the engine in this process gives: its lists are not appended to later
        done = whole.outputs[0]
        copy = dataclasses.replace(done, token_ids=list(done.token_ids),
                                   logprobs=None if done.logprobs is None else list(done.logprobs))
        return dataclasses.replace(whole, outputs=[copy])

    def log_idle_stats(self) -> None:
        """Nothing to write (the engine's process writes its idle stats line itself); an
        engine process that died while idle is noticed here (EngineDied)."""
        if not self._process.is_alive():
            raise EngineDied(f"the engine process ended (exit code {self._process.exitcode})")

    def has_unfinished_requests(self) -> bool:
        return bool(self._steps) or self._load.has_unfinished

    @property
    def num_waiting(self) -> int:
        return self._load.num_waiting

    @property
    def num_running(self) -> int:
        return self._load.num_running

    @property
    def kv_usage(self) -> float:
        return self._load.kv_usage

    @property
    def num_used_blocks(self) -> int:
        return self._load.num_used_blocks

    @property
    def stats(self) -> EngineStats:
        return self._load.stats

    def speculation_figures(self) -> SpeculatorFigures | None:
        return self._load.speculation

    # ---- the transport: pipes here, a Ray actor's calls in braid/engine/ray_engine.py ------

    def shutdown(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(OSError, EngineDied):
            self._calls.send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()

    def kill(self) -> None:
        """End the engine at once, as a crash would (the tests of a replica's death)."""
        self._process.kill()

    def _put(self, message: tuple) -> None:
        try:
            self._calls.send(message)
        except OSError:
            raise EngineDied("the engine process is gone") from None

    def _has_message(self) -> bool:
        return self._conn.poll(0)

    def _get(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join(1.0)  # its exit code, once reaped
            code = self._process.exitcode
            raise EngineDied(f"the engine process ended (exit code {code})") from None

    # ---- messages ---------------------------------------------------------------------

    def _call(self, name: str, *args: Any) -> Any:
        """Send a call and wait for its answer; step messages that come first are kept."""
        self._put((name, *args))
        while True:
            kind, ok, value = self._next_message()
            if kind == "answer":
                if not ok:
                    raise value
                return value

    def _next_message(self) -> tuple[str, bool, Any]:
        kind, ok, value, load = self._receive()
        if load is not None:
            self._recent.extend(load.stats.recent)  # steps since the last message
            load.stats.recent = self._recent
            self._load = load
        if kind == "step":
            self._steps.append((ok, value))
        return kind, ok, value

    def _receive(self) -> Any:
        message = self._get()
        kind, ok, value, _ = message
        if kind == "info" and not ok:
            raise value
        return message


def _serve(config: EngineConfig, calls: Connection, conn: Connection,
           cores: list[int] | None = None, label: str | None = None) -> None:
    """The engine process: build the engine, then step and answer calls until told to stop."""
    follow_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the server's to handle
    if cores:
        os.sched_setaffinity(0, cores)
    tag = f"[{label}] " if label else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {tag}%(message)s",
                        stream=sys.stderr)
    engine, info = build_engine(config)
    _send(conn, info)
    if engine is None:
        return
    inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    outbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    threading.Thread(target=_read_calls, args=(calls, inbox), name="braid-calls",
                     daemon=True).start()
    writer = threading.Thread(target=_write_messages, args=(conn, outbox),
                              name="braid-outputs", daemon=True)
    writer.start()
    try:
        EngineSide(engine, inbox, outbox, os.getppid()).run()
    except ExecutorBroken:  # logged where it broke; the server sees the process end
        outbox.put(("end", True, None, None))  # the writer ends after the messages before
        writer.join(5.0)
        sys.exit(1)


def build_engine(config: EngineConfig) -> tuple[Any, tuple]:
    """The engine and the first message to the server (its info); no engine, and the error
    as the message, where the config or the load failed."""
    from braid import heap
    from braid.engine.engine import LLMEngine

    heap.limit_arenas()
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # a config or load error: the server reports it
        return None, ("info", False, _portable(e), None)
    return engine, ("info", True, _info(engine), None)


class EngineSide:
    """The engine's loop in its process: step while there is work, answer calls between
    steps, write the idle stats line and give freed memory back when there is none. Calls
    come in through `inbox`, messages go out through `outbox` (pipes' threads or a Ray
    actor's methods carry them). `server_pid`: the server's process where it shares this
    machine's cores (`CoreShare`), else None."""

    def __init__(self, engine: Any, inbox: queue.SimpleQueue[tuple],
                 outbox: queue.SimpleQueue[tuple], server_pid: int | None) -> None:
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self.steps_sent = 0  # the stats' steps sent so far
        self.worked = False  # steps since the heap was last trimmed
        import torch

        self.cores = CoreShare(server_pid or 0, torch.get_num_threads(), torch.set_num_threads,
                               read=cpu_seconds if server_pid else _unknown)

    def run(self) -> None:
        from braid import heap

        engine = self.engine
        while True:
            calls = []
            if not engine.has_unfinished_requests():
                try:
                    calls.append(self.inbox.get(timeout=IDLE_WAKEUP))
                except queue.Empty:
                    engine.log_idle_stats()
                    if self.worked:
                        heap.trim()  # what the work that just ended freed goes back
                        self.worked = False
                    continue
            with contextlib.suppress(queue.Empty):
                while True:
                    calls.append(self.inbox.get_nowait())
            for name, *args in calls:
                if name == "stop":
                    engine.shutdown()
                    return
                self._answer(name, args)
            if engine.has_unfinished_requests():
                self.cores.check()
                self._step()

    def _answer(self, name: str, args: list[Any]) -> None:
        try:
            if name == "add":
                result: Any = [_portable(e) if e is not None else None
                               for e in self.engine.add_requests(*args)]
            elif name == "abort":
                result = self.engine.abort_requests(*args)
            else:
                raise ValueError(f"unknown engine call {name!r}")
        except Exception as e:
            self._send("answer", False, _portable(e))
            return
        self._send("answer", True, result)

    def _step(self) -> None:
        self.worked = True
        try:
            outputs = self.engine.step()
        except ExecutorBroken:
            # no step can run again: the engine ends, and the server sees it dead (it
            # fails what this engine answered, moves the rest and starts a new one)
            logger.exception("the engine's executor broke; the engine ends")
            self.engine.shutdown()
            raise
        except Exception as e:
            # The step mixes every scheduled request in one forward, so it cannot be pinned
            # on one of them: end them all here (the server fails them), keep serving.
            logger.exception("engine step failed; failing %d request(s)",
                             len(self.engine.requests))
            self.engine.abort_requests(list(self.engine.requests))
            self._send("step", False, _portable(e))
            return
        self._send("step", True, outputs)

    def _send(self, kind: str, ok: bool, value: Any) -> None:
        """Queue a message for the writer thread: the loop never waits for the server to
        read (a megabyte of prompt logprobs through a 64 kB pipe waited on a busy server's
        reads, and the steps behind it with it)."""
        load, self.steps_sent = _load(self.engine, self.steps_sent)
        self.outbox.put((kind, ok, value, load))


def _read_calls(calls: Connection, inbox: queue.SimpleQueue[tuple]) -> None:
    """The engine process's reader: the server's calls into `inbox`; a stop when it is gone."""
    while True:
        try:
            inbox.put(calls.recv())
        except (EOFError, OSError):
            inbox.put(("stop",))
            return


def _write_messages(conn: Connection, outbox: queue.SimpleQueue[tuple]) -> None:
    """The engine process's writer: `outbox`'s messages to the server, in order, until an
    "end". A message
    that does not pickle goes as its kind's failure (the server fails what it answers for),
    not as a writer that stopped while the server waits."""
    while (message := outbox.get())[0] != "end":
        kind, ok, value, load = message
        try:
            _send(conn, (kind, ok, value, load))
        except Exception as e:
            logger.exception("an engine message did not pickle")
            _send(conn, (kind, False, RuntimeError(f"the engine's answer did not pickle: {e}"),
                         load))


def _portable(error: BaseException) -> BaseException:
    """`error`, or where it does not pickle, a RuntimeError of its text."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _load(engine: Any, steps_sent: int) -> tuple[Load, int]:
    """The load figures, with the stats' steps since the last answer only (the metrics take
    new steps from `recent`; sending all of it every step would be waste)."""
    stats = engine.stats
    new = min(stats.num_steps - steps_sent, len(stats.recent))
    recent = deque(itertools.islice(stats.recent, len(stats.recent) - new, None))
    light = dataclasses.replace(stats, recent=recent)
    return Load(engine.num_running, engine.num_waiting, engine.kv_usage, engine.num_used_blocks,
                engine.has_unfinished_requests(), light,
                engine.speculation_figures()), stats.num_steps


def _info(engine: Any) -> EngineInfo:
    cache = engine.runner.kv_cache
    return EngineInfo(engine.config, engine.model_config.vocab_size,
                      engine.outputs.eos_token_ids, engine.default_sampling,
                      engine.max_tokens_cap, engine.max_logprobs(), engine.blocks.num_blocks,
                      str(cache.dtype).removeprefix("torch."), cache.nbytes, clock())


def clock() -> tuple[str, float]:
    """This machine's boot (the processes of one boot share one monotonic clock) and its
    monotonic time now."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}", time.monotonic()


def clock_offset(engine_clock: tuple[str, float]) -> float:
    """What to add to an engine's monotonic times to read them on this machine's clock: 0
    where it runs on this machine's boot, else the difference its `clock()` showed when
    sent (the message's transit time included: milliseconds, against times of requests of
    seconds)."""
    here, now = clock()
    there, then = engine_clock
    return 0.0 if there == here else now - then


def _unknown(pid: int) -> None:
    """No server's CPU time to read: its process is on another machine or unknown."""
    return None


def _send(conn: Connection, message: tuple) -> None:
    with contextlib.suppress(OSError, ValueError):  # the server is gone (the reader sees it)
        conn.send(message)

