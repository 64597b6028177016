"""The engine in a process of its own, as the server runs it.

The server's process parses, tokenizes, validates and writes requests; its Python shares one
GIL. An engine in the same process needs that GIL back after every torch call of a step, so
a request whose handling is long Python work (a multi-megabyte /tokenize, n choices of
logprobs) slowed every stream's steps several times over. In a process of its own the engine
has its own interpreter and the two share only the cores, which the OS divides fairly.

`EngineProcess` is the server's side: the calls of `LLMEngine` the server's engine loop makes
(braid/server/engine_loop.py's `EngineLike`), each a message over a pipe and its answer. The
engine's side (`_serve`) runs `LLMEngine` and answers them in order; every answer carries the
engine's load figures, so reading them costs no message. Requests, outputs and errors cross
as pickles (plain records); a RequestError stays a RequestError.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import logging
import multiprocessing
import signal
import sys
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from braid.config import EngineConfig
from braid.core.stats import EngineStats
from braid.outputs import RequestOutput
from braid.sampling_params import RequestOutputKind, SamplingParams
from braid.spec_decode.speculator import SpeculatorFigures

logger = logging.getLogger("braid")


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
    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a threaded process
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(config, child),
                                        name="braid-engine", daemon=True)
        self._process.start()
        child.close()
        self.info: EngineInfo = self._receive()
        self._load = Load(stats=EngineStats(num_kv_blocks=self.info.num_kv_blocks))
        # cumulative requests' outputs so far, by id (None until the first)
        self._whole: dict[str, RequestOutput | None] = {}

    # ---- EngineLike ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    group: str | None = None) -> None:
        params = sampling_params or SamplingParams()
        if params.output_kind == RequestOutputKind.CUMULATIVE:
            # the engine sends what is new, this side keeps the whole (a step's message
            # stays the size of the step, not of the request so far)
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            self._whole[request_id] = None
        try:
            self._call("add", request_id, prompt, params, arrival_time, priority, group)
        except BaseException:
            self._whole.pop(request_id, None)
            raise

    def abort(self, request_id: str) -> RequestOutput | None:
        out: RequestOutput | None = self._call("abort", request_id)
        return None if out is None else self._as_asked(out)

    def step(self) -> list[RequestOutput]:
        return [self._as_asked(out) for out in self._call("step")]

    def _as_asked(self, delta: RequestOutput) -> RequestOutput:
        """A cumulative request's output from the engine's delta: everything so far."""
        rid = delta.request_id
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
        self._call("idle")

    def has_unfinished_requests(self) -> bool:
        return self._load.has_unfinished

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

    # ---- the pipe -----------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(OSError, EngineDied):
            self._conn.send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()

    def _call(self, name: str, *args: Any) -> Any:
        try:
            self._conn.send((name, *args))
        except OSError:
            raise EngineDied("the engine process is gone") from None
        result, self._load = self._receive()
        return result

    def _receive(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            code = self._process.exitcode
            raise EngineDied(f"the engine process ended (exit code {code})") from None
        if not ok:
            raise value
        return value


def _serve(config: EngineConfig, conn: Connection) -> None:
    """The engine process: build the engine, then answer calls until told to stop."""
    _follow_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the server's to handle
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    from braid import heap
    from braid.engine.engine import LLMEngine

    heap.limit_arenas()
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # a config or load error: the server reports it
        _send(conn, False, e)
        return
    _send(conn, True, _info(engine))
    steps_sent = trimmed_at = 0
    while True:
        try:
            name, *args = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if name == "stop":
            return
        try:
            result = _answer(engine, name, args)
        except Exception as e:
            _send(conn, False, e)
            continue
        if name == "idle" and trimmed_at != engine.stats.num_steps:
            heap.trim()  # what the work that just ended freed goes back to the system
            trimmed_at = engine.stats.num_steps
        load, steps_sent = _load(engine, steps_sent)
        _send(conn, True, (result, load))


def _answer(engine: Any, name: str, args: list[Any]) -> Any:
    if name == "add":
        engine.add_request(*args)
        return None
    if name == "abort":
        return engine.abort(*args)
    if name == "step":
        return engine.step()
    if name == "idle":
        engine.log_idle_stats()
        return None
    raise ValueError(f"unknown engine call {name!r}")


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
                      str(cache.dtype).removeprefix("torch."), cache.nbytes)


def _send(conn: Connection, ok: bool, value: Any) -> None:
    try:
        conn.send((ok, value))
    except Exception as e:  # an exception that does not pickle: its text does
        if ok:
            raise
        conn.send((False, RuntimeError(f"{type(value).__name__}: {value}")))
        logger.debug("sent %r as text (%s)", value, e)


def _follow_parent() -> None:
    """SIGKILL when the server's process dies, however it dies (Linux's PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
