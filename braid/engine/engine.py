"""The engine: add_request / step / abort. It orchestrates a step: the scheduler decides it,
the executor computes it, speculation proposes the next drafts, the output processor
turns tokens into outputs."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from braid.config import EngineConfig
from braid.core.request import Request
from braid.core.scheduler import SchedulerOutput
from braid.core.stats import EngineStats
from braid.engine.bootstrap import (
    check_memory,
    eos_token_ids,
    load_target,
    make_executor,
    make_scheduler,
    sampling_defaults,
    set_threads,
)
from braid.engine.grammars import GrammarGate
from braid.engine.input import InputProcessor, RequestError, refusal
from braid.engine.isolation import run_step
from braid.engine.output import OutputProcessor, PromptScorers
from braid.engine.step_input import StepInputs
from braid.models.interface import CausalLM
from braid.outputs import RequestOutput
from braid.sampling_params import RequestOutputKind, SamplingParams
from braid.spec_decode.build import make_speculator
from braid.spec_decode.cost_model import step_work
from braid.spec_decode.speculator import SpeculatorFigures
from braid.structured.manager import StructuredOutputManager
from braid.tokenizer import Tokenizer
from braid.worker.memory import kv_cache_blocks
from braid.worker.step_io import StepResult

__all__ = ["LLMEngine", "RequestError"]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM | None = None,
        tokenizer: Tokenizer | None = None,
        draft_model: CausalLM | None = None,
    ) -> None:
        set_threads(config.threads)
        # what requests leave unset: generation_config.json's and --override-generation-config
        self.default_sampling: dict[str, Any]
        model, tokenizer, self.default_sampling = (
            load_target(config, draft_model is None) if model is None
            else (model, tokenizer, sampling_defaults(config, None)))
        # --override-generation-config's max_new_tokens caps the server's requests (vLLM's)
        self.max_tokens_cap: int | None = (config.override_generation_config or {}).get(
            "max_new_tokens")
        config.finalize(model.config.max_context, model.config.context_limit)
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        kv_dtype = config.kv_dtype(model.dtype, model.quant_type is not None)
        num_blocks = kv_cache_blocks(config, model.config, kv_dtype)
        self.scheduler = make_scheduler(config, num_blocks, model.config)
        self.blocks = self.scheduler.blocks
        self.outputs = OutputProcessor(tokenizer, eos_token_ids(model, tokenizer),
                                       config.max_model_len or 0)
        self.executor = make_executor(config, model, num_blocks, kv_dtype,
                                      self.outputs.eos_token_ids)
        self.step_inputs = StepInputs(self.blocks, model.config.vocab_size)
        self.executor.grammar_of = lambda rid: getattr(self.requests.get(rid), "grammar", None)
        self.runner = self.executor.runner  # the target's (engine/process.py reads its cache)
        self.speculator = make_speculator(config, self.executor, self.scheduler, draft_model,
                                          tokenizer, self.step_inputs.unsent)
        check_memory(config, self.executor.weight_and_kv_bytes)
        self.speculator.release_windows(self.scheduler, model.config)
        self.stats = EngineStats(num_kv_blocks=num_blocks)
        self.structured = None if tokenizer is None else StructuredOutputManager(
            tokenizer, model.config.vocab_size, self.outputs.eos_token_ids, self.stats.grammar)
        self.grammars = GrammarGate(self.scheduler, self.structured)
        self.scorers = PromptScorers()
        self.inputs = InputProcessor(config, model.config.vocab_size, tokenizer)

    # ---- request API -------------------------------------------------------------------

    def max_logprobs(self) -> int:
        """The most logprobs per position a request may ask for (--max-logprobs)."""
        return self.inputs.max_logprobs()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        group: str | None = None,
    ) -> Request:
        """Queue a request. `priority` (lower first) counts under --scheduling-policy
        priority; elsewhere only 0 is accepted, as vLLM. `group` names the API request it
        belongs to (its prompts x n choices): the scheduler shares decode rows fairly
        between groups (alone, a request is its own group)."""
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        req = self.inputs.process(request_id, prompt, sampling_params or SamplingParams(),
                                  priority, group)
        if req.sampling_params.structured_outputs is not None:
            self.grammars.submit(req)
        req.arrival_time = req.arrival_time if arrival_time is None else arrival_time
        self.scorers.add(req)
        self.outputs.add(req)
        self.scheduler.add(req)
        return req

    def add_requests(self, requests: Sequence[tuple]) -> list[Exception | None]:
        """Add each (`add_request`'s arguments, in order): per request None, or the error that
        refused it (the others are added all the same)."""
        return [refusal(self.add_request, args) for args in requests]

    def abort_requests(self, request_ids: Sequence[str]) -> list[RequestOutput | None]:
        return [self.abort(request_id) for request_id in request_ids]

    @property
    def requests(self) -> Mapping[str, Request]:
        """Unfinished requests by id (the scheduler's registry, read-only)."""
        return self.scheduler.requests

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks; unknown or finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        return self._finished(req)

    def _release(self, req: Request) -> None:
        """The one path every finished request takes after the scheduler finished it: the
        output side and the speculator drop their per-request state."""
        self.outputs.finish(req)
        self.speculator.finish(req)
        self.scorers.finish(req)
        self.step_inputs.forget(req.request_id)

    def shutdown(self) -> None:
        """End what the executor started (a pipeline's stage processes)."""
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def speculation_figures(self) -> SpeculatorFigures | None:
        return self.speculator.figures()

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_used_blocks

    @property
    def kv_usage(self) -> float:
        return self.blocks.usage

    # ---- one step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, update; return outputs of requests that moved."""
        start = time.perf_counter()
        failed = [self._finished(req) for req in self.grammars.failed()]
        sched = self.scheduler.schedule(self.speculator.prefill_cap(self.scheduler))
        if sched.is_empty:
            self.grammars.wait()
            return failed
        context = sum(s.request.num_computed_tokens for s in sched.scheduled)
        attention, rows = step_work(sched)  # measured before the step moves them on
        result, failing = run_step(self._execute, self.scheduler, sched,
                                   self._forget_preempted)
        culprits = [self._finished(req) for req in failing]
        for rid, lp in result.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(self.requests[rid], lp)
        outputs = self._update(sched, result)
        target_time = time.perf_counter() - start
        if not culprits:
            self.speculator.observe_step(sched.num_batched_tokens, attention, rows, target_time)
        self._propose(sched)
        self.grammars.share_time(sched, time.perf_counter() - start)
        self.stats.record(sched.step_stats(context, result.forward_end - start,
                                           time.perf_counter() - start, self.kv_usage,
                                           self.num_waiting))
        self.stats.maybe_log(self.config.log_stats_interval)
        return failed + culprits + outputs

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        return self.executor.execute(self.step_inputs.build(sched))

    def _finished(self, req: Request) -> RequestOutput:
        """The output of a request the scheduler just finished outside a step's updates."""
        self._release(req)
        return self.outputs.make_output(req)

    def _forget_preempted(self, sched: SchedulerOutput) -> None:
        """The speculator's state of the requests the step preempted goes (their KV did)."""
        for rid in sched.preempted:
            self.speculator.forget(rid)

    def _propose(self, sched: SchedulerOutput) -> None:
        """Drafts for the next step (Speculation.next_drafts)."""
        self._forget_preempted(sched)
        drafts = self.speculator.next_drafts(self.scheduler)
        cuts = self.scheduler.update_draft_token_ids(drafts)
        self.executor.set_drafts(drafts, cuts)

    def _update(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Hand the step's tokens to the scheduler, then the figures and outputs of every
        request that emitted some."""
        samples = result.samples
        updates = self.scheduler.update_from_output(
            sched, [samples[s.request.request_id].token_ids if s.needs_logits else []
                    for s in sched.scheduled], self.outputs.check_stop)
        outputs = []
        for u in updates:
            req = u.request
            req.last_token_time = time.monotonic()
            if req.first_token_time is None:
                req.first_token_time = req.last_token_time
                self.stats.prompt_tokens += req.num_prompt_tokens
            if (lp := samples[req.request_id].logprobs) is not None:
                self.outputs.add_logprobs(req, lp[: u.num_new_tokens])
            self.speculator.on_update(u)
            self.stats.add_update(u.num_new_tokens, u.num_drafts, u.num_accepted,
                                  u.num_grammar_rejected)
            if u.finish_reason is not None:
                self._release(req)
            elif req.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            out = self.outputs.make_output(req)
            if out.metrics.spec_stats:
                out.metrics.spec_stats.update(self.speculator.request_figures(req))
            outputs.append(out)
        return outputs

    def log_idle_stats(self) -> None:
        """The stats line of an engine that went idle (once; see EngineStats.maybe_log)."""
        self.stats.maybe_log(self.config.log_stats_interval, idle_kv_usage=self.kv_usage)

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()
