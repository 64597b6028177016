"""The engine thread and its asyncio bridge, in-process, with a scripted fake engine."""

from __future__ import annotations

import asyncio
import threading
import time

from braid.core.stats import EngineStats
from braid.outputs import CompletionOutput, RequestMetrics, RequestOutput
from braid.sampling_params import SamplingParams
from braid.server.engine_loop import AsyncEngine, OutputQueue, RequestFailed

BAD_ADD, BAD_STEP = [666], [13]


class FakeEngine:
    """Each request emits one token "a" per step and finishes after three. A request whose
    prompt is BAD_ADD fails to add; one whose prompt is BAD_STEP makes step() raise."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], list[int]]] = {}
        self.idle_logs = 0  # log_idle_stats calls

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    group: str | None = None) -> None:
        assert isinstance(prompt, list)
        if prompt == BAD_ADD:
            raise RuntimeError("tokenizer bug")
        self.requests[request_id] = (prompt, [])

    def add_requests(self, requests: list[tuple]) -> list[Exception | None]:
        errors: list[Exception | None] = []
        for args in requests:
            try:
                self.add_request(*args)
                errors.append(None)
            except RuntimeError as e:
                errors.append(e)
        return errors

    def abort(self, request_id: str) -> RequestOutput | None:
        self.requests.pop(request_id, None)
        return None

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput | None]:
        return [self.abort(request_id) for request_id in request_ids]

    def step(self) -> list[RequestOutput]:
        if any(prompt == BAD_STEP for prompt, _ in self.requests.values()):
            raise RuntimeError("step failed")
        outputs = []
        for request_id, (prompt, tokens) in list(self.requests.items()):
            tokens.append(97)
            finished = len(tokens) == 3
            if finished:
                del self.requests[request_id]
            outputs.append(RequestOutput(
                request_id, None, prompt,
                [CompletionOutput(0, "a" * len(tokens), list(tokens),
                                  "length" if finished else None)],
                finished, RequestMetrics(0.0, 0.0, 0.0 if finished else None)))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return 0

    @property
    def num_running(self) -> int:
        return len(self.requests)

    kv_usage = 0.0
    num_used_blocks = 0
    stats = EngineStats(num_kv_blocks=0)

    def speculation_figures(self) -> None:
        return None

    def log_idle_stats(self) -> None:
        self.idle_logs += 1


async def _final(out: OutputQueue) -> RequestOutput | RequestFailed:
    while True:
        item = await asyncio.wait_for(out.get(), timeout=10)
        if isinstance(item, RequestFailed) or item.finished:
            return item


async def _run(engine: AsyncEngine, request_id: str, prompt: list[int]
               ) -> RequestOutput | RequestFailed | BaseException:
    out: OutputQueue = asyncio.Queue()
    [error] = await engine.add_all([(request_id, prompt, SamplingParams())], out)
    if error is not None:
        return error
    return await _final(out)


def test_a_failing_add_fails_only_that_request() -> None:
    async def main() -> list:
        engine = AsyncEngine(FakeEngine())
        engine.start()
        try:
            return await asyncio.gather(_run(engine, "ok", [1]), _run(engine, "bad", BAD_ADD),
                                        _run(engine, "ok2", [2]))
        finally:
            await asyncio.to_thread(engine.stop)

    ok, bad, ok2 = asyncio.run(main())
    assert isinstance(bad, RuntimeError)
    assert isinstance(ok, RequestOutput) and ok.outputs[0].text == "aaa"
    assert isinstance(ok2, RequestOutput) and ok2.finished


def test_an_idle_engine_still_writes_its_last_stats_line(monkeypatch) -> None:
    """Once the work is done the loop asks the engine for its idle stats line, and asks
    again while idle (the line is due only when the interval is up), without a request."""
    monkeypatch.setattr("braid.server.engine_loop.IDLE_WAKEUP", 0.02)

    async def until(fake: FakeEngine, calls: int) -> None:
        deadline = time.monotonic() + 10
        while fake.idle_logs < calls and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def main() -> tuple[int, int]:
        fake = FakeEngine()
        engine = AsyncEngine(fake)
        engine.start()
        try:
            await _run(engine, "ok", [1])
            await until(fake, 1)
            first = fake.idle_logs
            await until(fake, first + 1)
            return first, fake.idle_logs
        finally:
            await asyncio.to_thread(engine.stop)

    first, later = asyncio.run(main())
    assert first >= 1 and later > first


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving() -> None:
    async def main() -> tuple:
        engine = AsyncEngine(FakeEngine())
        engine.start()
        try:
            failed = await _run(engine, "bad", BAD_STEP)
            later = await _run(engine, "later", [3])
            return failed, later, engine.is_alive
        finally:
            await asyncio.to_thread(engine.stop)

    failed, later, alive = asyncio.run(main())
    assert isinstance(failed, RequestFailed) and "step failed" in str(failed.error)
    assert isinstance(later, RequestOutput) and later.outputs[0].text == "aaa"
    assert alive


def test_abort_stops_delivery_and_frees_the_request() -> None:
    async def main() -> tuple[int, bool]:
        fake = FakeEngine()
        engine = AsyncEngine(fake)
        engine.start()
        out: OutputQueue = asyncio.Queue()
        try:
            assert await engine.add_all([("gone", [1], SamplingParams())], out) == [None]
            engine.abort("gone")
            await asyncio.sleep(0.2)
            return engine.snapshot.num_running, "gone" in fake.requests
        finally:
            await asyncio.to_thread(engine.stop)

    assert asyncio.run(main()) == (0, False)


class QueueingEngine(FakeEngine):
    """Requests wait until `release` is set (its steps emit nothing until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def step(self) -> list[RequestOutput]:
        if not self.release.wait(0.01):
            return []
        return super().step()

    @property
    def num_waiting(self) -> int:
        return 0 if self.release.is_set() else len(self.requests)


def test_a_request_counts_once_as_waiting_from_send_to_admission() -> None:
    """num_waiting (the server's waiting limit reads it) counts a request once whether it
    is still on its way to the engine thread, added there while its handler has not resumed
    yet, or admitted. It used to count twice in the middle state, so a burst within the limit
    got 503s."""
    async def main() -> list[int]:
        fake = QueueingEngine()
        engine = AsyncEngine(fake)
        engine.start()
        out: OutputQueue = asyncio.Queue()
        try:
            admission = engine.add_all([("a", [1], SamplingParams()),
                                        ("b", [2], SamplingParams())], out)
            seen = [engine.num_waiting]  # sent, not added yet (or just added)
            deadline = time.monotonic() + 10
            while engine.snapshot.num_waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # blocking: the loop cannot settle the admission yet
            seen.append(engine.num_waiting)  # added, its handler not resumed
            assert await admission == [None, None]
            seen.append(engine.num_waiting)  # admitted
            fake.release.set()
            await _final(out)
            await asyncio.sleep(0.1)
            seen.append(engine.num_waiting)
            return seen
        finally:
            await asyncio.to_thread(engine.stop)

    assert asyncio.run(main()) == [2, 2, 2, 0]
