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
from braid.engine.runner import ModelRunner, QuerySpan
from braid.spec_decode.cost_model import StepCostModel, attention_work
from braid.spec_decode.policy import (
    AcceptanceEstimator,
    StepPlan,
    choose_ks,
    expected_tokens,
    prefill_under_target,
    step_seconds,
)
from braid.spec_decode.proposer import Proposer

logger = logging.getLogger("braid")

# Prior acceptance before any verification (roughly what each method gets on code).
PRIOR_ALPHA = {"draft_model": 0.7, "ngram": 0.3}
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
# most this many of the request's future tokens when deciding whether to start drafting.
CATCH_UP_HORIZON = 256
# A request that would start drafting (catching the draft up on a backlog) must be predicted
# to speed its own tokens up by at least this much; see choose_ks.
START_MARGIN = 0.05


class Speculator:
    def __init__(self, spec: SpecConfig, proposer: Proposer, budget: int, max_model_len: int,
                 chunked_prefill: bool, target_itl: float | None = None,
                 max_num_seqs: int = 256) -> None:
        self.config = spec
        self.proposer = proposer
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.target_itl = target_itl  # seconds; each step's prefill cap follows from it
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
        k = min(self.config.num_speculative_tokens, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _choose(self, running: Sequence[Request], waiting: Sequence[Request],
                caps: list[int]) -> list[int]:
        if self.config.policy == "fixed":
            return caps
        alphas = [self.acceptance.alpha(r.request_id) for r in running]
        plan = self._plan(running, waiting, alphas)
        if not any(caps):
            return caps
        ks = choose_ks(alphas, caps, plan, self.cost)
        self.predicted_step_time = step_seconds(alphas, ks, plan, self.cost)
        return ks

    def _plan(self, running: Sequence[Request], waiting: Sequence[Request],
              alphas: list[float]) -> StepPlan:
        """What the scheduler will put in the next step besides drafts (decodes go first,
        then prefill chunks fill the budget), and what drafting would cost each request."""
        decoding = [r for r in running if not r.is_prefilling]
        prefilling = [r for r in running if r.is_prefilling]
        demand = sum(r.num_tokens - r.num_computed_tokens for r in prefilling)
        if self.chunked_prefill:
            demand += sum(r.num_tokens for r in waiting)
        else:
            demand = 0  # prompts run in steps of their own
        demand = min(demand, max(0, self.budget - len(decoding)))
        pending = min(len(prefilling) + len(waiting), self.max_num_seqs - len(decoding))
        contexts = [r.num_computed_tokens for r in running]
        lags = [self.proposer.lag(r) for r in running]
        plan = StepPlan(
            num_decodes=len(decoding), num_prefill_tokens=demand, budget=self.budget,
            num_pending=max(0, pending),
            base_attention=sum(attention_work(1, r.num_computed_tokens) for r in decoding),
            contexts=contexts,
            catch_up=[0.0 if r.is_prefilling else self._catch_up_cost(r, a, lag)  # never drafts
                      for r, a, lag in zip(running, alphas, lags, strict=True)],
            starting=[lag > self._usual_lag for lag in lags],
            start_margin=START_MARGIN)
        chunk_context = prefilling[0].num_computed_tokens if prefilling else 0
        if self.target_itl is not None and decoding:
            # ITL target: the biggest prefill chunk that keeps the step under it, then drafts
            # only where they still fit (choose_ks rejects plans over max_seconds).
            plan.max_seconds = self.target_itl
            plan.num_prefill_tokens = prefill_under_target(demand, plan, self.cost,
                                                           chunk_context)
        plan.prefill_attention = attention_work(plan.num_prefill_tokens, chunk_context)
        return plan

    def prefill_cap(self, running: Sequence[Request], waiting: Sequence[Request]) -> int | None:
        """Prefill tokens the ITL target allows in a step over these requests (None: no
        target, or no decodes whose inter-token latency a chunk could stretch)."""
        if self.target_itl is None or all(r.is_prefilling for r in running):
            return None
        alphas = [self.acceptance.alpha(r.request_id) for r in running]
        return self._plan(running, waiting, alphas).num_prefill_tokens

    @property
    def _usual_lag(self) -> int:
        """What a drafting request's window leaves the draft behind by (the accepted drafts
        and the bonus token); a longer lag is a backlog that starting to draft must pay."""
        return self.config.num_speculative_tokens + 1

    def _catch_up_cost(self, req: Request, alpha: float, lag: int) -> float:
        """Draft tokens request `req` (`lag` tokens behind the draft) adds to the first draft
        forward if it drafts now. The usual lag recurs every step and is charged in full; a
        longer backlog (the prompt, or tokens emitted while its k was 0) is paid once and is
        spread over the steps the request has left."""
        usual = self._usual_lag
        if lag <= usual:
            return float(max(lag, 1))
        remaining = min(self.max_model_len - req.num_tokens, CATCH_UP_HORIZON)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            remaining = min(remaining, max_tokens - req.num_output_tokens)
        steps = max(1.0, remaining / expected_tokens(alpha, self.config.num_speculative_tokens))
        return usual + (lag - usual) / steps

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.update(req.request_id, num_drafted, num_accepted)

    def observe_step(self, tokens: int, attention: int, rows: int, seconds: float) -> None:
        if self.config.policy != "goodput":
            return
        predicted = self.cost.target_time(tokens, attention, rows)
        self.cost.observe_target(tokens, attention, rows, seconds)
        self._steps += 1
        if self._steps % LOG_EVERY == 0:
            logger.info("cost model: step of %d tokens predicted %.0f ms, took %.0f ms; mean "
                        "relative error %.1f%%; acceptance estimate %.2f; k chosen %s",
                        tokens, predicted * 1e3, seconds * 1e3, self.cost.error_ema * 100,
                        self.acceptance.global_alpha, dict(sorted(self.chosen_k.items())))

    def observe_draft(self, tokens: int, rows: int, seconds: float) -> None:
        if self.config.policy == "goodput":
            self.cost.observe_draft(tokens, rows, seconds)

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
        if self.config.policy != "goodput":
            return
        start = time.perf_counter()
        rid = "__warmup__"
        largest = max(n for n, _ in WARMUP_TARGET + WARMUP_DRAFT)
        if not blocks.allocate(rid, largest):
            return
        try:
            for n, rows in WARMUP_TARGET:
                self.cost.observe_target(n, attention_work(n, 0), rows,
                                         _time_forward(target, blocks, rid, n, rows), anchor=True)
            if draft is not None:
                for n, rows in WARMUP_DRAFT:
                    self.cost.observe_draft(n, rows, _time_forward(draft, blocks, rid, n, rows),
                                            anchor=True)
        finally:
            blocks.free(rid)
        logger.info("speculation cost model warmed up in %.1f s: target step %.0f ms at 1 "
                    "token, %.0f ms at %d", time.perf_counter() - start,
                    self.cost.target_time(1) * 1e3, self.cost.target_time(64) * 1e3, 64)


def _time_forward(runner: ModelRunner, blocks: BlockManager, rid: str, n: int, rows: int
                  ) -> float:
    """Best of two timed forwards (after an untimed one that pays first-call costs): the
    anchors should describe the machine, not a hiccup. A forward longer than a quarter
    second is timed once (a hiccup is small beside it, and warm-up stays short)."""
    window = QuerySpan([0] * n, 0, blocks.block_table(rid), rows)
    runner.execute(runner.build_input([window]))
    times: list[float] = []
    while len(times) < 2 and sum(times) < 0.25:
        start = time.perf_counter()
        runner.execute(runner.build_input([window]))
        times.append(time.perf_counter() - start)
    return min(times)
