"""Proposers guess the next k tokens of each request; the target verifies them in one window."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from braid.core.request import Request
from braid.worker.draft import DraftForward
from braid.worker.runner import ModelRunner


@dataclass(slots=True)
class Proposal:
    drafts: list[list[int]]  # per request, in the order asked
    forwards: list[DraftForward] = field(default_factory=list)
    # per request, the drafts' confidence level where the proposer grades them (see
    # AcceptanceEstimator.alpha); None: it does not
    levels: list[int] | None = None


class Proposer(ABC):
    # Whether drafting needs KV slots beyond the request's tokens (a draft model writes KV
    # for its own drafts); the speculator has the scheduler reserve them first.
    needs_kv_slots = False
    runner: ModelRunner | None = None  # a draft model's runner (weights, KV cache)
    coarse_head = False  # its greedy drafts take the draft's two-stage LM head

    @abstractmethod
    def propose(self, requests: list[Request], ks: list[int]) -> Proposal:
        """Up to ks[i] draft tokens for requests[i] (k = 0: none). Called after every step
        with every running request; those still prefilling get k = 0."""

    def draft_after(self, req: Request, after: list[int], k: int) -> tuple[list[int], int | None]:
        """Up to k drafts that would follow `req`'s tokens and then `after` (tokens its
        grammar forces), and their confidence level (None: ungraded): a model-free proposer
        continues a grammar's forced run in the same window. None here (a draft model would
        need a forward over `after` first)."""
        return [], None

    def lag(self, req: Request) -> int:
        """Tokens of `req` the proposer must process before it can draft for it (0 for
        proposers without state)."""
        return 0

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional hook, no state by default
        """The request finished or lost its KV blocks (preempted)."""

    def finish(self, req: Request) -> None:
        """The request finished (a proposer that learns from outputs keeps its own)."""
        self.forget(req.request_id)
