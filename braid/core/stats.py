"""Per-step statistics: the raw material of logs, /metrics and the step-cost model."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger("braid")


@dataclass(slots=True)
class StepStats:
    num_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int  # sampled positions: 1 per decode + its drafts
    num_spec_tokens: int
    num_context_tokens: int  # cached tokens attended to (sum of num_computed_tokens)
    forward_time: float  # seconds: input building + target forward
    step_time: float  # seconds: the whole step
    kv_usage: float
    num_preemptions: int
    num_waiting: int
    num_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    num_cache_hits: int = 0  # of which found cached


@dataclass
class SpecStats:
    """Speculation counters with vLLM's definitions (docs/architecture.md, vocabulary)."""

    num_drafts: int = 0  # verification windows with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: accepted at draft i
    # drafts from the request's predicted output, as OpenAI's usage counts them
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def record_prediction(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted_prediction_tokens += num_accepted
        self.rejected_prediction_tokens += num_drafted - num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted per window (the bonus token counts)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict[str, float | int | list[int]]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
        }


@dataclass(slots=True)
class GrammarStats:
    """Structured output's figures (every request's grammar adds to one of these)."""

    num_masks: int = 0  # token masks computed (one per constrained sampling row)
    mask_time: float = 0.0  # seconds spent computing them
    num_rejected_drafts: int = 0  # draft tokens a grammar refused before verification


@dataclass
class EngineStats:
    num_kv_blocks: int
    num_recent: int = 256  # steps kept in `recent`
    recent: deque[StepStats] = field(default_factory=deque)
    num_steps: int = 0
    # prompt tokens of the requests that emitted their first token (cached ones included,
    # once per request: vLLM's prompt_tokens_total); computed ones are in `recent`
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    prefix_cache_hits: int = 0  # prompt tokens found cached
    spec_stats: SpecStats = field(default_factory=SpecStats)
    grammar: GrammarStats = field(default_factory=GrammarStats)
    _last_log: float = field(default_factory=time.monotonic)
    # the counters at the last log line: (steps, generated, cache queries, cache hits, drafts,
    # draft tokens, accepted tokens), so each line reports its own interval, as vLLM's does
    _at_last_log: tuple[int, ...] = (0, 0, 0, 0, 0, 0, 0)

    def record(self, s: StepStats) -> None:
        self.recent.append(s)
        if len(self.recent) > self.num_recent:
            self.recent.popleft()
        self.num_steps += 1
        self.num_preemptions += s.num_preemptions
        self.prefix_cache_queries += s.num_cache_queries
        self.prefix_cache_hits += s.num_cache_hits

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    def add_update(self, num_new_tokens: int, num_drafts: int = 0, num_accepted: int = 0,
                   num_grammar_rejected: int = 0) -> None:
        """A request's tokens from one step, and its verification window's figures."""
        self.generation_tokens += num_new_tokens
        if num_drafts:
            self.spec_stats.record(num_drafts, num_accepted)
        self.grammar.num_rejected_drafts += num_grammar_rejected

    def _counters(self) -> tuple[int, ...]:
        spec = self.spec_stats
        return (self.num_steps, self.generation_tokens, self.prefix_cache_queries,
                self.prefix_cache_hits, spec.num_drafts, spec.num_draft_tokens,
                spec.num_accepted_tokens)

    def maybe_log(self, interval: float, idle_kv_usage: float | None = None) -> None:
        """One line every `interval` seconds while steps run, of what happened since the
        last line. With `idle_kv_usage` (the KV cache's usage now) the engine has nothing to
        run: a line comes only if something ran since the last one, so the logs do not end
        on a busy line."""
        idle = idle_kv_usage is not None
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval or not self.recent:
            return
        counters = self._counters()
        if idle and counters == self._at_last_log:
            return
        _, tokens, queries, hits, drafts, drafted, accepted = (
            count - before for count, before in zip(counters, self._at_last_log, strict=True))
        rate = tokens / (now - self._last_log)
        last = self.recent[-1]
        where = ("idle: 0 running, 0 waiting" if idle else
                 f"step {self.num_steps}: {last.num_requests} scheduled, "
                 f"{last.num_waiting} waiting")
        logger.info(
            "%s, gen %.1f tok/s, last step %.0f ms (%d prefill + %d decode tokens, %d drafts), "
            "KV %.0f%%, prefix cache hit rate %.1f%%, preemptions %d%s",
            where, rate, last.step_time * 1e3, last.num_prefill_tokens,
            last.num_decode_tokens, last.num_spec_tokens,
            (last.kv_usage if idle_kv_usage is None else idle_kv_usage) * 100,
            100 * hits / queries if queries else 0.0, self.num_preemptions,
            f", spec acceptance {accepted / drafted:.2f} mean length "
            f"{1 + accepted / drafts:.2f}" if drafts else "",
        )
        self._last_log, self._at_last_log = now, counters
