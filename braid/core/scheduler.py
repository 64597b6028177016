"""Stall-free scheduler: one loop moves each request's num_computed_tokens toward its target.

Decoding requests first (1 + drafts each), then continuing prefill chunks, then new admissions
FCFS, all under one token budget (Sarathi-Serve / vLLM V1). A decode, a prefill chunk, a
recompute after preemption and a verification window are the same thing here: a number of
query tokens starting at num_computed_tokens.

The scheduler is the only writer of scheduling state (num_computed_tokens, output and draft
token ids, status, KV blocks): `schedule` decides a step, `update_from_output` applies what
it produced, `update_draft_token_ids` is the only way drafts enter, and `finish` the only
way a request leaves. Everyone else reads requests or hands results back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

from braid.core.block_manager import BlockManager
from braid.core.fairness import fair_decodes, seat_giver
from braid.core.request import Request, RequestStatus
from braid.core.stats import StepStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # query tokens this step, starting at request.num_computed_tokens
    num_spec_tokens: int  # drafts included at the end of the window (0 for plain steps)

    @property
    def needs_logits(self) -> bool:
        """The span reaches the end of the request's tokens, so the step samples for it."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens + self.num_spec_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Blocks published for KV this step computes (withdrawn if the step fails).
    published: list[int] = field(default_factory=list)
    num_cache_queries: int = 0  # prompt tokens looked up in the prefix cache this step
    num_cache_hits: int = 0  # of which found cached
    held: list[Request] = field(default_factory=list)  # decodes sitting this step out
    # (fair shares: fairness.py)

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

    def step_stats(self, context: int, forward_time: float, step_time: float,
                   kv_usage: float, num_waiting: int) -> StepStats:
        """The step's figures (`context`: the cached tokens its requests attended to)."""
        return StepStats(
            num_requests=len(self.scheduled),
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_batched_tokens - self.num_prefill_tokens,
            num_spec_tokens=self.num_spec_tokens,
            num_context_tokens=context,
            forward_time=forward_time,
            step_time=step_time,
            kv_usage=kv_usage,
            num_preemptions=len(self.preempted),
            num_waiting=num_waiting,
            num_cache_queries=self.num_cache_queries,
            num_cache_hits=self.num_cache_hits,
        )


@dataclass(slots=True)
class NextStep:
    """What the next `schedule` call will run besides drafts, as the scheduler's own rules
    see it now (the speculation policy plans drafts and the ITL cap from this)."""

    budget: int  # max_num_batched_tokens
    decoding: list[Request]  # past their prompt: 1 query token (+ drafts) each
    prefilling: list[Request]  # running, still prefilling: they get no drafts
    num_prefill_tokens: int  # prefill tokens that would ride along (before any cap)
    num_pending: int  # prefilling or waiting requests that will join the decode batch
    chunk_context: int  # cached tokens the first prefill chunk follows


@dataclass(slots=True)
class RequestUpdate:
    """What `update_from_output` did to one scheduled request that emitted tokens."""

    request: Request
    num_new_tokens: int  # output tokens appended (a stop can cut the sampled ones short)
    num_drafts: int  # drafts its window verified (0: plain step)
    num_accepted: int
    finish_reason: str | None  # set when this step finished it
    num_grammar_rejected: int = 0  # drafts proposed for it that its grammar cut


# (request, the token just appended) -> finish reason or None: the output processor's stop
# rules (stop ids, EOS, stop strings, lengths), asked once per appended token.
StopCheck = Callable[[Request, int], str | None]


def _rank(req: Request) -> tuple[int, float]:
    """A request's place under the priority policy: lower priority value, then earlier."""
    return req.priority, req.arrival_time


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        priority: bool = False,
        max_scored_rows: int | None = None,
    ) -> None:
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        # every running request decodes a token each step, within the step's budget
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        if max_num_seqs > max_num_batched_tokens:
            logger.info("--max-num-seqs %d is more than --max-num-batched-tokens %d: at most "
                        "%d requests run at once (each decode takes a token of a step's "
                        "budget)", max_num_seqs, max_num_batched_tokens, self.max_num_seqs)
        self.enable_chunked_prefill = enable_chunked_prefill
        # --scheduling-policy priority: requests ordered by (priority, arrival) instead of
        # FCFS, for admission and (last first) for preemption, as vLLM's priority policy
        self.priority = priority
        # The most prompt positions a request scoring its prompt (prompt_logprobs) computes
        # in a step beside decodes: each is a vocabulary-wide log-softmax and ranking, so
        # its chunks are cut to what keeps the decodes' steps near their usual cost (alone,
        # it takes the whole budget). None: no cut.
        self.max_scored_rows = max_scored_rows
        # Every layer (of the target, and of a draft model) attends in this window: blocks
        # before a request's window are given back after each step. `kv_floor` is the first
        # position a model may still compute KV from (a draft model behind the target: its
        # own progress); by default the request's num_computed_tokens.
        self.sliding_window: int | None = None
        self.kv_floor: Callable[[Request], int] = lambda req: req.num_computed_tokens
        self._beside_decodes = False  # this step has decodes (schedule sets it)
        self.num_steps = 0  # schedule() calls so far
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last one is preempted first
        self._requests: dict[str, Request] = {}  # every unfinished request, by id

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def requests(self) -> Mapping[str, Request]:
        """Every unfinished request (waiting or running), by id; read-only."""
        return MappingProxyType(self._requests)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_cap: int | None = None) -> SchedulerOutput:
        """This step's requests; `prefill_cap` (an ITL target's choice for this very step)
        limits the prefill chunks and admissions that ride with the decodes."""
        out = SchedulerOutput()
        self.num_steps += 1
        self._beside_decodes = False
        budget = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and self._can_admit_whole():
            # Classic prefill-first: whole prompts in a step of their own, ahead of decodes.
            self._admit(out, budget)
            return out
        seat_shared = self._share_seats(out)
        decoding, prefilling = self._split_running()
        decoding, out.held = fair_decodes(decoding)
        self._beside_decodes = bool(decoding)
        for req in out.held:
            req.rest_steps = max(0, req.rest_steps - 1)
        budget = self._schedule_running(out, decoding, budget, decodes=True)
        if self.enable_chunked_prefill:
            if prefill_cap is not None:
                budget = min(budget, prefill_cap)
            budget = self._schedule_running(out, prefilling, budget)
        # Preemptions are settled: publish before admissions, so a request admitted now
        # (another choice of the same prompt, say) shares what this step computes.
        for s in out.scheduled:
            self._publish(s, out)
        # no admission beside a preemption for memory (what it freed is needed back)
        if self.enable_chunked_prefill and len(out.preempted) == seat_shared:
            self._admit(out, budget)
        return out

    def _publish(self, s: ScheduledRequest, out: SchedulerOutput) -> None:
        """Publish the request's full blocks whose KV is final once this step ran: tokens
        before min(num_computed + span, num_tokens), never drafts. A layer writes every
        token's KV before any attention reads it, so a request admitted into this very step
        may read them."""
        req = s.request
        final = min(req.num_computed_tokens + s.num_new_tokens, req.num_tokens)
        if final - self.blocks.num_published_tokens(req.request_id) >= self.blocks.block_size:
            out.published += self.blocks.publish(req.request_id, req.token_ids, final)

    def _split_running(self) -> tuple[list[Request], list[Request]]:
        """Running requests past their prompt (decode first), then those still prefilling;
        under the priority policy, each in priority order (the budget goes to them first,
        and the preemption victims come last)."""
        running = sorted(self.running, key=_rank) if self.priority else self.running
        decoding = [r for r in running if not r.is_prefilling]
        return decoding, [r for r in running if r.is_prefilling]

    def _schedule_running(
        self, out: SchedulerOutput, requests: Sequence[Request], budget: int,
        decodes: bool = False,
    ) -> int:
        """Schedule `requests` in order within `budget`. Each of `decodes` keeps a token of
        the budget for every decode after it, so a budget too short for every window cuts
        drafts (the last decodes' first), never a decode's token."""
        for i, req in enumerate(requests):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            room = max(1, budget - (len(requests) - 1 - i)) if decodes else budget
            n = min(req.num_tokens_with_spec - req.num_computed_tokens, room,
                    self._chunk_limit(req))
            if not self._allocate_or_preempt(req, n, out):
                continue
            # Drafts are cut when the budget is short (the policy should have chosen fewer).
            num_spec = max(0, len(req.spec_token_ids) - (req.num_tokens_with_spec
                                                        - req.num_computed_tokens - n))
            out.scheduled.append(ScheduledRequest(req, n, num_spec))
            req.last_scheduled_step = self.num_steps
            budget -= n
        return budget

    def _share_seats(self, out: SchedulerOutput) -> int:
        """When every seat is taken and the next waiting request's group has none, the
        group that holds the most gives one up (fairness.py `seat_giver`): its newest member
        waits behind that request and recomputes its KV later, from the prefix cache where
        it can. Returns the number of seats given up (0 or 1)."""
        if self.priority or len(self.running) < self.max_num_seqs:
            return 0
        req = self._next_waiting()
        victim = None if req is None else seat_giver(self.running, req)
        if req is None or victim is None:
            return 0
        self._preempt(victim, out)
        self.waiting.remove(victim)
        self.waiting.insert(self.waiting.index(req) + 1, victim)
        return 1

    def rest(self, req: Request, num_steps: int) -> None:
        """Let `req` sit out its next `num_steps` steps while others decode (the engine
        asks it of a request whose grammar masks took much of a step's time)."""
        req.rest_steps = num_steps

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Make room for `n` more tokens of `req`, preempting the newest running requests."""
        while not self.blocks.allocate(req.request_id, req.num_computed_tokens + n):
            victim = max(self.running, key=_rank) if self.priority else self.running[-1]
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
        req.set_drafts([])
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        out.scheduled = [s for s in out.scheduled if s.request is not req]

    def _can_admit_whole(self) -> bool:
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        req = self._next_waiting()
        return req is not None and self.blocks.can_allocate(
            req.request_id, req.num_tokens, self._cached_prefix(req), self._headroom())

    def _headroom(self) -> int:
        """Blocks an admission leaves free: one for each running request and block table
        (a layer group's, GroupedBlocks), whose decodes take a block every block_size
        tokens. Admitted into the last free blocks, a request was the next preemption's
        victim before it decoded a token; under memory pressure requests re-prefilled again
        and again (15 preemptions for a 40-token reply)."""
        return len(self.running) * self.blocks.num_tables

    def _next_waiting(self) -> Request | None:
        """The first waiting request that can run (FCFS, or by priority), passing over those
        whose grammar is still compiling or failed (they keep their place; the engine ends
        failed ones) and those whose prompt scorer has not scored the prompt yet."""
        ready = (r for r in self.waiting if (r.grammar is not None or r.grammar_future is None)
                 and self._scorer_done(r))
        if self.priority:
            return min(ready, key=_rank, default=None)
        return next(ready, None)

    def _scorer_done(self, req: Request) -> bool:
        """Whether the request's prompt scorer (if any) has scored the prompt; one that
        finished without (aborted, failed) leaves the request to score it itself."""
        scorer = req.prompt_scorer
        if scorer is None or scorer.prompt_scored:
            return True
        if scorer.is_finished:
            req.prompt_scorer = None
            return True
        return False

    def _looks_up(self, req: Request) -> bool:
        """Whether admission looks the request's prefix up in the cache: caching is on, and
        the request's prompt logprobs do not need every prompt position's logits."""
        return self.blocks.enable_caching and not req.scores_prompt

    def _cached_prefix(self, req: Request) -> list[int]:
        """Published blocks of the request's prefix. The last token is always computed (its
        logits sample)."""
        if not self._looks_up(req):
            return []
        return self.blocks.find_cached(req.request_id, req.token_ids, req.num_tokens - 1)

    def _chunk_limit(self, req: Request) -> int:
        """The most tokens `req` may compute this step besides the budget's limit."""
        if (self.max_scored_rows is None or not self._beside_decodes
                or not (req.is_prefilling and req.scores_prompt)):
            return req.num_tokens_with_spec
        return self.max_scored_rows

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests FCFS while seats, budget and KV blocks allow (blocks for
        the whole prompt, and `_headroom` more); a cached prefix costs neither budget nor
        new blocks."""
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._next_waiting()
            if req is None:
                break
            cached = self._cached_prefix(req)
            num_cached = len(cached) * self.blocks.block_size
            n = req.num_tokens - num_cached
            if not self.enable_chunked_prefill and n > budget:
                break
            n = min(n, budget, self._chunk_limit(req))
            # blocks for all of it, not just this chunk: a request admitted with its first
            # chunk's blocks alone could find none for the next and preempt itself mid-prefill
            if not self.blocks.allocate(req.request_id, req.num_tokens, cached,
                                        self._headroom()):
                break
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens is None:  # the first admission's figure, as vLLM's
                req.num_cached_tokens = num_cached
                req.first_scheduled_time = time.monotonic()
            if self._looks_up(req):  # as vLLM counts them: lookups made
                out.num_cache_queries += req.num_tokens
                out.num_cache_hits += num_cached
            self.running.append(req)
            scheduled = ScheduledRequest(req, n, 0)
            out.scheduled.append(scheduled)
            self._publish(scheduled, out)
            budget -= n

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished (stop, length, abort, error) and release its KV blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.request_id)
        self._requests.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.set_drafts([])

    # ---- results of a step ---------------------------------------------------------------

    def update_from_output(
        self, sched: SchedulerOutput, sampled: Sequence[list[int]], check_stop: StopCheck
    ) -> list[RequestUpdate]:
        """Apply a step: `sampled[i]` holds the tokens emitted for `sched.scheduled[i]`
        (accepted drafts, then the target's token; empty for a prefill chunk that samples
        nothing). Advances num_computed_tokens, appends tokens until a stop, rolls rejected
        drafts back and finishes stopped requests."""
        updates = []
        for s, tokens in zip(sched.scheduled, sampled, strict=True):
            req = s.request
            if req.is_finished:
                continue  # aborted while its step ran
            req.num_computed_tokens += s.num_new_tokens
            if not tokens:
                continue
            rejected = req.num_grammar_rejected
            req.set_drafts([])
            reason, n = None, 0
            grammar = req.grammar
            while reason is None and n < len(tokens):
                req.output_token_ids.append(tokens[n])
                n += 1
                reason = check_stop(req, tokens[n - 1])
                if reason is None and grammar is not None:
                    reason = grammar.advance(tokens[n - 1])  # "stop" once it is complete
            # Only the last appended token lacks KV. Rejected drafts' KV stays in their slots
            # and is overwritten by the next step, which starts at num_computed_tokens.
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            accepted = len(tokens) - 1 if s.num_spec_tokens else 0
            updates.append(RequestUpdate(req, n, s.num_spec_tokens, accepted, reason,
                                         rejected))
            if s.num_spec_tokens:  # blocks that accepted drafts filled are final now
                self.blocks.publish(req.request_id, req.token_ids, req.num_computed_tokens)
            if reason is not None:
                self.finish(req, reason)
        for s in sched.scheduled:  # the next query is at kv_floor or later
            if not s.request.is_finished:
                self.blocks.release_windows(s.request.request_id, self.kv_floor(s.request),
                                            self.sliding_window)
        return updates

    def discard_published(self, sched: SchedulerOutput) -> None:
        """The step failed before its KV was final: withdraw the blocks it published, and
        send the requests admitted onto them (a prefix this very step was computing) back to
        waiting, where they counted those blocks' tokens as computed (recorded in `sched`)."""
        withdrawn = set(sched.published)
        self.blocks.unpublish(sched.published)
        for req in list(self.running):
            if withdrawn.intersection(self._computed_blocks(req)):
                self._preempt(req, sched)

    def _computed_blocks(self, req: Request) -> list[int]:
        """The blocks of every layer group's table that hold `req`'s computed tokens."""
        n = req.num_computed_tokens // self.blocks.block_size
        return [b for table in self.blocks.block_tables(req.request_id) for b in table[:n]]

    def requeue_dependents(self, sched: SchedulerOutput) -> None:
        """Before a failed step runs again in parts: back to waiting with the requests that
        were admitted onto blocks this step publishes (another request of the step computes
        their KV; a part without that request would read slots nobody wrote)."""
        published = set(sched.published)
        for s in list(sched.scheduled):
            if published.intersection(self._computed_blocks(s.request)):
                self._preempt(s.request, sched)

    def fail(self, req: Request, sched: SchedulerOutput) -> None:
        """Take a request that fails its step alone out of the step and finish it with
        "error", withdrawing the blocks the step published for it (KV never written)."""
        mine = set(sched.published).intersection(
            b for table in self.blocks.block_tables(req.request_id) for b in table)
        self.blocks.unpublish(list(mine))
        sched.published = [b for b in sched.published if b not in mine]
        sched.scheduled = [s for s in sched.scheduled if s.request is not req]
        self.finish(req, "error")

    def update_draft_token_ids(self, drafts: Mapping[str, list[int]]) -> dict[str, int]:
        """Drafts for the next step, by request id (the only way drafts enter). A request with
        a grammar keeps its drafts up to the first one the grammar refuses. Returns, by
        request id, the drafts kept where a grammar cut one that did not follow an end token
        (a sampled draft may be cut there only where the draft was certain of it: the
        worker, which holds the draft's probabilities, checks)."""
        cuts = {}
        for request_id, draft in drafts.items():
            req = self._requests.get(request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            draft, rejected = list(draft), 0
            grammar = req.grammar
            if grammar is not None and draft:
                # Cutting is exact for deterministic drafts (n-gram, greedy: verification
                # draws from p where the cut draft stood). Sampled drafts are drawn under the
                # same grammar (the draft model's rows are masked too), so none is cut but
                # after an EOS (where nothing can matter), or where the draft's constraints
                # left it no token and it took its end token for certain (q one-hot there:
                # p refuses it too, so verification would draw from p). Cutting any other
                # would select on the draft's own sample and bias rejection sampling.
                n = grammar.num_valid(draft)
                if n < len(draft) and not (n > 0 and grammar.is_eos(draft[n - 1])):
                    cuts[request_id] = n
                draft, rejected = draft[:n], len(draft) - n
            req.set_drafts(draft, rejected)
        return cuts

    # ---- what the speculator asks -------------------------------------------------------

    def next_step(self) -> NextStep:
        """The next step as `schedule` would build it now, drafts and caps aside."""
        decoding, prefilling = self._split_running()
        decoding = fair_decodes(decoding)[0]
        demand = 0
        if self.enable_chunked_prefill:  # otherwise prompts run in steps of their own
            demand = sum(r.num_tokens - r.num_computed_tokens for r in prefilling)
            # a waiting request's cached prefix costs nothing (the policy's cost model and
            # the ITL cap see only the tokens that will be computed)
            bs = self.blocks.block_size
            demand += sum(r.num_tokens - bs * len(self._cached_prefix(r)) for r in self.waiting)
        demand = min(demand, max(0, self.max_num_batched_tokens - len(decoding)))
        pending = min(len(prefilling) + len(self.waiting), self.max_num_seqs - len(decoding))
        return NextStep(self.max_num_batched_tokens, decoding, prefilling, demand, max(0, pending),
                        prefilling[0].num_computed_tokens if prefilling else 0)

    def reserve_draft_slots(self, req: Request, k: int) -> int:
        """KV slots for a draft model's k drafts of `req` (drafts 1..k-1 get KV at positions
        num_tokens..num_tokens+k-2): how many drafts fit (k, or fewer if blocks are short;
        the next `schedule` preempts if the verification window does not fit)."""
        if k and not self.blocks.allocate(req.request_id, req.num_tokens + k - 1):
            k = max(0, self.blocks.num_slots(req.request_id) - req.num_tokens + 1)
        return k

    @contextmanager
    def scratch_blocks(self, num_tokens: int) -> Iterator[list[list[int]] | None]:
        """Block tables (one per layer group) covering `num_tokens` slots of no request,
        freed on exit (warm-up forwards); None if the cache is too small."""
        rid = "__scratch__"
        if not self.blocks.allocate(rid, num_tokens, whole=True):
            yield None
            return
        try:
            yield self.blocks.block_tables(rid)
        finally:
            self.blocks.free(rid)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the scheduling state."""
        self.blocks.check_invariants()
        running, waiting = set(map(id, self.running)), set(map(id, self.waiting))
        assert not running & waiting, "a request is both running and waiting"
        assert len(running) + len(waiting) == len(self._requests), "registry out of step"
        assert len(self.running) <= self.max_num_seqs, "more running requests than seats"
        for req in self._requests.values():
            assert req.status != RequestStatus.FINISHED, f"{req.request_id} finished but held"
            assert 0 <= req.num_computed_tokens < req.num_tokens, (
                f"{req.request_id}: num_computed_tokens {req.num_computed_tokens} outside "
                f"[0, {req.num_tokens})")
            slots = self.blocks.num_slots(req.request_id)
            assert slots >= req.num_computed_tokens, f"{req.request_id}: KV of computed " \
                "tokens has no blocks"
            published = self.blocks.num_published_tokens(req.request_id)
            assert published <= req.num_computed_tokens, (
                f"{req.request_id}: published blocks past its computed tokens ({published} > "
                f"{req.num_computed_tokens})")
            if req.status == RequestStatus.WAITING:
                assert not req.spec_token_ids, f"{req.request_id} waits with drafts"
