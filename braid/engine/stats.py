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
    _tokens_at_last_log: int = 0

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

    def add_generated(self, n: int) -> None:
        self.generation_tokens += n

    def maybe_log(self, interval: float) -> None:
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval or not self.recent:
            return
        rate = (self.generation_tokens - self._tokens_at_last_log) / (now - self._last_log)
        last = self.recent[-1]
        spec = self.spec_stats
        logger.info(
            "step %d: %d scheduled, %d waiting, gen %.1f tok/s, last step %.0f ms "
            "(%d prefill + %d decode tokens, %d drafts), KV %.0f%%, prefix cache hit rate "
            "%.1f%%, preemptions %d%s",
            self.num_steps, last.num_requests, last.num_waiting, rate, last.step_time * 1e3,
            last.num_prefill_tokens, last.num_decode_tokens, last.num_spec_tokens,
            last.kv_usage * 100, self.prefix_cache_hit_rate * 100, self.num_preemptions,
            f", spec acceptance {spec.acceptance_rate:.2f} mean length "
            f"{spec.mean_acceptance_length:.2f}" if spec.num_drafts else "",
        )
        self._last_log, self._tokens_at_last_log = now, self.generation_tokens
