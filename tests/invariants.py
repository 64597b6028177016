"""An autouse fixture for the engine and speculation tests: the scheduler's invariants (and
the block manager's, which it checks too) hold after every engine step of every test, and
with chunked prefill every step schedules each decode that was running (or preempts it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from braid.core.scheduler import Scheduler, SchedulerOutput
from braid.engine.engine import LLMEngine
from braid.outputs import RequestOutput


@pytest.fixture(autouse=True)
def check_invariants_after_every_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    plain_step = LLMEngine.step

    def step(self: LLMEngine) -> list[RequestOutput]:
        outputs = plain_step(self)
        self.scheduler.check_invariants()
        return outputs

    plain_schedule = Scheduler.schedule

    def schedule(self: Scheduler, prefill_cap: int | None = None) -> SchedulerOutput:
        decoding = [r for r in self.running if not r.is_prefilling]
        out = plain_schedule(self, prefill_cap)
        if self.enable_chunked_prefill:  # prefill-first steps leave the decodes out
            served = {s.request.request_id for s in out.scheduled} | set(out.preempted) | {
                r.request_id for r in out.held}  # held back by the fair share
            starved = [r.request_id for r in decoding if r.request_id not in served]
            assert not starved, f"decodes {starved} got no token this step"
        return out

    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr(Scheduler, "schedule", schedule)
    yield
