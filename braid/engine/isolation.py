"""A step's computation, and finding the request that makes it fail.

A step's forward and sampling change no scheduling state: they write KV into the slots the
scheduler reserved and return each request's tokens. A request's result does not depend on
what else is in the batch (the attention and product kernels are batch invariant, and every
random number is keyed by the request's seed and position), and writing a span's KV again
writes the same values. So when a step raises, the engine runs it again in halves, then
quarters, down to the single requests that fail alone (their parameters or their grammar):
those are failed, every other request keeps the result it would have had.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from braid.engine.scheduler import ScheduledRequest, SchedulerOutput
from braid.outputs import SampleLogprobs
from braid.sample.step import StepSample

logger = logging.getLogger("braid")


@dataclass(slots=True)
class StepResult:
    """What a step computed: prompt logprobs by request id, and each scheduled request's
    sample (by the identity of its ScheduledRequest)."""

    prompt_logprobs: dict[str, SampleLogprobs] = field(default_factory=dict)
    samples: dict[int, StepSample] = field(default_factory=dict)
    forward_end: float = 0.0  # time.perf_counter() when its (last) forward ended

    def merge(self, other: StepResult) -> None:
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.samples.update(other.samples)

    def in_order(self, sched: SchedulerOutput) -> list[StepSample]:
        return [self.samples[id(s)] for s in sched.scheduled]


Compute = Callable[[SchedulerOutput], StepResult]


def isolate(compute: Compute, scheduled: list[ScheduledRequest]
            ) -> tuple[StepResult, list[ScheduledRequest]]:
    """The results of the requests that compute in smaller batches, and the requests that
    fail alone, after a step of `scheduled` raised."""
    result, culprits = StepResult(), []
    todo = [scheduled[: len(scheduled) // 2], scheduled[len(scheduled) // 2 :]]
    while todo:
        group = todo.pop()
        if not group:
            continue
        try:
            result.merge(compute(SchedulerOutput(scheduled=group)))
        except Exception:
            if len(group) == 1:
                logger.exception("request %s fails the step alone; it ends with an error",
                                 group[0].request.request_id)
                culprits.append(group[0])
            else:
                todo += [group[: len(group) // 2], group[len(group) // 2 :]]
    result.forward_end = time.perf_counter()
    return result, culprits
