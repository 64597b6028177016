"""A server with n-gram speculation: the response's `braid.spec_decode` and the spec counters."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
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
    assert 0 < values["braid:spec_decode_lookup_acceptance_estimate"] <= 1  # on by default
    assert "braid:spec_decode_cost_model_relative_error" in values
    assert values["braid:spec_decode_lookup_windows_total"] <= values[
        "braid:spec_decode_num_drafts_total"]


def test_itl_target_serves_requests_after_idle_and_bursts(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """--target-itl-ms once stopped scheduling for good after the engine went idle."""
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
                       "model": str(tiny_model_dir)})
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("itl"), *ENGINE_FLAGS,
                           "--speculative-config", spec, "--target-itl-ms", "1000")

    def complete(client: httpx.Client, prompt: str, tokens: int = 16) -> dict:
        body = {"model": server.model, "prompt": prompt, "max_tokens": tokens,
                "ignore_eos": True, "temperature": 0}
        res = client.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert res.status_code == 200, res.text
        return res.json()

    try:
        with httpx.Client() as client, ThreadPoolExecutor(8) as pool:
            alone = complete(client, "hello there")["choices"][0]["text"]
            time.sleep(0.5)  # idle
            pair = list(pool.map(lambda p: complete(client, p), ["hello there", "abc " * 9]))
            burst = list(pool.map(lambda i: complete(client, f"{i} " * (i + 1)), range(8)))
            # New requests while a long one decodes.
            long = pool.submit(complete, client, "the " * 5, 120)
            joined = list(pool.map(lambda p: complete(client, p), ["x y", "hello there"]))
            assert long.result()["usage"]["completion_tokens"] == 120
    finally:
        assert server.stop() == 0, server.log()
    assert pair[0]["choices"][0]["text"] == alone == joined[1]["choices"][0]["text"]
    assert all(r["usage"]["completion_tokens"] == 16 for r in burst + joined)


def _seeded_texts(server: ServerProcess, client: httpx.Client, stream: bool) -> list[str]:
    """Choice texts of one seeded, sampled completion with n = 4 (index order)."""
    body = {"model": server.model, "prompt": "a b c d", "max_tokens": 20, "ignore_eos": True,
            "temperature": 1.0, "top_p": 0.95, "seed": 1234, "n": 4, "stream": stream}
    if not stream:
        res = client.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert res.status_code == 200, res.text
        return [c["text"] for c in sorted(res.json()["choices"], key=lambda c: c["index"])]
    texts = [""] * 4
    with client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as res:
        for line in res.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    return texts


def test_seeded_requests_are_reproducible_with_goodput_speculation(
        server: ServerProcess, tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The issue's measurement: 6 identical seeded requests (n = 4) at once, streaming and
    not, on a goodput draft-model server, all give the same choices, and the same as a
    server without speculation."""
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
                       "model": str(tiny_model_dir)})
    spec_server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("seeded"),
                                *ENGINE_FLAGS, "--speculative-config", spec)
    try:
        with httpx.Client() as client, ThreadPoolExecutor(6) as pool:
            plain = _seeded_texts(server, client, stream=False)
            results = list(pool.map(lambda i: _seeded_texts(spec_server, client, i % 2 == 1),
                                    range(6)))
        values = scrape(spec_server.url)
    finally:
        assert spec_server.stop() == 0, spec_server.log()
    assert len(set(plain)) > 1  # choices have seeds 1234 .. 1237
    assert all(r == plain for r in results)
    assert values["braid:spec_decode_num_drafts_total"] > 0


def test_a_prediction_drafts_through_the_server(tiny_model_dir: Path,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """OpenAI's `prediction`: the same text with it or without, its drafts counted in the
    usage; a malformed one is a 400 naming the field."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("predict"), *ENGINE_FLAGS,
                           "--speculative-config", spec)
    url = f"{server.url}/v1/completions"
    body = {"model": server.model, "prompt": "the quick brown fox", "max_tokens": 32,
            "ignore_eos": True, "temperature": 0}
    try:
        # text the byte tokenizer gives back as the same tokens: letters only
        letters = httpx.post(f"{server.url}/tokenize", json={
            "model": server.model, "prompt": "abcdefghijklmnopqrstuvwxyz",
            "add_special_tokens": False}, timeout=60).json()["tokens"]
        body["allowed_token_ids"] = letters
        plain = httpx.post(url, json=body, timeout=60).json()
        text = plain["choices"][0]["text"]
        predicted = [httpx.post(url, json={**body, "prediction": p}, timeout=60).json()
                     for p in ({"type": "content", "content": text},
                               {"type": "content", "content": [
                                   {"type": "text", "text": text[:10]},
                                   {"type": "text", "text": text[10:]}]})]
        bad = [httpx.post(url, json={**body, "prediction": p}, timeout=60)
               for p in ({"type": "text", "content": text}, {"content": text}, text,
                         {"type": "content", "content": 5})]
    finally:
        assert server.stop() == 0, server.log()
    assert "completion_tokens_details" not in plain["usage"] or \
        plain["usage"]["completion_tokens_details"] is None
    for res in predicted:
        assert res["choices"][0]["text"] == text
        details = res["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 16, (res["usage"], res["braid"])
        assert details["rejected_prediction_tokens"] == 0
    for res in bad:
        assert res.status_code == 400, res.text
        assert res.json()["error"]["param"].startswith("prediction"), res.text
