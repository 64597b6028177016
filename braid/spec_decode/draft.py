"""Draft-model proposer: a smaller model with the same vocabulary and its own paged KV cache.

The draft cache uses the target's block tables (same slot layout, its own tensors), so it needs
no block manager of its own; when the target frees a request's blocks the draft forgets it.
Each call first catches every request that drafts up from the draft's own progress to the
request's tokens in one flat forward (its prompt if the draft has not seen it yet, tokens
accepted last step, tokens emitted while its k was 0, and the recovered/bonus token), so drafts
are never computed on a stale cache. Requests with k = 0 are left behind: under load, when the
policy turns speculation off, the draft costs nothing, and the policy weighs the catch-up (the
`lag`) before turning it back on. Then k - 1 more single-token forwards, batched over requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from braid.engine.block_manager import BlockManager
from braid.engine.request import Request
from braid.engine.runner import ModelRunner, QuerySpan
from braid.models.qwen2 import Qwen2ForCausalLM
from braid.spec_decode.proposer import DraftForward, Proposal, Proposer


@dataclass(slots=True)
class _Proposal:
    start: int  # position of the first draft token
    drafts: list[int]


class DraftModelProposer(Proposer):
    needs_kv_slots = True  # drafts 1..k-1 get KV at positions num_tokens..num_tokens+k-2

    def __init__(
        self, model: Qwen2ForCausalLM, blocks: BlockManager, block_size: int, device: torch.device
    ) -> None:
        self.runner = ModelRunner(model, blocks.num_blocks, block_size, device)
        self.blocks = blocks
        self.computed: dict[str, int] = {}  # draft KV is valid for positions < computed
        self.last: dict[str, _Proposal] = {}

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.last.pop(request_id, None)

    def propose(self, requests: list[Request], ks: list[int]) -> Proposal:
        """The scheduler has reserved KV slots for the ks (Scheduler.reserve_draft_slots)."""
        proposal = Proposal([[] for _ in requests])
        if not any(ks):
            return proposal  # the draft catches up lazily the next time it proposes
        first = self._catch_up(requests, ks, proposal.forwards)
        for i, token in first.items():
            proposal.drafts[i].append(token)
        for j in range(1, max(ks)):
            active = [i for i, k in enumerate(ks) if k > j]
            tokens = self._extend(requests, proposal.drafts, active, proposal.forwards)
            for i, token in zip(active, tokens, strict=True):
                proposal.drafts[i].append(token)
        for r, d in zip(requests, proposal.drafts, strict=True):
            if d:
                self.last[r.request_id] = _Proposal(r.num_tokens, d)
        return proposal

    def lag(self, req: Request) -> int:
        return req.num_tokens - min(self._valid_prefix(req, keep=True), req.num_tokens - 1)

    def _valid_prefix(self, req: Request, keep: bool = False) -> int:
        """Positions whose draft KV matches the request's tokens: earlier proposals' KV stays
        valid for the drafts that were accepted (consumed unless `keep`)."""
        done = self.computed.get(req.request_id, 0)
        last = self.last.get(req.request_id) if keep else self.last.pop(req.request_id, None)
        if last is None:
            return done
        actual = req.token_ids(last.start, last.start + len(last.drafts) - 1)
        drafts = last.drafts[: len(actual)]
        same = next((j for j, (a, b) in enumerate(zip(actual, drafts, strict=True)) if a != b),
                    len(actual))
        return last.start + same

    def _catch_up(self, requests: list[Request], ks: list[int], forwards: list[DraftForward]
                  ) -> dict[int, int]:
        """One forward bringing the draft cache of each request with k > 0 up to date; it
        runs through the last token and yields the first draft token."""
        spans, sampled = [], []
        for i, (r, k) in enumerate(zip(requests, ks, strict=True)):
            if not k:
                continue
            start = min(self._valid_prefix(r), r.num_tokens - 1)
            spans.append(QuerySpan(r.token_ids(start, r.num_tokens), start,
                                  self.blocks.block_table(r.request_id), 1))
            self.computed[r.request_id] = r.num_tokens
            sampled.append(i)
        tokens = self._run(spans, forwards)
        return dict(zip(sampled, tokens, strict=True))

    def _extend(self, requests: list[Request], drafts: list[list[int]], active: list[int],
                forwards: list[DraftForward]) -> list[int]:
        spans = [
            QuerySpan([drafts[i][-1]], requests[i].num_tokens + len(drafts[i]) - 1,
                   self.blocks.block_table(requests[i].request_id), 1)
            for i in active
        ]
        return self._run(spans, forwards)

    def _run(self, spans: list[QuerySpan], forwards: list[DraftForward]) -> list[int]:
        """Greedy draft tokens (q is one-hot, which keeps rejection sampling exact); the
        forward's size and time go to `forwards`."""
        start = time.perf_counter()
        logits = self.runner.execute(self.runner.build_input(spans))
        tokens = logits.argmax(dim=-1).tolist()
        forwards.append(DraftForward(sum(len(span.token_ids) for span in spans), len(spans),
                                     time.perf_counter() - start))
        return tokens
