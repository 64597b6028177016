"""Proposers guess the next k tokens of each request; the target verifies them in one window."""

from __future__ import annotations

from abc import ABC, abstractmethod

from braid.engine.request import Request


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens for requests[i] (k = 0: none, but the proposer may still
        use the call to keep its state current). Called after every step with every running
        request; those still prefilling get k = 0."""

    def lag(self, req: Request) -> int:
        """Tokens of `req` the proposer must process before it can draft for it (0 for
        proposers without state)."""
        return 0

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional hook, no state by default
        """The request finished or lost its KV blocks (preempted)."""

