"""How k is chosen: the policies behind `Speculator`'s one `choose` per step.

`FixedPolicy` drafts every request's cap (num_speculative_tokens, less where the request
cannot emit that many). `GoodputPolicy` prices the step the scheduler is about to build with
the measured cost model and each request's estimated acceptance, and picks the ks that
maximise expected tokens per second (policy.py `choose_ks`); with an ITL target it also picks
the prefill chunk that keeps the step under it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from braid.config import SpecConfig
from braid.core.request import Request
from braid.core.scheduler import NextStep, Scheduler
from braid.spec_decode.cost_model import StepCostModel, attention_work
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

# Warm-up forwards (query tokens, logits rows): verification-like windows that need logits
# at every position (every size up to 8: small forwards are not smooth in size on a CPU, and
# decode batches of a few requests are where k = 1 and k = 2 are told apart), prefill-like
# ones that need one, and draft forwards (one logits row per drafting request).
WARMUP_TARGET = (*((q, q) for q in range(1, 9)), (12, 12), (16, 16), (24, 24), (32, 32),
                 (64, 64), (128, 1))
WARMUP_DRAFT = (*((q, q) for q in range(1, 9)), (12, 12), (16, 16), (32, 1), (64, 1),
                (128, 1))
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
class Window:
    """One running request's speculation for the next step."""

    req: Request
    cap: int  # the most drafts worth proposing (0 while it prefills)
    # drafts from a source that costs no forward, or []; `source` names it: "grammar"
    # (forced tokens), "prediction", "lookup", "suffix", or a model-free method's own
    lookup: list[int] = field(default_factory=list)
    source: str = ""
    level: int | None = None  # the lookup's confidence level, where its source grades it
    # the lookup's leading drafts that its grammar forces, where `source` continues them
    # (0: the lookup is one source's)
    forced: int = 0
    k: int = 0  # the drafts chosen
    drafts: list[int] = field(default_factory=list)  # what it drafts (the lookup's or the model's)
    started: bool = False  # the draft model catches up on a backlog to draft for it

    @property
    def model_k(self) -> int:
        """The drafts the proposer makes for it (none where a lookup drafts)."""
        return 0 if self.lookup else self.k


def _caps(windows: Sequence[Window]) -> list[int]:
    """The most drafts each window can verify: its cap, or as many as its free source has."""
    return [min(w.cap, len(w.lookup)) if w.lookup else w.cap for w in windows]


def usual_lag(config: SpecConfig) -> int:
    """The lag up to which a request is not starting to draft: a model window leaves the
    draft 1-2 tokens behind, a short lookup window up to k + 1 more; a longer lag (its
    prompt, tokens emitted at k = 0) is a backlog that starting must pay. (Within it the lag
    is charged as it is: charging starts only the 1-2 tokens of a drafting request's lag
    measured no better.)"""
    return config.num_speculative_tokens + 1


class FixedPolicy:
    """Every request drafts its cap; nothing is priced or learned."""

    predicted_step_time = 0.0
    cost_error = 0.0

    def choose(self, windows: Sequence[Window], nxt: NextStep) -> None:
        for w in windows:
            w.k = w.cap

    def prefill_cap(self, running: Sequence[Request], nxt: NextStep) -> int | None:
        return None

    def observe_target(self, tokens: int, attention: int, rows: int, seconds: float
                       ) -> float | None:
        """The prediction the step's duration is checked against (None: no cost model)."""
        return None

    def observe_draft(self, tokens: int, rows: int, seconds: float) -> None:
        pass

    def on_started(self, w: Window) -> None:
        """`w`'s request drafts this step (its k > 0, from the draft model)."""

    def on_stopped(self, req: Request) -> None:
        """`req` could draft but does not."""

    def forget(self, request_id: str) -> None:
        """The request finished or lost its KV blocks."""

    def on_idle(self) -> None:
        """No request drafted from the model this step though some could."""

    def warm_up(self, target: ModelRunner, draft: ModelRunner | None, scheduler: Scheduler,
                coarse_head: bool) -> None:
        pass


class GoodputPolicy(FixedPolicy):
    """k per request from expected tokens per second (module docstring)."""

    def __init__(self, config: SpecConfig, proposer: Proposer, max_model_len: int,
                 acceptance: AcceptanceEstimator,
                 free_acceptance: dict[str, AcceptanceEstimator],
                 target_itl: float | None = None) -> None:
        self.config, self.proposer, self.max_model_len = config, proposer, max_model_len
        # the proposer's drafts' acceptance, and each free source's (by Window.source)
        self.acceptance, self.free_acceptance = acceptance, free_acceptance
        self.target_itl = target_itl  # seconds; each step's prefill cap follows from it
        self.cost = StepCostModel()
        self.persistence = StartPersistence(prior=CATCH_UP_HORIZON)
        self.predicted_step_time = 0.0  # of the step the last choice was made for

    @property
    def cost_error(self) -> float:  # type: ignore[override]
        return self.cost.error_ema

    def choose(self, windows: Sequence[Window], nxt: NextStep) -> None:
        """k per window; a lookup not worth verifying leaves its request to the draft model
        (and the plan is made again without it)."""
        if not any(w.cap for w in windows):
            return
        plan, alphas = self._plan(windows, nxt)
        ks = choose_ks(alphas, _caps(windows), plan, self.cost)
        if any(w.lookup and not k for w, k in zip(windows, ks, strict=True)):
            for w, k in zip(windows, ks, strict=True):
                if not k:
                    w.lookup, w.source, w.level, w.forced = [], "", None, 0
            plan, alphas = self._plan(windows, nxt)
            ks = choose_ks(alphas, _caps(windows), plan, self.cost)
        for w, k in zip(windows, ks, strict=True):
            w.k = k
        self.predicted_step_time = step_seconds(alphas, ks, plan, self.cost)

    def prefill_cap(self, running: Sequence[Request], nxt: NextStep) -> int | None:
        """Prefill tokens the ITL target allows in the step about to be built (None: no
        target, or no decodes whose inter-token latency a chunk could stretch)."""
        if self.target_itl is None or not nxt.decoding:
            return None
        return self._plan([Window(r, 0) for r in running], nxt)[0].num_prefill_tokens

    def _plan(self, windows: Sequence[Window], nxt: NextStep) -> tuple[StepPlan, list[float]]:
        """The scheduler's next step (`nxt`: decodes first, then prefill chunks fill the
        budget), what drafting would cost each running request, and the acceptance each is
        planned with: optimistic only where trying costs no more than the usual catch-up
        (see EXPLORE_TRIALS). Requests with a prompt lookup draft from it: no draft forward,
        their own acceptance estimate."""
        free = [bool(w.lookup) for w in windows]
        lags = [0 if f else self.proposer.lag(w.req) for w, f in zip(windows, free, strict=True)]
        starting = [lag > self.usual_lag for lag in lags]
        alphas = [self.free_acceptance[w.source].alpha(w.req.request_id, level=w.level) if f
                  else self.acceptance.alpha(w.req.request_id, optimistic=not start)
                  for w, f, start in zip(windows, free, starting, strict=True)]
        forced = self.free_acceptance["grammar"]
        demand = nxt.num_prefill_tokens
        plan = StepPlan(
            num_decodes=len(nxt.decoding), num_prefill_tokens=demand, budget=nxt.budget,
            num_pending=nxt.num_pending,
            base_attention=sum(attention_work(1, r.num_computed_tokens) for r in nxt.decoding),
            contexts=[w.req.num_computed_tokens for w in windows],
            catch_up=[0.0 if w.req.is_prefilling or f else self._catch_up_cost(w.req, a, lag)
                      for w, a, lag, f in zip(windows, alphas, lags, free, strict=True)],
            free=free,
            heads=[(w.forced, forced.alpha(w.req.request_id)) if w.forced else (0, 1.0)
                   for w in windows],
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

    @property
    def usual_lag(self) -> int:
        return usual_lag(self.config)

    def _catch_up_cost(self, req: Request, alpha: float, lag: int) -> float:
        """Draft tokens request `req` (`lag` tokens behind the draft) adds to the first draft
        forward if it drafts now. The usual lag recurs every step and is charged in full; a
        longer backlog (the prompt, or tokens emitted while its k was 0) is paid once and is
        spread over the steps it will draft: its remaining tokens, at most as many as started
        requests have drafted before they stopped (StartPersistence)."""
        usual = self.usual_lag
        if lag <= usual:
            return float(max(lag, 1))
        remaining = min(self.max_model_len - req.num_tokens, self.persistence.mean)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            remaining = min(remaining, max_tokens - req.num_output_tokens)
        steps = max(1.0, remaining / expected_tokens(alpha, self.config.num_speculative_tokens))
        return usual + (lag - usual) / steps

    def observe_target(self, tokens: int, attention: int, rows: int, seconds: float
                       ) -> float | None:
        predicted = self.cost.target_time(tokens, attention, rows)
        self.cost.observe_target(tokens, attention, rows, seconds)
        return predicted

    def observe_draft(self, tokens: int, rows: int, seconds: float) -> None:
        self.cost.observe_draft(tokens, rows, seconds)

    def on_started(self, w: Window) -> None:
        self.persistence.drafting(w.req.request_id, w.req.num_output_tokens, w.started)

    def on_stopped(self, req: Request) -> None:
        self.persistence.stopped(req.request_id, req.num_output_tokens)

    def forget(self, request_id: str) -> None:
        self.persistence.stopped(request_id)

    def on_idle(self) -> None:
        self.persistence.idle()

    def warm_up(self, target: ModelRunner, draft: ModelRunner | None, scheduler: Scheduler,
                coarse_head: bool) -> None:
        """A few synthetic forwards of different sizes so the first decisions are not blind
        (seconds); they stay in the cost model as anchors. `coarse_head`: greedy drafts go
        through the draft's coarse head."""
        start = time.perf_counter()
        largest = max(n for n, _ in WARMUP_TARGET + WARMUP_DRAFT)
        with scheduler.scratch_blocks(largest) as tables:
            if tables is None:
                return
            for n, rows in WARMUP_TARGET:
                self.cost.observe_target(n, attention_work(n, 0), rows,
                                         _time_forward(target, tables, n, rows), anchor=True)
            if draft is not None:
                for n, rows in WARMUP_DRAFT:
                    self.cost.observe_draft(
                        n, rows, _time_forward(draft, tables, n, rows, coarse_head),
                        anchor=True)
        logger.info("speculation cost model warmed up in %.1f s: target step %.0f ms at 1 "
                    "token, %.0f ms at %d", time.perf_counter() - start,
                    self.cost.target_time(1) * 1e3, self.cost.target_time(64) * 1e3, 64)


def _time_forward(runner: ModelRunner, tables: list[list[int]], n: int, rows: int,
                  greedy: bool = False) -> float:
    """Best of two timed forwards (after an untimed one that pays first-call costs): the
    anchors should describe the machine, not a hiccup. A forward longer than a quarter
    second is timed once (a hiccup is small beside it, and warm-up stays short). `tables`:
    one per layer group (a draft model reads the first); `greedy`: argmax ids instead of
    logits (ModelRunner.execute_greedy)."""
    window = QuerySpan([0] * n, 0, tables[0], rows, more_tables=tuple(tables[1:]))
    execute = runner.execute_greedy if greedy else runner.execute
    execute(runner.build_input([window]))
    times: list[float] = []
    while len(times) < 2 and sum(times) < 0.25:
        start = time.perf_counter()
        execute(runner.build_input([window]))
        times.append(time.perf_counter() - start)
    return min(times)
