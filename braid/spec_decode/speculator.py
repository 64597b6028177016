"""Speculation as the engine sees it: after every step, pick k per request (policy), get that
many drafts (proposer), and learn from what verification accepted and what steps cost.

It reads the scheduler (its requests and its view of the next step) and hands drafts back;
the scheduler writes them (`update_draft_token_ids`) and reserves their KV slots."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from braid.config import SpecConfig
from braid.core.request import Request
from braid.core.scheduler import NextStep, Scheduler
from braid.spec_decode.cost_model import StepCostModel, attention_work
from braid.spec_decode.ngram import NgramProposer
from braid.spec_decode.policy import (
    AcceptanceEstimator,
    StartPersistence,
    StepPlan,
    choose_ks,
    expected_tokens,
    prefill_under_target,
    step_seconds,
)
from braid.spec_decode.proposer import Proposer
from braid.worker.runner import ModelRunner, QuerySpan

logger = logging.getLogger("braid")

# Prior acceptance before any verification (roughly what each method gets on code).
PRIOR_ALPHA = {"draft_model": 0.7, "ngram": 0.3}
# Prior of lookups beside a draft model: about what n-grams of 2-5 accept on the target's
# own outputs, code and chat alike (docs/benchmarks.md, What the policy's rules rest on).
LOOKUP_PRIOR_ALPHA = 0.5
# Warm-up forwards (query tokens, logits rows): verification-like windows that need logits
# at every position (every size up to 8: small forwards are not smooth in size on a CPU, and
# decode batches of a few requests are where k = 1 and k = 2 are told apart), prefill-like
# ones that need one, and draft forwards (one logits row per drafting request).
WARMUP_TARGET = (*((q, q) for q in range(1, 9)), (12, 12), (16, 16), (24, 24), (32, 32),
                 (64, 64), (128, 1))
WARMUP_DRAFT = (*((q, q) for q in range(1, 9)), (12, 12), (16, 16), (32, 1), (64, 1),
                (128, 1))
LOG_EVERY = 100  # steps between cost-model log lines
# A draft backlog (a prompt the draft has not seen) is paid once; its cost is spread over at
# most this many of the request's future tokens when deciding whether to start drafting (and
# over fewer where started requests have drafted fewer before they stopped: StartPersistence).
CATCH_UP_HORIZON = 256
# A request that would start drafting (catching the draft up on a backlog) must be predicted
# to speed its own tokens up by at least this much; see choose_ks.
START_MARGIN = 0.05
# Drafting at all needs a predicted gain above the cost model's mean relative error (see
# choose_ks), capped here: the error runs 5-15% in steady serving. Only once the acceptance
# estimate rests on evidence (EXPLORE_TRIALS): before that the gain is predicted from the
# prior, and a margin would stop the policy from ever measuring what drafting accepts.
MAX_DRAFT_MARGIN = 0.15


@dataclass(slots=True)
class SpeculatorFigures:
    """What the speculator tells the outside world (logs, /metrics, benchmarks)."""

    chosen_k: dict[int, int]  # how often each k was chosen for a decoding request
    predicted_step_time: float  # seconds, of the step the last proposal was made for
    cost_model_error: float  # moving mean of the target step's relative prediction error
    acceptance_estimate: float  # global per-draft acceptance (the proposer's own drafts)
    lookup_windows: int  # windows whose drafts came from a prompt lookup instead
    lookup_acceptance_estimate: float | None  # the lookups' own (None: no lookups beside)


class Speculation:
    """What the engine asks of speculation, once per step. This base is speculation off (no
    drafts, nothing to learn, no prefill cap), so the engine runs one path either way;
    `Speculator` below is speculation on."""

    def prefill_cap(self, scheduler: Scheduler) -> int | None:
        """Prefill tokens the next step may carry (None: no cap)."""
        return None

    def propose(self, scheduler: Scheduler
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Drafts for the next step by request id, and the q [k, V] of sampled ones."""
        return {}, {}

    def observe_step(self, tokens: int, attention: int, rows: int, seconds: float) -> None:
        """A target step's size and duration (the cost model's evidence)."""

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """A window of `req`'s drafts was verified."""

    def forget(self, request_id: str) -> None:
        """The request finished or lost its KV blocks (preempted)."""

    def request_figures(self, req: Request) -> dict[str, float | str]:
        return {}

    def figures(self) -> SpeculatorFigures | None:
        return None

    @property
    def draft_runner(self) -> ModelRunner | None:
        """The draft model's runner (its weights and KV cache), if it has one."""
        return None


class Speculator(Speculation):
    def __init__(self, spec: SpecConfig, proposer: Proposer, max_model_len: int,
                 target_itl: float | None = None) -> None:
        self.config = spec
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.target_itl = target_itl  # seconds; each step's prefill cap follows from it
        self.acceptance = AcceptanceEstimator(prior=PRIOR_ALPHA[spec.method])
        # Prompt lookup beside a draft model (SpecConfig.draft_prompt_lookup): its drafts'
        # acceptance is learned apart from the model's (lookups accept markedly less).
        self.lookup = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                       if spec.method == "draft_model" and spec.draft_prompt_lookup else None)
        self.lookup_acceptance = AcceptanceEstimator(prior=LOOKUP_PRIOR_ALPHA)
        self._looked_up: set[str] = set()  # requests whose pending drafts came from a lookup
        self.lookup_windows = 0  # verified windows whose drafts came from a lookup
        self.cost = StepCostModel()
        self.persistence = StartPersistence(prior=CATCH_UP_HORIZON)
        self.chosen_k: Counter[int] = Counter()  # how often each k was chosen for a request
        self.predicted_step_time = 0.0  # of the step the last proposal was made for
        self._steps = 0

    # ---- per step -----------------------------------------------------------------------

    def propose(self, scheduler: Scheduler
                ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """Drafts for the next step of every running request, by request id, and the q
        [k, V] of those the proposer sampled (for rejection sampling)."""
        running = list(scheduler.running)
        caps = [0 if r.is_prefilling else self._cap(r) for r in running]
        found = self._lookups(running, caps)
        ks, lookups = self._choose(running, scheduler.next_step(), caps, found)
        if self.proposer.needs_kv_slots:
            ks = [scheduler.reserve_draft_slots(r, k) for r, k in zip(running, ks, strict=True)]
        # the proposer drafts for the requests without a lookup; it leaves the others behind
        model_ks = [0 if look else k for k, look in zip(ks, lookups, strict=True)]
        backlog = [k > 0 and self.proposer.lag(r) > self._usual_lag
                   for r, k in zip(running, model_ks, strict=True)]
        proposal = self.proposer.propose(running, model_ks)
        for f in proposal.forwards:
            self.observe_draft(f.num_tokens, f.num_rows, f.seconds)
        all_drafts = [look[:k] if look else d
                      for look, k, d in zip(lookups, ks, proposal.drafts, strict=True)]
        for r, d, look, started in zip(running, all_drafts, lookups, backlog, strict=True):
            if r.is_prefilling:
                continue
            self.chosen_k[len(d)] += 1
            self._looked_up.discard(r.request_id)
            if look:
                # neither starts nor stops the draft model's drafting; the tokens this window
                # emits are lag the draft catches up on when the model drafts for the request
                # again, priced then like any backlog beyond the usual lag (a start; counting
                # them as usual lag measured no better: docs/benchmarks.md, What the
                # policy's rules rest on)
                if d:
                    self._looked_up.add(r.request_id)
                self.acceptance.rest(r.request_id)  # no model drafts: its evidence ages
            elif d:
                self.persistence.drafting(r.request_id, r.num_output_tokens, started)
            elif self._cap(r):
                self.persistence.stopped(r.request_id, r.num_output_tokens)
                self.acceptance.rest(r.request_id)
        modelled = [c for c, look in zip(caps, lookups, strict=True) if not look]
        if any(modelled) and not any(proposal.drafts):
            self.acceptance.age()
            self.persistence.idle()
        if any(found) and not any(d for d, look in zip(all_drafts, lookups, strict=True)
                                  if look):
            self.lookup_acceptance.age()  # lookups found, none verified: explore again in time
        drafts = {r.request_id: d for r, d in zip(running, all_drafts, strict=True)}
        probs = {} if proposal.probs is None else {
            r.request_id: q for r, q in zip(running, proposal.probs, strict=True) if q is not None}
        return drafts, probs

    def _cap(self, req: Request) -> int:
        """Drafts beyond what the request can still emit are waste."""
        k = min(self.config.num_speculative_tokens, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _lookups(self, running: Sequence[Request], caps: list[int]) -> list[list[int]]:
        """Per request, what a prompt lookup proposes: `cap` tokens, or [] (none found, a
        shorter one that the draft model would out-draft, or no draft_prompt_lookup)."""
        if self.lookup is None:
            return [[] for _ in running]
        found = self.lookup.propose(list(running), caps).drafts
        return [look if len(look) == cap else [] for look, cap in zip(found, caps, strict=True)]

    def _choose(self, running: Sequence[Request], nxt: NextStep, caps: list[int],
                lookups: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        """k per request, and the lookups to draft from (where k > 0; lookups are full
        length, see `_lookups`)."""
        if self.config.policy == "fixed" or not any(caps):
            return caps, lookups
        plan, alphas = self._plan(running, nxt, lookups)
        ks = choose_ks(alphas, caps, plan, self.cost)
        if any(look and not k for look, k in zip(lookups, ks, strict=True)):
            # a lookup not worth verifying leaves its request to the draft model
            lookups = [look if k else [] for look, k in zip(lookups, ks, strict=True)]
            plan, alphas = self._plan(running, nxt, lookups)
            ks = choose_ks(alphas, caps, plan, self.cost)
        self.predicted_step_time = step_seconds(alphas, ks, plan, self.cost)
        return ks, lookups

    def _plan(self, running: Sequence[Request], nxt: NextStep,
              lookups: list[list[int]] | None = None) -> tuple[StepPlan, list[float]]:
        """The scheduler's next step (`nxt`: decodes first, then prefill chunks fill the
        budget), what drafting would cost each running request, and the acceptance each is
        planned with: optimistic only where trying costs no more than the usual catch-up
        (see EXPLORE_TRIALS). Requests with a prompt lookup (`lookups`) draft from it: no
        draft forward, their own acceptance estimate."""
        free = [bool(look) for look in lookups] if lookups else [False] * len(running)
        contexts = [r.num_computed_tokens for r in running]
        lags = [0 if f else self.proposer.lag(r) for r, f in zip(running, free, strict=True)]
        starting = [lag > self._usual_lag for lag in lags]
        alphas = [self.lookup_acceptance.alpha(r.request_id) if f
                  else self.acceptance.alpha(r.request_id, optimistic=not start)
                  for r, f, start in zip(running, free, starting, strict=True)]
        demand = nxt.num_prefill_tokens
        plan = StepPlan(
            num_decodes=len(nxt.decoding), num_prefill_tokens=demand, budget=nxt.budget,
            num_pending=nxt.num_pending,
            base_attention=sum(attention_work(1, r.num_computed_tokens) for r in nxt.decoding),
            contexts=contexts,
            catch_up=[0.0 if r.is_prefilling or f else self._catch_up_cost(r, a, lag)
                      for r, a, lag, f in zip(running, alphas, lags, free, strict=True)],
            free=free,
            starting=starting,
            start_margin=START_MARGIN,
            draft_margin=self._draft_margin())
        chunk_context = nxt.chunk_context
        if self.target_itl is not None and nxt.decoding:
            # ITL target: the biggest prefill chunk that keeps the step under it, then drafts
            # only where they still fit (choose_ks rejects plans over max_seconds).
            plan.max_seconds = self.target_itl
            plan.num_prefill_tokens = prefill_under_target(demand, plan, self.cost,
                                                           chunk_context)
        plan.prefill_attention = attention_work(plan.num_prefill_tokens, chunk_context)
        return plan, alphas

    def _draft_margin(self) -> float:
        """The gain a plan with drafts must show over none (see MAX_DRAFT_MARGIN)."""
        if not self.acceptance.has_evidence:
            return 0.0
        return min(self.cost.error_ema, MAX_DRAFT_MARGIN)

    def prefill_cap(self, scheduler: Scheduler) -> int | None:
        """Prefill tokens the ITL target allows in the step the scheduler is about to build
        (None: no target, or no decodes whose inter-token latency a chunk could stretch)."""
        nxt = scheduler.next_step()
        if self.target_itl is None or not nxt.decoding:
            return None
        return self._plan(list(scheduler.running), nxt)[0].num_prefill_tokens

    @property
    def _usual_lag(self) -> int:
        """The lag up to which a request is not starting to draft: a model window leaves the
        draft 1-2 tokens behind, a short lookup window up to k + 1 more; a longer lag (its
        prompt, tokens emitted at k = 0) is a backlog that starting must pay. (Within it the
        lag is charged as it is: charging starts only the 1-2 tokens of a drafting request's
        lag measured no better.)"""
        return self.config.num_speculative_tokens + 1

    def _catch_up_cost(self, req: Request, alpha: float, lag: int) -> float:
        """Draft tokens request `req` (`lag` tokens behind the draft) adds to the first draft
        forward if it drafts now. The usual lag recurs every step and is charged in full; a
        longer backlog (the prompt, or tokens emitted while its k was 0) is paid once and is
        spread over the steps it will draft: its remaining tokens, at most as many as started
        requests have drafted before they stopped (StartPersistence)."""
        usual = self._usual_lag
        if lag <= usual:
            return float(max(lag, 1))
        remaining = min(self.max_model_len - req.num_tokens, self.persistence.mean)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            remaining = min(remaining, max_tokens - req.num_output_tokens)
        steps = max(1.0, remaining / expected_tokens(alpha, self.config.num_speculative_tokens))
        return usual + (lag - usual) / steps

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        looked_up = req.request_id in self._looked_up
        self._looked_up.discard(req.request_id)
        self.lookup_windows += looked_up
        estimator = self.lookup_acceptance if looked_up else self.acceptance
        estimator.update(req.request_id, num_drafted, num_accepted)

    def observe_step(self, tokens: int, attention: int, rows: int, seconds: float) -> None:
        if self.config.policy != "goodput":
            return
        predicted = self.cost.target_time(tokens, attention, rows)
        self.cost.observe_target(tokens, attention, rows, seconds)
        self._steps += 1
        if self._steps % LOG_EVERY == 0:
            logger.info("cost model: step of %d tokens predicted %.0f ms, took %.0f ms; mean "
                        "relative error %.1f%%; acceptance estimate %.2f; k chosen %s; %d "
                        "windows from prompt lookups",
                        tokens, predicted * 1e3, seconds * 1e3, self.cost.error_ema * 100,
                        self.acceptance.global_alpha, dict(sorted(self.chosen_k.items())),
                        self.lookup_windows)

    def observe_draft(self, tokens: int, rows: int, seconds: float) -> None:
        if self.config.policy == "goodput":
            self.cost.observe_draft(tokens, rows, seconds)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.acceptance.forget(request_id)
        self.lookup_acceptance.forget(request_id)
        if self.lookup is not None:
            self.lookup.forget(request_id)
        self._looked_up.discard(request_id)
        self.persistence.stopped(request_id)

    def request_figures(self, req: Request) -> dict[str, float | str]:
        """Per-response figures: the acceptance estimates (the model's, and the lookups'
        where they draft beside it), and how this request's drafts were verified and (draft
        model) drawn."""
        figures: dict[str, float | str] = {
            "acceptance_estimate": round(self.acceptance.alpha(req.request_id), 4),
            "verification": self.config.verification_for(req.sampling_params),
        }
        if self.config.method == "draft_model":
            figures["draft_sampling"] = self.config.draft_sampling_for(req.sampling_params)
        if self.lookup is not None:
            figures["lookup_acceptance_estimate"] = round(
                self.lookup_acceptance.alpha(req.request_id), 4)
        return figures

    @property
    def draft_runner(self) -> ModelRunner | None:
        return self.proposer.runner

    def figures(self) -> SpeculatorFigures:
        return SpeculatorFigures(
            dict(self.chosen_k), self.predicted_step_time, self.cost.error_ema,
            self.acceptance.global_alpha, self.lookup_windows,
            None if self.lookup is None else self.lookup_acceptance.global_alpha)

    # ---- start-up -----------------------------------------------------------------------

    def warm_up(self, target: ModelRunner, draft: ModelRunner | None,
                scheduler: Scheduler) -> None:
        """A few synthetic forwards of different sizes so the first decisions are not blind
        (seconds); they stay in the cost model as anchors."""
        if self.config.policy != "goodput":
            return
        start = time.perf_counter()
        largest = max(n for n, _ in WARMUP_TARGET + WARMUP_DRAFT)
        with scheduler.scratch_blocks(largest) as table:
            if table is None:
                return
            for n, rows in WARMUP_TARGET:
                self.cost.observe_target(n, attention_work(n, 0), rows,
                                         _time_forward(target, table, n, rows), anchor=True)
            if draft is not None:
                # greedy drafts go through the draft's coarse head where it has one
                greedy = self.proposer.coarse_head
                for n, rows in WARMUP_DRAFT:
                    self.cost.observe_draft(n, rows, _time_forward(draft, table, n, rows, greedy),
                                            anchor=True)
        logger.info("speculation cost model warmed up in %.1f s: target step %.0f ms at 1 "
                    "token, %.0f ms at %d", time.perf_counter() - start,
                    self.cost.target_time(1) * 1e3, self.cost.target_time(64) * 1e3, 64)


def _time_forward(runner: ModelRunner, table: list[int], n: int, rows: int,
                  greedy: bool = False) -> float:
    """Best of two timed forwards (after an untimed one that pays first-call costs): the
    anchors should describe the machine, not a hiccup. A forward longer than a quarter
    second is timed once (a hiccup is small beside it, and warm-up stays short). `greedy`:
    argmax ids instead of logits (ModelRunner.execute_greedy)."""
    window = QuerySpan([0] * n, 0, table, rows)
    execute = runner.execute_greedy if greedy else runner.execute
    execute(runner.build_input([window]))
    times: list[float] = []
    while len(times) < 2 and sum(times) < 0.25:
        start = time.perf_counter()
        execute(runner.build_input([window]))
        times.append(time.perf_counter() - start)
    return min(times)
