"""What the engine hands back to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Per generated token: {token_id: logprob} holding the sampled token and the top-n.
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0
    # Speculation figures of this request (drafts, draft tokens, accepted, ...), once present.
    spec_stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With prompt_logprobs: per prompt token (None for the first) {token_id: logprob} of the
    # prompt token and the top-n; set once the whole prompt has been scored.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With prompt_logprobs: each prompt token's rank in the vocabulary (1: the most likely;
    # None for the first), as vLLM's Logprob.rank.
    prompt_logprob_ranks: list[int | None] | None = None
    # Prompt tokens whose KV came from the prefix cache (vLLM's name; 0 before admission).
    num_cached_tokens: int = 0
