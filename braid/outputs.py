"""What the engine hands back to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """One token's entry in a position's logprobs, as vLLM's: its raw model logprob, its rank
    in the vocabulary (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position {token_id: Logprob}: the position's own token (sampled, or the prompt's) and the
# top-n. Prompt logprobs have None for the first prompt token (nothing precedes it).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With logprobs: per generated token, the sampled token and the top-n.
    logprobs: SampleLogprobs | None = None
    # With logprobs: the sum of the generated tokens' logprobs (vLLM's, e.g. to rank n samples)
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's times (time.monotonic() seconds) and figures, with vLLM's names."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # its first admission: queueing ends
    # Speculation figures of this request (drafts, draft tokens, accepted, ...), once present.
    spec_stats: dict[str, Any] = field(default_factory=dict)
    last_token_time: float | None = None  # when its latest tokens came

    @property
    def finished_time(self) -> float | None:
        return self.finish_time

    @property
    def time_in_queue(self) -> float | None:
        """Arrival to first admission."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With prompt_logprobs: per prompt token (None for the first) the prompt token and the
    # top-n; set once the whole prompt has been scored.
    prompt_logprobs: PromptLogprobs | None = None
    # Prompt tokens whose KV came from the prefix cache (vLLM's name; 0 before admission).
    num_cached_tokens: int = 0
