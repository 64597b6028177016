"""Predicted outputs: drafts follow the output along the client's prediction, rejoin it
after an edit, and never change the output (greedy or seeded)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from braid.core.request import Request
from braid.sampling_params import SamplingParams
from braid.spec_decode.prediction import PredictedOutputs, rejoin
from tests.engine.test_engine import make_engine, prompts
from tests.spec_decode.test_spec_engine import spec_engine

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True)


def test_drafts_follow_the_output_and_rejoin_after_a_departure() -> None:
    predicted = PredictedOutputs()
    req = Request("r", [1, 2], replace(GREEDY, prediction_token_ids=[10, 11, 12, 13, 14, 15,
                                                                         16, 17]))
    assert predicted.drafts(req, 3) == [10, 11, 12]
    req.output_token_ids += [10, 11]
    assert predicted.drafts(req, 3) == [12, 13, 14]
    req.output_token_ids += [99]  # departs: nothing to draft until it rejoins
    assert predicted.drafts(req, 3) == []
    req.output_token_ids += [13, 14]  # rejoined: (13, 14) occurs in the prediction
    assert predicted.drafts(req, 3) == [15, 16, 17]
    req.output_token_ids += [15, 16, 17]
    assert predicted.drafts(req, 3) == []  # its end
    assert predicted.drafts(Request("s", [1], GREEDY), 3) == []  # no prediction


def test_rejoining_prefers_the_occurrence_after_the_furthest_point_reached() -> None:
    prediction = np.array([5, 6, 1, 5, 6, 2, 5, 6, 3])
    assert rejoin(prediction, [9, 5, 6]) == 2
    assert rejoin(prediction, [9, 5, 6], after=4) == 5
    assert rejoin(prediction, [1, 5, 6], after=8) == 5  # a longer tail wins wherever it is
    assert rejoin(prediction, [7, 8]) is None


def run_one(engine, params: SamplingParams, prompt: list[int]) -> tuple[list[int], dict]:
    engine.add_request("p", prompt, params)
    final = [o for o in engine.run_until_done() if o.finished][0]
    return final.outputs[0].token_ids, final.metrics.spec_stats


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_prediction_drafts_and_leaves_the_output_unchanged(params: SamplingParams,
                                                             method: str) -> None:
    prompt = prompts()[1]
    alone, _ = run_one(make_engine(), params, prompt)
    exact, spec = run_one(spec_engine(method, 4), replace(params, prediction_token_ids=alone),
                          prompt)
    assert exact == alone
    # every draft taken: 4 of each window's 5 tokens (the fifth is the target's own)
    assert spec["rejected_prediction_tokens"] == 0
    assert spec["accepted_prediction_tokens"] >= 4 * (len(alone) - 1) // 5 - 1
    edited = alone[:12] + [3, 4, 5, 6] + alone[12:]  # the output will not have these
    out, spec = run_one(spec_engine(method, 4), replace(params, prediction_token_ids=edited),
                        prompt)
    assert out == alone
    assert spec["rejected_prediction_tokens"] >= 1
    assert spec["accepted_prediction_tokens"] >= len(alone) // 2  # it rejoined after the edit


def test_a_wrong_prediction_costs_nothing_but_rejected_drafts() -> None:
    prompt = prompts()[2]
    alone, _ = run_one(make_engine(), GREEDY, prompt)
    out, spec = run_one(spec_engine("draft_model", 3, policy="goodput"),
                        replace(GREEDY, prediction_token_ids=[7] * 40), prompt)
    assert out == alone
    assert spec["accepted_prediction_tokens"] <= alone.count(7) + 3


@pytest.mark.parametrize("trust", [0.01, 0.99])
def test_the_free_source_expected_to_emit_most_is_taken(trust: float) -> None:
    """A request with a prediction and prompt lookups beside a draft model: whichever source
    is expected to emit more tokens (its acceptance estimate, held fixed here) drafts, the
    output unchanged."""
    from braid.spec_decode.policy import AcceptanceEstimator

    prompt = [5, 6, 7, 8] * 10
    alone, _ = run_one(make_engine(), GREEDY, prompt)
    engine = spec_engine("draft_model", 2, draft_prompt_lookup=True)  # lookups of 2 recur
    for source, prior in (("prediction", trust), ("lookup", 0.5)):
        estimator = engine.speculator.free_acceptance[source] = AcceptanceEstimator(prior=prior)
        estimator.update = lambda *args: None  # type: ignore[method-assign]
    out, _ = run_one(engine, replace(GREEDY, prediction_token_ids=alone), prompt)
    assert out == alone
    windows = engine.speculator.windows_by_source
    if trust > 0.5:
        assert windows["prediction"] > 0 and windows["lookup"] == 0
    else:  # the prediction drafts only where no lookup is found
        assert windows["lookup"] > windows["prediction"]


@pytest.mark.parametrize("bad", [[-1], [10**6], [True], ["3"]])
def test_prediction_ids_outside_the_vocabulary_are_refused(bad: list) -> None:
    from braid.engine.input import RequestError

    engine = spec_engine("ngram", 3)
    with pytest.raises(RequestError, match="prediction_token_ids must be token ids"):
        engine.add_request("r", prompts()[0], replace(GREEDY, prediction_token_ids=bad))
    assert not engine.has_unfinished_requests()
