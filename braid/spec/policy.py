"""How many tokens to draft for each request, every step.

`fixed`: the configured k for everyone. `goodput`: k_i chosen to maximize expected emitted
tokens per second of the next step, from each request's measured acceptance and an online
model of step cost, inside the token budget the scheduler will share with prefill chunks.
Under compute-bound load the extra query tokens cost more than they return, and every k is 0.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from braid.spec.cost_model import StepCostModel


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens a window of k drafts emits (accepted + the bonus/recovered token),
    when each draft is accepted with probability alpha given the previous ones were."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class AcceptanceEstimator:
    """Per-request acceptance alpha: decayed counts of accepted drafts over drafts that were
    tried (a window stops at its first rejection), pulled toward a global estimate so a new
    request starts from what the proposer achieves on average."""

    prior: float = 0.5  # global alpha before any verification
    decay: float = 0.8  # per window: an estimate follows roughly the last 5 windows
    prior_weight: float = 2.0  # pseudo-trials of the global estimate in each request's
    _global: list[float] = field(default_factory=lambda: [0.0, 0.0])  # accepted, trials
    _requests: dict[str, list[float]] = field(default_factory=dict)

    def update(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafted else 0)
        for counts, decay in ((self._requests.setdefault(request_id, [0.0, 0.0]), self.decay),
                              (self._global, 0.99)):
            counts[0] = decay * counts[0] + num_accepted
            counts[1] = decay * counts[1] + trials

    @property
    def global_alpha(self) -> float:
        accepted, trials = self._global
        return (accepted + self.prior * 4) / (trials + 4)

    def alpha(self, request_id: str) -> float:
        accepted, trials = self._requests.get(request_id, (0.0, 0.0))
        g = self.global_alpha
        return min((accepted + g * self.prior_weight) / (trials + self.prior_weight), 0.999)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


@dataclass(slots=True)
class StepPlan:
    """What the next step is expected to hold besides drafts."""

    num_decodes: int  # requests past their prompt: 1 query token each
    num_prefill_tokens: int  # prefill chunk tokens the scheduler will run
    num_requests: int  # requests in the step (decodes + prefilling)
    context_tokens: int  # cached tokens attended to
    budget: int  # max_num_batched_tokens
    max_seconds: float = math.inf  # predicted step time (target + drafting) must stay under


def choose_ks(
    alphas: list[float], max_ks: list[int], plan: StepPlan, cost: StepCostModel
) -> list[int]:
    """Maximize sum_i E(alpha_i, k_i) / (target step time + draft time) over k_i in
    [0, max_ks[i]] with the drafts fitting the budget left after decodes and prefill.

    Drafting K tokens for anyone costs K draft forwards for the batch, so for each K (the
    largest k) the k_i are allocated greedily by marginal gain (E is concave in k, the
    target's cost linear in tokens), and the best K wins."""
    room = max(0, plan.budget - plan.num_decodes - plan.num_prefill_tokens)
    best_ks, best = [0] * len(alphas), goodput_of(alphas, [0] * len(alphas), plan, cost)
    for top in range(1, max(max_ks, default=0) + 1):
        ks = _greedy(alphas, [min(m, top) for m in max_ks], room, plan, cost)
        value = goodput_of(alphas, ks, plan, cost)
        if value > best * (1 + 1e-9):
            best_ks, best = ks, value
    return best_ks


def _greedy(alphas: list[float], caps: list[int], room: int, plan: StepPlan,
            cost: StepCostModel) -> list[int]:
    """Add draft tokens one at a time, each to the request whose next draft adds the most
    expected tokens; return the best prefix of that path (goodput is evaluated in O(1) per
    token from running sums)."""
    ks = [0] * len(alphas)
    heap = [(-(expected_tokens(a, 1) - 1.0), i) for i, a in enumerate(alphas) if caps[i] > 0]
    heapq.heapify(heap)
    emitted = float(len(alphas))
    base_tokens = plan.num_decodes + plan.num_prefill_tokens
    best, best_ks = _ratio(emitted, base_tokens, 0, 0, plan, cost), list(ks)
    drafting = top = total = 0
    while heap and total < room:
        neg_gain, i = heapq.heappop(heap)
        emitted -= neg_gain
        drafting += ks[i] == 0
        ks[i] += 1
        total += 1
        top = max(top, ks[i])
        value = _ratio(emitted, base_tokens + total, drafting, top, plan, cost)
        if value > best * (1 + 1e-9):
            best, best_ks = value, list(ks)
        if ks[i] < caps[i]:
            a = alphas[i]
            gain = expected_tokens(a, ks[i] + 1) - expected_tokens(a, ks[i])
            heapq.heappush(heap, (-gain, i))
    return best_ks


def _ratio(emitted: float, tokens: int, drafting: int, top: int, plan: StepPlan,
           cost: StepCostModel) -> float:
    """Expected emitted tokens per second of a step with `tokens` query tokens, where
    `drafting` requests draft up to `top` tokens (that many batched draft forwards). The
    first draft forward also carries the step's prefill chunk: a draft that proposes must
    have seen every prompt, so speculating during a prefill-heavy step pays for that too."""
    seconds = cost.target_time(tokens, plan.num_requests, plan.context_tokens)
    if top:
        seconds += (cost.draft_time(drafting + plan.num_prefill_tokens)
                    + cost.draft_time(drafting) * (top - 1))
    if seconds > plan.max_seconds:
        return -math.inf
    return emitted / seconds if seconds > 0 else math.inf


def goodput_of(alphas: list[float], ks: list[int], plan: StepPlan, cost: StepCostModel
               ) -> float:
    """Expected emitted tokens per second of the next step with drafts `ks`."""
    emitted = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
    tokens = plan.num_decodes + plan.num_prefill_tokens + sum(ks)
    return _ratio(emitted, tokens, sum(1 for k in ks if k), max(ks, default=0), plan, cost)


def prefill_under_target(demand: int, plan: StepPlan, cost: StepCostModel,
                         min_chunk: int = 16) -> int:
    """Largest prefill chunk (<= demand) whose step, without drafts, is predicted to stay
    under plan.max_seconds; at least `min_chunk` tokens so waiting prompts always move."""
    def fits(p: int) -> bool:
        t = cost.target_time(plan.num_decodes + p, plan.num_requests, plan.context_tokens)
        return t <= plan.max_seconds

    lo, hi = 0, demand  # step time grows with tokens: bisect for the last chunk that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return max(lo, min(min_chunk, demand))
