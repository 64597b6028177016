"""What the engine hands an executor each step, and what comes back: plain records of ids,
token lists, sampling parameters and tensors, never the scheduler's own objects, so a step
pickles whole to an executor in another process or on another machine.

A request's fixed parts (prompt, parameters, seed) go once, the first step it is scheduled
in (`NewRequest`); after that each step sends only what changed: the output tokens the worker
has not seen (`ScheduledSpan.new_output_ids`), and the ids of the requests that ended
(`StepInput.finished`). vLLM V1's SchedulerOutput (new and cached request data) works the
same way."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from braid.outputs import PackedLogprobs, SampleLogprobs
from braid.sampling_params import SamplingParams
from braid.worker.runner import QuerySpan


@dataclass(slots=True)
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # keys its random numbers (braid/worker/sampler.py)


@dataclass(slots=True)
class ScheduledSpan:
    """One scheduled request's part of the step."""

    request_id: str
    query: QuerySpan  # its query tokens, KV blocks, logits rows and prompt rows to score
    num_spec_tokens: int  # drafts at the end of the query (0 for plain steps)
    new_output_ids: list[int] = field(default_factory=list)  # outputs the worker lacks
    # With a grammar and a sampled window: [1 + num_spec_tokens, ceil(V / 32)] int32, the
    # tokens allowed at each window position (after the drafts before it).
    grammar_bitmask: torch.Tensor | None = None

    @property
    def samples(self) -> bool:
        return self.query.num_logits > 0

    @property
    def drafts(self) -> list[int]:
        k = self.num_spec_tokens
        return self.query.token_ids[len(self.query.token_ids) - k :] if k else []


@dataclass(slots=True)
class StepInput:
    spans: list[ScheduledSpan]
    new_requests: list[NewRequest] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # ids the worker may forget


@dataclass(slots=True)
class SampleResult:
    """What one step produced for one request that sampled."""

    token_ids: list[int]  # accepted drafts, then the target's token
    logprobs: SampleLogprobs | None


@dataclass(slots=True)
class StepResult:
    """What a step computed, by request id: prompt logprobs, and the samples of the spans
    that sample (a prefill chunk has none)."""

    prompt_logprobs: dict[str, PackedLogprobs] = field(default_factory=dict)
    samples: dict[str, SampleResult] = field(default_factory=dict)
    forward_end: float = 0.0  # time.perf_counter() when its (last) forward ended

    def merge(self, other: StepResult) -> None:
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.samples.update(other.samples)
