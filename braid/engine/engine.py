"""The engine: add_request / step / abort. It orchestrates a step: the scheduler decides it,
the executor computes it, speculation proposes the next drafts, the output processor
turns tokens into outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from braid.config import EngineConfig
from braid.core.block_manager import BlockManager
from braid.core.request import Request
from braid.core.scheduler import Scheduler, SchedulerOutput
from braid.core.stats import EngineStats, StepStats
from braid.engine.bootstrap import check_memory, load_target, sampling_defaults, set_threads
from braid.engine.input import InputProcessor, RequestError
from braid.engine.isolation import isolate
from braid.engine.output import OutputProcessor
from braid.models.interface import CausalLM
from braid.outputs import RequestOutput
from braid.sampling_params import RequestOutputKind, SamplingParams
from braid.spec_decode.build import make_speculator
from braid.spec_decode.cost_model import attention_work
from braid.spec_decode.speculator import SpeculatorFigures
from braid.structured.manager import StructuredOutputManager
from braid.tokenizer import Tokenizer
from braid.worker.executor import InProcessExecutor, StepResult
from braid.worker.memory import kv_cache_blocks
from braid.worker.step import StepSample

__all__ = ["LLMEngine", "RequestError"]

logger = logging.getLogger("braid")


# A request's grammar masks may take this share of a step's other work, on average (see
# LLMEngine._share_grammar_time); it rests at most MAX_REST_STEPS steps at a time.
GRAMMAR_SHARE = 0.5
MAX_REST_STEPS = 200


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
        if model is None:
            model, tokenizer, self.default_sampling = load_target(config, draft_model is None)
        else:
            self.default_sampling = sampling_defaults(config, None)
        # --override-generation-config's max_new_tokens caps the server's requests (vLLM's)
        self.max_tokens_cap: int | None = (config.override_generation_config or {}).get(
            "max_new_tokens")
        config.finalize(model.config.max_position_embeddings)
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        kv_dtype = config.kv_dtype(model.dtype, model.quant_type is not None)
        num_blocks = kv_cache_blocks(config, model.config, kv_dtype)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        assert config.max_num_batched_tokens is not None
        self.scheduler = Scheduler(
            self.blocks, config.max_num_batched_tokens, config.max_num_seqs,
            config.enable_chunked_prefill, priority=config.scheduling_policy == "priority",
        )
        self.outputs = OutputProcessor(tokenizer, self._eos_token_ids(model),
                                       config.max_model_len or 0)
        self.executor = InProcessExecutor(config, model, self.blocks, kv_dtype,
                                          self.outputs.eos_token_ids)
        self.runner = self.executor.runner  # the speculator's warm-up and draft share it
        self.speculator = make_speculator(config, self.runner, self.scheduler, draft_model,
                                          self.outputs.eos_token_ids)
        weights, kv = self.executor.weight_and_kv_bytes
        if (draft := self.speculator.draft_runner) is not None:
            draft_weights, draft_kv = draft.weight_and_kv_bytes
            weights, kv = weights + draft_weights, kv + draft_kv
        check_memory(config, weights, kv)
        self.stats = EngineStats(num_kv_blocks=num_blocks)
        self.structured = None if tokenizer is None else StructuredOutputManager(
            tokenizer, model.config.vocab_size, self.outputs.eos_token_ids, self.stats.grammar)
        self._compiling: list[Request] = []  # requests whose grammar is not compiled yet
        # (group, prompt, prompt_logprobs) -> the request that scores that prompt for its group
        self._prompt_scorers: dict[tuple[str, tuple[int, ...], int], Request] = {}
        self.inputs = InputProcessor(config, model.config.vocab_size, tokenizer)

    def _eos_token_ids(self, model: CausalLM) -> frozenset[int]:
        if self.tokenizer is not None:
            return frozenset(self.tokenizer.eos_token_ids)
        eos = model.config.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else eos or [])

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
        params = req.sampling_params
        if params.structured_outputs is not None:
            if self.structured is None:
                raise RequestError("structured_outputs needs a tokenizer: this engine has none")
            req.grammar_future = self.structured.submit(params.structured_outputs,
                                                        params.ignore_eos)
            self._compiling.append(req)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if params.prompt_logprobs is not None and group is not None:
            # n choices of one prompt: the first scores it for all
            key = (group, tuple(req.prompt_token_ids), params.prompt_logprobs)
            scorer = self._prompt_scorers.setdefault(key, req)
            req.prompt_scorer = None if scorer is req else scorer
        self.outputs.add(req)
        self.scheduler.add(req)
        return req

    def add_requests(self, requests: Sequence[tuple]) -> list[Exception | None]:
        """Add each (`add_request`'s arguments, in order): per request None, or the error that
        refused it (the others are added all the same)."""
        errors: list[Exception | None] = []
        for args in requests:
            try:
                self.add_request(*args)
            except Exception as e:
                errors.append(e)
            else:
                errors.append(None)
        return errors

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
        self._release(req)
        return self.outputs.make_output(req)

    def _release(self, req: Request) -> None:
        """The one path every finished request takes after the scheduler finished it: the
        output side and the speculator drop their per-request state."""
        self.outputs.finish(req)
        self.speculator.forget(req.request_id)
        if req.prompt_scorer is None and req.sampling_params.prompt_logprobs is not None:
            key = (req.group, tuple(req.prompt_token_ids), req.sampling_params.prompt_logprobs)
            if self._prompt_scorers.get(key) is req:
                del self._prompt_scorers[key]

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
        failed = self._check_grammars()
        sched = self.scheduler.schedule(self._prefill_cap())
        if sched.is_empty:
            if self._compiling:  # nothing else can run: let a compilation finish
                wait([r.grammar_future for r in self._compiling if r.grammar_future],
                     timeout=0.05, return_when=FIRST_COMPLETED)
            return failed
        context = sum(s.request.num_computed_tokens for s in sched.scheduled)
        attention = sum(attention_work(s.num_new_tokens, s.request.num_computed_tokens)
                        for s in sched.scheduled)
        rows = sum(1 + s.num_spec_tokens for s in sched.scheduled if s.needs_logits)
        result, culprits = self._run(sched)
        for rid, lp in result.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(self.requests[rid], lp)
        outputs = self._update(sched, result.in_order(sched))
        target_time = time.perf_counter() - start
        if not culprits:
            self.speculator.observe_step(sched.num_batched_tokens, attention, rows, target_time)
        self._propose(sched)
        self._share_grammar_time(sched, time.perf_counter() - start)
        self._record(sched, context, result.forward_end - start, time.perf_counter() - start)
        return failed + culprits + outputs

    def _share_grammar_time(self, sched: SchedulerOutput, step_time: float) -> None:
        """A request whose grammar masks took more than GRAMMAR_SHARE of the rest of the
        step sits out steps in proportion (while others decode): on average its masks cost
        the others at most that share. A 64 kB literal costs ~30 ms a mask."""
        spent = {id(s.request): (s.request, g.take_mask_time())
                 for s in sched.scheduled if (g := s.request.grammar) is not None}
        if len(self.scheduler.running) < 2 or not spent:
            return
        rest_of_step = max(step_time - sum(t for _, t in spent.values()), 1e-4)
        for req, seconds in spent.values():
            if seconds > GRAMMAR_SHARE * rest_of_step and not req.is_finished:
                steps = int(seconds / (GRAMMAR_SHARE * rest_of_step))
                self.scheduler.rest(req, min(steps, MAX_REST_STEPS))

    def _run(self, sched: SchedulerOutput) -> tuple[StepResult, list[RequestOutput]]:
        """The step's results. Where it raises, it runs again in parts (isolation.py): the
        requests that fail alone end with "error" (their outputs are returned), those that
        read KV another request of the step was computing go back to waiting, and every
        other request gets its result."""
        try:
            return self.executor.execute(sched), []
        except Exception:
            logger.exception("engine step failed; running it again in parts to find the "
                             "request that fails it")
        except BaseException:
            self.scheduler.discard_published(sched)  # their KV was never written
            self._forget_preempted(sched)
            raise
        self.scheduler.requeue_dependents(sched)
        result, culprits = isolate(self.executor.execute, list(sched.scheduled))
        failed = []
        for s in culprits:
            self.scheduler.fail(s.request, sched)
            self._release(s.request)
            failed.append(self.outputs.make_output(s.request))
        return result, failed

    def _check_grammars(self) -> list[RequestOutput]:
        """Forget compiled grammars' requests; finish those whose grammar failed to compile
        (with reason "error": the server and `LLM` check grammars before they add requests,
        so here it is a request added straight to the engine with a grammar the grammar
        engine refuses)."""
        failed, still = [], []
        for req in self._compiling:
            future = req.grammar_future
            assert future is not None
            if not future.done():
                still.append(req)
            elif future.exception() is not None and not req.is_finished:
                logger.error("request %s: %s", req.request_id, future.exception())
                self.scheduler.finish(req, "error")
                self._release(req)
                failed.append(self.outputs.make_output(req))
        self._compiling = still
        return failed

    def _prefill_cap(self) -> int | None:
        """The ITL target's prefill cap, computed for the step about to be scheduled (from
        the requests running and waiting now, so new arrivals always count)."""
        return self.speculator.prefill_cap(self.scheduler)

    def _forget_preempted(self, sched: SchedulerOutput) -> None:
        """The speculator's state of the requests the step preempted goes (their KV did)."""
        for rid in sched.preempted:
            self.speculator.forget(rid)

    def _propose(self, sched: SchedulerOutput) -> None:
        """Drafts for the next step. A proposer that raises costs this step's drafts only:
        the draft model's progress is forgotten (it catches up later), and a request at
        fault fails alone in the next target step, which meets the same fault."""
        self._forget_preempted(sched)
        try:
            drafts, probs = self.speculator.propose(self.scheduler)
        except Exception:
            logger.exception("proposing drafts failed; this step goes without")
            for req in self.scheduler.running:
                self.speculator.forget(req.request_id)
            return
        cuts = self.scheduler.update_draft_token_ids(drafts)
        self.executor.set_draft_probs(probs, drafts, cuts)

    def _update(self, sched: SchedulerOutput, sampled: list[StepSample]) -> list[RequestOutput]:
        """Hand the step's tokens to the scheduler, then the figures and outputs of every
        request that emitted some."""
        updates = self.scheduler.update_from_output(
            sched, [r.token_ids for r in sampled], self._check_stop)
        logprobs = {id(r.scheduled.request): r.logprobs for r in sampled}
        outputs = []
        for u in updates:
            req = u.request
            req.last_token_time = time.monotonic()
            if req.first_token_time is None:
                req.first_token_time = req.last_token_time
                self.stats.prompt_tokens += req.num_prompt_tokens
            if (lp := logprobs[id(req)]) is not None:
                self.outputs.add_logprobs(req, lp[: u.num_new_tokens])
            if u.num_drafts:
                req.spec_stats.record(u.num_drafts, u.num_accepted)
                self.stats.spec_stats.record(u.num_drafts, u.num_accepted)
            if u.num_drafts or u.num_grammar_rejected:
                # the policy learns from what it proposed: drafts a grammar cut count as
                # rejected
                self.speculator.on_verified(req, u.num_drafts + u.num_grammar_rejected,
                                            u.num_accepted)
                self.stats.grammar.num_rejected_drafts += u.num_grammar_rejected
            self.stats.add_generated(u.num_new_tokens)
            if u.finish_reason is not None:
                self._release(req)
            elif req.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue
            out = self.outputs.make_output(req)
            if out.metrics.spec_stats:
                out.metrics.spec_stats.update(self.speculator.request_figures(req))
            outputs.append(out)
        return outputs

    def _check_stop(self, req: Request, token: int) -> str | None:
        """The output processor's stop rules; a failure there (detokenizer, stop strings)
        finishes that request alone with reason "error", and the others go on."""
        try:
            return self.outputs.check_stop(req, token)
        except Exception:
            logger.exception("request %s failed while appending its tokens", req.request_id)
            return "error"

    def _record(
        self, sched: SchedulerOutput, context: int, forward_time: float, step_time: float
    ) -> None:
        self.stats.record(StepStats(
            num_requests=len(sched.scheduled),
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_batched_tokens - sched.num_prefill_tokens,
            num_spec_tokens=sched.num_spec_tokens,
            num_context_tokens=context,
            forward_time=forward_time,
            step_time=step_time,
            kv_usage=self.kv_usage,
            num_preemptions=len(sched.preempted),
            num_waiting=self.num_waiting,
            num_cache_queries=sched.num_cache_queries,
            num_cache_hits=sched.num_cache_hits,
        ))
        self.stats.maybe_log(self.config.log_stats_interval)

    def log_idle_stats(self) -> None:
        """The stats line of an engine that went idle (once; see EngineStats.maybe_log)."""
        self.stats.maybe_log(self.config.log_stats_interval, idle_kv_usage=self.kv_usage)

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()
