"""Draft-model proposer: a smaller model with the same vocabulary and its own paged KV cache.

The draft cache uses the target's block tables (same slot layout, its own tensors), so it needs
no block manager of its own; when the target frees a request's blocks the draft forgets it.
Prefix caching covers the draft too: a published block records whether the draft's KV in it
is valid, and a request's catch-up starts after the leading blocks that say so.
Each call first catches every request that drafts up from the draft's own progress to the
request's tokens in one flat forward (its prompt if the draft has not seen it yet, tokens
accepted last step, tokens emitted while its k was 0, and the recovered/bonus token), so drafts
are never computed on a stale cache. Requests with k = 0 are left behind: under load, when the
policy turns speculation off, the draft costs nothing, and the policy weighs the catch-up (the
`lag`) before turning it back on. Then k - 1 more single-token forwards, batched over requests.

Drafts are the draft's argmax after the request's grammar, penalties, logit_bias and
min_tokens, as the target's greedy token is ("greedy"), or for requests that sample a draw
from the draft's own distribution after the request's penalties and filters: with the keyed
number the target's draw at that output position uses ("coupled"), or with a stream of its
own ("independent"); `SpecConfig.draft_sampling_for` picks per request. The q rows of
requests verified by rejection sampling are kept for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from braid.config import SpecConfig
from braid.core.block_manager import BlockManager
from braid.core.request import Request
from braid.models.interface import CausalLM
from braid.spec_decode.proposer import DraftForward, Proposal, Proposer
from braid.structured.grammar import bitmask_after
from braid.worker.constraints import RequestConstraints
from braid.worker.runner import ModelRunner, QuerySpan
from braid.worker.sampler import DRAFT, SAMPLE, SamplingMetadata, apply_penalties, sample_rows
from braid.worker.step import allowed_rows, rows_metadata


@dataclass(slots=True)
class _Proposal:
    start: int  # position of the first draft token
    drafts: list[int]


class DraftModelProposer(Proposer):
    runner: ModelRunner
    needs_kv_slots = True  # drafts 1..k-1 get KV at positions num_tokens..num_tokens+k-2

    def __init__(
        self, model: CausalLM, blocks: BlockManager, block_size: int, device: torch.device,
        spec: SpecConfig | None = None, kv_dtype: torch.dtype | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.runner = ModelRunner(model, blocks.num_blocks, block_size, device, kv_dtype)
        self.runner.logit_ids = None if spec is None else spec.draft_vocab_size
        # greedy forwards through the two-stage head where the model can have one
        self.coarse_head = (spec is None or spec.draft_coarse_head) and model.add_coarse_head()
        self.blocks = blocks
        self.spec = spec  # how each request's drafts are drawn and verified (None: greedy)
        # the target's: min_tokens suppresses them, and a row its constraints leave no token
        # takes the first, in draft rows as in the target's
        self.eos_token_ids = eos_token_ids
        self.computed: dict[str, int] = {}  # draft KV is valid for positions < computed
        self.last: dict[str, _Proposal] = {}
        # each request's lists as tensors (its sampling rows': built once, as the target's)
        self.constraints: dict[str, RequestConstraints] = {}

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.last.pop(request_id, None)
        self.constraints.pop(request_id, None)

    def propose(self, requests: list[Request], ks: list[int]) -> Proposal:
        """The scheduler has reserved KV slots for the ks (Scheduler.reserve_draft_slots)."""
        proposal = Proposal([[] for _ in requests])
        if not any(ks):
            return proposal  # the draft catches up lazily the next time it proposes
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        keeps_q = [self._keeps_q(r) for r in requests]
        active = [i for i, k in enumerate(ks) if k]
        tokens, probs = self._catch_up(requests, active, proposal)
        for j in range(max(ks)):
            if j:
                active = [i for i in active if ks[i] > j]
                tokens, probs = self._extend(requests, active, proposal)
            for row, (i, token) in enumerate(zip(active, tokens, strict=True)):
                proposal.drafts[i].append(token)
                if (q := probs[row]) is not None and keeps_q[i]:
                    q_rows[i].append(q)
        for r, d in zip(requests, proposal.drafts, strict=True):
            if d:
                self.last[r.request_id] = _Proposal(r.num_tokens, d)
        if any(q_rows):
            proposal.probs = [torch.stack(q) if q else None for q in q_rows]
        return proposal

    def _draws(self, req: Request) -> str:
        """"greedy", "coupled" or "independent"."""
        return "greedy" if self.spec is None else self.spec.draft_sampling_for(req.sampling_params)

    def _keeps_q(self, req: Request) -> bool:
        return self.spec is not None and self.spec.verification_for(
            req.sampling_params) == "rejection"

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

    def _catch_up(self, requests: list[Request], active: list[int], proposal: Proposal
                  ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One forward bringing the draft cache of each request in `active` up to date; it
        runs through the last token and yields the first draft token."""
        spans = []
        for i in active:
            r = requests[i]
            start = min(self._valid_prefix(r), r.num_tokens - 1)
            spans.append(QuerySpan(r.token_ids(start, r.num_tokens), start,
                                   self.blocks.block_table(r.request_id), 1))
            self.computed[r.request_id] = r.num_tokens
        out = self._run(spans, [requests[i] for i in active], proposal)
        for i in active:  # shared blocks now serve the draft too
            self.blocks.mark_draft_computed(requests[i].request_id, requests[i].num_tokens)
        return out

    def _extend(self, requests: list[Request], active: list[int], proposal: Proposal
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        drafts = proposal.drafts
        spans = [
            QuerySpan([drafts[i][-1]], requests[i].num_tokens + len(drafts[i]) - 1,
                      self.blocks.block_table(requests[i].request_id), 1)
            for i in active
        ]
        return self._run(spans, [requests[i] for i in active], proposal,
                         [drafts[i] for i in active])

    def _run(self, spans: list[QuerySpan], requests: list[Request], proposal: Proposal,
             drafted: list[list[int]] | None = None
             ) -> tuple[list[int], list[torch.Tensor | None]]:
        """The next draft token of each span's request (after its `drafted` tokens) and the
        q row it was drawn from (None for an argmax); the forward's size and time go to
        `proposal.forwards`."""
        start = time.perf_counter()
        probs: list[torch.Tensor | None] = [None] * len(requests)
        draws = [self._draws(r) for r in requests]
        inp = self.runner.build_input(spans)
        if self.coarse_head and all(d == "greedy" and not _shaped(r)
                                    for d, r in zip(draws, requests, strict=True)):
            tokens = self.runner.execute_greedy(inp)
        else:
            tokens = self._pick(self.runner.execute(inp), requests, draws,
                                drafted or [[] for _ in requests], probs)
        proposal.forwards.append(DraftForward(inp.input_ids.numel(), len(spans),
                                              time.perf_counter() - start))
        return tokens.tolist(), probs

    def _pick(self, logits: torch.Tensor, requests: list[Request], draws: list[str],
              drafted: list[list[int]], probs: list[torch.Tensor | None]) -> torch.Tensor:
        """Each row's draft token from the draft's logits [R, V], as `draws` says; the q rows
        sampled tokens were drawn from go into `probs`."""
        tokens = logits.argmax(dim=-1)
        shaped = [i for i, r in enumerate(requests) if draws[i] == "greedy" and _shaped(r)]
        if shaped:  # the target's argmax sees the grammar, penalties and bias: so does ours
            meta = self._metadata(shaped, requests, drafted, logits)
            tokens[shaped] = apply_penalties(logits[shaped], meta).argmax(dim=-1)
        sampled = [i for i, d in enumerate(draws) if d != "greedy"]
        if sampled:
            # the target's sampling rows at these positions: keyed in the target's stream for
            # coupled draws, in the draft's own for independent ones
            meta = self._metadata(sampled, requests, drafted, logits,
                                  [SAMPLE if draws[i] == "coupled" else DRAFT for i in sampled])
            picked, q = sample_rows(logits[sampled], meta)
            assert q is not None  # every sampled row is a random one
            tokens[sampled] = picked
            for row, i in enumerate(sampled):
                probs[i] = q[row]
        return tokens

    def _metadata(self, rows: list[int], requests: list[Request], drafted: list[list[int]],
                  logits: torch.Tensor, stream: int | list[int] = SAMPLE) -> SamplingMetadata:
        """The target's sampling rows for `rows` of this forward (after their drafts)."""
        vocab = logits.shape[-1]
        masks = [None if (g := requests[i].grammar) is None
                 else bitmask_after(g, drafted[i], vocab) for i in rows]
        return rows_metadata([(requests[i], drafted[i]) for i in rows], vocab, logits.device,
                             self.eos_token_ids, stream,
                             allowed_rows(masks, vocab, logits.device),
                             [self._constraints(requests[i]) for i in rows])

    def _constraints(self, req: Request) -> RequestConstraints:
        found = self.constraints.get(req.request_id)
        if found is None:
            found = RequestConstraints.build(req.sampling_params, req.prompt_token_ids)
            self.constraints[req.request_id] = found
        return found


def _shaped(req: Request) -> bool:
    """Whether the request's greedy token may not be the model's plain argmax."""
    p = req.sampling_params
    return (req.grammar is not None or p.shapes_logits
            or req.num_output_tokens < p.min_tokens)  # its ends are still suppressed
