"""An autouse fixture for the engine and speculation tests: the scheduler's invariants (and
the block manager's, which it checks too) hold after every engine step of every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from braid.engine.engine import LLMEngine
from braid.outputs import RequestOutput


@pytest.fixture(autouse=True)
def check_invariants_after_every_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    plain_step = LLMEngine.step

    def step(self: LLMEngine) -> list[RequestOutput]:
        outputs = plain_step(self)
        self.scheduler.check_invariants()
        return outputs

    monkeypatch.setattr(LLMEngine, "step", step)
    yield
