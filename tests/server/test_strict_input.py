"""Input a hostile or careless client sends: text that cannot be UTF-8 anywhere in a body,
values of the wrong JSON type, malformed tool calls and names, over-long request ids, auth
header spellings; and what an OpenAI client sends or asks that braid serves as OpenAI does
(GET /v1/models/{id}, error bodies, fields that are only hints)."""

from __future__ import annotations

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from braid.server.middleware import ApiKeyAuth
from braid.server.protocol import ChatCompletionRequest
from tests.server.conftest import ServerProcess
from tests.server.test_hardening import assert_400, chat, completion, post

BAD = "a\ud800b"  # a lone surrogate: json.dumps keeps it as an escape
USER = {"role": "user", "content": "hi"}


def tool(name: str = "f", parameters: object = None) -> dict:
    function: dict = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def called(function: object) -> list[dict]:
    """A conversation whose assistant message made the call `function`."""
    return [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]


# ---- item 6: a lone surrogate anywhere is a 400 naming the field ------------------------------

SURROGATES = {
    "completions model": ("/v1/completions", {"prompt": "hi", "model": BAD}, "model"),
    "chat model": ("/v1/chat/completions", {"messages": [USER], "model": BAD}, "model"),
    "tokenize model": ("/tokenize", {"prompt": "hi", "model": BAD}, "model"),
    "tokenize chat model": ("/tokenize", {"messages": [USER], "model": BAD}, "model"),
    "detokenize model": ("/detokenize", {"tokens": [104], "model": BAD}, "model"),
    "invocations model": ("/invocations", {"prompt": "hi", "model": BAD}, "model"),
    "parameters key": ("/v1/chat/completions", {"messages": [USER], "tools": [tool(
        parameters={"type": "object", "properties": {BAD: {"type": "string"}}})]}, "tools"),
    "parameters enum": ("/v1/chat/completions", {"messages": [USER], "tools": [tool(
        parameters={"type": "object", "properties": {"a": {"enum": ["x", BAD]}}})]},
        "tools"),
    "tokenize parameters": ("/tokenize", {"messages": [USER], "tools": [tool(
        parameters={"type": "object", "properties": {BAD: {}}})]}, "tools"),
    "call arguments": ("/v1/chat/completions", {"messages": called(
        {"name": "f", "arguments": f'{{"zone": "{BAD}"}}'})}, "messages"),
    "call arguments object": ("/v1/chat/completions", {"messages": called(
        {"name": "f", "arguments": {BAD: 1}})}, "messages"),
    "call name": ("/v1/chat/completions", {"messages": called(
        {"name": BAD, "arguments": "{}"})}, "messages"),
    "tool_call_id": ("/v1/chat/completions", {"messages": [
        USER, {"role": "tool", "tool_call_id": BAD, "content": "x"}]}, "messages"),
    "template kwargs tools": ("/v1/chat/completions", {"messages": [USER],
                              "chat_template_kwargs": {"tools": [tool(parameters={
                                  "type": "object", "properties": {BAD: {}}})]}},
                              "chat_template_kwargs"),
    "template kwargs value": ("/tokenize", {"messages": [USER],
                              "chat_template_kwargs": {"tail": [BAD]}},
                              "chat_template_kwargs"),
    "documents key": ("/v1/chat/completions", {"messages": [USER],
                                               "documents": [{BAD: "x"}]}, "documents"),
    "json schema key": ("/v1/chat/completions", {"messages": [USER], "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"properties": {BAD: {}}}}}},
        "response_format"),
    "structured json": ("/v1/completions", {"prompt": "hi", "structured_outputs": {
        "json": {"enum": [BAD]}}}, "structured_outputs"),
    "metadata key": ("/v1/chat/completions", {"messages": [USER], "metadata": {BAD: "x"}},
                     "metadata"),
}


@pytest.mark.parametrize("case", list(SURROGATES))
def test_lone_surrogate_anywhere_is_400_naming_the_field(server: ServerProcess,
                                                         case: str) -> None:
    path, body, param = SURROGATES[case]
    r = post(server, path, {"max_tokens": 2, **body} if path.startswith("/v1") else body)
    assert_400(r, param)
    assert "UTF-8" in r.json()["error"]["message"]


@pytest.mark.parametrize("tool_calls", ["oops", [1], [{"id": "1", "function": None}],
                                        [{"id": "1", "function": {"arguments": "{}"}}],
                                        [{"id": "1", "type": "web", "function": {
                                            "name": "f", "arguments": "{}"}}]])
def test_malformed_tool_calls_are_400_naming_messages(server: ServerProcess,
                                                      tool_calls: object) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        r = post(server, path, {"model": server.model, "messages": [
            USER, {"role": "assistant", "content": None, "tool_calls": tool_calls}]})
        assert_400(r, "messages")
    assert post(server, "/v1/chat/completions", {"messages": called(
        {"name": "f", "arguments": '{"zone": "UTC"}'}), "max_tokens": 2}).status_code == 200


def test_an_error_message_never_fails_to_encode() -> None:
    """A message quoting the client's text is sent with its surrogates escaped."""
    from braid.server.errors import APIError

    body = APIError(404, f"The model `{BAD}` does not exist", "model").response().body
    assert "The model `a\\\\ud800b` does not exist" in bytes(body).decode()


# ---- item 7: request ids are bounded -----------------------------------------------------------


def test_request_id_is_at_most_256_characters(server: ServerProcess) -> None:
    r = completion(server, request_id="x" * 256)
    assert r.status_code == 200 and r.headers["x-request-id"] == "cmpl-" + "x" * 256
    for length in (257, 2**20):
        r = completion(server, request_id="x" * length)
        assert_400(r, "request_id")
        assert "256" in r.json()["error"]["message"] and "x" * 300 not in r.text
        assert "x" * 300 not in r.headers.get("x-request-id", "")


def test_an_over_long_request_id_header_is_not_echoed(server: ServerProcess) -> None:
    """The X-Request-Id header is taken as the response's id only where it could be the
    request_id field (a proxy may set one the client cannot change): else braid names the
    response itself."""
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "hi",
                                         "max_tokens": 2}, headers={"X-Request-Id": "y" * 256})
    assert r.json()["id"] == r.headers["x-request-id"] == "cmpl-" + "y" * 256
    for header in ("y" * 8192, "y" * 257):
        r = post(server, "/v1/chat/completions", {
            "model": server.model, "messages": [USER], "max_tokens": 2},
            headers={"X-Request-Id": header})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == r.headers["x-request-id"]
        assert r.headers["x-request-id"].startswith("chatcmpl-")
        assert len(r.headers["x-request-id"]) < 100


# ---- item 8: lax input -------------------------------------------------------------------------


@pytest.mark.parametrize("key", [" 7", "1_0", "\u0665", "+7", "-1", "7 ", "0x7", ""])
def test_logit_bias_keys_are_ascii_digits(server: ServerProcess, key: str) -> None:
    assert_400(completion(server, logit_bias={key: 1}), "logit_bias")
    assert_400(chat(server, logit_bias={key: 1}), "logit_bias")


def test_logit_bias_digits_still_work(server: ServerProcess) -> None:
    assert completion(server, logit_bias={"104": 5, "0": -1}).status_code == 200


STRICT = {
    "seed": True, "n": True, "max_tokens": "3", "temperature": True, "top_p": "0.5",
    "top_k": 2.0, "min_tokens": False, "logprobs": True, "stop_token_ids": [True],
    "logit_bias": {"104": True}, "stream": 1, "echo": "true", "priority": 1.5,
}


@pytest.mark.parametrize("name", list(STRICT))
def test_wrong_json_types_are_400(server: ServerProcess, name: str) -> None:
    """No bool for a number, no number in a string, no float for an integer."""
    assert_400(completion(server, **{name: STRICT[name]}), name)


def test_strict_types_on_chat_and_token_routes(server: ServerProcess) -> None:
    assert_400(chat(server, n=True), "n")
    assert_400(chat(server, logprobs=1), "logprobs")
    assert_400(chat(server, max_completion_tokens="3"), "max_completion_tokens")
    assert_400(post(server, "/detokenize", {"tokens": [True]}), "tokens")
    assert_400(post(server, "/tokenize", {"prompt": "hi", "add_special_tokens": 1}),
               "add_special_tokens")
    assert_400(chat(server, stream=True, stream_options={"include_usage": "yes"}),
               "stream_options")


def test_an_integer_is_a_float() -> None:
    body = ChatCompletionRequest(messages=[USER], temperature=1, top_p=1)
    assert body.temperature == 1.0 and isinstance(body.temperature, float)


@pytest.mark.parametrize("tools", [
    [tool("")], [tool("a" * 65)], [tool("a" * 10_000)], [tool("get weather")],
    [tool("caf\u00e9")], [tool("f.g")], [tool("f"), tool("f")],
    [tool("f"), tool("g"), tool("f")],
])
def test_tool_names_follow_openai_s_rule(server: ServerProcess, tools: list[dict]) -> None:
    r = chat(server, tools=tools)
    assert_400(r, "tools")
    assert len(r.json()["error"]["message"]) < 300
    assert_400(post(server, "/tokenize", {"messages": [USER], "tools": tools}), "tools")


def test_good_tool_names_are_accepted(server: ServerProcess) -> None:
    tools = [tool("a" * 64), tool("get_weather-2"), tool("F")]
    assert chat(server, tools=tools, tool_choice="none").status_code == 200


def _auth_client() -> TestClient:
    async def hello(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = ApiKeyAuth(Starlette(routes=[Route("/v1/models", hello)]), api_key="KEY")
    return TestClient(app)  # type: ignore[arg-type]


@pytest.mark.parametrize("header", ["Bearer KEY", "bearer KEY", "BEARER KEY", "bEaReR KEY",
                                    "Bearer  KEY"])
def test_the_auth_scheme_is_case_insensitive(header: str) -> None:
    """RFC 7235: the scheme is case-insensitive; the key is not."""
    r = _auth_client().get("/v1/models", headers={"authorization": header})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("header", ["Bearer key", "Bearer KEY2", "KEY", "Basic KEY",
                                    "BearerKEY", "Bearer", "", "Bearer KEY ", "Token KEY"])
def test_a_wrong_key_or_scheme_is_401(header: str) -> None:
    r = _auth_client().get("/v1/models", headers={"authorization": header})
    assert r.status_code == 401
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"


# ---- compatibility -----------------------------------------------------------------------------


def test_models_retrieve_with_the_openai_client(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    card = client.models.retrieve(server.model)  # a path: its slashes are percent-encoded
    assert (card.id, card.object, card.owned_by) == (server.model, "model", "braid")
    listed = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found"
    assert listed["id"] == card.id and listed["max_model_len"] == card.max_model_len  # type: ignore[attr-defined]


def test_unknown_model_card_is_404_in_openai_s_shape(server: ServerProcess) -> None:
    r = httpx.get(f"{server.url}/v1/models/no-such-model")
    assert r.status_code == 404
    assert r.json() == {"error": {
        "message": r.json()["error"]["message"], "type": "not_found_error", "param": "model",
        "code": "model_not_found"}}
    assert "no-such-model" in r.json()["error"]["message"]


@pytest.mark.parametrize("send", [
    lambda s: completion(s, temperature=-1), lambda s: chat(s, n=0),
    lambda s: post(s, "/v1/completions", {"prompt": "hi", "bogus": 1}),
    lambda s: httpx.post(f"{s.url}/v1/completions", content=b"{", timeout=30),
    lambda s: httpx.get(f"{s.url}/no/such/route"),
    lambda s: httpx.put(f"{s.url}/v1/completions"),
])
def test_error_bodies_are_openai_s_shape(server: ServerProcess, send: object) -> None:
    """{"error": {"message", "type", "param", "code"}}, code a string or null."""
    r = send(server)  # type: ignore[operator]
    assert r.status_code >= 400
    error = r.json()["error"]
    assert set(r.json()) == {"error"}
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["code"] is None or isinstance(error["code"], str), error


HINTS = {
    "modalities": ["text"], "audio": None, "verbosity": "low", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "reasoning_effort": "xhigh",
    "function_call": "none", "functions": None, "web_search_options": None,
    "moderation": None, "service_tier": "flex", "store": True, "parallel_tool_calls": True,
}


def test_openai_hints_are_accepted_and_change_nothing(server: ServerProcess) -> None:
    plain = chat(server, max_tokens=6).json()["choices"]
    r = chat(server, max_tokens=6, **HINTS)
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain
    part = [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}]
    assert chat(server, part, max_tokens=6).json()["choices"] == plain
    r = chat(server, max_tokens=6, stream=True,
             stream_options={"include_usage": True, "include_obfuscation": False})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")


def test_openai_s_client_sends_its_hints(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        modalities=["text"], verbosity="medium", prompt_cache_retention="in_memory",
        store=False, reasoning_effort="none")
    assert reply.choices[0].finish_reason in ("length", "stop")


REFUSED = {
    "modalities": [["audio"]], "audio": [{"voice": "alloy", "format": "wav"}],
    "web_search_options": [{}], "moderation": [{"model": "omni-moderation-latest"}],
    "functions": [[{"name": "f"}]], "function_call": ["auto", {"name": "f"}],
    "verbosity": ["loud"],
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_openai_fields_that_would_change_the_output_are_400(server: ServerProcess,
                                                           name: str) -> None:
    for value in REFUSED[name]:
        assert_400(chat(server, **{name: value}), name)
    assert_400(chat(server, modalities=["text", "audio"]), "modalities")
