"""Prometheus metrics named like vLLM's, under a `braid:` prefix.

Everything is written from the engine thread (prometheus-client is thread-safe); counters
follow `engine.stats` by deltas so the engine stays the single source of truth.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from braid.core.stats import EngineStats
from braid.outputs import RequestOutput
from braid.spec_decode.speculator import SpeculatorFigures

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_K_BUCKETS = tuple(float(k) for k in range(17))
_TOKEN_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
                  10000.0, 20000.0, 50000.0, 100000.0)  # vLLM's 1-2-5 series
_STEP_TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                       8192.0, 16384.0)
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)  # vLLM's request_params_n buckets
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0, 20.0)


@dataclass(slots=True)
class _Tracked:
    """Per-request state needed for inter-token latency."""

    last_token_time: float
    num_tokens: int


@dataclass(slots=True)
class _Seen:
    """Engine counters already exported."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    grammar_rejected_drafts: int = 0
    grammar_masks: int = 0
    grammar_mask_time: float = 0.0


class ServerMetrics:
    """One engine's series. With several replicas (`for_replica`) every replica's recorder
    writes the same metric families, its series told apart by a `replica` label; the series
    the front end records (admitted requests' parameters) carry no such label."""

    def __init__(self, model_name: str, cache_config: dict[str, object] | None = None,
                 replica: int | None = None) -> None:
        """cache_config: the KV cache's settings, vLLM's cache_config_info labels."""
        self.registry = CollectorRegistry()
        self._families: dict[str, Any] = {}
        self.model_name, self._replica = model_name, replica
        if cache_config is not None:
            Gauge("braid:cache_config_info", "Information of the KV cache's configuration",
                  list(cache_config), registry=self.registry).labels(
                      *map(str, cache_config.values())).set(1)
        self._build()

    def for_replica(self, replica: int) -> ServerMetrics:
        """A fresh recorder of `replica`'s series in this one's registry (a restarted
        replica's engine counts from zero again: its recorder starts over, the counters
        it adds to go on)."""
        other = object.__new__(ServerMetrics)
        other.registry, other._families = self.registry, self._families
        other.model_name, other._replica = self.model_name, replica
        other._build()
        return other

    def _build(self) -> None:
        self._build_gauges()
        self._build_counters()
        self._build_histograms()
        self._seen = _Seen()
        self._steps_seen = 0
        self._accepted_per_pos: list[int] = []
        self._chosen_k_seen: dict[int, int] = {}
        self._lookup_windows_seen = 0
        self._tracked: dict[str, _Tracked] = {}

    def _labels(self) -> list[str]:
        return ["model_name"] + ([] if self._replica is None else ["replica"])

    def _values(self) -> list[str]:
        return [self.model_name] + ([] if self._replica is None else [str(self._replica)])

    def family(self, kind: type, name: str, doc: str, labels: list[str], **kw: Any) -> Any:
        """The registry's metric `name`, made on first use (replicas share it)."""
        if name not in self._families:
            self._families[name] = kind(name, doc, labels, registry=self.registry, **kw)
        return self._families[name]

    def _build_gauges(self) -> None:
        self.running = self._gauge("braid:num_requests_running", "Requests in the running batch")
        self.waiting = self._gauge("braid:num_requests_waiting",
                                   "Requests waiting to be scheduled")
        self.kv_usage = self._gauge("braid:kv_cache_usage_perc", "KV cache usage (1 = 100%)")
        self.prefix_cache_hit_rate = self._gauge(
            "braid:prefix_cache_hit_rate", "Prompt tokens found cached / looked up, since start")

    def _gauge(self, name: str, doc: str) -> Gauge:
        return self.family(Gauge, name, doc, self._labels()).labels(*self._values())

    def _counter(self, name: str, doc: str) -> Counter:
        return self.family(Counter, name, doc, self._labels()).labels(*self._values())

    def _build_counters(self) -> None:
        self.prompt_tokens = self._counter(
            "braid:prompt_tokens", "Prompt tokens of requests past their prefill, prefix-cached "
            "ones included (as vLLM counts them)")
        self.generation_tokens = self._counter("braid:generation_tokens", "Tokens generated")
        self.preemptions = self._counter("braid:num_preemptions", "Preemptions")
        self.prefix_cache_queries = self._counter(
            "braid:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = self._counter(
            "braid:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_drafts = self._counter("braid:spec_decode_num_drafts",
                                        "Verification windows with at least one draft token")
        self.num_draft_tokens = self._counter("braid:spec_decode_num_draft_tokens",
                                              "Draft tokens proposed and verified")
        self.num_accepted_tokens = self._counter("braid:spec_decode_num_accepted_tokens",
                                                 "Draft tokens accepted")
        self.lookup_windows = self._counter(
            "braid:spec_decode_lookup_windows",
            "Windows whose drafts came from a prompt lookup instead of the draft model")
        self.grammar_rejected_drafts = self._counter(
            "braid:structured_output_rejected_draft_tokens",
            "Draft tokens cut before verification because the request's grammar refused them")
        self.grammar_masks = self._counter("braid:structured_output_masks",
                                           "Token masks computed for grammar-constrained rows")
        self.grammar_mask_time = self._counter("braid:structured_output_mask_seconds",
                                               "Time spent computing grammar token masks")
        self.accepted_per_pos = self.family(
            Counter, "braid:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position", [*self._labels(), "position"])
        self.request_success = self.family(
            Counter, "braid:request_success", "Finished requests by finish reason",
            [*self._labels(), "finished_reason"])

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...],
                   front: bool = False) -> Histogram:
        """front: a series of the front end's (no replica label)."""
        labels, values = (["model_name"], [self.model_name]) if front else (self._labels(),
                                                                         self._values())
        return self.family(Histogram, name, doc, labels, buckets=buckets).labels(*values)

    def _build_histograms(self) -> None:
        self.ttft = self._histogram("braid:time_to_first_token_seconds",
                                    "Time to first token", _LATENCY_BUCKETS)
        self.itl = self._histogram("braid:inter_token_latency_seconds",
                                   "Time between a request's successive token outputs",
                                   _ITL_BUCKETS)
        self.e2e = self._histogram("braid:e2e_request_latency_seconds",
                                   "Arrival to finish", _LATENCY_BUCKETS)
        # per finished request, as vLLM's: its tokens, and where its time went
        self.request_prompt_tokens = self._histogram(
            "braid:request_prompt_tokens", "Prompt tokens of each finished request",
            _TOKEN_BUCKETS)
        self.request_generation_tokens = self._histogram(
            "braid:request_generation_tokens", "Generated tokens of each finished request",
            _TOKEN_BUCKETS)
        self.queue_time = self._histogram(
            "braid:request_queue_time_seconds", "Arrival to first admission (waiting)",
            _LATENCY_BUCKETS)
        self.prefill_time = self._histogram(
            "braid:request_prefill_time_seconds", "First admission to first token",
            _LATENCY_BUCKETS)
        self.decode_time = self._histogram(
            "braid:request_decode_time_seconds", "First token to finish", _LATENCY_BUCKETS)
        self.inference_time = self._histogram(
            "braid:request_inference_time_seconds", "First admission to finish",
            _LATENCY_BUCKETS)
        self.request_params_n = self._histogram(
            "braid:request_params_n", "n (choices per prompt) of each admitted request's "
            "prompts", _N_BUCKETS, front=True)
        self.request_params_max_tokens = self._histogram(
            "braid:request_params_max_tokens", "max_tokens of each admitted engine request "
            "(where unset, what the model length leaves after the prompt)", _TOKEN_BUCKETS,
            front=True)
        self.time_per_output_token = self._histogram(
            "braid:request_time_per_output_token_seconds",
            "Decode time over the tokens after the first, per finished request", _ITL_BUCKETS)
        self.iteration_tokens = self._histogram(
            "braid:iteration_tokens_total", "Tokens computed per engine step (prefill chunks, "
            "decodes and verification windows)", _STEP_TOKEN_BUCKETS)
        self.chosen_k = self._histogram("braid:spec_decode_chosen_k",
                                        "Draft tokens chosen per decoding request and step",
                                        _K_BUCKETS)
        self.step_time = self._gauge("braid:step_time_seconds", "Last measured step time")
        self.predicted_step_time = self._gauge(
            "braid:spec_decode_predicted_step_time_seconds",
            "Step time (target forward and drafting) the speculation policy predicted for its "
            "last decision")
        self.cost_model_error = self._gauge(
            "braid:spec_decode_cost_model_relative_error",
            "Moving average of |predicted - measured| / measured target step time")
        self.acceptance_estimate = self._gauge(
            "braid:spec_decode_acceptance_estimate", "Global per-draft acceptance estimate")
        self.lookup_acceptance_estimate = self._gauge(
            "braid:spec_decode_lookup_acceptance_estimate",
            "Global per-draft acceptance estimate of prompt lookups beside the draft model")

    # ---- updates (the event loop) ------------------------------------------------------

    def record_admitted(self, num_prompts: int, n: int, max_tokens: list[int]) -> None:
        """One admitted request: its prompts (n choices each) and the max_tokens of its
        engine requests."""
        for _ in range(num_prompts):
            self.request_params_n.observe(n)
        for m in max_tokens:
            self.request_params_max_tokens.observe(m)

    # ---- updates (engine thread) -------------------------------------------------------

    def set_load(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def record_stats(self, stats: EngineStats, speculator: SpeculatorFigures | None = None
                     ) -> None:
        if stats.recent:
            self.step_time.set(stats.recent[-1].step_time)
        new_steps = min(stats.num_steps - self._steps_seen, len(stats.recent))
        for step in itertools.islice(reversed(stats.recent), new_steps):
            self.iteration_tokens.observe(step.num_prefill_tokens + step.num_decode_tokens)
        self._steps_seen = stats.num_steps
        if speculator is not None:
            self._record_speculator(speculator)
        seen = self._seen
        spec = stats.spec_stats
        for counter, attr, value in (
            (self.prompt_tokens, "prompt_tokens", stats.prompt_tokens),
            (self.generation_tokens, "generation_tokens", stats.generation_tokens),
            (self.preemptions, "num_preemptions", stats.num_preemptions),
            (self.prefix_cache_queries, "prefix_cache_queries", stats.prefix_cache_queries),
            (self.prefix_cache_hits, "prefix_cache_hits", stats.prefix_cache_hits),
            (self.num_drafts, "num_drafts", spec.num_drafts),
            (self.num_draft_tokens, "num_draft_tokens", spec.num_draft_tokens),
            (self.num_accepted_tokens, "num_accepted_tokens", spec.num_accepted_tokens),
            (self.grammar_rejected_drafts, "grammar_rejected_drafts",
             stats.grammar.num_rejected_drafts),
            (self.grammar_masks, "grammar_masks", stats.grammar.num_masks),
            (self.grammar_mask_time, "grammar_mask_time", stats.grammar.mask_time),
        ):
            if value > getattr(seen, attr):
                counter.inc(value - getattr(seen, attr))
                setattr(seen, attr, value)
        self._record_per_position(spec.accepted_per_position)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)

    def _record_speculator(self, figures: SpeculatorFigures) -> None:
        for k, count in figures.chosen_k.items():
            for _ in range(count - self._chosen_k_seen.get(k, 0)):
                self.chosen_k.observe(k)
            self._chosen_k_seen[k] = count
        self.lookup_windows.inc(figures.lookup_windows - self._lookup_windows_seen)
        self._lookup_windows_seen = figures.lookup_windows
        self.predicted_step_time.set(figures.predicted_step_time)
        self.cost_model_error.set(figures.cost_model_error)
        self.acceptance_estimate.set(figures.acceptance_estimate)
        if figures.lookup_acceptance_estimate is not None:
            self.lookup_acceptance_estimate.set(figures.lookup_acceptance_estimate)

    def _record_per_position(self, accepted: list[int]) -> None:
        for pos, value in enumerate(accepted):
            if pos == len(self._accepted_per_pos):
                self._accepted_per_pos.append(0)
            if value > self._accepted_per_pos[pos]:
                self.accepted_per_pos.labels(*self._values(), str(pos)).inc(
                    value - self._accepted_per_pos[pos])
                self._accepted_per_pos[pos] = value

    def record_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            self._record_tokens(out, now)
            if out.finished:
                self.record_finished(out)

    def _record_tokens(self, out: RequestOutput, now: float) -> None:
        num_tokens = len(out.outputs[0].token_ids)
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            if num_tokens and out.metrics.first_token_time is not None:
                self.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
                self._tracked[out.request_id] = _Tracked(now, num_tokens)
        elif num_tokens > tracked.num_tokens:
            self.itl.observe(now - tracked.last_token_time)
            tracked.last_token_time, tracked.num_tokens = now, num_tokens

    def record_finished(self, out: RequestOutput) -> None:
        self._tracked.pop(out.request_id, None)
        reason = out.outputs[0].finish_reason or "abort"
        self.request_success.labels(*self._values(), reason).inc()
        if reason == "abort":
            return
        m = out.metrics
        finish = m.finish_time or time.monotonic()
        self.e2e.observe(finish - m.arrival_time)
        generated = len(out.outputs[0].token_ids)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(generated)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            self.inference_time.observe(finish - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            self.decode_time.observe(finish - m.first_token_time)
            if generated > 1:
                self.time_per_output_token.observe((finish - m.first_token_time)
                                                   / (generated - 1))

    def forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
