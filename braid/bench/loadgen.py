"""Open-loop load generator for an OpenAI-compatible server: one asyncio task per request,
sent at seeded Poisson (or gamma) arrival times whatever the server's progress, streaming;
and a closed loop over multi-turn agentic sessions (`run_sessions`)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from braid.bench import agentic
from braid.bench.datasets import BenchPrompt
from braid.bench.metrics import RequestRecord, failed_record, record_from_chunks

logger = logging.getLogger("braid.bench")
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class LoadConfig:
    base_url: str
    model: str
    endpoint: str = "chat"
    request_rate: float = math.inf  # requests per second; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson
    max_concurrency: int | None = None
    seed: int = 0
    max_output_len: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 3600.0
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)  # never saved with the results

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")

    def client(self, timeout: httpx.Timeout, **options: Any) -> httpx.AsyncClient:
        """The HTTP client the load uses: the API key goes with every request."""
        headers = {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}
        return httpx.AsyncClient(timeout=timeout, headers=headers, **options)


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send offsets in seconds, the first at 0: gamma inter-arrival times with mean 1/rate and
    shape `burstiness` (1: exponential, i.e. a Poisson process; < 1 burstier)."""
    if num == 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def request_body(cfg: LoadConfig, prompt: BenchPrompt, max_tokens: int | None = None
                 ) -> dict[str, Any]:
    tokens = max_tokens or min(prompt.output_len, cfg.max_output_len or prompt.output_len)
    body: dict[str, Any] = {
        "model": cfg.model, "max_tokens": tokens, "temperature": cfg.temperature,
        "ignore_eos": cfg.ignore_eos, "stream": True,
        "stream_options": {"include_usage": True}, **cfg.extra_body,
    }
    if cfg.endpoint == "chat":
        turns = prompt.messages or (("user", prompt.prompt),)
        body["messages"] = [{"role": role, "content": text} for role, text in turns]
    else:
        body["prompt"] = prompt.prompt
    if prompt.schema is not None:  # OpenAI's form on chat, vLLM's on completions
        body.update({"response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": prompt.schema}}} if cfg.endpoint == "chat" else
            {"structured_outputs": {"json": prompt.schema}})
    return body


Clock = Callable[[], float]


async def send_one(client: httpx.AsyncClient, cfg: LoadConfig, body: dict[str, Any],
                   clock: Clock, t0: float, text: list[str] | None = None) -> RequestRecord:
    """Stream one request; every failure becomes a record with its reason. The streamed
    text is appended piece by piece to `text` when given (a chat client's history)."""
    send = clock() - t0
    try:
        async with client.stream("POST", cfg.base_url.rstrip("/") + ENDPOINTS[cfg.endpoint],
                                 json=body) as res:
            if res.status_code != 200:
                return failed_record(send, _http_error(res.status_code, await res.aread()))
            return await _read_stream(res, send, clock, t0, text)
    except httpx.HTTPError as e:
        return failed_record(send, f"{type(e).__name__}: {e}"[:300])


async def _read_stream(res: httpx.Response, send: float, clock: Clock, t0: float,
                       text: list[str] | None = None) -> RequestRecord:
    chunks: list[float] = []
    usage: dict[str, Any] = {}
    async for line in res.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            return failed_record(send, f"stream error: {_message(event)}")
        pieces = [_text(c) for c in event.get("choices") or []]
        if any(pieces):
            chunks.append(clock() - t0)
            if text is not None:
                text.extend(pieces)
        usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return record_from_chunks(send, chunks, clock() - t0, usage.get("completion_tokens"),
                              usage.get("prompt_tokens", 0), details.get("cached_tokens") or 0)


def _text(choice: dict[str, Any]) -> str:
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""


def _message(event: dict[str, Any]) -> str:
    error = event.get("error")
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]


def _http_error(status: int, content: bytes) -> str:
    try:
        detail = _message(json.loads(content))
    except (ValueError, AttributeError):
        detail = content.decode(errors="replace")[:300]
    return f"HTTP {status}: {detail}"


async def run_load(cfg: LoadConfig, prompts: list[BenchPrompt],
                   clock: Clock = time.perf_counter) -> tuple[list[RequestRecord], float]:
    """Send every prompt at its arrival time; returns the records (in prompt order) and the
    run's duration (first send to last completion)."""
    offsets = arrival_times(len(prompts), cfg.request_rate, cfg.burstiness, cfg.seed)
    limit = asyncio.Semaphore(cfg.max_concurrency or len(prompts) or 1)
    bar = tqdm(total=len(prompts), disable=not cfg.progress, desc="requests", unit="req")
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with cfg.client(timeout, limits=limits) as client:
        t0 = clock()

        async def one(prompt: BenchPrompt, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, offset - (clock() - t0)))
            async with limit:
                record = await send_one(client, cfg, request_body(cfg, prompt), clock, t0)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(p, float(o)) for p, o in
                                         zip(prompts, offsets, strict=True)))
        duration = clock() - t0
    bar.close()
    return list(records), duration


def session_body(cfg: LoadConfig, session: agentic.Session) -> dict[str, Any]:
    """A session's next turn: its conversation and the tools; tool_choice "none" leaves the
    reply as text, from which the session reads its calls (the forms small models write)."""
    return {"model": cfg.model, "messages": session.messages, "tools": agentic.TOOLS,
            "tool_choice": "none", "max_tokens": cfg.max_output_len or 128,
            "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **cfg.extra_body}


async def run_sessions(cfg: LoadConfig, sessions: list[agentic.Session],
                       clock: Clock = time.perf_counter
                       ) -> tuple[list[RequestRecord], float]:
    """Closed loop over agentic sessions (chat endpoint): at most `max_concurrency` sessions
    at once (all, unset); each turn is one streamed request, sent as soon as the turn before
    it was answered and its tool results added. One record per turn, in finishing order;
    a failed turn ends its session."""
    limit = asyncio.Semaphore(cfg.max_concurrency or len(sessions) or 1)
    bar = tqdm(total=len(sessions), disable=not cfg.progress, desc="sessions", unit="session")
    records: list[RequestRecord] = []
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    async with cfg.client(timeout) as client:
        t0 = clock()

        async def one(session: agentic.Session) -> None:
            async with limit:
                going = True
                while going:
                    text: list[str] = []
                    record = await send_one(client, cfg, session_body(cfg, session), clock, t0,
                                            text)
                    records.append(record)
                    going = record.success and session.add_reply("".join(text))
            bar.update(1)

        await asyncio.gather(*(one(s) for s in sessions))
        duration = clock() - t0
    bar.close()
    return records, duration


async def warm_up(cfg: LoadConfig, prompt: BenchPrompt) -> RequestRecord:
    """One short request before measuring (loads caches, checks the server answers)."""
    async with cfg.client(httpx.Timeout(cfg.timeout_s, connect=30.0)) as client:
        body = request_body(cfg, prompt, max_tokens=4)
        return await send_one(client, cfg, body, time.perf_counter, time.perf_counter())
