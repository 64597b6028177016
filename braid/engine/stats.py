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


@dataclass
class EngineStats:
    num_kv_blocks: int
    window: int = 256
    recent: deque[StepStats] = field(default_factory=deque)
    num_steps: int = 0
    prompt_tokens: int = 0  # prefill tokens computed (recompute after preemption included)
    generation_tokens: int = 0
    num_preemptions: int = 0
    _last_log: float = field(default_factory=time.monotonic)
    _tokens_at_last_log: int = 0

    def record(self, s: StepStats) -> None:
        self.recent.append(s)
        if len(self.recent) > self.window:
            self.recent.popleft()
        self.num_steps += 1
        self.prompt_tokens += s.num_prefill_tokens
        self.num_preemptions += s.num_preemptions

    def add_generated(self, n: int) -> None:
        self.generation_tokens += n

    def maybe_log(self, interval: float) -> None:
        now = time.monotonic()
        if interval <= 0 or now - self._last_log < interval or not self.recent:
            return
        rate = (self.generation_tokens - self._tokens_at_last_log) / (now - self._last_log)
        last = self.recent[-1]
        logger.info(
            "step %d: %d running, %d waiting, gen %.1f tok/s, last step %.0f ms "
            "(%d prefill + %d decode tokens), KV %.0f%%, preemptions %d",
            self.num_steps, last.num_requests, last.num_waiting, rate, last.step_time * 1e3,
            last.num_prefill_tokens, last.num_decode_tokens, last.kv_usage * 100,
            self.num_preemptions,
        )
        self._last_log, self._tokens_at_last_log = now, self.generation_tokens
