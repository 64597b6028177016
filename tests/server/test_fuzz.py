"""A fuzzer against a real server on a tiny model ([M16]): hypothesis writes request bodies with
valid, boundary and hostile values for every field (wrong types, degenerate numbers, lone
surrogates, huge lists, hostile grammars and tool schemas) for every route. Whatever it sends:
never a 5xx (nor an error event inside a stream), never a dead process, and /health, probed
all along from another thread, keeps answering at once."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import ENGINE_FLAGS, ServerProcess

SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00x"])
TEXT = st.one_of(st.text(max_size=40), SURROGATES, st.sampled_from(["", " ", "\x00", "<|im_end|>"]))
HUGE_INT = st.sampled_from([-(2**70), -(2**63) - 1, 2**63, 2**64, 2**70, 10**400])
WRONG = st.one_of(st.none(), st.booleans(), TEXT, st.sampled_from(["3", "0.5", "nan", "inf"]),
                  st.lists(st.integers(), max_size=3), st.dictionaries(TEXT, st.integers(),
                                                                        max_size=2))
# non-finite floats: json.dumps writes NaN and Infinity, which Python's JSON reader takes
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, 1e-300, 1e-45, 5e-324, 1e-5, 1e300, -0.0, 2.0, 100.0]))


def numbers(*typical: float) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(typical), FLOATS, st.integers(-5, 300), HUGE_INT, WRONG)


def counts(*typical: int) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(typical), st.integers(-3, 300), HUGE_INT, WRONG,
                     st.floats(0, 10))


TOKEN_IDS = st.lists(st.one_of(st.integers(0, 271), st.integers(-3, 10**6), WRONG), max_size=8)
SCHEMAS = st.sampled_from([
    {"type": "object"}, {"type": "string", "maxLength": 4}, {"enum": ["a", "b"]},
    {"type": "objectx"}, {"$ref": "#/nope"}, {"type": "array", "items": {"type": "integer"}},
    {"anyOf": [{"type": "null"}, {"const": "x"}]}, {"properties": 3}, {"type": ["string"]},
    {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(300)} | {
        "d300": {"type": "string"}}, "$ref": "#/$defs/d0"},
    {"enum": [f"v{i}" for i in range(3000)]}, {"const": "x" * 3000}, {"pattern": "((a{9}){9}){9}"},
])
REGEXES = st.sampled_from(["[a-c]{2}", "a[b", "((a{100}){100}){100}", "(a|b)*", "", ".*",
                           "x" * 5000, "\\d{3}", "(" * 300 + "a" + ")" * 300, "[^\\x00-\\xff]"])
GRAMMARS = st.sampled_from(['start: "x"', "start: foo", "root ::= ((", 'root ::= "a" | "b"',
                            "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(2500))
                            + 'r2500: "x"\n', "root ::= " + " | ".join(f'"w{i}"' for i in range(
                                2000))])
STRUCTURED = st.one_of(
    st.fixed_dictionaries({"json": st.one_of(SCHEMAS, TEXT)}),
    st.fixed_dictionaries({"regex": st.one_of(REGEXES, TEXT)}),
    st.fixed_dictionaries({"choice": st.one_of(st.lists(TEXT, max_size=4), WRONG)}),
    st.fixed_dictionaries({"grammar": st.one_of(GRAMMARS, TEXT)}),
    st.fixed_dictionaries({"json_object": st.one_of(st.booleans(), WRONG)}),
    st.dictionaries(TEXT, WRONG, max_size=3))
SAMPLING = {
    "max_tokens": counts(1, 4, 16, 0, 255, 256),
    "temperature": numbers(0, 0.7, 1),
    "top_p": numbers(1, 0.9, 0),
    "top_k": counts(0, -1, 1, 5),
    "min_p": numbers(0, 0.1, 1),
    "presence_penalty": numbers(0, 2, -2),
    "frequency_penalty": numbers(0, 2, -2),
    "repetition_penalty": numbers(1, 1.1, 0),
    "seed": counts(0, 7, 2**63 - 1, 2**64 - 1, -(2**63)),
    "n": counts(1, 2, 4, 128, 129),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), st.just([f"s{i}" for i in range(3000)]),
                      WRONG),
    "stop_token_ids": st.one_of(TOKEN_IDS, WRONG),
    "min_tokens": counts(0, 2, 300),
    "ignore_eos": st.one_of(st.booleans(), WRONG),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.sampled_from(
        ["0", "5", "271", "272", " 7", "1_0", "٥", "-1", "99999999999999999999"]), TEXT),
        numbers(0, 100, -100), max_size=5), st.just({str(i): 1.0 for i in range(272)}), WRONG),
    "allowed_token_ids": st.one_of(TOKEN_IDS, WRONG),
    "bad_words": st.one_of(st.lists(TEXT, max_size=4), st.just([f"w{i}" for i in range(2000)]),
                           WRONG),
    "logprobs": counts(0, 1, 5, 20, 21, -1),
    "prompt_logprobs": counts(0, 1, 20, -1),
    "echo": st.one_of(st.booleans(), WRONG),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}),
        WRONG),
    "structured_outputs": st.one_of(STRUCTURED, WRONG),
    "response_format": st.one_of(st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
                                 st.fixed_dictionaries({"type": st.just("json_schema"),
                                                        "json_schema": st.fixed_dictionaries({
                                                            "name": TEXT, "schema": SCHEMAS})}),
                                 WRONG),
    "request_id": st.one_of(TEXT, st.just("r" * 300), WRONG),
    "truncate_prompt_tokens": counts(-1, 1, 4, 0),
    "priority": counts(0, 1),
    "user": st.one_of(TEXT, WRONG),
    "prediction": st.one_of(st.fixed_dictionaries({"type": st.just("content"), "content": st.one_of(
        TEXT, st.just("ab" * 300_000), st.lists(st.fixed_dictionaries(
            {"type": st.just("text"), "text": TEXT}), max_size=3), WRONG)}), WRONG),
}
PROMPTS = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3), TOKEN_IDS,
                    st.lists(TOKEN_IDS, max_size=2), st.just(["ab"] * 5000), st.just(""),
                    st.just([]), WRONG)
COMPLETION = st.fixed_dictionaries({"prompt": PROMPTS}, optional={
    **SAMPLING, "suffix": st.one_of(TEXT, WRONG), "add_special_tokens": st.booleans(),
    "best_of": counts(1, 2), "frobnicate": WRONG})
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                           "content": st.one_of(TEXT, st.none(), st.lists(
                               st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                               max_size=2))}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                           "tool_calls": st.one_of(st.just("oops"), st.just([1]), st.lists(
                               st.fixed_dictionaries({"id": TEXT, "type": st.just("function"),
                                                      "function": st.fixed_dictionaries({
                                                          "name": TEXT, "arguments": TEXT})}),
                               max_size=2))}),
    WRONG)
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["get_weather", "f", "a" * 65, ""]), TEXT)},
    optional={"parameters": st.one_of(SCHEMAS, WRONG), "description": TEXT})})
CHAT = st.fixed_dictionaries({"messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3),
                                                    WRONG)}, optional={
    **SAMPLING, "logprobs": st.one_of(st.booleans(), WRONG), "top_logprobs": counts(0, 5, 21),
    "max_completion_tokens": counts(1, 8), "tools": st.one_of(st.lists(TOOL, max_size=3), WRONG),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]),
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "function": st.fixed_dictionaries(
                                                        {"name": TEXT})}), WRONG),
    "parallel_tool_calls": st.one_of(st.booleans(), WRONG),
    "chat_template_kwargs": st.one_of(st.dictionaries(TEXT, WRONG, max_size=2), WRONG),
    "add_generation_prompt": st.one_of(st.booleans(), WRONG),
    "continue_final_message": st.one_of(st.booleans(), WRONG),
    "modalities": st.one_of(st.sampled_from([["text"], ["audio"]]), WRONG),
    "audio": WRONG, "verbosity": st.one_of(st.sampled_from(["low", "high"]), WRONG)})
TOKENIZE = st.one_of(st.fixed_dictionaries({"prompt": st.one_of(TEXT, WRONG)}, optional={
    "return_token_strs": st.one_of(st.booleans(), WRONG), "add_special_tokens": st.booleans()}),
    CHAT)
DETOKENIZE = st.fixed_dictionaries({"tokens": st.one_of(TOKEN_IDS, WRONG)})
MODEL = st.one_of(st.none(), st.just("<served>"), TEXT)
# Values a valid request may carry (mostly within bounds; the boundaries included), so that
# most bodies reach the engine with one hostile field at most.
VALID = {
    "max_tokens": st.sampled_from([1, 4, 16, 64]), "temperature": st.sampled_from(
        [0, 0.7, 1, 1e-300, 1e-45, 1e-6, 2.0, 100.0]),
    "top_p": st.sampled_from([1, 0.9, 1e-300, 1e-45, 0.5]), "top_k": st.sampled_from([0, -1, 1, 5]),
    "min_p": st.sampled_from([0, 0.1, 1, 1e-300]),
    "presence_penalty": st.sampled_from([0, 2, -2, 1e-300]),
    "frequency_penalty": st.sampled_from([0, 2, -2]),
    "repetition_penalty": st.sampled_from([1, 1.1, 1e-300, 1e-45, 1e300, 0.01]),
    "seed": st.sampled_from([0, 7, 2**63 - 1, 2**64 - 1, -(2**63)]),
    "n": st.sampled_from([1, 2, 4, 16]), "stop": st.sampled_from(
        ["e", ["x", "yz"], [f"s{i}" for i in range(3000)], "\n"]),
    "stop_token_ids": st.sampled_from([[0], [256, 270], list(range(272))]),
    "min_tokens": st.sampled_from([0, 2]), "ignore_eos": st.booleans(),
    "logit_bias": st.sampled_from([{"5": 100}, {"0": -100, "271": 50},
                                   {str(i): 1.0 for i in range(272)}]),
    "allowed_token_ids": st.sampled_from([[97, 98], list(range(272)), [256]]),
    "bad_words": st.sampled_from([["a"], ["hello world"], [f"w{i}" for i in range(2000)]]),
    "logprobs": st.sampled_from([0, 1, 5, 20]), "prompt_logprobs": st.sampled_from([0, 1, 20]),
    "echo": st.booleans(), "stream": st.booleans(),
    "structured_outputs": STRUCTURED, "request_id": st.sampled_from(["r1", "x" * 256]),
    "truncate_prompt_tokens": st.sampled_from([1, 4, 100]),
    "prediction": st.sampled_from([{"type": "content", "content": "hello world"},
                                   {"type": "content", "content": "ab" * 5000}]),
}
VALID_CHAT = {**{k: v for k, v in VALID.items() if k not in ("logprobs", "echo")},
              "logprobs": st.booleans(), "top_logprobs": st.sampled_from([0, 5, 20]),
              "response_format": SAMPLING["response_format"],
              "tools": st.lists(TOOL, max_size=3),
              "tool_choice": st.sampled_from(["none", "auto", "required"])}


@st.composite
def near_valid(draw: st.DrawFn, required: dict[str, Any], valid: dict[str, Any],
               hostile: dict[str, Any]) -> dict[str, Any]:
    """A body of valid values for a few fields, and a hostile value for one field at most."""
    names = draw(st.lists(st.sampled_from(sorted(valid)), max_size=4, unique=True))
    body = {k: draw(v) for k, v in required.items()} | {k: draw(valid[k]) for k in names}
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(hostile)))
        body[name] = draw(hostile[name])
    return body


VALID_PROMPT = {"prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(
    st.integers(0, 271), min_size=1, max_size=8), st.lists(st.text(min_size=1, max_size=8),
                                                           min_size=1, max_size=3))}
VALID_MESSAGES = {"messages": st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system"]), "content": st.text(max_size=30)}),
    min_size=1, max_size=3)}
ROUTES = st.one_of(
    st.tuples(st.just("/v1/completions"), COMPLETION),
    st.tuples(st.just("/v1/completions"), near_valid(VALID_PROMPT, VALID, SAMPLING)),
    st.tuples(st.just("/v1/chat/completions"), CHAT),
    st.tuples(st.just("/v1/chat/completions"), near_valid(VALID_MESSAGES, VALID_CHAT, {
        **SAMPLING, "messages": st.lists(MESSAGE, min_size=1, max_size=3),
        "tools": st.lists(TOOL, max_size=3)})),
    st.tuples(st.just("/invocations"), st.one_of(COMPLETION, CHAT)),
    st.tuples(st.just("/tokenize"), TOKENIZE),
    st.tuples(st.just("/detokenize"), DETOKENIZE))


class HealthProbe:
    """/health every 20 ms from another thread; its answer times."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.times: list[float] = []
        self.failures: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._done.is_set():
                start = time.monotonic()
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError as e:
                    status, self.failures = 0, [*self.failures, repr(e)]
                self.times.append(time.monotonic() - start)
                if status != 200:
                    self.failures.append(f"/health {status}")
                time.sleep(0.02)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    """A server of this module's own, speculating with prompt lookups (more code on the path
    of every request), its KV cache small enough that large requests preempt."""
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("fuzz-log"), *ENGINE_FLAGS,
                         "--speculative-config", json.dumps({
                             "method": "ngram", "num_speculative_tokens": 3,
                             "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
                         "--max-waiting-requests", "128")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def probe(server: ServerProcess) -> Iterator[HealthProbe]:
    p = HealthProbe(server.url)
    yield p
    p.stop()
    times = sorted(p.times)
    p99 = times[int(0.99 * (len(times) - 1))] if times else 0.0
    print(f"\n/health while fuzzing: {len(times)} probes, median "
          f"{statistics.median(times) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
          f"max {max(times) * 1e3:.1f} ms")
    assert not p.failures, p.failures[:5]
    # generous against a loaded 2-core machine: a blocked event loop took seconds
    assert max(times) < 2.0


def send(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    if isinstance(body, dict) and body.get("model") == "<served>":
        body["model"] = server.model
    raw = json.dumps(body)  # keeps lone surrogates as escapes; writes NaN and Infinity
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", f"{server.url}{path}", content=raw, headers=headers,
                      timeout=120) as r:
        text = "".join(r.iter_text())
    assert r.status_code < 500, (path, raw[:500], r.status_code, text[:500])
    if r.status_code == 200 and text.startswith("data:"):
        for event in text.split("\n\n"):
            assert '"internal_server_error"' not in event, (path, raw[:500], event[:500])
    assert server.proc.poll() is None, server.log()


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(route=ROUTES, model=MODEL)
def test_no_request_gets_a_5xx_or_stalls_the_server(server: ServerProcess, probe: HealthProbe,
                                                    route: tuple[str, Any],
                                                    model: Any) -> None:
    path, body = route
    if isinstance(body, dict) and model is not None:
        body = {"model": model, **body}
    send(server, path, body)


def test_innocent_requests_are_served_alike_after_the_fuzzing(server: ServerProcess,
                                                              probe: HealthProbe) -> None:
    """After everything the fuzzer sent, the engine is idle and a greedy request's output
    is the same as a fresh server's (nothing was left behind)."""
    body = {"model": server.model, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    running = [line for line in metrics.splitlines()
               if line.startswith("braid:num_requests_running")]
    assert running and running[0].split()[-1] in ("0.0", "0")
