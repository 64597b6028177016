"""Speculation as the engine sees it: after every step, pick k per request (policy), get that
many drafts (proposer), and learn from what verification accepted and what steps cost."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

from braid.config import SpecConfig
from braid.engine.block_manager import BlockManager
from braid.engine.request import Request
from braid.engine.runner import ModelRunner, Window
from braid.spec.cost_model import StepCostModel
from braid.spec.policy import (
    AcceptanceEstimator,
    StepPlan,
    choose_ks,
    prefill_under_target,
)
from braid.spec.proposer import Proposer

logger = logging.getLogger("braid")

# Prior acceptance before any verification (roughly what each method gets on code).
PRIOR_ALPHA = {"draft_model": 0.7, "ngram": 0.3}
WARMUP_TARGET_TOKENS = (1, 8, 32, 96)
LOG_EVERY = 100  # steps between cost-model log lines
WARMUP_DRAFT_TOKENS = (1, 8, 32)


class Speculator:
    def __init__(self, spec: SpecConfig, proposer: Proposer, budget: int, max_model_len: int,
                 chunked_prefill: bool, target_itl: float | None = None) -> None:
        self.spec = spec
        self.proposer = proposer
        self.budget = budget
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.target_itl = target_itl  # seconds; the next step's prefill cap follows from it
        self.prefill_cap: int | None = None
        self.acceptance = AcceptanceEstimator(prior=PRIOR_ALPHA[spec.method])
        self.cost = StepCostModel()
        self.chosen_k: Counter[int] = Counter()  # how often each k was chosen for a request
        self.predicted_step_time = 0.0  # of the step the last proposal was made for
        self._steps = 0

    # ---- per step -----------------------------------------------------------------------

    def propose(self, running: Sequence[Request], waiting: Sequence[Request]) -> None:
        """Set spec_token_ids of every running request for the next step."""
        caps = [0 if r.is_prefilling else self._cap(r) for r in running]
        ks = self._choose(running, waiting, caps)
        drafts = self.proposer.propose(list(running), ks)
        for r, d in zip(running, drafts, strict=True):
            r.spec_token_ids = d
            if not r.is_prefilling:
                self.chosen_k[len(d)] += 1

    def _cap(self, req: Request) -> int:
        """Drafts beyond what the request can still emit are waste."""
        k = min(self.spec.num_speculative_tokens, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _choose(self, running: Sequence[Request], waiting: Sequence[Request],
                caps: list[int]) -> list[int]:
        if self.spec.policy == "fixed":
            return caps
        plan = self._plan(running, waiting)  # also sets the ITL target's prefill cap
        if not any(caps):
            return caps
        alphas = [self.acceptance.alpha(r.request_id) for r in running]
        ks = choose_ks(alphas, caps, plan, self.cost)
        self.predicted_step_time = self.cost.target_time(
            plan.num_decodes + plan.num_prefill_tokens + sum(ks), plan.num_requests,
            plan.context_tokens)
        return ks

    def _plan(self, running: Sequence[Request], waiting: Sequence[Request]) -> StepPlan:
        """What the scheduler will put in the next step besides drafts (decodes go first,
        then prefill chunks fill the budget)."""
        decodes = sum(1 for r in running if not r.is_prefilling)
        demand = sum(r.num_tokens - r.num_computed_tokens for r in running if r.is_prefilling)
        if self.chunked_prefill:
            demand += sum(r.num_tokens for r in waiting)
        else:
            demand = 0  # prompts run in steps of their own
        demand = min(demand, max(0, self.budget - decodes))
        plan = StepPlan(
            num_decodes=decodes, num_prefill_tokens=demand,
            num_requests=len(running) + (1 if waiting and demand else 0),
            context_tokens=sum(r.num_computed_tokens for r in running), budget=self.budget)
        if self.target_itl is not None and decodes:
            # ITL target: the biggest prefill chunk that keeps the step under it, then drafts
            # only where they still fit (choose_ks rejects plans over max_seconds).
            plan.max_seconds = self.target_itl
            plan.num_prefill_tokens = prefill_under_target(demand, plan, self.cost)
        self.prefill_cap = plan.num_prefill_tokens if self.target_itl is not None else None
        return plan

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.update(req.request_id, num_drafted, num_accepted)

    def observe_step(self, tokens: int, requests: int, context: int, seconds: float) -> None:
        if self.spec.policy != "goodput":
            return
        predicted = self.cost.target_time(tokens, requests, context)
        self.cost.observe_target(tokens, requests, context, seconds)
        self._steps += 1
        if self._steps % LOG_EVERY == 0:
            logger.info("cost model: step of %d tokens predicted %.0f ms, took %.0f ms; mean "
                        "relative error %.1f%%; acceptance estimate %.2f; k chosen %s",
                        tokens, predicted * 1e3, seconds * 1e3, self.cost.error_ema * 100,
                        self.acceptance.global_alpha, dict(sorted(self.chosen_k.items())))

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if self.spec.policy == "goodput":
            self.cost.observe_draft(tokens, seconds)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.acceptance.forget(request_id)

    def request_figures(self, req: Request) -> dict[str, float]:
        return {"acceptance_estimate": round(self.acceptance.alpha(req.request_id), 4)}

    # ---- start-up -----------------------------------------------------------------------

    def warm_up(self, target: ModelRunner, draft: ModelRunner | None,
                blocks: BlockManager) -> None:
        """A few synthetic forwards of different sizes so the first decisions are not blind
        (seconds); they stay in the cost model as anchors."""
        if self.spec.policy != "goodput":
            return
        start = time.perf_counter()
        rid = "__warmup__"
        sizes = [n for n in WARMUP_TARGET_TOKENS if n <= self.budget]
        if not blocks.allocate(rid, max(sizes)):
            return
        try:
            for n in sizes:
                self.cost.observe_target(n, 1, 0, _time_forward(target, blocks, rid, n),
                                         anchor=True)
            if draft is not None:
                for n in [n for n in WARMUP_DRAFT_TOKENS if n <= max(sizes)]:
                    self.cost.observe_draft(n, _time_forward(draft, blocks, rid, n), anchor=True)
        finally:
            blocks.free(rid)
        logger.info("speculation cost model warmed up in %.1f s: target step %.0f ms at 1 "
                    "token, %.0f ms at %d", time.perf_counter() - start,
                    self.cost.target_time(1, 1, 0) * 1e3,
                    self.cost.target_time(max(sizes), 1, 0) * 1e3, max(sizes))


def _time_forward(runner: ModelRunner, blocks: BlockManager, rid: str, n: int) -> float:
    """Best of two timed forwards (after an untimed one that pays first-call costs): the
    anchors should describe the machine, not a hiccup."""
    window = Window([0] * n, 0, blocks.block_table(rid), 1)
    runner.execute(runner.build_input([window]))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        runner.execute(runner.build_input([window]))
        times.append(time.perf_counter() - start)
    return min(times)
