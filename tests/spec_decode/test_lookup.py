"""Prompt lookup beside the draft model (speculative_config draft_prompt_lookup): lossless,
the draft catching up after lookup windows, and the policy choosing between the two."""

from __future__ import annotations

import pytest

from braid.config import ConfigError, SpecConfig
from braid.spec_decode.policy import AcceptanceEstimator
from tests.engine.test_engine import STAGGERED, make_engine, run
from tests.spec_decode.test_spec_engine import GREEDY, LinearCost, spec_engine


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return run(make_engine(max_num_batched_tokens=256), STAGGERED, GREEDY)


def windows_by_source(engine) -> dict[str, list]:
    """(drafted, accepted) of every verified window from now on, by where its drafts came
    from ("lookup" or "model"), as the speculator attributes them; "order": (request id,
    source) of each window in turn."""
    speculator, seen = engine.speculator, {"lookup": [], "model": [], "order": []}
    verified = speculator.on_verified

    def recording(req, num_drafted, num_accepted):
        source = "lookup" if req.request_id in speculator._looked_up else "model"
        seen[source].append((num_drafted, num_accepted))
        seen["order"].append((req.request_id, source))
        verified(req, num_drafted, num_accepted)

    speculator.on_verified = recording
    return seen


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
@pytest.mark.parametrize("k,budget", [(1, 8), (2, 16), (3, 32)])
def test_prompt_lookup_beside_the_draft_is_lossless(reference, policy: str, k: int,
                                                    budget: int) -> None:
    """Requests whose tokens recur take their drafts from a prompt lookup and skip the draft
    forwards; the draft catches up on what it skipped the next time it drafts for them. With
    the target as its own draft every model window is accepted whole, which it would not be
    if a catch-up after lookup windows left the draft's cache stale."""
    engine = spec_engine("draft_model", k, policy=policy, max_num_batched_tokens=budget,
                         prompt_lookup_min=3,  # (with 1 almost every window is a lookup)
                         draft_prompt_lookup=True)
    # drafting pays, a draft forward costs half a step: lookups beat the model where found
    engine.speculator.policy.cost = LinearCost(0.1, 0.001, 0.05)
    windows = windows_by_source(engine)
    assert run(engine, STAGGERED, GREEDY) == reference
    for _ in range(3):
        assert engine.step() == []  # idle, then a second batch
    assert run(engine, {0: [1, 4]}, GREEDY) == {i: reference[i] for i in ("1", "4")}
    assert windows["lookup"] and windows["model"]
    assert engine.speculator.lookup_windows == len(windows["lookup"])
    assert all(accepted == drafted for drafted, accepted in windows["model"])
    if policy == "fixed":  # (the goodput policy verifies fewer, surer ones here)
        # lookups miss where the tiny model does not repeat itself, so the windows
        # attributed to the model (all accepted) are not lookups
        assert any(accepted < drafted for drafted, accepted in windows["lookup"])
    # the model drafted again for requests after their lookup windows (catching up)
    after_lookup = {rid for rid, source in windows["order"] if source == "lookup"}
    resumed = set()
    for rid, source in windows["order"]:
        if source == "model" and rid in after_lookup:
            resumed.add(rid)
        after_lookup |= {rid} if source == "lookup" else set()
    assert resumed


def test_prompt_lookup_is_on_by_default() -> None:
    spec = SpecConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3})
    assert spec.draft_prompt_lookup is True


def test_a_lookup_not_worth_verifying_leaves_the_request_to_the_draft(reference) -> None:
    """Verification tokens are dear (half a step each) and lookups are expected to fail:
    the policy would verify none of them, so the requests draft with the model (cheap, and
    accepted) instead of not at all, though nearly every step has a lookup (n-grams of 1)."""
    seen, found = {}, []
    for lookup in (True, False):
        engine = spec_engine("draft_model", 3, policy="goodput", max_num_batched_tokens=32,
                             draft_prompt_lookup=lookup)
        engine.speculator.policy.cost = LinearCost(0.1, 0.05, 0.001)
        engine.speculator.free_acceptance["lookup"] = AcceptanceEstimator(prior=0.01)
        seen[lookup] = windows_by_source(engine)
        def counting(windows, lookups=engine.speculator._free_drafts):
            out = lookups(windows)
            found.extend(w.lookup for w in windows if w.lookup)
            return out

        engine.speculator._free_drafts = counting
        assert run(engine, STAGGERED, GREEDY) == reference
    assert found and not seen[True]["lookup"]
    assert seen[False]["model"]
    assert seen[True]["model"] == seen[False]["model"]  # as if lookups were off


def test_prompt_lookup_can_be_turned_off() -> None:
    engine = spec_engine("draft_model", 3, draft_prompt_lookup=False)
    windows = windows_by_source(engine)
    run(engine, STAGGERED, GREEDY)
    assert engine.speculator.lookup is None and not windows["lookup"] and windows["model"]
    assert spec_engine("ngram", 3).speculator.lookup is None  # the ngram method is one
    with pytest.raises(ConfigError, match="draft_prompt_lookup must be true or false"):
        spec_engine("draft_model", 3, draft_prompt_lookup="yes")


def test_the_lookups_acceptance_is_reported_apart() -> None:
    """Per response and in the speculator's figures, beside the model's own estimate."""
    for lookup in (True, False):
        engine = spec_engine("draft_model", 2, policy="fixed", max_num_batched_tokens=32,
                             prompt_lookup_min=1, draft_prompt_lookup=lookup)
        engine.add_request("a", [5, 6, 7, 5, 6, 7, 5, 6], GREEDY)
        final = [o for o in engine.run_until_done() if o.finished][0]
        figures = engine.speculator.figures()
        if lookup:
            assert figures.lookup_windows > 0
            assert 0 < final.metrics.spec_stats["lookup_acceptance_estimate"] < 1
            assert figures.lookup_acceptance_estimate == \
                engine.speculator.lookup_acceptance.global_alpha
        else:
            assert "lookup_acceptance_estimate" not in final.metrics.spec_stats
            assert figures.lookup_acceptance_estimate is None
