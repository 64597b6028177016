"""Draft-model proposer, the engine's side: which requests the draft model drafts for, from
where, and how many; its forwards run in the worker, behind the executor
(braid/worker/draft.py).

The draft cache uses the target's block tables (same slot layout, its own tensors), so it needs
no block manager of its own; when the target frees a request's blocks the draft forgets it.
Prefix caching covers the draft too: a published block records whether the draft's KV in it
is valid, and a request's catch-up starts after the leading blocks that say so.
Each call first catches every request that drafts up from the draft's own progress to the
request's tokens in one flat forward (its prompt if the draft has not seen it yet, tokens
accepted last step, tokens emitted while its k was 0, and the recovered/bonus token), so drafts
are never computed on a stale cache. Requests with k = 0 are left behind: under load, when the
policy turns speculation off, the draft costs nothing, and the policy weighs the catch-up (the
`lag`) before turning it back on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from braid.core.block_manager import BlockManager
from braid.core.request import Request
from braid.models.config import ModelConfig
from braid.spec_decode.proposer import Proposal, Proposer
from braid.worker.draft import DraftSpan
from braid.worker.executor import Executor
from braid.worker.runner import ModelRunner, QuerySpan


@dataclass(slots=True)
class _Proposal:
    start: int  # position of the first draft token
    drafts: list[int]


class DraftModelProposer(Proposer):
    needs_kv_slots = True  # drafts 1..k-1 get KV at positions num_tokens..num_tokens+k-2

    def __init__(self, executor: Executor, config: ModelConfig, blocks: BlockManager,
                 unsent: Callable[[Request], list[int]] = lambda req: []) -> None:
        self.executor = executor  # it runs the draft model (Executor.start_draft)
        self.config = config  # the draft model's
        self.blocks = blocks
        self.unsent = unsent  # a request's outputs the worker has not been sent yet
        self.computed: dict[str, int] = {}  # draft KV is valid for positions < computed
        self.last: dict[str, _Proposal] = {}

    @property
    def runner(self) -> ModelRunner | None:  # type: ignore[override]
        return self.executor.draft_runner

    @property
    def coarse_head(self) -> bool:  # type: ignore[override]
        return self.executor.draft_coarse_head

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.last.pop(request_id, None)

    def propose(self, requests: list[Request], ks: list[int]) -> Proposal:
        """The scheduler has reserved KV slots for the ks (Scheduler.reserve_draft_slots)."""
        proposal = Proposal([[] for _ in requests])
        if not any(ks):
            return proposal  # the draft catches up lazily the next time it proposes
        active = [i for i, k in enumerate(ks) if k]
        spans = []
        for i in active:
            r = requests[i]
            start = min(self._valid_prefix(r), r.num_tokens - 1)
            spans.append(DraftSpan(
                r.request_id, QuerySpan(r.token_ids(start, r.num_tokens), start,
                                        self.blocks.block_table(r.request_id), 1),
                ks[i], self.unsent(r)))
            self.computed[r.request_id] = r.num_tokens
        result = self.executor.propose_drafts(spans)
        proposal.forwards = result.forwards
        for i, drafts in zip(active, result.drafts, strict=True):
            r = requests[i]
            self.blocks.mark_draft_computed(r.request_id, r.num_tokens)  # shared blocks too
            proposal.drafts[i] = drafts
            if drafts:
                self.last[r.request_id] = _Proposal(r.num_tokens, drafts)
        return proposal

    def lag(self, req: Request) -> int:
        return req.num_tokens - min(self._valid_prefix(req, keep=True), req.num_tokens - 1)

    def _valid_prefix(self, req: Request, keep: bool = False) -> int:
        """Positions whose draft KV matches the request's tokens: earlier proposals' KV stays
        valid for the drafts that were accepted (consumed unless `keep`)."""
        done = self.computed.get(req.request_id)
        if done is None:  # a prefix cached with the draft's KV needs no catch-up
            done = self.blocks.num_draft_cached_tokens(req.request_id)
        last = self.last.get(req.request_id) if keep else self.last.pop(req.request_id, None)
        if last is None:
            return done
        actual = req.token_ids(last.start, last.start + len(last.drafts) - 1)
        drafts = last.drafts[: len(actual)]
        same = next((j for j, (a, b) in enumerate(zip(actual, drafts, strict=True)) if a != b),
                    len(actual))
        return last.start + same

