"""Structured output over a real server with the openai client: response_format and vLLM's
structured_outputs on both endpoints, streaming and not; outputs always match (the mask forces
it even for a random model); bad constraints get 400 naming the field; a burst of mixed
requests gives the same greedy outputs with draft speculation as without."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import ENGINE_FLAGS, ServerProcess
from tests.server.metrics_util import scrape

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Where?"}]


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[ServerProcess]:
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
                       "policy": "fixed", "model": str(tiny_model_dir)})
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("structured-spec"),
                         *ENGINE_FLAGS, "--speculative-config", spec)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_output_validates(server: ServerProcess, stream: bool) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, messages=MESSAGES, max_tokens=200,
                                  temperature=0, response_format=JSON_SCHEMA_FORMAT)
    c = client(server)
    if stream:
        chunks = list(c.chat.completions.create(stream=True, **kwargs))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    else:
        res = c.chat.completions.create(**kwargs)
        text, finish = res.choices[0].message.content or "", res.choices[0].finish_reason
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop"


@pytest.mark.parametrize("constraint, check", [
    ({"json": SCHEMA, "disable_any_whitespace": True},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) or " " not in t),
    ({"regex": r"[a-c]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
    ({"choice": ["left", "right", "straight on"]},
     lambda t: t in ["left", "right", "straight on"]),
    ({"grammar": 'root ::= "go " ("north" | "south") "!"'},
     lambda t: t in ["go north!", "go south!"]),
])
def test_completions_structured_outputs(server: ServerProcess, constraint: dict,
                                        check: Any) -> None:
    """n = 2 sampled choices, and the stream's text equals the non-streamed one."""
    c = client(server)
    kwargs: dict[str, Any] = dict(model=server.model, prompt="Answer:", max_tokens=200,
                                  extra_body={"structured_outputs": constraint})
    sampled = c.completions.create(n=2, temperature=1.0, seed=3, **kwargs)
    for choice in sampled.choices:
        assert check(choice.text) and choice.finish_reason == "stop", choice.text
    greedy = c.completions.create(temperature=0, **kwargs).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        temperature=0, stream=True, **kwargs) if ch.choices)
    assert streamed == greedy and check(greedy)


def test_json_object_on_both_endpoints(server: ServerProcess) -> None:
    """Any JSON object. Its strings are unbounded, and a random model would never close one,
    so a logit bias toward `"`, `}` and `0` leads it out: the mask keeps it valid JSON."""
    c = client(server)
    bias = {str(ord(ch)): 8 for ch in '"}0'}
    res = c.completions.create(model=server.model, prompt="{", max_tokens=100, temperature=0,
                               logit_bias=bias, extra_body={"structured_outputs": {
                                   "json_object": True}})
    assert isinstance(json.loads(res.choices[0].text), dict)
    chat = c.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=100,
                                     temperature=0, logit_bias=bias,
                                     response_format={"type": "json_object"})
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    assert chat.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, field", [
    ({"structured_outputs": {"regex": "a[b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= (("}}, "structured_outputs"),
    ({"structured_outputs": {"jsonx": {}}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format"),
    ({"guided_json": SCHEMA}, "guided_json"),
])
def test_bad_constraints_are_400_naming_the_field(server: ServerProcess, body: dict,
                                                  field: str) -> None:
    for route, extra in (("completions", {"prompt": "hi"}), ("chat/completions",
                                                             {"messages": MESSAGES})):
        res = httpx.post(f"{server.url}/v1/{route}", timeout=30,
                         json={"model": server.model, **extra, **body})
        assert res.status_code == 400, res.text
        assert res.json()["error"]["param"] == field, res.json()
    ok = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": server.model, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200  # the server goes on


def burst(server: ServerProcess) -> list[str]:
    """Eight requests at once, half of them constrained, greedy."""
    constraints = [{"json": SCHEMA}, None, {"regex": "[0-9]{4}"}, None,
                   {"choice": ["red", "green"]}, None, {"grammar": 'start: "a"+ "b"'}, None]

    def one(i: int) -> str:
        extra = {} if constraints[i] is None else {"structured_outputs": constraints[i]}
        res = client(server).completions.create(
            model=server.model, prompt=f"item {i}:", max_tokens=120, temperature=0,
            extra_body=extra)
        return res.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(8)))


def test_a_burst_is_the_same_with_draft_speculation(server: ServerProcess,
                                                    spec_server: ServerProcess) -> None:
    want = burst(server)
    assert burst(spec_server) == want
    jsonschema.validate(json.loads(want[0]), SCHEMA)
    values = scrape(spec_server.url)
    assert values["braid:spec_decode_num_accepted_tokens_total"] > 0
    assert values["braid:structured_output_masks_total"] > 0
    assert values["braid:structured_output_mask_seconds_total"] > 0
    assert "braid:structured_output_rejected_draft_tokens_total" in values
