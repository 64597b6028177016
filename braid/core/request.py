"""A request's state as the engine tracks it: two numbers (computed, total) and its outputs."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from braid.core.stats import SpecStats
from braid.outputs import PackedLogprobs, SampleLogprobs
from braid.sampling_params import SamplingParams


class Grammar(Protocol):
    """A request's compiled grammar as the layers above drive it (its implementation:
    braid/structured/grammar.py's GrammarState)."""

    def advance(self, token: int) -> str | None:
        """Accept an emitted token: "stop" once the grammar is complete, else None."""

    def num_valid(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows from its current state."""

    def is_eos(self, token: int) -> bool: ...

    def fill_mask(self, drafts: Sequence[int], out: Any) -> None:
        """The allowed tokens after `drafts`, as a bitmask written into `out`."""

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens that are the grammar's only continuation from here."""

    def take_mask_time(self) -> float:
        """Seconds spent on its masks since the last call."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache and final (docs/architecture.md, vocabulary).
    num_computed_tokens: int = 0
    # Draft tokens proposed for the next step; never part of num_tokens until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # Keys the request's random numbers (braid/worker/sampler.py): sampling_params.seed,
    # or one the engine drew for an unseeded request.
    seed: int = 0
    first_scheduled_time: float | None = None  # its first admission (the end of its queueing)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache at the first admission (None until admitted).
    num_cached_tokens: int | None = None
    logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0  # the sum of the sampled tokens' logprobs, with logprobs
    # With sampling_params.prompt_logprobs: one entry per prompt token scored so far (the
    # first token has none), holding the prompt token and the top-n, in flat arrays.
    prompt_logprobs: PackedLogprobs = field(default_factory=lambda: PackedLogprobs([None]))
    spec_stats: SpecStats = field(default_factory=SpecStats)  # this request's speculation figures
    # With sampling_params.structured_outputs: its grammar, compiled off the engine loop; the
    # scheduler admits the request once it is done.
    grammar_future: Future[Grammar] | None = None
    # Drafts of the current proposal cut because the grammar refused them.
    num_grammar_rejected: int = 0
    # The API request it belongs to (its prompts x n choices share one group; alone: its
    # id): the scheduler shares decode rows fairly between groups.
    group: str = ""
    # Steps it sits out before it decodes again (its grammar's masks cost much; scheduler)
    rest_steps: int = 0
    last_scheduled_step: int = -1  # the scheduler's step count when it last ran
    # With prompt_logprobs and n > 1: the first choice, which scores the prompt for every
    # choice of its group with the same prompt (once, not n times); this one waits until
    # it has, then shares its entries and its cached prefix.
    prompt_scorer: Request | None = None

    def __post_init__(self) -> None:
        self.group = self.group or self.request_id

    def set_drafts(self, token_ids: list[int], num_grammar_rejected: int = 0) -> None:
        self.spec_token_ids = token_ids
        self.num_grammar_rejected = num_grammar_rejected

    @property
    def grammar(self) -> Grammar | None:
        """The compiled grammar (None without structured output, or while compiling)."""
        f = self.grammar_future
        return f.result() if f is not None and f.done() and f.exception() is None else None

    @property
    def scores_prompt(self) -> bool:
        """Whether its own steps compute its prompt logprobs (asked for, no scorer)."""
        return self.sampling_params.prompt_logprobs is not None and self.prompt_scorer is None

    @property
    def prompt_scores(self) -> PackedLogprobs:
        """Its prompt logprobs so far: its own, or its scorer's."""
        return (self.prompt_logprobs if self.prompt_scorer is None
                else self.prompt_scorer.prompt_logprobs)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token has its logprobs (its own, or its scorer's)."""
        return len(self.prompt_scores) >= self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + accepted output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Some prompt (or, after preemption, recomputed output) token still lacks KV."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output + drafts."""
        p = self.num_prompt_tokens
        out = self.prompt_token_ids[start:min(end, p)]
        if end > p:
            rest = self.output_token_ids + self.spec_token_ids
            out = out + rest[max(start - p, 0) : end - p]
        return out
