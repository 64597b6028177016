"""The replay of k choices on recorded acceptance (braid/bench/acceptance.py)."""

from __future__ import annotations

import random

import pytest
import torch

from braid.bench.acceptance import (
    Costs,
    accepted_runs,
    best_k,
    hindsight_alpha,
    lookup_runs,
    record_runs,
    replay,
)
from braid.sampling_params import SamplingParams
from braid.spec_decode.ngram import NgramMatcher
from braid.spec_decode.policy import AcceptanceEstimator
from tests.engine.test_engine import WEIGHTS, prompts
from tests.spec_decode.test_spec_engine import spec_engine

FLAT = Costs((1.0, 1.1, 1.2, 1.3, 1.4, 1.5), 0.0)


def test_accepted_runs_count_the_matches_in_a_row_from_each_position() -> None:
    tokens = [9, 9, 1, 2, 3, 4, 5, 6]
    guesses = [-1, -1, -1, 2, 3, 0, 5, 6]  # from position 3: hits at 3, 4, 6, 7
    assert accepted_runs(guesses, tokens, 3, longest=5) == [2, 1, 0, 2, 1]
    assert accepted_runs(guesses, tokens, 3, longest=1) == [1, 1, 0, 1, 1]


def test_lookup_runs_match_the_lookup_s_proposal_against_what_follows() -> None:
    matcher = NgramMatcher(1, 3)
    tokens = [1, 2, 3, 4, 1, 2, 3, 7, 8]
    runs, lengths, levels = lookup_runs(tokens, 5, 3, matcher)
    # at 5 (after ... 4 1) the lookup proposes 2 3 4: 2 of them follow; at 6 (after 1 2) 3 4
    # 1: 1 follows; at 7 (after 2 3) 4 1 2: none; at 8 (after 3 7): no match
    assert runs == [2, 1, 0, 0]
    assert lengths == [3, 3, 3, 0]
    assert levels == [1, 2, 3, 0]  # the matched lengths: "1", "1 2", "1 2 3", none


def test_a_position_without_drafts_is_a_plain_decode_that_teaches_nothing() -> None:
    """Where the proposer has fewer drafts than asked the window shrinks to them; where it
    has none the step is a decode and the estimator hears nothing of it."""
    runs, lengths = [[2, 0, 0, 0, 0, 0]], [[2, 0, 0, 0, 1, 0]]
    out = replay(runs, None, FLAT, 5, rule=lambda rid, cap: 5, lengths=lengths)
    assert out.ks == {2: 1, 0: 2, 1: 1} and out.tokens == 6
    est = AcceptanceEstimator(prior=0.5)
    replay([[0] * 30], est, FLAT, 5, lengths=[[0] * 30])
    assert est.global_trials == 0 and est.weight.windows == 0


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_a_replay_emits_every_position_once_and_prices_each_window(k: int) -> None:
    rng = random.Random(k)
    requests = [[rng.randint(0, 5) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    out = replay(requests, None, FLAT, 5, rule=lambda rid, cap: k)
    assert out.tokens == sum(map(len, requests))
    assert out.cost == pytest.approx(sum(FLAT.step(j) * n for j, n in out.ks.items()))
    assert max(out.ks) <= k


def test_a_window_of_k_emits_its_accepted_drafts_and_one_more() -> None:
    runs = [3, 0, 0, 0, 2, 5, 5, 5, 5, 5]
    # a window of 3 at 0 emits 4 tokens, at 4 3 (2 accepted, the third rejected), at 7 3;
    # at 10 nothing is left
    out = replay([runs], None, FLAT, 3, rule=lambda rid, cap: 3)
    assert out.ks == {3: 2, 2: 1}  # at 7 only 3 tokens are left: 2 drafts and the bonus
    assert out.tokens == 10
    assert hindsight_alpha(runs, 3) == pytest.approx((3 + 2 + 2) / (3 + 3 + 2))


def test_the_best_k_grows_with_acceptance_and_shrinks_with_cost() -> None:
    dear = Costs((1.0, 1.3, 1.6, 1.9, 2.2, 2.5), 0.3)
    assert best_k(0.1, 5, FLAT) <= best_k(0.6, 5, FLAT) <= best_k(0.95, 5, FLAT) == 5
    assert best_k(0.5, 5, dear) == 0 < best_k(0.95, 5, dear) <= best_k(0.95, 5, FLAT)


def test_an_estimator_replayed_lands_between_no_drafts_and_the_hindsight_rule() -> None:
    rng = random.Random(0)
    good = [[rng.choice([5, 5, 5, 4, 2]) for _ in range(60)] for _ in range(4)]
    bad = [[rng.choice([0, 0, 0, 1]) for _ in range(60)] for _ in range(4)]
    requests = [r for pair in zip(good, bad, strict=True) for r in pair]
    costs = Costs((1.0, 1.3, 1.6, 1.9, 2.2, 2.5), 0.0)
    alphas = {str(i): hindsight_alpha(r, 5) for i, r in enumerate(requests)}
    ideal = replay(requests, None, costs, 5,
                   rule=lambda rid, cap: best_k(alphas[rid], cap, costs))
    learned = replay(requests, AcceptanceEstimator(prior=0.5), costs, 5)
    assert 1.0 < learned.speedup <= ideal.speedup * 1.01


def test_costs_parse_and_refuse() -> None:
    assert Costs.parse("draft=0.4,1.2,1.5") == Costs((1.0, 1.2, 1.5), 0.4)
    for bad in ("draft=0.4", "draft=-1,1.2", "1.2,x", "1.2,0", "1.2,inf"):
        with pytest.raises(ValueError, match="give draft=D"):
            Costs.parse(bad)


def test_a_record_replays_exactly_what_a_fixed_k_engine_accepts() -> None:
    """record_runs' alignment: the record of a tiny pair (the target's weights, perturbed,
    as the draft: it agrees often, not always), replayed at fixed k, accepts the drafts an
    engine drafting fixed k accepted on the same prompts."""
    gen = torch.Generator().manual_seed(3)
    draft = {name: w + 0.03 * w.std() * torch.randn(w.shape, generator=gen)
             if w.is_floating_point() and w.dim() > 1 else w for name, w in WEIGHTS.items()}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ps = prompts()[:3]
    record = record_runs(spec_engine("draft_model", 3, draft_weights=draft), ps, 30, 3)
    for k in (1, 3):
        engine = spec_engine("draft_model", k, draft_weights=draft)
        for i, p in enumerate(ps):
            engine.add_request(str(i), p, params)
        list(engine.run_until_done())
        stats = engine.stats.spec_stats
        played = replay(record["draft_model"], None, FLAT, k, rule=lambda rid, cap, k=k: k)
        windows = sum(n for j, n in played.ks.items() if j)
        assert (stats.num_drafts, stats.num_accepted_tokens) == (
            windows, played.tokens - sum(played.ks.values()))
        assert 0.2 < stats.acceptance_rate < 0.9
