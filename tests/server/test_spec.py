"""A server with n-gram speculation: the response's `braid.spec` and the spec counters."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ENGINE_FLAGS, ServerProcess
from tests.server.metrics_util import scrape


def test_ngram_speculation_figures(tiny_model_dir: Path,
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed",
                       "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("spec"), *ENGINE_FLAGS,
                           "--speculative-config", spec)
    try:
        body = {"model": server.model, "prompt": "ab " * 20, "max_tokens": 40,
                "ignore_eos": True, "temperature": 0}
        res = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        figures = res["braid"]["spec"]
        values = scrape(server.url)
    finally:
        assert server.stop() == 0, server.log()
    assert res["usage"]["completion_tokens"] == 40
    assert figures["num_drafts"] > 0 and figures["num_draft_tokens"] >= figures["num_drafts"]
    assert values["braid:spec_decode_num_drafts_total"] == figures["num_drafts"]
    assert values["braid:spec_decode_num_draft_tokens_total"] == figures["num_draft_tokens"]
    assert values["braid:spec_decode_num_accepted_tokens_total"] == figures["num_accepted_tokens"]
    per_pos = sum(v for k, v in values.items()
                  if k.startswith("braid:spec_decode_num_accepted_tokens_per_pos_total{"))
    assert per_pos == figures["num_accepted_tokens"]
    assert values["braid:spec_decode_chosen_k_count"] > 0
    assert values["braid:spec_decode_chosen_k_bucket{le=3.0}"] > 0


def test_goodput_policy_observability(tiny_model_dir: Path,
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
                       "model": str(tiny_model_dir)})
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("goodput"), *ENGINE_FLAGS,
                           "--speculative-config", spec)
    try:
        body = {"model": server.model, "prompt": "hello", "max_tokens": 24,
                "ignore_eos": True, "temperature": 0}
        res = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        values = scrape(server.url)
    finally:
        assert server.stop() == 0, server.log()
    assert res["usage"]["completion_tokens"] == 24
    assert values["braid:spec_decode_chosen_k_count"] > 0
    assert values["braid:step_time_seconds"] > 0
    assert 0 < values["braid:spec_decode_acceptance_estimate"] <= 1
    assert "braid:spec_decode_cost_model_relative_error" in values
