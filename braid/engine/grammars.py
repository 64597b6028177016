"""Requests whose grammar is compiling, and the grammars' share of each step.

A constrained request is scheduled once its grammar compiled (on the structured-output
manager's worker); one whose grammar failed finishes with reason "error". Each step, a
request whose grammar masks took more than GRAMMAR_SHARE of the rest of the step sits out
steps in proportion (while others decode), so on average its masks cost the others at most
that share (a 64 kB literal costs ~30 ms a mask).
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, wait

from braid.core.request import Request
from braid.core.scheduler import Scheduler, SchedulerOutput
from braid.engine.input import RequestError
from braid.structured.manager import StructuredOutputManager

logger = logging.getLogger("braid")

GRAMMAR_SHARE = 0.5
MAX_REST_STEPS = 200  # the most steps a request rests at a time


class GrammarGate:
    def __init__(self, scheduler: Scheduler, manager: StructuredOutputManager | None) -> None:
        self.scheduler, self.manager = scheduler, manager
        self.compiling: list[Request] = []  # requests whose grammar is not compiled yet

    def submit(self, req: Request) -> None:
        """Start compiling the request's grammar (RequestError without a tokenizer)."""
        params = req.sampling_params
        assert params.structured_outputs is not None
        if self.manager is None:
            raise RequestError("structured_outputs needs a tokenizer: this engine has none")
        req.grammar_future = self.manager.submit(params.structured_outputs, params.ignore_eos)
        self.compiling.append(req)

    def failed(self) -> list[Request]:
        """Forget compiled grammars' requests; finish those whose grammar failed to compile
        (reason "error": the server and `LLM` check grammars before they add requests, so
        here it is a request added straight to the engine with a grammar the grammar engine
        refuses). Returns them, for the engine to release and report."""
        failed, still = [], []
        for req in self.compiling:
            future = req.grammar_future
            assert future is not None
            if not future.done():
                still.append(req)
            elif future.exception() is not None and not req.is_finished:
                logger.error("request %s: %s", req.request_id, future.exception())
                self.scheduler.finish(req, "error")
                failed.append(req)
        self.compiling = still
        return failed

    def wait(self) -> None:
        """Nothing else can run: let a compilation finish (or 50 ms pass)."""
        futures = [r.grammar_future for r in self.compiling if r.grammar_future]
        if futures:
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)

    def share_time(self, sched: SchedulerOutput, step_time: float) -> None:
        """Rest the requests whose masks took more than their share of this step."""
        spent = {id(s.request): (s.request, g.take_mask_time())
                 for s in sched.scheduled if (g := s.request.grammar) is not None}
        if len(self.scheduler.running) < 2 or not spent:
            return
        rest_of_step = max(step_time - sum(t for _, t in spent.values()), 1e-4)
        for req, seconds in spent.values():
            if seconds > GRAMMAR_SHARE * rest_of_step and not req.is_finished:
                steps = int(seconds / (GRAMMAR_SHARE * rest_of_step))
                self.scheduler.rest(req, min(steps, MAX_REST_STEPS))
