"""Speculation figures from two /metrics scrapes."""

from __future__ import annotations

import pytest

from braid.bench.server_metrics import parse, spec_figures

TEMPLATE = """\
# TYPE braid:spec_decode_num_drafts counter
braid:spec_decode_num_drafts_total{{model_name="m"}} {drafts}
# TYPE braid:spec_decode_num_draft_tokens counter
braid:spec_decode_num_draft_tokens_total{{model_name="m"}} {drafted}
# TYPE braid:spec_decode_num_accepted_tokens counter
braid:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}
# TYPE braid:spec_decode_num_accepted_tokens_per_pos counter
braid:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {pos0}
braid:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="1"}} {pos1}
# TYPE braid:spec_decode_chosen_k histogram
braid:spec_decode_chosen_k_bucket{{le="0.0",model_name="m"}} {k0}
braid:spec_decode_chosen_k_bucket{{le="1.0",model_name="m"}} {k0}
braid:spec_decode_chosen_k_bucket{{le="2.0",model_name="m"}} {k2}
braid:spec_decode_chosen_k_bucket{{le="+Inf",model_name="m"}} {k2}
braid:spec_decode_chosen_k_count{{model_name="m"}} {k2}
"""


def scrape(**values: int) -> dict[str, float]:
    return parse(TEMPLATE.format(**values))


def test_figures_are_differences_of_the_counters() -> None:
    before = scrape(drafts=5, drafted=10, accepted=4, pos0=3, pos1=1, k0=1, k2=6)
    after = scrape(drafts=15, drafted=30, accepted=19, pos0=12, pos1=7, k0=3, k2=18)
    spec = spec_figures(before, after)
    assert spec is not None
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (
        10, 20, 15)
    assert spec["acceptance_rate"] == pytest.approx(0.75)
    assert spec["mean_acceptance_length"] == pytest.approx(2.5)
    assert spec["accepted_per_position"] == [9, 6]
    assert spec["chosen_k"] == {"0": 2, "2": 10}


def test_no_speculation_counters_means_no_figures() -> None:
    assert spec_figures(None, None) is None
    assert spec_figures({}, {"other": 1.0}) is None
    zeros = scrape(drafts=0, drafted=0, accepted=0, pos0=0, pos1=0, k0=0, k2=0)
    spec = spec_figures(zeros, zeros)
    assert spec is not None and spec["acceptance_rate"] is None and spec["chosen_k"] == {}


def test_replicas_series_read_as_their_sum() -> None:
    """Each replica's series under its own name, and summed under the name without the
    replica label: the figures of replicas read as one engine's."""
    def two(values: dict[str, int]) -> str:
        lines = TEMPLATE.format(**values).splitlines()
        return "\n".join(line if line.startswith("#") else "\n".join(
            line.replace('model_name="m"', f'model_name="m",replica="{r}"') for r in "01")
            for line in lines) + "\n"

    values = dict(drafts=2, drafted=6, accepted=3, pos0=2, pos1=1, k0=1, k2=2)
    before = parse(two({k: 0 for k in values}))
    after = parse(two(values))
    assert after['braid:spec_decode_num_drafts_total{replica=1}'] == 2
    figures = spec_figures(before, after)
    assert figures is not None
    assert figures["num_drafts"] == 4 and figures["acceptance_rate"] == 0.5
    assert figures["accepted_per_position"] == [4, 2]
    assert figures["chosen_k"] == {"0": 2, "2": 2}
