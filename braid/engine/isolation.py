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

from braid.core.request import Request
from braid.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from braid.worker.lifetime import ExecutorBroken
from braid.worker.step_io import StepResult

logger = logging.getLogger("braid")


Compute = Callable[[SchedulerOutput], StepResult]


def run_step(compute: Compute, scheduler: Scheduler, sched: SchedulerOutput,
             forget: Callable[[SchedulerOutput], None]) -> tuple[StepResult, list[Request]]:
    """The step's results, and the requests that fail it alone (the scheduler finished them
    with "error"; the engine releases them). Those that read KV another request of the
    step was computing go back to waiting; every other request gets its result. Where the
    step ends otherwise (KeyboardInterrupt, a broken executor), the blocks it published are
    withdrawn and `forget` drops the state of the requests it preempted."""
    try:
        return compute(sched), []
    except ExecutorBroken:  # no request's fault, and no step can run again
        _withdraw(scheduler, sched, forget)
        raise
    except Exception:
        logger.exception("engine step failed; running it again in parts to find the "
                         "request that fails it")
    except BaseException:
        _withdraw(scheduler, sched, forget)
        raise
    scheduler.requeue_dependents(sched)
    try:
        result, culprits = isolate(compute, list(sched.scheduled))
    except ExecutorBroken:
        _withdraw(scheduler, sched, forget)
        raise
    for s in culprits:
        scheduler.fail(s.request, sched)
    return result, [s.request for s in culprits]


def _withdraw(scheduler: Scheduler, sched: SchedulerOutput,
              forget: Callable[[SchedulerOutput], None]) -> None:
    scheduler.discard_published(sched)  # their KV was never written
    forget(sched)


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
        except ExecutorBroken:
            raise  # broke while running in parts: still no request's fault
        except Exception:
            if len(group) == 1:
                logger.exception("request %s fails the step alone; it ends with an error",
                                 group[0].request.request_id)
                culprits.append(group[0])
            else:
                todo += [group[: len(group) // 2], group[len(group) // 2 :]]
    result.forward_end = time.perf_counter()
    return result, culprits
