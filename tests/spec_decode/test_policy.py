"""The goodput policy with synthetic step costs and acceptance rates."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from braid.spec_decode.cost_model import EXACT_UP_TO, ForwardCost, StepCostModel, nnls
from braid.spec_decode.policy import (
    DEFAULT_PRIOR_WEIGHT,
    EXPLORE_TRIALS,
    FREE_AGE_FLOOR,
    AcceptanceEstimator,
    StartPersistence,
    StepPlan,
    _Prices,
    choose_ks,
    expected_tokens,
    goodput_of,
)


def cost_model(per_token: float, knee: int = 16, fixed: float = 0.25, draft: float = 0.02,
               per_context: float = 0.0) -> StepCostModel:
    """Fitted from synthetic measurements: flat up to `knee` tokens (memory-bound), then
    `per_token` seconds per extra token (compute-bound)."""
    model = StepCostModel()
    for q in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256):
        for attention in (0, 4000, 64000):
            seconds = fixed + 0.0002 * q + per_token * max(0, q - knee) + per_context * attention
            model.observe_target(q, attention, q, seconds, anchor=True)
    for q in (1, 4, 8, 16, 32):
        model.observe_draft(q, q, draft + 0.001 * q, anchor=True)
    return model


MEMORY_BOUND = cost_model(per_token=0.0005)
# Past the knee each token costs 20 ms: a draft accepted with probability a yields a tokens
# for 20 ms, while the step's own decodes already yield more than 1 token per 20 ms.
COMPUTE_BOUND = cost_model(per_token=0.02, knee=8, fixed=0.05)


def plan(decodes: int, prefill: int = 0, budget: int = 128) -> StepPlan:
    return StepPlan(num_decodes=decodes, num_prefill_tokens=prefill, budget=budget,
                    base_attention=500 * decodes, contexts=[500] * decodes)


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


@pytest.mark.parametrize(("alpha", "head", "head_alpha"), [(0.3, 2, 1.0), (0.6, 3, 0.9),
                                                           (0.0, 1, 0.5), (1.0, 4, 0.95)])
def test_expected_tokens_with_a_forced_head(alpha: float, head: int, head_alpha: float) -> None:
    """A window's expected tokens are 1 + the sum over drafts of the chance that every draft
    up to it is accepted: head_alpha for each of the first `head`, alpha after."""
    for k in range(7):
        chances = [head_alpha if j < head else alpha for j in range(k)]
        want = 1 + sum(math.prod(chances[: j + 1]) for j in range(k))
        assert expected_tokens(alpha, k, head, head_alpha) == pytest.approx(want)
    assert expected_tokens(alpha, 5, 0, 0.1) == expected_tokens(alpha, 5)


def test_forced_heads_make_the_policy_draft_where_the_source_alone_would_not() -> None:
    """At one request on a machine where a window of k costs (1 + 0.3 k) decodes, drafts
    that accept 0.2 are not worth verifying (choose_ks keeps k = 0); behind two forced
    tokens (accepted 0.99) the same source's window pays: at least the head is drafted."""
    costs = cost_model(per_token=0.03, knee=1, fixed=0.1)
    alone = replace(plan(1), free=[True])
    assert choose_ks([0.2], [5], alone, costs) == [0]
    headed = replace(alone, heads=[(2, 0.99)])
    assert choose_ks([0.2], [5], headed, costs)[0] >= 2


def test_cost_model_fits_the_hinge() -> None:
    assert MEMORY_BOUND.target_time(1) == pytest.approx(0.2502, rel=0.02)
    assert MEMORY_BOUND.target_time(64) == pytest.approx(0.25 + 0.0128 + 0.024, rel=0.02)


def test_memory_bound_high_acceptance_takes_the_maximum() -> None:
    assert choose_ks([0.9, 0.9], [5, 5], plan(2), MEMORY_BOUND) == [5, 5]


def test_compute_bound_turns_speculation_off() -> None:
    assert choose_ks([0.9] * 32, [5] * 32, plan(32), COMPUTE_BOUND) == [0] * 32


def test_low_acceptance_turns_speculation_off() -> None:
    assert choose_ks([0.02, 0.05], [5, 5], plan(2), MEMORY_BOUND) == [0, 0]


def test_short_budget_shared_with_prefill_gives_smaller_k() -> None:
    roomy = choose_ks([0.8, 0.8], [5, 5], plan(2, prefill=0, budget=32), MEMORY_BOUND)
    short = choose_ks([0.8, 0.8], [5, 5], plan(2, prefill=26, budget=32), MEMORY_BOUND)
    assert sum(short) == 4 < sum(roomy)


def test_heterogeneous_requests_get_k_in_order_of_acceptance() -> None:
    alphas = [0.3, 0.9, 0.6, 0.75]
    ks = choose_ks(alphas, [6] * 4, plan(4, prefill=100, budget=112), MEMORY_BOUND)
    order = sorted(range(4), key=lambda i: alphas[i])
    assert [ks[i] for i in order] == sorted(ks)
    assert ks[1] > ks[0]


def brute_force_ks(
    alphas: list[float], max_ks: list[int], plan: StepPlan, cost: StepCostModel
) -> tuple[list[int], float]:
    """Exhaustive optimum over every k assignment that fits the budget."""
    room = max(0, plan.budget - plan.num_decodes - plan.num_prefill_tokens)
    best: tuple[list[int], float] = ([0] * len(alphas), -1.0)
    for ks in itertools.product(*(range(m + 1) for m in max_ks)):
        if sum(ks) <= room:
            value = goodput_of(alphas, list(ks), plan, cost)
            if value > best[1]:
                best = (list(ks), value)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_greedy_within_two_percent_of_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    alphas = [rng.uniform(0.05, 0.95) for _ in range(n)]
    caps = [rng.randint(0, 4) for _ in range(n)]
    p = plan(n, prefill=rng.choice([0, 10, 40]), budget=rng.choice([16, 48, 128]))
    cost = rng.choice([MEMORY_BOUND, COMPUTE_BOUND, cost_model(per_token=0.004, knee=8)])
    _, best = brute_force_ks(alphas, caps, p, cost)
    assert goodput_of(alphas, choose_ks(alphas, caps, p, cost), p, cost) >= 0.98 * best


def test_acceptance_estimate_follows_the_request_and_starts_from_global() -> None:
    est = AcceptanceEstimator(prior=0.5)
    for _ in range(20):
        est.update("good", 4, 4)
        est.update("bad", 4, 0)
    assert est.alpha("good") > 0.85 and est.alpha("bad") < 0.3
    assert est.alpha("new") == pytest.approx(est.global_alpha, abs=0.05)
    assert est.alpha("bad") < est.global_alpha < est.alpha("good")


def test_acceptance_is_optimistic_until_measured() -> None:
    """Before any verification a new request plans with more than the prior (so a policy
    that would never draft at the prior still measures); evidence removes the bonus."""
    est = AcceptanceEstimator(prior=0.7)
    assert est.alpha("first") > 0.9
    for _ in range(100):
        est.update("x", 5, 2)  # 2 accepted, then a rejection: alpha 2/3
    assert 2 / 3 < est.alpha("new") < 2 / 3 + 0.04


def test_a_costly_start_plans_with_the_plain_estimate_once_there_is_evidence() -> None:
    """A request the draft must first catch up on explores optimistically only while the
    global estimate has little evidence."""
    est = AcceptanceEstimator(prior=0.5)
    assert est.alpha("new", optimistic=False) == est.alpha("new") > 0.7
    for _ in range(EXPLORE_TRIALS):  # 2 trials each (1 accepted, then a rejection), decayed
        est.update("x", 2, 1)
    assert est.alpha("new", optimistic=False) == pytest.approx(est.global_alpha)
    assert est.alpha("new") > est.alpha("new", optimistic=False) + 0.05


def test_idle_steps_age_the_evidence_until_starting_requests_explore_again() -> None:
    """A policy that stopped drafting measures nothing: the global evidence ages with idle
    steps (mean kept) until a starting request plans optimistically again, and stops aging
    at half of EXPLORE_TRIALS."""
    est = AcceptanceEstimator(prior=0.7)
    for _ in range(200):
        est.update("x", 3, 1)  # 1 accepted, then a rejection: alpha 1/2
    plain, mean = est.alpha("new", optimistic=False), est.global_alpha
    assert plain == pytest.approx(mean)
    for _ in range(1000):
        est.age()
    assert est.global_alpha == pytest.approx(0.5, abs=0.1)  # measured mean, prior's pull
    assert est.alpha("new", optimistic=False) > mean + 0.05
    assert est.alpha("new", optimistic=False) == est.alpha("new") < 0.75


def test_steps_without_drafts_age_a_request_s_own_evidence() -> None:
    """A request at k = 0 measures nothing: its own evidence ages with each such step (as
    with each verified window) until its estimate is the global one again."""
    est = AcceptanceEstimator(prior=0.7)
    for _ in range(100):
        est.update("x", 3, 3)
    for _ in range(6):
        est.update("r", 3, 0)
    low, trials = est.alpha("r"), est.global_trials
    assert low < 0.5 < 0.95 < est.alpha("new")
    est.rest("r")
    assert low < est.alpha("r")
    for _ in range(60):
        est.rest("r")
        est.rest("unknown")  # a request without evidence has none to age
    assert est.alpha("r") == pytest.approx(est.alpha("new"), abs=0.01)
    assert est.global_trials == trials  # the global evidence is not a request's


def test_itl_target_caps_the_prefill_chunk_then_the_drafts() -> None:
    from braid.spec_decode.policy import prefill_under_target

    p = plan(2, prefill=0, budget=512)
    p.max_seconds = 0.30
    chunk = prefill_under_target(400, p, COMPUTE_BOUND)
    t = COMPUTE_BOUND.target_time
    assert t(2 + chunk, 1000 + chunk ** 2) <= 0.30 < t(2 + chunk + 1, 1000 + (chunk + 1) ** 2)
    assert prefill_under_target(400, p, COMPUTE_BOUND, min_chunk=16) >= 16
    p.num_prefill_tokens = chunk
    ks = choose_ks([0.9, 0.9], [5, 5], p, COMPUTE_BOUND)
    assert goodput_of([0.9, 0.9], ks, p, COMPUTE_BOUND) > 0  # the chosen plan fits the target
    roomy = plan(2, prefill=chunk, budget=512)
    assert sum(ks) <= sum(choose_ks([0.9, 0.9], [5, 5], roomy, COMPUTE_BOUND))


def test_a_draft_backlog_delays_drafting_for_that_request_alone() -> None:
    """A request the draft has not caught up on (its prompt, or tokens emitted at k = 0)
    pays for the catch-up in the first draft forward; with a costly draft it waits while a
    caught-up request with the same acceptance drafts."""
    cost = cost_model(per_token=0.0005, draft=0.02)
    for q in (64, 128, 512):
        cost.observe_draft(q, 1, 0.02 + 0.004 * q, anchor=True)  # 4 ms per catch-up token
    p = plan(2)
    p.catch_up = [1.0, 400.0]
    ks = choose_ks([0.9, 0.9], [5, 5], p, cost)
    assert ks[0] == 5 and ks[1] == 0
    p.catch_up = [1.0, 1.0]
    assert choose_ks([0.9, 0.9], [5, 5], p, cost) == [5, 5]


def test_drafts_from_a_lookup_cost_only_their_verification() -> None:
    """A draft forward as dear as the target step makes model drafts a loss at an
    acceptance where drafts from a prompt lookup (no draft forward) still pay; a request
    with a lookup drafts beside one whose model drafts would not pay."""
    cost = cost_model(per_token=0.0005, fixed=0.05, draft=0.05)
    p = plan(1)
    assert choose_ks([0.6], [3], p, cost) == [0]
    p.free = [True]
    assert choose_ks([0.6], [3], p, cost) == [3]
    two = plan(2)
    two.free = [True, False]
    ks = choose_ks([0.6, 0.6], [5, 5], two, cost)
    assert ks[0] >= 3 and ks[1] == 0
    free = goodput_of([0.6, 0.6], ks, two, cost)
    two.free = []
    assert goodput_of([0.6, 0.6], ks, two, cost) < free  # the same ks, with forwards
    # A well-accepted model request beside a lookup: one model draft would pay for itself
    # less than the lookup's later drafts, so the plan with lookup drafts only must be
    # among those compared, not just the greedy path's prefixes (which put the model's
    # first draft before the lookup's third).
    two.free = [True, False]
    ks = choose_ks([0.6, 0.95], [5, 5], two, cost)
    assert ks[1] == 0 and ks[0] >= 3
    assert goodput_of([0.6, 0.95], ks, two, cost) > goodput_of([0.6, 0.95], [2, 0], two, cost)


def test_nnls_is_the_constrained_optimum() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (40, 6))
    truth = np.array([0.5, 0.0, 2.0, 0.0, 1.0, 0.3])
    x = nnls(a, a @ truth)
    assert np.allclose(x, truth, atol=1e-8)
    b = rng.normal(0, 1, 40)  # unconstrained fit has negative coefficients
    x = nnls(a, b)
    grad = a.T @ (b - a @ x)  # KKT: zero where x > 0, <= 0 where x == 0
    assert (x >= 0).all() and (x == 0).any()
    assert np.allclose(grad[x > 0], 0, atol=1e-8) and (grad[x == 0] <= 1e-8).all()


def test_cost_model_keeps_attention_apart_from_tokens() -> None:
    """Long contexts cost attention work, not extra tokens: a model fitted on prefill chunks
    over long prompts still predicts a cheap decode step."""
    model = StepCostModel()
    for q in (1, 16, 64, 128):
        for attention in (q * q, q * (2000 + q)):
            model.observe_target(q, attention, q, 0.25 + 0.002 * q + 2e-7 * attention)
    assert model.target_time(16, 16 * 2000) == pytest.approx(0.25 + 0.032 + 0.0064, rel=0.02)
    assert model.target_time(128) == pytest.approx(0.25 + 0.256, rel=0.02)


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.8])
def test_a_prefill_chunk_does_not_make_drafts_look_cheap(alpha: float) -> None:
    """Past the knee drafts do not pay for themselves; a long prefill chunk in the same step
    costs the same whatever k is, so it must not tip the decision (it would if the chunk's
    seconds counted in the ratio: more emitted tokens over a barely longer step)."""
    cost = cost_model(per_token=0.01, knee=8, fixed=0.1)
    decode_only = plan(8, budget=256)
    with_prefill = plan(8, prefill=100, budget=256)
    with_prefill.prefill_attention = 100 * 100
    assert choose_ks([alpha] * 8, [5] * 8, decode_only, cost) == [0] * 8
    assert choose_ks([alpha] * 8, [5] * 8, with_prefill, cost) == [0] * 8


def test_drafts_pay_for_themselves_in_the_batch_pending_requests_join() -> None:
    """One request decodes while fifteen prefill: drafting for it alone looks worth it, but
    its tokens would soon decode in a batch of sixteen, where drafts do not pay."""
    cost = cost_model(per_token=0.01, knee=8, fixed=0.1, draft=0.05)
    alone = plan(1, prefill=100, budget=256)
    assert choose_ks([0.9], [5], alone, cost) != [0]
    alone.num_pending = 15
    assert choose_ks([0.9], [5], alone, cost) == [0]


def test_prediction_is_the_fit_applied_to_the_features() -> None:
    """ForwardCost predicts in plain Python; it must be the fitted coefficients times the
    features the fit was made on, at every hinge segment, plus the correction at measured
    sizes (none past EXACT_UP_TO)."""
    rng = random.Random(1)
    model = ForwardCost()
    for _ in range(60):
        model.observe(rng.randint(1, 300), rng.random() * 1e6, rng.randint(1, 50), rng.random())
    coef = np.array(model._coefficients())
    for tokens in (0, 1, 4, 5, 31, 64, 200, 257, 400):
        for attention, rows in ((0.0, None), (3e5, 7)):
            x = ForwardCost.features(tokens, attention, tokens if rows is None else rows)
            assert model(tokens, attention, rows) == pytest.approx(
                float(coef @ x) + model.correction(tokens), abs=1e-12)
    assert model.correction(EXACT_UP_TO + 1) == 0.0


def test_correction_is_the_median_residual_of_each_measured_size() -> None:
    """Sizes measured an odd and an even number of times, in random order, beside sizes past
    EXACT_UP_TO; times grow with size, so no size gives way to a neighbour."""
    rng = random.Random(2)
    model = ForwardCost()
    sizes = [1, 2, 3, 5, 8, 13, 40, 64, 65, 200]
    samples = [(q, 0.2 + 0.01 * q + 0.004 * rng.random()) for q in sizes
               for _ in range(rng.randint(1, 6))]
    rng.shuffle(samples)
    for q, seconds in samples:
        model.observe(q, 0.0, q, seconds)
    coef = np.array(model._coefficients())
    for q in sizes:
        residuals = [s - float(coef @ ForwardCost.features(q, 0.0, q)) for t, s in samples
                     if t == q]
        expected = float(np.median(residuals)) if q <= EXACT_UP_TO else 0.0
        assert model.correction(q) == pytest.approx(expected, abs=1e-12)


def test_memoized_prices_are_the_cost_model_s_own() -> None:
    """choose_ks prices its candidates through _Prices; asked again (memoized) or first, each
    price must be exactly what the cost model predicts, or decisions would drift from it."""
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(80):
        q = rng.randint(1, 140)
        seconds = 0.02 + 0.0004 * q + 0.002 * rng.random()
        model.observe_target(q, rng.randint(0, 400) * q, q, seconds)
        model.observe_draft(q, rng.randint(1, 4), 0.01 + 0.0001 * q + 0.001 * rng.random())
    prices = _Prices(model)
    for _ in range(2):
        for q in (1, 2, 7, 16, 17, 63, 64, 65, 130):
            for attention in (0, 1234, 5e5):
                assert prices.batch(q, attention) == model.target_time(q, attention)
        for first, drafting, top in ((1.0, 1, 1), (37.5, 3, 4), (200.25, 16, 2)):
            assert prices.drafting(first, drafting, top) == (
                model.draft_time(first, drafting) + model.draft_time(drafting) * (top - 1))


def step_at_seven(q: float) -> float:
    """A CPU-like small-forward curve: flat to 6 tokens, 15% more from 7, linear from 12."""
    return 0.2 + (0.03 if q >= 7 else 0.0) + 0.015 * max(0.0, q - 11)


def test_measured_sizes_correct_a_curve_the_fit_cannot_bend_to() -> None:
    """The hinge fit is convex and cannot step up between 6 and 7 tokens; the correction by
    measured sizes (every size, as the warm-up measures them) predicts each within 2%, and
    sizes between measured ones are interpolated."""
    model = StepCostModel()
    for q in [*range(1, 13), 16, 24, 32, 64]:
        model.observe_target(q, 0, q, step_at_seven(q), anchor=True)
    for q in [*range(1, 13), 16, 24, 32]:
        assert model.target_time(q) == pytest.approx(step_at_seven(q), rel=0.02)
    assert model.target_time(20) == pytest.approx(
        (step_at_seven(16) + step_at_seven(24)) / 2, rel=0.02)
    # Steady-state steps at one size move its prediction to what they measure.
    for _ in range(20):
        model.observe_target(9, 0, 9, 0.26)
    assert model.target_time(9) == pytest.approx(0.26, rel=0.02)
    assert model.target_time(6) == pytest.approx(step_at_seven(6), rel=0.03)


def test_a_size_measured_while_the_machine_was_slow_does_not_stay_dear() -> None:
    """Steps at 4 tokens ran during a slow spell; the policy then moved to 5 tokens, which
    now measure fast. The 4-token size must not be predicted dearer than the 5-token one (it
    would push the policy to the larger k for good: it never revisits 4)."""
    model = StepCostModel()
    for q in [*range(1, 13), 16, 32, 64]:
        model.observe_target(q, 0, q, 0.19 + 0.001 * q, anchor=True)
    for _ in range(30):
        model.observe_target(4, 0, 4, 0.26)
    for _ in range(40):
        model.observe_target(5, 0, 5, 0.19)
    assert model.target_time(4) <= model.target_time(5) == pytest.approx(0.19, rel=0.02)


def test_the_policy_sees_the_step_between_k1_and_k2() -> None:
    """Three requests at acceptance 0.65 (a chat workload, as measured on ShareGPT): 6 tokens
    (k = 1) cost what a plain decode does and 9 (k = 2) cost 15% more, so k = 1 wins."""
    model = StepCostModel()
    for q in [*range(1, 13), 16, 24, 32, 64]:
        model.observe_target(q, 0, q, step_at_seven(q), anchor=True)
    for q in range(1, 17):
        model.observe_draft(q, q, 0.05 + 0.001 * q, anchor=True)
    p = plan(3)
    p.base_attention, p.contexts = 0.0, [0, 0, 0]
    assert choose_ks([0.65] * 3, [5] * 3, p, model) == [1, 1, 1]


def test_starting_to_draft_needs_a_margin_and_drafting_requests_keep_the_plain_rule() -> None:
    """Near break-even, noise decides whether a step drafts; a request the draft must catch
    up on starts only for a predicted gain above start_margin, while one already drafting
    goes on at any predicted gain (hysteresis)."""
    cost = cost_model(per_token=0.004, knee=4, fixed=0.1, draft=0.03)
    gains = []
    for alpha in np.linspace(0.05, 0.95, 91):
        p = plan(1)
        plain = choose_ks([alpha], [5], p, cost)
        gain = goodput_of([alpha], plain, p, cost) / goodput_of([alpha], [0], p, cost)
        p.start_margin = 0.05
        p.starting = [False]
        assert choose_ks([alpha], [5], p, cost) == plain
        p.starting = [True]
        assert choose_ks([alpha], [5], p, cost) == (plain if gain > 1.05 else [0])
        gains.append(gain)
    assert any(1.0 < g < 1.05 for g in gains) and any(g > 1.05 for g in gains)  # both sides


def test_the_start_margin_is_per_starting_request() -> None:
    """A new request joining three drafting ones needs its own speedup, not the batch's, to
    beat the margin: a batch gain of a quarter of start_margin is enough for it."""
    cost = cost_model(per_token=0.004, knee=4, fixed=0.1, draft=0.03)
    seen = set()
    for alpha in np.linspace(0.05, 0.95, 91):
        alphas = [0.8, 0.8, 0.8, float(alpha)]
        p = plan(4)
        plain = choose_ks(alphas, [5] * 4, p, cost)
        held = choose_ks(alphas, [5, 5, 5, 0], p, cost)
        assert any(held)  # the three go on drafting
        gain = goodput_of(alphas, plain, p, cost) / goodput_of(alphas, held, p, cost)
        p.start_margin, p.starting = 0.05, [False, False, False, True]
        starts = plain[3] > 0 and gain > 1 + 0.05 / 4
        assert choose_ks(alphas, [5] * 4, p, cost) == (plain if starts else held)
        if starts:
            seen.add(gain > 1.05)
    assert seen == {False, True}  # some starts gained less than the margin for the batch


def test_drafting_at_all_needs_a_gain_above_the_cost_models_error() -> None:
    """A predicted gain inside the cost model's own error is not acted on: with
    draft_margin 0.1 the policy drafts only where the best plan beats no drafts by more than
    10%, and then drafts exactly as without the margin."""
    cost = cost_model(per_token=0.004, knee=4, fixed=0.1, draft=0.03)
    sides = set()
    for alpha in np.linspace(0.05, 0.95, 91):
        alphas = [float(alpha)] * 2
        p = plan(2)
        plain = choose_ks(alphas, [5, 5], p, cost)
        gain = goodput_of(alphas, plain, p, cost) / goodput_of(alphas, [0, 0], p, cost)
        p.draft_margin = 0.1
        drafts = any(plain) and gain > 1.1
        assert choose_ks(alphas, [5, 5], p, cost) == (plain if drafts else [0, 0])
        if any(plain):
            sides.add(drafts)
    assert sides == {False, True}  # gains on both sides of the margin were seen


def test_the_draft_margin_waits_for_acceptance_evidence() -> None:
    """Before EXPLORE_TRIALS of verified drafts the policy plans from its prior, and a margin
    would keep it from ever measuring: none until then, then the cost model's error (capped),
    and none again once idle steps have aged the evidence away."""
    from braid.config import SpecConfig
    from braid.spec_decode.goodput import MAX_DRAFT_MARGIN
    from braid.spec_decode.ngram import NgramProposer
    from braid.spec_decode.speculator import Speculator

    spec = Speculator(SpecConfig(method="ngram", num_speculative_tokens=3),
                      NgramProposer(2, 5), max_model_len=1024)
    spec.policy.cost.target.error_ema = 0.08
    assert spec.policy._draft_margin() == 0.0
    while spec.acceptance.global_trials < EXPLORE_TRIALS:
        spec.acceptance.update("r", 3, 2)
    assert spec.policy._draft_margin() == pytest.approx(0.08)
    spec.policy.cost.target.error_ema = 0.4
    assert spec.policy._draft_margin() == MAX_DRAFT_MARGIN
    for _ in range(200):
        spec.acceptance.age()
    assert spec.policy._draft_margin() == 0.0


def test_start_persistence_is_a_decayed_mean_of_what_started_requests_drafted() -> None:
    """A span opens at a start (not at a caught-up request's drafting), closes when the
    request stops or finishes; idle steps pull the mean back toward the prior."""
    p = StartPersistence(prior=256.0)
    assert p.mean == 256.0
    p.drafting("a", 10, started=False)  # drafting without a start opens nothing
    p.stopped("a", 30)
    assert p.mean == 256.0
    p.drafting("a", 10, started=True)
    p.drafting("a", 14, started=True)  # still the same span
    p.stopped("a", 22)
    assert p.mean == pytest.approx(0.7 * 256 + 0.3 * 12)
    p.drafting("b", 0, started=True)
    p.drafting("b", 5, started=False)
    p.stopped("b")  # finished: its last drafting step and that window's token
    assert p.mean == pytest.approx(0.7 * (0.7 * 256 + 0.3 * 12) + 0.3 * 6)
    low = p.mean
    for _ in range(140):
        p.idle()
    assert low < p.mean < 256 and p.mean == pytest.approx((256 + low) / 2, rel=0.02)


def test_a_backlog_s_catch_up_is_spread_over_what_started_requests_drafted() -> None:
    """The backlog is charged over the request's remaining tokens, at most the persistence:
    where started requests stopped after a few windows a start costs far more a step."""
    from braid.config import SpecConfig
    from braid.core.request import Request
    from braid.sampling_params import SamplingParams
    from braid.spec_decode.ngram import NgramProposer
    from braid.spec_decode.speculator import Speculator

    spec = Speculator(SpecConfig(method="ngram", num_speculative_tokens=3),
                      NgramProposer(2, 5), max_model_len=1024)
    req = Request("r", list(range(300)), SamplingParams(max_tokens=128))
    usual = spec.policy.usual_lag
    assert spec.policy._catch_up_cost(req, 0.8, 2) == 2.0  # the usual lag: charged in full
    long_lived = spec.policy._catch_up_cost(req, 0.8, 300)
    per_window = expected_tokens(0.8, 3)
    assert long_lived == pytest.approx(usual + (300 - usual) / (128 / per_window))
    spec.policy.persistence.mean = 12.0
    assert spec.policy._catch_up_cost(req, 0.8, 300) == pytest.approx(
        usual + (300 - usual) / (12 / per_window))


def _windows(est: AcceptanceEstimator, alphas: list[float], windows: int, k: int,
             rng: random.Random) -> None:
    """`windows` windows of k drafts for requests accepting each draft with alphas[i]; each
    request is forgotten at the end, as a finished one."""
    for i, alpha in enumerate(alphas):
        for _ in range(windows):
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            est.update(str(i), k, accepted)
        est.forget(str(i))


def test_the_prior_weight_is_fitted_to_how_alike_requests_accept() -> None:
    """Empirical Bayes: where every request accepts alike its recent windows are noise and
    the global estimate weighs heavily; where requests differ (and keep differing) their own
    windows count. Before PRIOR_WEIGHT_WINDOWS windows the default weight holds."""
    rng = random.Random(0)
    alike = AcceptanceEstimator(prior=0.5)
    assert alike.prior_weight == DEFAULT_PRIOR_WEIGHT
    _windows(alike, [0.9] * 30, 20, 4, rng)
    unlike = AcceptanceEstimator(prior=0.5)
    _windows(unlike, [0.95, 0.15] * 15, 20, 4, rng)
    assert alike.prior_weight >= 32 and unlike.prior_weight <= 4
    fixed = AcceptanceEstimator(prior=0.5, fixed_weight=4.0)
    _windows(fixed, [0.9] * 30, 20, 4, rng)
    assert fixed.prior_weight == 4.0


def test_a_fitted_weight_keeps_alike_requests_near_the_global_estimate() -> None:
    """A request of a population that accepts alike is planned with about the global
    estimate even after a few unlucky windows (following such windows overshoots k)."""
    rng = random.Random(1)
    est = AcceptanceEstimator(prior=0.5)
    _windows(est, [0.92] * 30, 20, 5, rng)
    for _ in range(3):
        est.update("unlucky", 5, 1)
    assert est.alpha("unlucky", optimistic=False) > 0.85
    assert est.prior_weight >= 32


def test_a_confidence_level_moves_the_estimate_by_how_its_drafts_accept() -> None:
    """Drafts graded 5 (a long n-gram match) accepted 0.9, graded 2 accepted 0.2: a request
    is planned higher at grade 5 and lower at grade 2; an unseen grade leaves it as is."""
    rng = random.Random(2)
    est = AcceptanceEstimator(prior=0.5)
    for i in range(200):
        for level, alpha in ((5, 0.9), (2, 0.2)):
            accepted = 0
            while accepted < 3 and rng.random() < alpha:
                accepted += 1
            est.update(str(i % 7), 3, accepted, level)
    plain = est.alpha("new", optimistic=False)
    assert est.alpha("new", optimistic=False, level=5) > plain + 0.15
    assert est.alpha("new", optimistic=False, level=2) < plain - 0.15
    assert est.alpha("new", optimistic=False, level=3) == plain


def test_idle_steps_age_the_levels_with_the_global_evidence() -> None:
    """A free source whose graded drafts accepted poorly is tried again after idle steps at
    every grade: the levels' evidence ages with the global (kept, it would pull the
    estimate back down by the old gap)."""
    est = AcceptanceEstimator(prior=0.5, age_floor=FREE_AGE_FLOOR)
    for i in range(60):
        est.update(str(i), 2, 0, level=i % 3)
    assert est.alpha("new", level=1) < 0.2
    for _ in range(400):
        est.age()
    assert est.alpha("new", level=1) == pytest.approx(est.alpha("new"), abs=0.02)
    assert est.alpha("new") > 0.7


def test_a_free_source_s_evidence_ages_to_nothing_so_it_is_tried_again() -> None:
    """Two unlucky windows of a free source (prompt lookup at prior 0.3) put its estimate
    below break-even for good where idle steps stop aging at the draft model's floor; a
    free source's evidence ages to nothing, and the prior's optimism returns."""
    free = AcceptanceEstimator(prior=0.3, age_floor=FREE_AGE_FLOOR)
    model = AcceptanceEstimator(prior=0.3)
    for est in (free, model):
        est.update("a", 1, 0)
        est.update("a", 1, 0)
        est.forget("a")
    low = free.alpha("b")
    assert low == model.alpha("b") < 0.37  # one draft for a 1.4-decode window: not worth it
    for _ in range(60):
        free.age()
        model.age()
    assert model.alpha("b") == low
    assert free.alpha("b") > 0.43 and free.global_trials < 1
