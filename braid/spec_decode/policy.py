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

import numpy as np

from braid.spec_decode.cost_model import StepCostModel, attention_work

# Trials of global evidence after which a request the draft must first catch up on (its
# prompt) is planned with the plain global acceptance, not the optimistic one: the catch-up
# is a draft forward over the whole backlog, a costly way to explore once the evidence is in
# (on chat, where the draft is accepted ~0.6, the optimism started requests whose catch-up
# was then spent on a few windows).
EXPLORE_TRIALS = 16
# Per step in which no request drafts, the global evidence is worth this much less (its mean
# unchanged), down to half of EXPLORE_TRIALS. Without it a policy that stopped drafting never
# measured again: requests that accepted poorly early on kept every later request at k = 0 (a
# fresh engine at concurrency 1 stayed at k = 0 for most of a HumanEval run). After ~150 idle
# steps starting requests plan with the optimistic estimate again: the measured mean plus
# about 0.1, which restarts drafting where the mean was near break-even and nowhere else.
IDLE_DECAY = 0.98
# How far idle steps age the evidence of a source whose drafts cost no forward (prompt
# lookup, suffix decoding, a prediction, forced tokens): to nothing, so the prior's optimism
# returns and the source is tried again (a try costs one window's verification, no
# catch-up); a draft model's stops at DRAFT_MODEL_AGE_FLOOR. Measured in docs/benchmarks.md,
# The acceptance estimate on replayed windows.
FREE_AGE_FLOOR = 0.0
DRAFT_MODEL_AGE_FLOOR = EXPLORE_TRIALS / 2
# The weights of the global estimate in a request's own (pseudo-trials) among which
# PriorWeight chooses, and the one used until it has seen PRIOR_WEIGHT_WINDOWS windows.
PRIOR_WEIGHTS = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0])
DEFAULT_PRIOR_WEIGHT = 4.0
PRIOR_WEIGHT_WINDOWS = 32
# Pseudo-trials of the global estimate in a confidence level's (AcceptanceEstimator.alpha).
LEVEL_WEIGHT = 8.0


def age_floor(free: bool) -> float:
    """The age floor of a source's acceptance evidence: `free`, its drafts cost no forward."""
    return FREE_AGE_FLOOR if free else DRAFT_MODEL_AGE_FLOOR


def expected_tokens(alpha: float, k: int, head: int = 0, head_alpha: float = 1.0) -> float:
    """Expected tokens a window of k drafts emits (accepted + the bonus/recovered token),
    when each draft is accepted with probability alpha given the previous ones were; the
    first `head` drafts (a grammar's forced tokens that another source continues) with
    head_alpha instead."""
    if head > 0:
        h = min(head, k)
        first = expected_tokens(head_alpha, h)
        if k == h:
            return first
        reach = head_alpha ** h  # every head draft accepted
        return first + reach * (expected_tokens(alpha, k - h) - 1.0)
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class PriorWeight:
    """How much the global estimate weighs in a request's (pseudo-trials), fitted to the
    windows verified so far: empirical Bayes, the prior's strength chosen by how well each
    candidate would have predicted what the windows accepted (the log-likelihood of every
    window's accepted drafts and its rejection, at the alpha each weight gives the request
    from its evidence before the window and the plain global estimate). Where requests
    accept alike a request's few recent windows are mostly noise and a heavy weight wins;
    where they differ, or drift within a request, a light one does."""

    decay: float = 0.998  # per window: the fit follows roughly the last 500 windows
    windows: int = 0
    value: float = DEFAULT_PRIOR_WEIGHT  # the weight in use
    _loss: np.ndarray = field(default_factory=lambda: np.zeros(len(PRIOR_WEIGHTS)))

    def observe(self, counts: list[float], g: float, num_accepted: int, rejected: bool
                ) -> None:
        """A window of a request whose decayed (accepted, trials) were `counts` before it,
        the global estimate `g`: it accepted `num_accepted` drafts, then one was rejected
        (or not: the window was accepted whole)."""
        alpha = np.clip((counts[0] + g * PRIOR_WEIGHTS) / (counts[1] + PRIOR_WEIGHTS),
                        1e-3, 0.999)
        loss = -num_accepted * np.log(alpha) - (np.log1p(-alpha) if rejected else 0.0)
        self._loss = self.decay * self._loss + loss
        self.windows += 1
        if self.windows >= PRIOR_WEIGHT_WINDOWS:
            self.value = float(PRIOR_WEIGHTS[int(np.argmin(self._loss))])


@dataclass
class AcceptanceEstimator:
    """Per-request acceptance alpha: decayed counts of accepted drafts over drafts that were
    tried (a window stops at its first rejection), pulled toward a global estimate so a new
    request starts from what the proposer achieves on average, with a weight fitted to the
    windows seen so far (PriorWeight; `fixed_weight` instead keeps one)."""

    prior: float = 0.5  # global alpha before any verification
    decay: float = 0.9  # per window: an estimate follows roughly the last 10 windows
    fixed_weight: float | None = None  # pseudo-trials of the global estimate (None: fitted)
    # trials of global evidence idle steps age it down to (FREE_AGE_FLOOR for free sources)
    age_floor: float = DRAFT_MODEL_AGE_FLOOR
    weight: PriorWeight = field(default_factory=PriorWeight)
    _global: list[float] = field(default_factory=lambda: [0.0, 0.0])  # accepted, trials
    _requests: dict[str, list[float]] = field(default_factory=dict)
    # accepted, trials by confidence level, decayed and aged as _global is
    _levels: dict[int, list[float]] = field(default_factory=dict)

    @property
    def prior_weight(self) -> float:
        """Pseudo-trials of the global estimate in each request's."""
        return self.weight.value if self.fixed_weight is None else self.fixed_weight

    def update(self, request_id: str, num_drafted: int, num_accepted: int,
               level: int | None = None) -> None:
        """A window of `num_drafted` drafts (of confidence `level`, if its source grades
        them) accepted `num_accepted`."""
        if num_drafted == 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafted else 0)
        own = self._requests.setdefault(request_id, [0.0, 0.0])
        if self.fixed_weight is None:
            self.weight.observe(own, self.global_alpha, num_accepted,
                                num_accepted < num_drafted)
        if level is not None:
            self._levels.setdefault(level, [0.0, 0.0])
        for tally in self._levels.values():  # every level's evidence ages with each window
            tally[0] *= 0.99
            tally[1] *= 0.99
        tallies = [(own, self.decay), (self._global, 0.99)]
        if level is not None:
            tallies.append((self._levels[level], 1.0))  # (aged above)
        for counts, decay in tallies:
            counts[0] = decay * counts[0] + num_accepted
            counts[1] = decay * counts[1] + trials

    def rest(self, request_id: str) -> None:
        """A step passed in which this request did not draft with the model: its own
        evidence ages as with a verified window (`decay`), so its estimate drifts back to the
        global one. Without it a request whose first windows went badly was planned with
        that estimate to its end, since k = 0 verifies nothing; on HumanEval at concurrency
        1 a request the draft accepts ~0.9 on ran 126 of 128 tokens at k = 0 after its first
        window."""
        if (counts := self._requests.get(request_id)) is not None:
            counts[0] *= self.decay
            counts[1] *= self.decay

    def age(self) -> None:
        """A step passed without any verification: the global evidence ages."""
        trials = self._global[1]
        if trials > self.age_floor:
            factor = max(IDLE_DECAY, self.age_floor / trials)
            for tally in (self._global, *self._levels.values()):
                tally[0] *= factor
                tally[1] *= factor

    @property
    def global_trials(self) -> float:
        """Decayed count of verified draft trials behind global_alpha."""
        return self._global[1]

    @property
    def has_evidence(self) -> bool:
        """EXPLORE_TRIALS of verified drafts behind the global estimate (decayed counts)."""
        return self._global[1] >= EXPLORE_TRIALS

    @property
    def global_alpha(self) -> float:
        accepted, trials = self._global
        return (accepted + self.prior * 4) / (trials + 4)

    def _global_optimistic(self) -> float:
        """The global estimate plus one standard error. A policy that never drafts never
        learns what drafting would accept: while there is little evidence (a new server, a
        prior that undersells the draft) the doubt leans toward trying, and a few measured
        windows then decide. With evidence the bonus vanishes (~0.015 after 400 trials)."""
        n = self._global[1] + 4
        mean = self.global_alpha
        return mean + math.sqrt(mean * (1.0 - mean) / n)

    def alpha(self, request_id: str, optimistic: bool = True, level: int | None = None
              ) -> float:
        """What the policy plans with: the request's own evidence, pulled toward the global
        estimate: the optimistic one, or (optimistic=False, once there are EXPLORE_TRIALS
        trials of evidence) the plain one. `level`: the drafts' confidence as their source
        grades it (a prompt lookup's matched n-gram length, suffix decoding's estimated
        probability); the estimate moves by how that level's drafts accept against all of
        the source's (in log-odds, the level's tally pulled toward the global estimate)."""
        accepted, trials = self._requests.get(request_id, (0.0, 0.0))
        explore = optimistic or not self.has_evidence
        g = self._global_optimistic() if explore else self.global_alpha
        weight = self.prior_weight
        alpha = min((accepted + g * weight) / (trials + weight), 0.999)
        if level is None or level not in self._levels:
            return alpha
        mean = self.global_alpha
        level_accepted, level_trials = self._levels[level]
        rate = (level_accepted + mean * LEVEL_WEIGHT) / (level_trials + LEVEL_WEIGHT)
        return min(_sigmoid(_logit(alpha) + _logit(rate) - _logit(mean)), 0.999)

    @property
    def levels(self) -> dict[int, tuple[float, float]]:
        """Decayed (accepted, trials) of the windows of each confidence level."""
        return {level: (tally[0], tally[1]) for level, tally in self._levels.items()}

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def _logit(p: float) -> float:
    p = min(max(p, 1e-3), 0.999)
    return math.log(p / (1.0 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@dataclass
class StartPersistence:
    """Output tokens a request emits while drafting once it has started (the draft caught up
    on its backlog), until the policy turns it off or it finishes: a decayed mean over starts.
    A catch-up is repaid only over those tokens. Where acceptance sits near break-even (chat
    at two requests) started requests drafted ~5 windows and stopped, so their catch-ups were
    mostly lost; on code at one request a request drafts to its end. Steps in which nobody
    drafts pull the mean back toward `prior` (half-way in ~140 steps), so what one workload
    taught does not keep the next from starting."""

    prior: float
    decay: float = 0.7  # per recorded start
    idle_decay: float = 0.995  # per step without drafts: share of the gap to the prior kept
    mean: float = field(init=False)  # starts at the prior
    _open: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (start, latest)

    def __post_init__(self) -> None:
        self.mean = self.prior

    def drafting(self, request_id: str, num_output_tokens: int, started: bool) -> None:
        """The request drafts this step (`started`: after catching the draft up)."""
        if started and request_id not in self._open:
            self._open[request_id] = (num_output_tokens, num_output_tokens)
        elif request_id in self._open:
            self._open[request_id] = (self._open[request_id][0], num_output_tokens)

    def stopped(self, request_id: str, num_output_tokens: int | None = None) -> None:
        """The request no longer drafts (k = 0 with `num_output_tokens` emitted, or it
        finished: its last drafting step's count and that window's token)."""
        if (span := self._open.pop(request_id, None)) is not None:
            end = span[1] + 1 if num_output_tokens is None else num_output_tokens
            self.mean = self.decay * self.mean + (1 - self.decay) * max(end - span[0], 1)

    def idle(self) -> None:
        self.mean = self.prior - self.idle_decay * (self.prior - self.mean)


@dataclass(slots=True)
class StepPlan:
    """What the next step is expected to hold besides drafts, and what drafting costs."""

    num_decodes: int  # requests past their prompt: 1 query token each
    num_prefill_tokens: int  # prefill chunk tokens the scheduler will run
    budget: int  # max_num_batched_tokens
    base_attention: float = 0.0  # attention work of the decodes without drafts
    prefill_attention: float = 0.0  # attention work of the prefill chunks
    # Requests prefilling or waiting to start: they will decode beside these in the coming
    # steps, so drafts must pay for themselves in a batch that includes them.
    num_pending: int = 0
    # Per request (the order of the alphas): cached tokens its decode window follows, and the
    # draft tokens it adds to the first draft forward if it drafts (catching the draft up).
    contexts: list[int] = field(default_factory=list)
    catch_up: list[float] = field(default_factory=list)
    max_seconds: float = math.inf  # predicted step time (target + drafting) must stay under
    # Per request: True if drafting now means catching the draft up on a backlog (its prompt,
    # or tokens emitted at k = 0). Starting such a request needs a predicted gain of at least
    # start_margin per starting request's share of the decode batch (see choose_ks).
    starting: list[bool] = field(default_factory=list)
    start_margin: float = 0.0
    # Any plan with drafts must beat the plan without them by this share (see choose_ks).
    draft_margin: float = 0.0
    # Per request: True if its drafts come from a prompt lookup (SpecConfig
    # draft_prompt_lookup): they cost verification tokens but no draft forward.
    free: list[bool] = field(default_factory=list)
    # Per request: its leading drafts that a grammar forces, where another source continues
    # them, and their acceptance (the request's alpha is the continuation's); (0, 1.0): none.
    heads: list[tuple[int, float]] = field(default_factory=list)


def choose_ks(
    alphas: list[float], max_ks: list[int], plan: StepPlan, cost: StepCostModel
) -> list[int]:
    """Maximize sum_i E(alpha_i, k_i) / (target step time + draft time) over k_i in
    [0, max_ks[i]] with the drafts fitting the budget left after decodes and prefill.

    Drafting K tokens for anyone costs K draft forwards for the batch, so for each K (the
    largest k) the k_i are allocated greedily by marginal gain per marginal cost (E is
    concave in k; a request's first draft also pays for catching the draft up), and the
    best K wins. Drafts from a prompt lookup (plan.free) cost only their verification.

    Goodput is judged on the decode batch: the step's decodes, its drafts, and the requests
    still prefilling or waiting (they will decode beside these within a few steps). The
    prefill chunk's seconds are spent whatever k is and are left out; counting them made
    drafts look cheap in prefill-heavy steps (the emitted tokens grew while the long step
    barely did), and judging drafts against a batch of the few requests already decoding
    made them look cheap while the rest of the batch was still prefilling.

    Hysteresis: starting a request costs its catch-up once, stopping it wastes that, and near
    break-even the prediction's noise decides which side a step lands on. So a plan that
    starts requests (plan.starting) must beat the best plan without them by start_margin
    times their share of the batch (each starter must speed its own tokens up by about
    start_margin); requests already drafting keep the plain rule.

    Doubt: a predicted gain smaller than the cost model's own error is a coin toss that
    costs when it lands wrong (the draft forwards are spent either way). So any plan with
    drafts must beat the plan without them by plan.draft_margin, the model's measured
    relative error: speculation stays on where it clearly pays (code at one request: +30-40%
    predicted) and off where the gain is inside the noise (chat, acceptance ~0.65, a few
    requests: ~+5%).
    """
    prices = _Prices(cost)
    best_ks, best = _best(alphas, max_ks, plan, prices)
    starters = sum(1 for k, s in zip(best_ks, plan.starting, strict=False) if k and s)
    if starters and plan.start_margin > 0:
        held = [0 if s else m for m, s in zip(max_ks, plan.starting, strict=True)]
        kept_ks, kept = _best(alphas, held, plan, prices)
        share = starters / max(1, plan.num_decodes + plan.num_pending)
        if not best > kept * (1 + plan.start_margin * share):
            best_ks, best = kept_ks, kept
    if any(best_ks) and plan.draft_margin > 0:
        without = _goodput(alphas, [0] * len(alphas), plan, prices)
        if not best > without * (1 + plan.draft_margin):
            return [0] * len(alphas)
    return best_ks


class _Prices:
    """The cost model's predictions for one choose_ks call, memoized. Its candidate steps
    differ in attention work (priced linearly) but share few token counts and drafting
    shapes, and the greedy search prices thousands of them at 16 requests: unmemoized, the
    cost model's calls were two thirds of the policy's time, ~2% of a step."""

    __slots__ = ("cost", "per_attention", "_tokens", "_drafting")

    def __init__(self, cost: StepCostModel) -> None:
        self.cost = cost
        self.per_attention = cost.target_seconds_per_attention
        self._tokens: dict[float, float] = {}
        self._drafting: dict[tuple[float, int, int], float] = {}

    def batch(self, tokens: float, attention: float) -> float:
        """cost.target_time(tokens, attention): a forward with logits at every token."""
        seconds = self._tokens.get(tokens)
        if seconds is None:
            seconds = self._tokens[tokens] = self.cost.target_time_without_attention(tokens)
        return seconds + self.per_attention * attention

    def drafting(self, first_draft: float, drafting: int, top: int) -> float:
        """The draft forwards of a step: the first over the drafting requests' catch-up, then
        top - 1 of one token each."""
        key = (first_draft, drafting, top)
        seconds = self._drafting.get(key)
        if seconds is None:
            seconds = self._drafting[key] = (self.cost.draft_time(first_draft, drafting)
                                             + self.cost.draft_time(drafting) * (top - 1))
        return seconds


def _best(alphas: list[float], max_ks: list[int], plan: StepPlan, prices: _Prices
          ) -> tuple[list[int], float]:
    """The greedy allocation for every largest k, and no drafts at all: the best, with its
    goodput."""
    room = max(0, plan.budget - plan.num_decodes - plan.num_prefill_tokens)
    best_ks, best = [0] * len(alphas), _goodput(alphas, [0] * len(alphas), plan, prices)
    free = _per_request(plan, len(alphas))[2]
    # Free drafts add no draft forward, so they are not capped by `top`; top = 0 is the plan
    # with lookup drafts only (the greedy path may otherwise place a costly first model draft
    # before a lookup's later ones and never reach it).
    modelled = max((m for m, f in zip(max_ks, free, strict=True) if not f), default=0)
    for top in range(0 if any(free) else 1, modelled + 1):
        ks = _greedy(alphas, [m if f else min(m, top) for m, f in zip(max_ks, free, strict=True)],
                     room, plan, prices)
        value = _goodput(alphas, ks, plan, prices)
        if value > best * (1 + 1e-9):
            best_ks, best = ks, value
    return best_ks, best


@dataclass(slots=True)
class _Step:
    """Running sums of a candidate step, so goodput is evaluated in O(1) per draft token."""

    emitted: float  # expected tokens of the requests in the plan's alphas
    drafts: int = 0  # sum of k
    draft_attention: float = 0.0  # attention work the drafts add to the target forward
    first_draft: float = 0.0  # query tokens of the first draft forward
    drafting: int = 0  # requests that draft with the draft model
    top: int = 0  # largest k of those: number of draft forwards


def _greedy(alphas: list[float], caps: list[int], room: int, plan: StepPlan,
            prices: _Prices) -> list[int]:
    """Add draft tokens one at a time, each where it adds the most expected tokens per
    second it costs; return the best prefix of that path."""
    n = len(alphas)
    contexts, catch_up, free, heads = _per_request(plan, n)
    step = _step_of(alphas, [0] * n, plan)
    # Marginal prices, from the cost model around the batch without drafts.
    base = plan.num_decodes + plan.num_pending
    cost = prices.cost
    t_token = max((cost.target_time(base + 16) - cost.target_time(base)) / 16, 1e-6)
    t_attention = max(cost.target_time(base, 1e6) - cost.target_time(base), 0.0) / 1e6
    d_token = max((cost.draft_time(65, 1) - cost.draft_time(1, 1)) / 64, 0.0)

    def entry(i: int, k: int) -> tuple[float, int, float]:
        """(heap key, request, the expected tokens request i's draft k + 1 adds)."""
        gain = (expected_tokens(alphas[i], k + 1, *heads[i])
                - expected_tokens(alphas[i], k, *heads[i]))
        seconds = t_token + t_attention * (contexts[i] + 2 * k + 2)
        if k == 0 and not free[i]:
            seconds += d_token * catch_up[i]
        return -gain / seconds, i, gain

    ks = [0] * n
    heap = [entry(i, 0) for i in range(n) if caps[i] > 0]  # one entry a request
    heapq.heapify(heap)
    best, best_ks = _ratio(step, n, plan, prices), list(ks)
    while heap and step.drafts < room:
        _, i, gain = heapq.heappop(heap)
        k = ks[i]
        step.emitted += gain
        step.drafts += 1
        # attention_work(k + 2, c) - attention_work(k + 1, c)
        step.draft_attention += contexts[i] + 2 * k + 3
        if k == 0 and not free[i]:
            step.drafting += 1
            step.first_draft += catch_up[i]
        ks[i] = k + 1
        if not free[i]:
            step.top = max(step.top, k + 1)
        value = _ratio(step, n, plan, prices)
        if value > best * (1 + 1e-9):
            best, best_ks = value, list(ks)
        if ks[i] < caps[i]:
            heapq.heappush(heap, entry(i, ks[i]))
    return best_ks


def _seconds(step: _Step, plan: StepPlan, prices: _Prices, batch: bool) -> float:
    """Predicted seconds of the target forward and the drafting. batch=False: the step as
    scheduled (decodes, drafts, prefill chunk); batch=True: the decode batch the policy
    judges drafts in (decodes and pending requests, drafts, no prefill chunk)."""
    if batch:
        tokens = plan.num_decodes + plan.num_pending + step.drafts
        seconds = prices.batch(tokens, plan.base_attention + step.draft_attention)
    else:
        rows = plan.num_decodes + step.drafts
        seconds = prices.cost.target_time(rows + plan.num_prefill_tokens, plan.base_attention
                                          + plan.prefill_attention + step.draft_attention, rows)
    if step.top:
        seconds += prices.drafting(step.first_draft, step.drafting, step.top)
    return seconds


def _ratio(step: _Step, num_requests: int, plan: StepPlan, prices: _Prices) -> float:
    """Expected emitted tokens per second of the decode batch (see choose_ks): the target
    forward, plus (when anyone drafts) one draft forward that catches the drafting requests
    up and yields their first draft, and top - 1 more over the drafting requests."""
    if plan.max_seconds < math.inf and _seconds(step, plan, prices, False) > plan.max_seconds:
        return -math.inf
    # The alphas cover decodes and requests still prefilling (which emit nothing extra).
    emitted = step.emitted - (num_requests - plan.num_decodes) + plan.num_pending
    seconds = _seconds(step, plan, prices, True)
    return emitted / seconds if seconds > 0 else math.inf


def _per_request(plan: StepPlan, n: int
                 ) -> tuple[list[int], list[float], list[bool], list[tuple[int, float]]]:
    """The plan's contexts, catch-up costs, free flags and forced heads (defaults: no
    context, one token each, every request drafting with the draft model, no heads)."""
    return (plan.contexts or [0] * n, plan.catch_up or [1.0] * n, plan.free or [False] * n,
            plan.heads or [(0, 1.0)] * n)


def _step_of(alphas: list[float], ks: list[int], plan: StepPlan) -> _Step:
    contexts, catch_up, free, heads = _per_request(plan, len(alphas))
    modelled = [0 if f else k for k, f in zip(ks, free, strict=True)]  # draft-model drafts
    return _Step(
        emitted=sum(expected_tokens(a, k, *h) for a, k, h in zip(alphas, ks, heads,
                                                                 strict=True)),
        drafts=sum(ks),
        draft_attention=sum(attention_work(1 + k, c) - attention_work(1, c)
                            for k, c in zip(ks, contexts, strict=True) if k),
        first_draft=sum(c for k, c in zip(modelled, catch_up, strict=True) if k),
        drafting=sum(1 for k in modelled if k), top=max(modelled, default=0))


def goodput_of(alphas: list[float], ks: list[int], plan: StepPlan, cost: StepCostModel
               ) -> float:
    """Expected emitted tokens per second of the decode batch with drafts `ks`."""
    return _goodput(alphas, ks, plan, _Prices(cost))


def _goodput(alphas: list[float], ks: list[int], plan: StepPlan, prices: _Prices) -> float:
    return _ratio(_step_of(alphas, ks, plan), len(alphas), plan, prices)


def step_seconds(alphas: list[float], ks: list[int], plan: StepPlan, cost: StepCostModel
                 ) -> float:
    """Predicted seconds of the next step as scheduled, with drafts `ks`."""
    return _seconds(_step_of(alphas, ks, plan), plan, _Prices(cost), False)


def prefill_under_target(demand: int, plan: StepPlan, cost: StepCostModel,
                         context: int = 0, min_chunk: int = 16) -> int:
    """Largest prefill chunk (<= demand, following `context` cached tokens) whose step,
    without drafts, is predicted to stay under plan.max_seconds (plan.base_attention holds
    the decodes' attention); at least `min_chunk` tokens so waiting prompts always move."""
    def fits(p: int) -> bool:
        attention = plan.base_attention + attention_work(p, context)
        return (cost.target_time(plan.num_decodes + p, attention, plan.num_decodes + 1)
                <= plan.max_seconds)

    lo, hi = 0, demand  # step time grows with tokens: bisect for the last chunk that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return max(lo, min(min_chunk, demand))
