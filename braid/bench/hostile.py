"""Hostile requests: each one crashed braid, failed other requests, froze its event loop or
starved its engine before [M16]. The soak mixes them into its load; the server must answer
each alone (a 4xx, or a completion) and keep every other request's pace."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Hostile:
    name: str
    path: str
    body: Callable[[str, int], Any]  # (model, vocabulary size) -> JSON body
    statuses: tuple[int, ...] = (200, 400)  # what a server that holds may answer


def _completion(**fields: Any) -> Callable[[str, int], dict[str, Any]]:
    return lambda model, vocab: {"model": model, "prompt": "Answer: ", "max_tokens": 16,
                                 **fields}


def _chat(**fields: Any) -> Callable[[str, int], dict[str, Any]]:
    return lambda model, vocab: {"model": model, "max_tokens": 16,
                                 "messages": [{"role": "user", "content": "hi"}], **fields}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 8}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


BIG = "x" * 400_000
LONG_PROMPT = "def f(x):\n    return x\n" * 80
HOSTILE = [
    Hostile("lark chain of 3,000 rules", "/v1/completions",
            _completion(structured_outputs={"grammar": lark_chain(3000)})),
    Hostile("GBNF chain of 10,000 rules", "/v1/completions",
            _completion(structured_outputs={"grammar": gbnf_chain(10_000)})),
    Hostile("$ref chain of 1,000 (response_format)", "/v1/chat/completions",
            _chat(response_format=_schema(ref_chain(1000)))),
    Hostile("$ref chain of 1,000 (tools, required)", "/v1/chat/completions",
            _chat(tools=[{"type": "function", "function": {"name": "f",
                                                           "parameters": ref_chain(1000)}}],
                  tool_choice="required")),
    Hostile("temperature 1e-300", "/v1/completions", _completion(temperature=1e-300)),
    Hostile("temperature 1e-45", "/v1/completions", _completion(temperature=1e-45)),
    Hostile("top_p 1e-300", "/v1/completions", _completion(top_p=1e-300, temperature=1)),
    Hostile("repetition_penalty 1e-300", "/v1/completions",
            _completion(repetition_penalty=1e-300)),
    Hostile("700,000 prompts", "/v1/completions",
            lambda model, vocab: {"model": model, "prompt": ["ab"] * 700_000}, (400, 413)),
    Hostile("2,000 prompts x n = 64", "/v1/completions",
            lambda model, vocab: {"model": model, "prompt": ["ab"] * 2000, "n": 64}),
    # an ordinary request, the reference for the one after it: its prompt's prefill chunks
    # ride with every decode, as any long prompt's do
    Hostile("a long prompt (not hostile: the reference)", "/v1/completions",
            _completion(prompt=LONG_PROMPT, max_tokens=8, temperature=1), (200,)),
    Hostile("n = 16, logprobs and prompt_logprobs 20 of a long prompt", "/v1/completions",
            _completion(prompt=LONG_PROMPT, n=16, max_tokens=8,
                        logprobs=20, prompt_logprobs=20, temperature=1)),
    Hostile("/tokenize of 3.5 MB with token strings", "/tokenize",
            lambda model, vocab: {"model": model, "prompt": "hello world " * 300_000,
                                  "return_token_strs": True}, (200, 413)),
    Hostile("enum of 100,000 strings", "/v1/chat/completions",
            _chat(response_format=_schema({"enum": [f"value {i}" for i in range(100_000)]}))),
    Hostile("choice of 100,000", "/v1/completions",
            _completion(structured_outputs={"choice": [f"c{i}" for i in range(100_000)]})),
    Hostile("regex of 100,000 alternatives", "/v1/completions",
            _completion(structured_outputs={"regex": "|".join(f"r{i}" for i in range(100_000))})),
    Hostile("400 kB grammar literal", "/v1/completions",
            _completion(structured_outputs={"grammar": f'start: "{BIG}"'})),
    Hostile("400 kB regex", "/v1/completions", _completion(structured_outputs={"regex": BIG})),
    Hostile("400 kB const", "/v1/chat/completions", _chat(response_format=_schema(
        {"const": BIG}))),
    Hostile("30 kB literal (a dear mask at every token)", "/v1/completions",
            _completion(structured_outputs={"regex": "ab" * 15_000}, max_tokens=64)),
    Hostile("logit_bias over the whole vocabulary", "/v1/completions",
            lambda model, vocab: _completion(logit_bias={str(i): 0.1 for i in range(vocab)})(
                model, vocab)),
    Hostile("100,000 bad_words", "/v1/completions",
            _completion(bad_words=[f"w{i}x" for i in range(100_000)], max_tokens=64)),
    Hostile("10,000 stop strings", "/v1/completions",
            _completion(stop=[f"stop word {i}" for i in range(10_000)], max_tokens=64,
                        ignore_eos=True)),
    Hostile("n = 64 with repetition_penalty", "/v1/completions",
            _completion(n=64, max_tokens=100, temperature=0.5, repetition_penalty=1.1)),
    Hostile("((a{100}){100}){100}", "/v1/completions",
            _completion(structured_outputs={"regex": "((a{100}){100}){100}"}), (400,)),
    Hostile("1 MB request_id", "/v1/completions", _completion(request_id="r" * 2**20), (400,)),
    Hostile("lone surrogate model", "/tokenize",
            lambda model, vocab: {"model": "a\ud800", "prompt": "hi"}, (400,)),
]


def encoded(hostile: Hostile, model: str, vocab: int) -> bytes:
    """The body as JSON text (json.dumps keeps lone surrogates as escapes)."""
    return json.dumps(hostile.body(model, vocab)).encode()


class Observer:
    """A process of its own (a benchmark's client does heavy work of its own: large bodies in
    and out) that probes /health every 50 ms and runs one innocent greedy stream after
    another until `stop`. Times are time.monotonic's, which processes share."""

    def __init__(self, url: str, stream_body: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")
        self._queue = context.Queue()
        self._stop = context.Event()
        self._process = context.Process(target=_observe, args=(
            url, stream_body, self._stop, self._queue), daemon=True)
        self._process.start()

    def stop(self) -> tuple[list[float], list[tuple[float, float, float]]]:
        """(/health answer times in ms, innocent streams as (start, end, tokens/s))."""
        self._stop.set()
        out = self._queue.get()
        self._process.join()
        return out


def _observe(url: str, stream_body: dict[str, Any], stop: Any, queue: Any) -> None:
    health: list[float] = []
    streams: list[tuple[float, float, float]] = []

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            while not stop.is_set():
                start = time.monotonic()
                client.get("/health")
                health.append((time.monotonic() - start) * 1e3)
                time.sleep(0.05)

    thread = threading.Thread(target=probe)
    thread.start()
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop.is_set():
            times = []
            with client.stream("POST", "/v1/completions", json=stream_body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.monotonic())
            if len(times) > 1:
                streams.append((times[0], times[-1], (len(times) - 1) / (times[-1] - times[0])))
    thread.join()
    queue.put((health, streams))


def paces(streams: list[tuple[float, float, float]], spans: list[tuple[float, float, str]]
          ) -> tuple[float, list[tuple[str, float]]]:
    """The median pace of the streams beside no span, and each other stream's pace with the
    names of the spans it overlapped."""
    calm, beside = [], []
    for start, end, pace in streams:
        names = sorted({name for s, e, name in spans if s < end and e > start})
        if names:
            beside.append((", ".join(names), pace))
        else:
            calm.append(pace)
    calm.sort()
    return (calm[len(calm) // 2] if calm else 0.0), beside


def percentiles(times: list[float]) -> dict[str, float]:
    times = sorted(times) or [0.0]
    return {"p50": round(times[len(times) // 2], 1),
            "p99": round(times[int(0.99 * (len(times) - 1))], 1), "max": round(times[-1], 1)}
