"""One request can never hurt another ([M16]): hostile grammars, degenerate sampling and
oversized requests sent to a real server beside innocent streams. The server must answer each
hostile request alone (a 400 naming the field, or a completion), stay alive and healthy, and
give the innocent requests the outputs they get alone."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from tests.server.conftest import ENGINE_FLAGS, ServerProcess

T = TypeVar("T")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    """A server of this module's own: a crash here must not take other modules' server."""
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("isolation-log"),
                         *ENGINE_FLAGS)
    yield proc
    assert proc.stop() == 0, proc.log()


def post(server: ServerProcess, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=json.dumps({"model": server.model, **body}),
                      headers={"content-type": "application/json"}, timeout=timeout)


def completion(server: ServerProcess, **fields: object) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0,
                                            **fields})


def assert_alive(server: ServerProcess) -> None:
    assert server.proc.poll() is None, server.log()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def ref_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 3}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


# ---- grammars that crashed the process -----------------------------------------------------


def test_a_chain_of_rules_compiles_on_a_large_stack(server: ServerProcess) -> None:
    """3,000 chained Lark rules overflowed the compiling thread's stack: SIGSEGV, no log."""
    r = completion(server, structured_outputs={"grammar": lark_chain(3000)})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "x"
    assert_alive(server)


def test_a_gbnf_chain_past_the_rule_limit_is_400(server: ServerProcess) -> None:
    """10,000 GBNF rules: converting them took ~30 s of held GIL before the crash."""
    r = completion(server, structured_outputs={"grammar": gbnf_chain(10_000)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs"
    assert "GBNF rules" in r.json()["error"]["message"]
    assert_alive(server)


@pytest.mark.parametrize("via", ["response_format", "tools"])
def test_a_deep_ref_chain_compiles(server: ServerProcess, via: str) -> None:
    schema = ref_chain(1000)
    body: dict = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                  "temperature": 0}
    if via == "tools":
        body |= {"tools": [{"type": "function", "function": {"name": "f",
                                                              "parameters": schema}}],
                 "tool_choice": "required"}
    else:
        body |= {"response_format": {"type": "json_schema",
                                     "json_schema": {"name": "s", "schema": schema}}}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert_alive(server)


def test_an_oversized_grammar_is_400_naming_the_field(server: ServerProcess) -> None:
    r = completion(server, structured_outputs={"regex": "x" * 300_000})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs"
    assert "too large" in r.json()["error"]["message"]


def test_a_grammar_past_the_lexer_limits_is_400_every_time(server: ServerProcess) -> None:
    """The regex stalled the engine ~2.5 s and ended with finish_reason "error"; sent again,
    its cached failure came back as a 200 with an empty "stop"."""
    for _ in range(2):
        start = time.monotonic()
        r = completion(server, structured_outputs={"regex": "((a{100}){100}){100}"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "structured_outputs"
        assert "too complex" in r.json()["error"]["message"]
        assert time.monotonic() - start < 30
    ok = completion(server, structured_outputs={"regex": "(a{3}){2}"}, max_tokens=8)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "aaaaaa", ok.text


def test_grammar_checks_leave_the_event_loop_free(server: ServerProcess) -> None:
    """While a large grammar compiles, /health answers at once."""
    big = {"enum": [f"value-{i}" for i in range(8000)]}
    r, slowest = slowest_health_during(server, lambda: post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": big}}}))
    assert r.status_code == 200, r.text
    assert slowest < 1.0  # generous: the event loop is not where the compile runs


# ---- the event loop ------------------------------------------------------------------------


def slowest_health_during(server: ServerProcess, work: Callable[[], T]) -> tuple[T, float]:
    """`work()`'s result, and the slowest /health answer while it ran (probed every 10 ms)."""
    done = threading.Event()
    slowest = 0.0

    def probe() -> None:
        nonlocal slowest
        while not done.is_set():
            start = time.monotonic()
            httpx.get(f"{server.url}/health", timeout=60)
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.01)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        return work(), slowest
    finally:
        done.set()
        thread.join()


def test_a_request_of_too_many_prompts_is_refused_before_any_work(
        server: ServerProcess) -> None:
    """700,000 prompts in a 4 MB body held the loop 18 s (tokenized and set up per choice
    before the count was checked); 2,000 prompts x n = 64 in 24 kB held it 4 s."""
    r, slowest = slowest_health_during(server, lambda: completion(
        server, prompt=["ab"] * 600_000))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = completion(server, prompt=["ab"] * 2000, n=64)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert slowest < 1.0  # generous: parsed and checked off the loop (~0.5 s on it before)


def test_large_token_routes_leave_the_loop_free(server: ServerProcess) -> None:
    text = "hello world " * 40_000  # ~0.5 MB: as many tokens (a byte tokenizer)
    r, slowest = slowest_health_during(server, lambda: post(
        server, "/tokenize", {"prompt": text, "return_token_strs": True}))
    assert r.status_code == 200 and r.json()["count"] == len(text), r.text[:200]
    assert len(r.json()["token_strs"]) == len(text)
    tokens = r.json()["tokens"]
    r, slowest_too = slowest_health_during(server, lambda: post(
        server, "/detokenize", {"tokens": tokens}))
    assert r.status_code == 200 and r.json()["prompt"] == text
    assert max(slowest, slowest_too) < 1.0


def test_a_response_with_logprobs_is_written_in_pieces(server: ServerProcess) -> None:
    """The response is built off the loop and sent one choice at a time; it is the same JSON."""
    prompt = "the quick brown fox " * 10
    r = completion(server, prompt=prompt, n=4, max_tokens=8, logprobs=5, prompt_logprobs=5,
                   temperature=1, seed=3)
    assert r.status_code == 200, r.text
    assert r.headers.get("content-length") is None  # streamed: chunked
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c in body["choices"]:
        assert len(c["prompt_logprobs"]) == len(prompt) and len(c["logprobs"]["tokens"]) == 8
    assert body["usage"]["completion_tokens"] == 32

