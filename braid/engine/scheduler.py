"""Stall-free scheduler: one loop moves each request's num_computed_tokens toward its target.

Decoding requests first (1 + drafts each), then continuing prefill chunks, then new admissions
FCFS, all under one token budget (Sarathi-Serve / vLLM V1). A decode, a prefill chunk, a
recompute after preemption and a verification window are the same thing here: a number of
query tokens starting at num_computed_tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from braid.engine.block_manager import BlockManager
from braid.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # query tokens this step, starting at request.num_computed_tokens
    num_spec_tokens: int  # drafts included at the end of the window (0 for plain steps)

    @property
    def needs_logits(self) -> bool:
        """The window reaches the end of the request's tokens, so the step samples for it."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + self.num_spec_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.needs_logits) + sum(
            s.num_new_tokens - 1 - s.num_spec_tokens for s in self.scheduled if s.needs_logits)

    @property
    def num_spec_tokens(self) -> int:
        return sum(s.num_spec_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last one is preempted first

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_cap: int | None = None) -> SchedulerOutput:
        """This step's requests; `prefill_cap` (an ITL target's choice for this very step)
        limits the prefill chunks and admissions that ride with the decodes."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and self._can_admit_whole():
            # Classic prefill-first: whole prompts in a step of their own, ahead of decodes.
            self._admit(out, budget)
            return out
        decoding = [r for r in self.running if not r.is_prefilling]
        prefilling = [r for r in self.running if r.is_prefilling]
        budget = self._schedule_running(out, decoding, budget)
        if self.enable_chunked_prefill:
            if prefill_cap is not None:
                budget = min(budget, prefill_cap)
            budget = self._schedule_running(out, prefilling, budget)
            if not out.preempted:
                self._admit(out, budget)
        return out

    def _schedule_running(
        self, out: SchedulerOutput, requests: Iterable[Request], budget: int
    ) -> int:
        for req in requests:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, out):
                continue
            # Drafts are cut when the budget is short (the policy should have chosen fewer).
            num_spec = max(0, len(req.spec_token_ids) - (req.num_tokens_with_spec
                                                        - req.num_computed_tokens - n))
            out.scheduled.append(ScheduledRequest(req, n, num_spec))
            budget -= n
        return budget

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Make room for `n` more tokens of `req`, preempting the newest running requests."""
        while not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks; it recomputes its prompt and outputs when resumed."""
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def _can_admit_whole(self) -> bool:
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        req = self.waiting[0]
        return self.blocks.can_allocate(req.request_id, req.num_tokens)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests FCFS while seats, budget and KV blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed_tokens
            if not self.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget)
            if not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, 0))
            budget -= n

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished (stop, length, abort, error) and release its KV blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.spec_token_ids = []
