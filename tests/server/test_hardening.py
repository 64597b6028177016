"""The server as an attacker or a careless client meets it: every field honoured or refused,
odd text, huge bodies, bursts past the waiting limit, auth, token routes, shutdown."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ENGINE_FLAGS, ServerProcess, tls_flags
from tests.server.metrics_util import scrape, wait_until_in_engine

KEY = "s3cret-key"
UI = "http://ui.example:3000"  # the one origin the guarded server allows
LIMIT_BYTES = 100_000


def post(server: ServerProcess, path: str, body: dict, **kwargs: object) -> httpx.Response:
    """POST `body` as JSON text written by json.dumps (which keeps lone surrogates as
    escapes, where httpx's own encoder would refuse them)."""
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}  # type: ignore[dict-item]
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), headers=headers,
                      timeout=60, **kwargs)  # type: ignore[arg-type]


def completion(server: ServerProcess, **fields: object) -> httpx.Response:
    return post(server, "/v1/completions", {"model": server.model, "prompt": "hi",
                                            "max_tokens": 4, "temperature": 0, **fields})


def chat(server: ServerProcess, content: object = "hi", **fields: object) -> httpx.Response:
    return post(server, "/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": content}],
        "max_tokens": 4, "temperature": 0, **fields})


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert r.json()["error"]["message"]


# ---- text that is not UTF-8 ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["prompt", "prompt list", "chat content", "chat part",
                                   "stop"])
def test_lone_surrogate_is_400_naming_the_field(server: ServerProcess, where: str) -> None:
    bad = "a\ud800b"
    r = {
        "prompt": lambda: completion(server, prompt=bad),
        "prompt list": lambda: completion(server, prompt=["ok", bad]),
        "chat content": lambda: chat(server, bad),
        "chat part": lambda: chat(server, [{"type": "text", "text": bad}]),
        "stop": lambda: completion(server, stop=[bad]),
    }[where]()
    assert_400(r, {"chat content": "messages", "chat part": "messages",
                   "prompt list": "prompt"}.get(where, where))
    message = r.json()["error"]["message"]  # the client's path, in plain words
    assert "text must be valid UTF-8" in message and "function-" not in message
    assert "Value error" not in message
    assert completion(server).status_code == 200


# ---- seeds ---------------------------------------------------------------------------------


def test_seed_past_64_bits_is_400_and_the_largest_works_with_n_2(server: ServerProcess) -> None:
    assert_400(completion(server, seed=2**64, temperature=1), "seed")
    r = completion(server, seed=2**64 - 1, n=2, temperature=1)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


# ---- every field honoured or refused -------------------------------------------------------

REFUSED = {
    "best_of": {"best_of": 2},
    "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "tool_choice": {"tool_choice": "auto"},
    "guided_json": {"guided_json": {"type": "object"}},
    "guided_regex": {"guided_regex": "a+"},
    "no_such_field": {"no_such_field": 1},
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unimplemented_and_unknown_fields_are_400(server: ServerProcess, name: str) -> None:
    assert_400(completion(server, **REFUSED[name]), name)
    if name not in ("tools", "tool_choice"):  # completions-only refusals (chat implements
        # tools)
        assert_400(chat(server, **REFUSED[name]), name)


def test_null_is_the_field_s_default_as_in_vllm(server: ServerProcess) -> None:
    """Clients send unset options as null; vLLM's fields are Optional, so null means the
    default. Where null is a value (completions' max_tokens: to the context's end) it stays."""
    nulls = dict.fromkeys(("top_p", "top_k", "min_p", "n", "presence_penalty",
                           "frequency_penalty", "repetition_penalty", "min_tokens",
                           "ignore_eos", "stream", "include_stop_str_in_output", "seed",
                           "stop", "logprobs"))
    for send in (completion, chat):
        plain = send(server, max_tokens=6, temperature=0)
        r = send(server, max_tokens=6, temperature=0, **nulls)
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == plain.json()["choices"]
        assert send(server, temperature=None, seed=3, max_tokens=2).status_code == 200
    r = completion(server, max_tokens=None, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] + r.json()["usage"]["prompt_tokens"] == 256


def test_more_of_vllm_s_request_conventions(server: ServerProcess) -> None:
    """An empty model name is the served model; null inside a part of the body is its
    default too; the X-Request-Id header names the response; /tokenize gives token strings."""
    assert completion(server, model="").status_code == 200
    r = completion(server, stream=True, stream_options={"include_usage": None}, max_tokens=2)
    assert '"usage":{"prompt_tokens"' in r.text.replace(" ", "")
    r = chat(server, response_format={"type": "json_schema", "json_schema": {
        "name": None, "schema": {"type": "object"}}}, max_tokens=6)
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": 2},
             headers={"X-Request-Id": "from-header"})
    assert r.json()["id"] == r.headers["x-request-id"] == "cmpl-from-header"
    r = chat(server, stream=True, max_tokens=2)
    assert r.headers["x-request-id"].startswith("chatcmpl-") and r.headers[
        "x-request-id"] in r.text
    r = post(server, "/tokenize", {"prompt": "hi you", "return_token_strs": True})
    assert "".join(r.json()["token_strs"]) == "hiĠyou"  # byte-level spellings
    assert len(r.json()["token_strs"]) == r.json()["count"]
    assert post(server, "/tokenize", {"prompt": "hi"}).json().get("token_strs") is None


def test_return_tokens_as_token_ids(server: ServerProcess) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>" (bytes that
    are no text are named exactly); text and text offsets stay text."""
    plain = completion(server, logprobs=2, max_tokens=4, prompt="hey").json()["choices"][0]
    r = completion(server, logprobs=2, max_tokens=4, prompt="hey",
                   return_tokens_as_token_ids=True).json()["choices"][0]
    assert r["text"] == plain["text"]
    assert r["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert all(t.startswith("token_id:") for t in r["logprobs"]["tokens"])
    assert len(r["logprobs"]["tokens"]) == 4
    for token, top in zip(r["logprobs"]["tokens"], r["logprobs"]["top_logprobs"], strict=True):
        assert token in top and all(k.startswith("token_id:") for k in top)  # its own too
    assert [t.removeprefix("token_id:").isdigit() for t in r["logprobs"]["tokens"]] == [True] * 4
    c = chat(server, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True).json()
    for entry in c["choices"][0]["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:")
        token_id = int(entry["token"].removeprefix("token_id:"))
        if token_id < 256:  # the byte tokenizer's: a token is its byte (bytes stay the token's)
            assert entry["bytes"] == [token_id]
        assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])


def test_output_cut_inside_a_character(server: ServerProcess) -> None:
    """A max_tokens that ends the output inside a UTF-8 character drops that character (as
    vLLM) instead of ending the text with U+FFFD, streamed or not; logprobs' `bytes` are each
    token's own (OpenAI's: the bytes of a character's parts), not U+FFFD's."""
    lead = {"240": 100}  # the byte tokenizer's 0xF0: the first of a 4-byte character
    for stream in (False, True):
        r = completion(server, logit_bias=lead, max_tokens=1, stream=stream)
        assert r.status_code == 200, r.text
        text = ("".join(json.loads(line[6:])["choices"][0]["text"]
                        for line in r.text.splitlines()
                        if line.startswith("data: {") and '"choices":[{' in line)
                if stream else r.json()["choices"][0]["text"])
        assert text == ""
    r = chat(server, logit_bias=lead, max_tokens=2, logprobs=True, top_logprobs=1).json()
    choice = r["choices"][0]
    assert choice["message"]["content"] == "\ufffd"  # an 0xF0 another 0xF0 follows: invalid
    assert [e["bytes"] for e in choice["logprobs"]["content"]] == [[240], [240]]
    top = choice["logprobs"]["content"][0]["top_logprobs"]  # the model's own, before the bias
    assert top and all(len(t["bytes"]) == 1 for t in top)  # one byte each, as their tokens


def test_stream_options_as_in_vllm(server: ServerProcess) -> None:
    """include_usage defaults to true once stream_options is given; stream_options without
    stream is a 400 naming it."""
    r = completion(server, stream=True, stream_options={}, max_tokens=3)
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 3
    for send in (completion, chat):
        assert_400(send(server, stream_options={"include_usage": True}), "stream_options")


def test_accepted_no_ops(server: ServerProcess) -> None:
    """Fields that change no output are accepted, so OpenAI clients that send them work; the
    output is what the request gives without them. A value of the wrong type is still 400."""
    r = completion(server, user="u1", best_of=1, response_format={"type": "text"},
                   tool_choice="none")
    assert r.status_code == 200, r.text
    hints = {"user": "u1", "metadata": {"run": "7"}, "store": False, "service_tier": "auto",
             "prompt_cache_key": "k", "safety_identifier": "s", "reasoning_effort": "low"}
    r = chat(server, max_tokens=8, **hints)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == chat(server, max_tokens=8).json()[
        "choices"][0]["message"]
    assert_400(chat(server, store="yes please"), "store")
    assert_400(chat(server, reasoning_effort="extreme"), "reasoning_effort")
    assert_400(completion(server, metadata={"run": "7"}), "metadata")  # chat's, not completions'


def test_logit_bias_steers_greedy_output(server: ServerProcess) -> None:
    token = 104  # byte-level: "h"
    for r in (completion(server, logit_bias={str(token): 100}, max_tokens=6),
              chat(server, logit_bias={str(token): 100}, max_tokens=6)):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice.get("text") or choice["message"]["content"]) == "hhhhhh"
    assert_400(completion(server, logit_bias={"h": 5}), "logit_bias")
    assert_400(completion(server, logit_bias={"3": 500}), "logit_bias")
    assert_400(completion(server, logit_bias={"99999": 1}), "logit_bias")



def test_suffix_needs_fill_in_the_middle_tokens(server: ServerProcess) -> None:
    """The tiny model has no FIM tokens: a suffix is a 400 naming it (the default model's
    infill is in test_real_model); an empty suffix is no suffix. Chat has no suffix."""
    r = completion(server, suffix="tail")
    assert_400(r, "suffix")
    assert "fill-in-the-middle" in r.json()["error"]["message"]
    assert completion(server, suffix="").status_code == 200
    assert_400(chat(server, suffix="tail"), "suffix")


def test_generation_config_fills_what_a_request_leaves_unset(tmp_path: Path) -> None:
    """As vLLM's --generation-config auto: the folder's recommended sampling (here top_k 1,
    which is greedy) for fields a request leaves out or sends as null; its own fields win."""
    from tests.tiny import save_tiny_model

    folder = save_tiny_model(tmp_path / "model")
    (folder / "generation_config.json").write_text(json.dumps(
        {"top_k": 1, "temperature": 0.9, "max_new_tokens": 5}))
    server = ServerProcess(folder, tmp_path, *ENGINE_FLAGS)
    try:
        # max_new_tokens: the max_tokens of a request that leaves it unset (or null)
        for r in (chat(server, ignore_eos=True, max_tokens=None),
                  completion(server, ignore_eos=True, max_tokens=None)):
            assert r.json()["usage"]["completion_tokens"] == 5, r.text
        assert chat(server, ignore_eos=True, max_tokens=9).json()["usage"][
            "completion_tokens"] == 9
        greedy = completion(server, temperature=0, max_tokens=8).json()["choices"][0]["text"]
        for fields in ({"seed": 1}, {"seed": 2, "top_k": None}, {"seed": 3, "temperature": 1.5}):
            r = completion(server, max_tokens=8, **fields)
            assert r.json()["choices"][0]["text"] == greedy, fields
        r = chat(server, seed=4, max_tokens=8)
        assert r.json()["choices"][0]["message"]["content"] == chat(
            server, temperature=0, max_tokens=8).json()["choices"][0]["message"]["content"]
        sampled = {completion(server, max_tokens=8, top_k=0, temperature=5, seed=s).json()[
                       "choices"][0]["text"]
                   for s in range(4)}
        assert sampled != {greedy}  # a request's own top_k wins
    finally:
        assert server.stop() == 0, server.log()
    assert "default sampling from" in server.log_path.read_text()


def test_override_max_new_tokens_limits_every_request(tmp_path: Path) -> None:
    """vLLM's --override-generation-config max_new_tokens: the default max_tokens and every
    request's limit (a larger max_tokens, even one past the context, runs to it), streams
    too."""
    from tests.tiny import save_tiny_model

    server = ServerProcess(save_tiny_model(tmp_path / "model"), tmp_path, *ENGINE_FLAGS,
                           "--override-generation-config", '{"max_new_tokens": 3}')
    try:
        for r in (chat(server, max_tokens=None), chat(server, max_completion_tokens=50),
                  completion(server, max_tokens=None), completion(server, max_tokens=10_000)):
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length"
        assert completion(server, max_tokens=2).json()["usage"]["completion_tokens"] == 2
        r = completion(server, max_tokens=50, stream=True,
                       stream_options={"include_usage": True})
        usage = [json.loads(line[6:]) for line in r.text.splitlines()
                 if line.startswith("data: {")][-1]["usage"]
        assert usage["completion_tokens"] == 3
    finally:
        assert server.stop() == 0, server.log()


def test_truncate_prompt_tokens_keeps_the_prompt_s_end(server: ServerProcess) -> None:
    """vLLM's truncate_prompt_tokens: the last k prompt tokens (-1: max_model_len); a prompt
    past the context then fits where it was a 400."""
    r = completion(server, prompt="abcdefghij", truncate_prompt_tokens=4, echo=True,
                   max_tokens=1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4
    assert r.json()["choices"][0]["text"].startswith("ghij")
    long = "x" * 300  # one token a byte, past max_model_len 256
    assert_400(completion(server, prompt=long), "prompt")
    r = completion(server, prompt=[long, "ab"], truncate_prompt_tokens=200, max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 202
    # -1 keeps max_model_len tokens: no room for one more, which is the prompt's fault
    assert_400(completion(server, prompt=long, truncate_prompt_tokens=-1), "prompt")
    # token ids past the context are the prompt's fault too, not the default max_tokens'
    r = completion(server, prompt=[104] * 300)
    assert_400(r, "prompt")
    assert r.json()["error"]["message"].startswith("prompt is 300 tokens, the maximum is 255")
    assert_400(chat(server, "y" * 300, truncate_prompt_tokens=-1), "messages")
    r = chat(server, "y" * 300, truncate_prompt_tokens=100, max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100
    for bad in (0, -2, 257, "x"):
        assert_400(completion(server, truncate_prompt_tokens=bad), "truncate_prompt_tokens")
        assert_400(chat(server, truncate_prompt_tokens=bad), "truncate_prompt_tokens")


def test_request_id_names_the_response(server: ServerProcess) -> None:
    """vLLM's request_id: the response id's tail; two requests may share one."""
    with ThreadPoolExecutor(2) as pool:
        same = list(pool.map(lambda _: completion(server, request_id="mine", max_tokens=4),
                             range(2)))
    assert [r.json()["id"] for r in same] == ["cmpl-mine"] * 2
    assert chat(server, request_id="mine").json()["id"] == "chatcmpl-mine"
    r = chat(server, request_id="s", stream=True)
    assert all(json.loads(line[6:])["id"] == "chatcmpl-s" for line in r.text.splitlines()
               if line.startswith("data: {"))
    assert completion(server, add_special_tokens=False).status_code == 200
    assert chat(server, add_special_tokens=True).status_code == 200


def test_spaces_between_special_tokens_as_vllm_s_fast_detokenizer(server: ServerProcess
                                                                   ) -> None:
    """Accepted on both endpoints; special tokens generated back to back (the only tokens
    allowed) read the same either way, with no space between them, as in vLLM with a
    byte-level tokenizer; a value that is not a boolean is a 400 naming the field."""
    specials = post(server, "/tokenize", {"model": server.model, "add_special_tokens": False,
                                          "prompt": "<|im_start|><|im_end|>"}).json()["tokens"]
    assert len(specials) == 2
    for send in (completion, chat):
        texts = set()
        for spaces in (True, False):
            r = send(server, allowed_token_ids=specials, skip_special_tokens=False,
                     spaces_between_special_tokens=spaces, ignore_eos=True, max_tokens=4)
            assert r.status_code == 200, r.text
            body = r.json()["choices"][0]
            texts.add(body["text"] if "text" in body else body["message"]["content"])
        assert len(texts) == 1
        text = texts.pop()
        assert len(text) > len("<|im_end|>") and " " not in text
    r = completion(server, spaces_between_special_tokens="sometimes")
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"


def test_priority_needs_the_priority_policy(server: ServerProcess) -> None:
    """As vLLM: a priority other than 0 is refused unless --scheduling-policy priority."""
    assert completion(server, priority=0).status_code == 200
    for send in (completion, chat):
        r = send(server, priority=2)
        assert_400(r, "priority")
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
    assert_400(completion(server, priority="high"), "priority")


def test_bad_words_are_not_generated(server: ServerProcess) -> None:
    forced = {"logit_bias": {str(ord("h")): 100}, "max_tokens": 6}  # "hhhhhh" otherwise
    for r in (completion(server, bad_words=["hh"], **forced),
              chat(server, bad_words=["hh"], **forced)):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text") or choice["message"]["content"]
        assert "hh" not in text and text.count("h") == 3, text  # every other token
    for bad in ([""], ["  "], "hh", [3]):
        assert_400(completion(server, bad_words=bad), "bad_words")


def test_allowed_token_ids_restrict_the_output(server: ServerProcess) -> None:
    allowed = [ord(c) for c in "ab"]  # byte-level tokens
    for r in (completion(server, allowed_token_ids=allowed, max_tokens=8, ignore_eos=True),
              chat(server, allowed_token_ids=allowed, max_tokens=8, ignore_eos=True,
                   temperature=1.0, seed=4)):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text") or choice["message"]["content"]
        assert len(text) == 8 and set(text) <= set("ab")
    for bad in ([], [-1], [99999], "a"):
        assert_400(completion(server, allowed_token_ids=bad), "allowed_token_ids")
    # a stop id beyond the vocabulary is never sampled: refused as the others are
    assert_400(chat(server, stop_token_ids=[10**9]), "stop_token_ids")


def test_echo_returns_prompt_then_completion(server: ServerProcess) -> None:
    plain = completion(server, prompt="hello", max_tokens=5).json()["choices"][0]
    r = completion(server, prompt="hello", max_tokens=5, echo=True, logprobs=1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "hello" + plain["text"]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    assert lp["text_offset"][5] == 5  # first generated token starts after the prompt

    with httpx.stream("POST", f"{server.url}/v1/completions", json={
            "model": server.model, "prompt": "hello", "max_tokens": 5, "temperature": 0,
            "echo": True, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"].startswith("hello")
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


def test_prompt_logprobs_over_http(server: ServerProcess) -> None:
    r = completion(server, prompt="hello", prompt_logprobs=2)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == 5 and entries[0] is None
    for entry, token in zip(entries[1:], [ord(c) for c in "ello"], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert all(v["logprob"] <= 0 for v in entry.values())
        # ranks as vLLM gives them: the top two hold 1 and 2, the prompt token its own rank
        # in the vocabulary; a better rank never has a lower logprob
        by_rank = sorted(entry.values(), key=lambda v: v["rank"])
        assert [v["rank"] for v in by_rank][:2] == [1, 2]
        assert [v["logprob"] for v in by_rank] == sorted((v["logprob"] for v in by_rank),
                                                         reverse=True)
    r = chat(server, prompt_logprobs=0, n=2, temperature=1.0)
    body = r.json()  # at the top level, once for the conversation, as in vLLM
    entries = body["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    assert len(entries) == body["usage"]["prompt_tokens"]
    assert all("prompt_logprobs" not in c for c in body["choices"])


# ---- token routes, version, docs ----------------------------------------------------------


def test_tokenize_detokenize_version(server: ServerProcess) -> None:
    r = post(server, "/tokenize", {"model": server.model, "prompt": "hey"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 3, "max_model_len": 256, "tokens": [104, 101, 121],
                        "token_strs": None}
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hey"}]})
    assert r.status_code == 200 and r.json()["count"] > 3
    # content parts are joined with a newline, as vLLM joins them
    parts = [{"type": "text", "text": "he"}, {"type": "text", "text": "y"}]
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    joined = post(server, "/tokenize", {"messages": [{"role": "user", "content": "he\ny"}]})
    assert r.json()["tokens"] == joined.json()["tokens"]
    r = post(server, "/detokenize", {"tokens": [104, 101, 121]})
    assert r.json() == {"prompt": "hey"}
    assert_400(post(server, "/detokenize", {"tokens": [10**6]}), "tokens")
    assert httpx.get(f"{server.url}/version").json()["version"]
    # errors name the field the client sent, not the body's model class
    assert_400(post(server, "/tokenize", {"messages": "x"}), "messages")
    assert_400(post(server, "/tokenize", {"prompt": 5}), "prompt")
    assert_400(post(server, "/tokenize", {"prompt": "x", "bogus": 1}), "bogus")
    assert_400(post(server, "/tokenize", {}), "prompt")


def test_chat_template_fields_as_in_vllm(server: ServerProcess) -> None:
    """continue_final_message (an assistant prefill the model continues), chat_template and
    chat_template_kwargs, on /tokenize and /v1/chat/completions; their misuse is a 400 naming
    the field, and the server goes on."""
    prefill = [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "Sure, "}]

    def tokens(**fields: object) -> list[int]:
        r = post(server, "/tokenize", {"messages": prefill, **fields})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    opened = tokens(add_generation_prompt=False, continue_final_message=True)
    detok = post(server, "/detokenize", {"tokens": opened}).json()["prompt"]
    assert detok.endswith("<|im_start|>assistant\nSure, ")
    closed = tokens(add_generation_prompt=False)
    assert closed[:len(opened)] == opened and len(closed) > len(opened)
    variables = "{% if tail %}{{ tail }}{% endif %}"  # the tiny model's template has none
    assert tokens(chat_template_kwargs={"tail": "!"}) == tokens()
    # transformers' tokenize is dropped, as vLLM drops it (it was a 500 for a moment)
    assert tokens(chat_template_kwargs={"tokenize": True}) == tokens()
    assert chat(server, chat_template_kwargs={"tokenize": False}).status_code == 200

    r = post(server, "/v1/chat/completions", {
        "model": server.model, "messages": prefill, "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(opened)

    # as in vLLM, chat_template_kwargs may set the template's own options
    assert tokens(chat_template_kwargs={"add_generation_prompt": False,
                                        "continue_final_message": True}) == opened
    assert_400(chat(server, continue_final_message=True), "continue_final_message")
    for kwargs in ({"messages": []}, {"add_generation_prompt": "maybe"}, [1]):
        assert_400(chat(server, chat_template_kwargs=kwargs), "chat_template_kwargs")
    assert_400(chat(server, chat_template_kwargs={"chat_template": variables}), "chat_template")
    assert_400(post(server, "/tokenize", {"messages": [prefill[0], {"role": "assistant"}],
                                          "add_generation_prompt": False,
                                          "continue_final_message": True}),
               "continue_final_message")
    # a request's own template only where the server trusts them (as in vLLM)
    r = chat(server, chat_template=variables)
    assert_400(r, "chat_template")
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    assert_400(post(server, "/tokenize", {"messages": prefill, "chat_template": variables}),
               "chat_template")
    assert chat(server).status_code == 200


def test_chat_echo_leads_the_reply_with_the_prefill(server: ServerProcess) -> None:
    """vLLM's chat `echo`: where the reply continues the last message (an assistant prefill,
    or no generation prompt), that message's content leads it, streamed or not."""
    prefill = [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "Sure, "}]
    fields = {"model": server.model, "messages": prefill, "max_tokens": 4, "temperature": 0,
              "ignore_eos": True, "add_generation_prompt": False,
              "continue_final_message": True}
    plain = post(server, "/v1/chat/completions", fields).json()["choices"][0]["message"]
    echoed = post(server, "/v1/chat/completions", {**fields, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Sure, " + plain["content"]
    assert echoed["usage"]["completion_tokens"] == 4
    r = post(server, "/v1/chat/completions", {**fields, "echo": True, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
              for line in r.text.splitlines() if line.startswith("data: {")]
    assert deltas[0] == "Sure, " and "".join(deltas) == "Sure, " + plain["content"]
    # a new assistant turn does not continue the user's message: nothing to echo
    r = chat(server, echo=True)
    assert r.json()["choices"][0]["message"]["content"] == chat(server).json()[
        "choices"][0]["message"]["content"]


def test_a_model_s_broken_chat_template(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A model whose own chat template does not compile: the server starts with a warning
    and serves completions; each chat request is a 500 that says so (it was a 400 blaming
    the client's messages); `braid generate` names it instead of a TemplateSyntaxError
    traceback."""
    from braid.cli import main
    from tests.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "m")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    server = ServerProcess(model, tmp_path, *ENGINE_FLAGS)
    try:
        assert "its chat template does not compile (line 1: unexpected '}')" in server.log()
        assert completion(server).status_code == 200
        r = chat(server)
        assert r.status_code == 500, r.text
        assert "the model's chat template does not compile" in r.json()["error"]["message"]
        assert_400(chat(server, chat_template="{% if %}"), "chat_template")
    finally:
        assert server.stop() == 0, server.log()
    assert main(["generate", "--model", str(model), "--num-kv-blocks", "64", "hi"]) == 2
    assert f"braid: error: --model {model}: its chat template fails" in capsys.readouterr().err


def test_serve_chat_template_flag(tiny_model_dir: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    """--chat-template (a file, or the template itself, as in vLLM) replaces the model's."""
    from braid.cli import build_parser

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    server = ServerProcess(tiny_model_dir, tmp_path, *ENGINE_FLAGS, "--chat-template",
                           str(template), "--trust-request-chat-template")
    prefill = [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "Sure, "}]

    def text(**fields: object) -> str:
        r = post(server, "/tokenize", {"messages": prefill, **fields})
        assert r.status_code == 200, r.text
        return post(server, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]

    try:
        assert text() == "user: hey\nassistant: Sure, \n"
        own = "{% for m in messages %}{{ m.role[0] }}{{ m.content }}{% endfor %}{{ tail }}"
        assert text(chat_template=own, chat_template_kwargs={"tail": "!"}) == "uheyaSure, !"
        rag = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        assert text(chat_template=rag, documents=[{"title": "A", "text": "x"},
                                                  {"title": "B", "text": "y"}]) == "[A: x][B: y]"
        assert text(chat_template=own, add_generation_prompt=False,
                    continue_final_message=True) == "uheyaSure, "
        assert chat(server, chat_template=own).status_code == 200
        assert_400(chat(server, chat_template="{% for %}"), "chat_template")
        assert_400(chat(server, chat_template="{{ messages | length }}",
                        add_generation_prompt=False, continue_final_message=True),
                   "continue_final_message")
        assert_400(chat(server, chat_template="{{ raise_exception('no') }}"), "messages")
        assert chat(server).status_code == 200
    finally:
        assert server.stop() == 0, server.log()
    args = build_parser().parse_args(["serve", "--chat-template", "{{ messages[0].content }}"])
    assert args.chat_template == "{{ messages[0].content }}"
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    for bad, message in ((str(tmp_path / "missing.jinja"), "no such file, nor a Jinja template"),
                         ("{% if %}", "not a valid Jinja template (line 1"),
                         (str(latin1), f"{latin1} is not UTF-8 text (invalid continuation "
                                       "byte at byte 7)")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--chat-template", bad])
        assert f"argument --chat-template: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("where, body, param", [
    ("stream_options", {"stream": True, "stream_options": {"include_usge": True}},
     "stream_options"),
    ("content part", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}, "messages"),
    ("tool_choice", {"tools": [{"type": "function", "function": {"name": "f"}}],
                     "tool_choice": {"type": "function", "function": {"name": "f", "x": 1}}},
     "tool_choice"),
])
def test_unknown_nested_fields_are_400(server: ServerProcess, where: str, body: dict,
                                      param: str) -> None:
    r = chat(server, **body)
    assert_400(r, param)
    assert "extra" in r.json()["error"]["message"].lower(), where


@pytest.mark.parametrize("field, value", [("temperature", "inf"), ("temperature", "NaN"),
                                          ("repetition_penalty", "Infinity"),
                                          ("top_p", "nan")])
def test_inf_and_nan_are_400(server: ServerProcess, field: str, value: str) -> None:
    """JSON's reader here takes NaN and Infinity, pydantic the strings "inf" and "nan"."""
    text = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 2, field: 1.0})
    bare = [text.replace("1.0", value)] if value in ("NaN", "Infinity") else []  # JSON's own
    for raw in (*bare, text.replace("1.0", f'"{value}"')):
        r = httpx.post(f"{server.url}/v1/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=60)
        assert_400(r, field)


def test_top_logprobs_needs_logprobs(server: ServerProcess) -> None:
    """As vLLM: top_logprobs above 0 needs logprobs true; 0 goes without."""
    assert_400(chat(server, top_logprobs=2), "top_logprobs")
    assert_400(chat(server, top_logprobs=2, logprobs=False), "top_logprobs")
    r = chat(server, top_logprobs=0, logprobs=False)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    r = chat(server, top_logprobs=2, logprobs=True)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def test_max_tokens_past_the_context_is_400(server: ServerProcess) -> None:
    """As vLLM: asked-for tokens that cannot follow the prompt within max_model_len (256
    here) are refused, not silently cut; without max_tokens chat runs to the context's end."""
    long = [104] * 250
    r = completion(server, prompt=long, max_tokens=7)
    assert_400(r, "max_tokens")
    assert "250 input tokens" in r.json()["error"]["message"]
    assert_400(post(server, "/v1/completions", {"prompt": long}), "max_tokens")  # default 16
    r = completion(server, prompt=long, max_tokens=6, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert_400(chat(server, max_tokens=10**6), "max_tokens")
    assert_400(chat(server, max_completion_tokens=10**6), "max_completion_tokens")
    r = chat(server, max_tokens=None, content="h" * 200, ignore_eos=True)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 256 and r.json()["choices"][0]["finish_reason"] == "length"


def test_min_tokens_with_structured_output_is_400(server: ServerProcess) -> None:
    assert_400(chat(server, min_tokens=2, response_format={"type": "json_object"}),
               "min_tokens")
    assert_400(completion(server, min_tokens=2, structured_outputs={"choice": ["a", "b"]}),
               "min_tokens")


def test_docs_are_off_by_default(server: ServerProcess) -> None:
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{server.url}{path}").status_code == 404


def test_unknown_route_or_method_says_what_is_served(server: ServerProcess) -> None:
    """An OpenAI route braid does not serve (embeddings) is a 404 that lists what it serves;
    a wrong method a 405 naming the right one."""
    r = post(server, "/v1/embeddings", {"input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    message = r.json()["error"]["message"]
    assert "no POST /v1/embeddings" in message and "POST /v1/chat/completions" in message
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405
    assert r.json()["error"]["message"] == ("Method Not Allowed: /v1/completions takes POST, "
                                            "not GET")


# ---- a guarded server: small body limit, API key, waiting limit 4, under /llm -------------


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("guarded"), *ENGINE_FLAGS,
                         "--max-request-bytes", str(LIMIT_BYTES), "--api-key", KEY,
                         "--max-waiting-requests", "4", "--max-num-seqs", "2",
                         "--enable-docs", "--allowed-origins", f'["{UI}"]',
                         "--disable-uvicorn-access-log", "--response-role", "bot",
                         "--root-path", "/llm/", "--enable-force-include-usage",
                         "--enable-log-requests", "--max-log-len", "12")
    yield proc
    assert proc.stop() == 0, proc.log()


AUTH = {"authorization": f"Bearer {KEY}"}


def preflight(server: ServerProcess, origin: str) -> httpx.Response:
    """What a browser sends before a cross-origin POST with a JSON body and a key."""
    return httpx.options(f"{server.url}/v1/chat/completions", headers={
        "origin": origin, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})


def test_cors_by_default_any_origin_as_in_vllm(server: ServerProcess) -> None:
    r = preflight(server, "http://anywhere.example")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": 2},
             headers={"origin": "http://anywhere.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_response_role_as_vllm(guarded: ServerProcess) -> None:
    """--response-role names the reply after a generation prompt, streamed or not; a reply
    that continues the last message takes that message's role."""
    messages = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        r = post(guarded, "/v1/chat/completions", {
            "model": guarded.model, "messages": messages, "max_tokens": 2, "stream": stream},
            headers=AUTH)
        assert r.status_code == 200, r.text
        if stream:
            first = json.loads(r.text.splitlines()[0].removeprefix("data: "))
            assert first["choices"][0]["delta"]["role"] == "bot"
        else:
            assert r.json()["choices"][0]["message"]["role"] == "bot"
    r = post(guarded, "/v1/chat/completions", {
        "model": guarded.model, "max_tokens": 2, "add_generation_prompt": False,
        "continue_final_message": True,
        "messages": [*messages, {"role": "assistant", "content": "Sure,"}]}, headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_access_log_as_vllm(server: ServerProcess, guarded: ServerProcess) -> None:
    """A line per HTTP request, as vLLM's uvicorn writes it, unless
    --disable-uvicorn-access-log."""
    for proc in (server, guarded):
        r = httpx.get(f"{proc.url}/version")
        assert r.status_code == 200
    time.sleep(0.5)  # the server writes its log line after the answer
    assert '"GET /version HTTP/1.1" 200' in server.log_path.read_text(errors="replace")
    assert "GET /version" not in guarded.log_path.read_text(errors="replace")


def test_cors_allowed_origins_with_an_api_key(guarded: ServerProcess) -> None:
    """--allowed-origins: the listed origin's preflight passes without the key (a browser
    sends none there) and even a 401 carries the header a browser needs to read it; other
    origins get no CORS headers, and their preflight is refused."""
    r = preflight(guarded, UI)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    body = {"model": guarded.model, "prompt": "hi", "max_tokens": 2}
    r = post(guarded, "/v1/completions", body, headers={"origin": UI})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == UI
    r = post(guarded, "/v1/completions", body, headers={"origin": UI, **AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    assert preflight(guarded, "http://elsewhere.example").status_code == 400
    r = post(guarded, "/v1/completions", body, headers={"origin": "http://elsewhere.example",
                                                        **AUTH})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("options", [None, {"include_usage": False}])
def test_force_include_usage_as_vllm(guarded: ServerProcess, options: dict | None) -> None:
    """--enable-force-include-usage: usage in every chunk and a last usage chunk, whatever
    stream_options say; a response without a stream has its usage as always."""
    body = {"model": guarded.model, "prompt": "hi", "max_tokens": 3, "stream": True,
            "ignore_eos": True, **({"stream_options": options} if options else {})}
    r = post(guarded, "/v1/completions", body, headers=AUTH)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert all(c["usage"] for c in chunks), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    body.pop("stream")
    body.pop("stream_options", None)
    assert post(guarded, "/v1/completions", body, headers=AUTH).json()["usage"][
        "completion_tokens"] == 3


def test_log_requests_as_vllm(guarded: ServerProcess) -> None:
    """--enable-log-requests: a line per engine request as it arrives (prompt text and ids
    cut at --max-log-len, sampling parameters) and as it ends, aborted ones too."""
    body = {"model": guarded.model, "prompt": "abcdefghijklmnopqrstuvwxyz", "max_tokens": 3,
            "n": 2, "ignore_eos": True}
    rid = post(guarded, "/v1/completions", body, headers=AUTH).json()["id"]
    with httpx.stream("POST", f"{guarded.url}/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "n": 1, "max_tokens": 200, "stream": True}) as r:
        cut = json.loads(next(line for line in r.iter_lines() if line.startswith("data:"))[6:])
    log = guarded.log_path.read_text(errors="replace")
    for j in (0, 1):
        assert (f"Received request {rid}-{j}: prompt: 'abcdefghijkl', params: SamplingParams("
                f"n=1, ") in log, log[-3000:]
        assert f"Finished request {rid}-{j}: length, 26 prompt + 3 generated tokens" in log
    assert "prompt_token_ids: [97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108]" in log
    deadline = time.monotonic() + 10
    while f"Aborted request {cut['id']}-0: abort" not in log and time.monotonic() < deadline:
        time.sleep(0.1)
        log = guarded.log_path.read_text(errors="replace")
    assert f"Aborted request {cut['id']}-0: abort" in log
    # A client's own id starts the engine requests' ids, so its lines can be found by it
    # (they held an internal id only), and a reused one still names distinct requests.
    for _ in range(2):
        r = post(guarded, "/v1/completions", {**body, "n": 1, "request_id": "client-7"},
                 headers=AUTH)
        assert r.json()["id"] == "cmpl-client-7"
    log = guarded.log_path.read_text(errors="replace")
    finished = re.findall(r"Finished request (cmpl-client-7-\w+-0): length", log)
    assert len(set(finished)) == 2, log[-3000:]
    assert all(f"Received request {rid}: prompt" in log for rid in finished)
    # an id that could not be a header is refused (a line break ended the connection without
    # a response); one with spaces or quotes cannot break a log line
    r = post(guarded, "/v1/completions", {**body, "request_id": "x\nFinished request y"},
             headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    r = post(guarded, "/v1/completions", {**body, "n": 1, "request_id": 'x "Finished" y'},
             headers=AUTH)
    assert r.headers["x-request-id"] == r.json()["id"] == 'cmpl-x "Finished" y'
    log = guarded.log_path.read_text(errors="replace")
    assert "Received request cmpl-x__Finished__y-" in log


def test_api_key_guards_v1_and_token_routes(guarded: ServerProcess) -> None:
    """With and without --root-path's prefix (as a path-based proxy forwards it, or strips
    it): the same routes, the same key; a prefix cannot walk around the check."""
    body = {"model": guarded.model, "prompt": "hi", "max_tokens": 2}
    for root in ("", "/llm"):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            r = post(guarded, f"{root}/v1/completions", body, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["type"] == "authentication_error"
            assert httpx.get(f"{guarded.url}{root}/v1/models",
                             headers=headers).status_code == 401
            assert post(guarded, f"{root}/tokenize", {"prompt": "x"},
                        headers=headers).status_code == 401
            assert post(guarded, f"{root}/invocations", body, headers=headers).status_code == 401
        assert post(guarded, f"{root}/v1/completions", body, headers=AUTH).status_code == 200
        assert post(guarded, f"{root}/invocations", body, headers=AUTH).status_code == 200
        assert httpx.get(f"{guarded.url}{root}/v1/models", headers=AUTH).status_code == 200
        for path in ("/health", "/ping", "/metrics", "/version", "/docs", "/openapi.json"):
            assert httpx.get(f"{guarded.url}{root}{path}").status_code == 200, path
    assert httpx.get(f"{guarded.url}/llmx/v1/models", headers=AUTH).status_code == 404
    assert httpx.get(f"{guarded.url}/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_bench_serve_sends_the_api_key(guarded: ServerProcess, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`braid bench serve --api-key` (or $OPENAI_API_KEY) against a guarded server; the key
    is not written into the result. Without it the warm-up's 401 stops the benchmark."""
    from braid.cli import main

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("BRAID_API_KEY", raising=False)
    argv = ["bench", "serve", "--base-url", guarded.url, "--model", guarded.model, "--dataset",
            "random", "--num-prompts", "2", "--random-input-len", "3", "--random-output-len",
            "2", "--no-progress"]
    assert main(argv) == 2
    assert "HTTP 401: invalid or missing API key" in capsys.readouterr().err
    for extra, env in ((["--api-key", KEY], None), ([], KEY)):
        if env is not None:
            monkeypatch.setenv("OPENAI_API_KEY", env)
        result = tmp_path / "r.json"
        assert main([*argv, *extra, "--result-json", str(result)]) == 0
        assert json.loads(result.read_text())["completed"] == 2
        assert KEY not in result.read_text()


def test_body_over_the_limit_is_413(guarded: ServerProcess) -> None:
    big = {"model": guarded.model, "prompt": "x" * LIMIT_BYTES, "max_tokens": 2}
    r = post(guarded, "/v1/completions", big, headers=AUTH)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["param"] == "body"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 10_000
        yield b'"}'

    r = httpx.post(f"{guarded.url}/v1/completions", content=chunks(), timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413, r.text
    r = post(guarded, "/v1/completions", {**big, "prompt": "x" * (LIMIT_BYTES // 2)},
             headers=AUTH)
    assert_400(r, "prompt")  # under the byte limit, over max_model_len
    assert post(guarded, "/v1/completions", {**big, "prompt": "ok"},
                headers=AUTH).status_code == 200


def test_request_that_can_never_be_admitted_is_400(guarded: ServerProcess) -> None:
    body = {"model": guarded.model, "max_tokens": 2}
    assert_400(post(guarded, "/v1/completions", {**body, "prompt": "hi", "n": 5},
                    headers=AUTH), "n")
    assert_400(post(guarded, "/v1/completions", {**body, "prompt": ["a"] * 5},
                    headers=AUTH), "prompt")
    r = post(guarded, "/v1/completions", {**body, "prompt": ["a", "b"], "n": 2},
             headers=AUTH)
    assert r.status_code == 200, r.text


def test_waiting_limit_holds_under_a_burst(guarded: ServerProcess) -> None:
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            waiting = scrape(guarded.url).get("braid:num_requests_waiting", 0)
            peak[0] = max(peak[0], int(waiting))
            time.sleep(0.005)

    body = {"model": guarded.model, "prompt": "burst", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0}
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(40) as pool:
            responses = list(pool.map(
                lambda _: post(guarded, "/v1/completions", body, headers=AUTH), range(40)))
    finally:
        stop.set()
        watcher.join()
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 503 in codes, codes
    assert peak[0] <= 4, peak
    texts = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
    assert len(texts) == 1  # greedy: every admitted request got the same full answer
    assert all(r.json()["usage"]["completion_tokens"] == 60
               for r in responses if r.status_code == 200)


# ---- shutdown deadline ---------------------------------------------------------------------


def test_shutdown_deadline_ends_streams_with_an_error_and_done(
        tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    server = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("deadline"), *ENGINE_FLAGS,
                           "--max-num-seqs", "1", "--shutdown-timeout", "1")
    body = {"model": server.model, "prompt": "long", "max_tokens": 240, "ignore_eos": True,
            "temperature": 0}
    streams: list[list[str]] = [[] for _ in range(8)]
    started = threading.Event()

    def stream(events: list[str]) -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions",
                          json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    def plain() -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

    try:
        with ThreadPoolExecutor(12) as pool:
            stream_futures = [pool.submit(stream, events) for events in streams]
            plain_futures = [pool.submit(plain) for _ in range(4)]
            assert started.wait(30), server.log()
            wait_until_in_engine(server.url, len(streams) + len(plain_futures), server.log())
            server.terminate()
            for f in stream_futures:
                f.result(60)
            statuses = [f.result(60).status_code for f in plain_futures]
        assert server.proc.wait(60) == 0, server.log()
    finally:
        server.stop()
    assert all(events[-1] == "data: [DONE]" for events in streams), [e[-2:] for e in streams]
    errors = [json.loads(e[-2][6:])["error"] for e in streams if '"error"' in e[-2]]
    assert errors and all(err["type"] == "service_unavailable_error" for err in errors), [
        e[-2:] for e in streams]
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses


# ---- TLS ---------------------------------------------------------------------------------------


def test_tls_serves_https_with_the_certificate_given(tiny_model_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    """vLLM's --ssl-keyfile / --ssl-certfile: the openai client talks https to a server with a
    self-signed certificate it trusts; plain http on that port gets no answer, nor does a
    client that does not trust the certificate; files that cannot be used are refused at
    start naming the flags, before any weight loads."""
    import openai

    from braid.cli import main

    flags = tls_flags(tmp_path)
    key, cert = flags[1], flags[3]
    server = ServerProcess(tiny_model_dir, tmp_path, *ENGINE_FLAGS, *flags)
    try:
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(verify=server.verify))
        out = client.completions.create(model=server.model, prompt="hi", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
        assert "Uvicorn running on https://" in server.log_path.read_text()
    finally:
        assert server.stop() == 0, server.log()  # the client's idle connection still open
    for bad, message in (
            (["--ssl-keyfile", key], "--ssl-keyfile and --ssl-certfile go together"),
            (["--ssl-keyfile", cert, "--ssl-certfile", cert],
             f"--ssl-certfile {cert} --ssl-keyfile {cert}: "),
            (["--ssl-keyfile", key, "--ssl-certfile", str(tmp_path / "none.pem")],
             "No such file or directory"),
            ([*flags, "--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2 needs --ssl-ca-certs")):
        assert main(["serve", "--model", "/no/such/model", *bad]) == 2
        assert message in capsys.readouterr().err


def test_tls_with_an_encrypted_key(tiny_model_dir: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    """An encrypted --ssl-keyfile needs --ssl-keyfile-password: without it the start is
    refused naming the flag (no passphrase prompt, which uvicorn would repeat); with it the
    server serves https."""
    import subprocess

    from braid.cli import main

    tls_flags(tmp_path)  # skips the test without an openssl command
    key, cert = tmp_path / "enc.key", tmp_path / "enc.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-days", "1",
                    "-passout", "pass:s3cret", "-keyout", str(key), "-out", str(cert),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    assert "ENCRYPTED" in key.read_text()
    tls = ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    assert main(["serve", "--model", "/no/such/model", *tls]) == 2
    assert f"--ssl-keyfile {key} is encrypted: give its passphrase with --ssl-keyfile-password" \
        in capsys.readouterr().err
    assert main(["serve", "--model", "/no/such/model", *tls, "--ssl-keyfile-password", "no"]) == 2
    assert (f"--ssl-keyfile {key}: cannot decrypt it with --ssl-keyfile-password (wrong "
            "passphrase?)") in capsys.readouterr().err
    # beyond Python's limit: a message, not a traceback
    assert main(["serve", "--model", "/no/such/model", *tls,
                 "--ssl-keyfile-password", "x" * 2000]) == 2
    assert "--ssl-keyfile-password: password cannot be longer than 1024 bytes" in \
        capsys.readouterr().err
    server = ServerProcess(tiny_model_dir, tmp_path, *ENGINE_FLAGS, *tls,
                           "--ssl-keyfile-password", "s3cret")
    try:
        r = httpx.post(f"{server.url}/v1/completions", verify=server.verify, timeout=30,
                       json={"model": server.model, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        assert server.stop() == 0, server.log()
