"""Every bad input gets HTTP 400 with an OpenAI-style body naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess

LONG = "x" * 300  # one byte-level token per character: past max_model_len 256


def chat(content: str = "hi", **fields: object) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                    **fields}


def completion(**fields: object) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "hi", **fields}


CASES = {
    "prompt too long": (completion(prompt=LONG), "prompt"),
    "chat prompt too long": (chat(LONG), "messages"),
    "max_tokens zero": (completion(max_tokens=0), "max_tokens"),
    "max_tokens negative": (chat(max_tokens=-3), "max_tokens"),
    "max_completion_tokens zero": (chat(max_completion_tokens=0), "max_completion_tokens"),
    "temperature negative": (completion(temperature=-0.5), "temperature"),
    "top_p too large": (chat(top_p=1.5), "top_p"),
    "max_tokens wrong type": (completion(max_tokens="many"), "max_tokens"),
    "temperature wrong type": (chat(temperature=[1]), "temperature"),
    "messages wrong type": (("/v1/chat/completions", {"messages": "hi"}), "messages"),
    "messages missing": (("/v1/chat/completions", {}), "messages"),
    "prompt missing": (("/v1/completions", {"max_tokens": 3}), "prompt"),
    "prompt token out of vocab": (completion(prompt=[1, 99999]), "prompt"),
    "empty prompt": (completion(prompt=""), "prompt"),
    "n zero": (completion(n=0), "n"),
    "stream wrong type": (completion(stream="yes please"), "stream"),
    "stream_options without stream": (completion(stream_options={}), "stream_options"),
    # beyond --max-logprobs (20 by default, as vLLM)
    "logprobs beyond the limit": (completion(logprobs=21), "logprobs"),
    "top_logprobs beyond the limit": (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    "prompt_logprobs beyond the limit": (completion(prompt_logprobs=10**6), "prompt_logprobs"),
    "chat prompt_logprobs beyond the limit": (chat(prompt_logprobs=21), "prompt_logprobs"),
    # -1, vLLM's whole vocabulary, is beyond the default limit
    "top_logprobs -1 beyond the limit": (chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    "logprobs -1 beyond the limit": (completion(logprobs=-1), "logprobs"),
    "logprobs below -1": (completion(logprobs=-2), "logprobs"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_400_naming_the_field(server: ServerProcess, case: str) -> None:
    (path, body), field = CASES[case]
    body.setdefault("model", server.model)
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field, error
    assert error["message"]


def test_minus_one_beyond_the_limit_is_named_as_sent(server: ServerProcess) -> None:
    """The message names the -1 the client sent (it named the vocabulary's size instead)."""
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": server.model, "prompt": "hi", "logprobs": -1}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("logprobs -1 asks for the whole vocabulary")


@pytest.mark.parametrize("raw", [b'{"prompt": "hi", "max_tokens": ', b"not json", b"[1, 2]"])
def test_malformed_body_is_400(server: ServerProcess, raw: bytes) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "body"


def test_openai_client_sees_bad_request(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.model, prompt="hi", temperature=-1)
    assert info.value.status_code == 400
    assert info.value.param == "temperature"


@pytest.mark.parametrize("path, body", [chat(), completion(),
                                        ("/tokenize", {"prompt": "hi"}),
                                        ("/detokenize", {"tokens": [104]})])
def test_an_unknown_model_is_404_as_in_vllm(server: ServerProcess, path: str, body: dict
                                            ) -> None:
    r = httpx.post(f"{server.url}{path}", json={**body, "model": "no-such-model"}, timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "not_found_error", "model", "model_not_found")
    assert error["message"].startswith("The model `no-such-model` does not exist")
    assert server.model in error["message"]


def test_openai_client_sees_not_found(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_server_still_serves_after_bad_requests(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": server.model, "prompt": "ok", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
