"""The engine: add_request / step / abort over one scheduler, one runner and one sampler."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

import torch

from braid.config import EngineConfig
from braid.engine.block_manager import BlockManager
from braid.engine.bootstrap import (
    check_before_loading,
    sampling_defaults,
    warn_without_tokenizer,
)
from braid.engine.isolation import StepResult, isolate
from braid.engine.memory import (
    available_memory,
    kv_cache_blocks,
    refuse_beyond_memory,
    warn_beyond_available,
)
from braid.engine.output import OutputProcessor
from braid.engine.request import Request
from braid.engine.runner import ModelRunner
from braid.engine.scheduler import Scheduler, SchedulerOutput
from braid.engine.stats import EngineStats, StepStats
from braid.models.qwen2 import Qwen2ForCausalLM
from braid.outputs import RequestOutput
from braid.sample.step import StepSample, StepSampler, score_prompts
from braid.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    bad_words_token_ids,
    is_int,
)
from braid.spec_decode.build import make_speculator
from braid.spec_decode.cost_model import attention_work
from braid.spec_decode.speculator import SpeculatorFigures
from braid.structured.manager import StructuredOutputManager
from braid.tokenizer import Tokenizer

logger = logging.getLogger("braid")


# A request's grammar masks may take this share of a step's other work, on average (see
# LLMEngine._share_grammar_time); it rests at most MAX_REST_STEPS steps at a time.
GRAMMAR_SHARE = 0.5
MAX_REST_STEPS = 200


class RequestError(ValueError):
    """A request the engine cannot serve (too long, bad ids); the message names the field."""


def with_bad_words(params: SamplingParams, tokenizer: Tokenizer | None) -> SamplingParams:
    """`params` with its bad_words as token ids. It takes a tokenizer call per word (100,000
    words: ~1.5 s): the server does it in a worker thread before it adds the request."""
    if tokenizer is None:
        raise RequestError("bad_words needs a tokenizer: this engine has none")
    return dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(
        params.bad_words or [],
        lambda texts: tokenizer.encode_batch(texts, add_special_tokens=False)))


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: Qwen2ForCausalLM | None = None,
        tokenizer: Tokenizer | None = None,
        draft_model: Qwen2ForCausalLM | None = None,
    ) -> None:
        torch.set_num_threads(config.threads)
        cores = len(os.sched_getaffinity(0))
        if config.threads > cores:
            logger.warning("--num-threads %d is more than the %d cores this process may use: "
                           "the threads share them and every step slows down",
                           config.threads, cores)
        # what requests leave unset: generation_config.json's and --override-generation-config
        self.default_sampling: dict[str, Any]
        if model is None:
            from braid.models.build import load_model

            checked = check_before_loading(config, draft=draft_model is None)
            self.default_sampling = sampling_defaults(config, checked.folder)
            model, tokenizer = load_model(config.model, config.torch_dtype, config.device,
                                          config.quantization,
                                          with_tokenizer=checked.tokenizer is None)
            if checked.tokenizer is not None:
                tokenizer = checked.tokenizer
            elif tokenizer is None:
                warn_without_tokenizer(config.model, checked.folder)
        else:
            self.default_sampling = sampling_defaults(config, None)
        # --override-generation-config's max_new_tokens caps the server's requests (vLLM's)
        self.max_tokens_cap: int | None = (config.override_generation_config or {}).get(
            "max_new_tokens")
        config.finalize(model.config.max_position_embeddings)
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.device = torch.device(config.device)
        kv_dtype = config.kv_dtype(model.dtype, model.quant_type is not None)
        num_blocks = kv_cache_blocks(config, model.config, kv_dtype)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        assert config.max_num_batched_tokens is not None
        self.scheduler = Scheduler(
            self.blocks, config.max_num_batched_tokens, config.max_num_seqs,
            config.enable_chunked_prefill, priority=config.scheduling_policy == "priority",
        )
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.device, kv_dtype)
        self.outputs = OutputProcessor(tokenizer, self._eos_token_ids(model),
                                       config.max_model_len or 0)
        self.sampler = StepSampler(self.device, self.outputs.eos_token_ids, config.spec_config)
        self.speculator = make_speculator(config, self.runner, self.scheduler, draft_model,
                                          self.outputs.eos_token_ids)
        self._check_memory()
        self.stats = EngineStats(num_kv_blocks=num_blocks)
        self.structured = None if tokenizer is None else StructuredOutputManager(
            tokenizer, model.config.vocab_size, self.outputs.eos_token_ids, self.stats.grammar)
        self._compiling: list[Request] = []  # requests whose grammar is not compiled yet
        # (group, prompt, prompt_logprobs) -> the request that scores that prompt for its group
        self._prompt_scorers: dict[tuple[str, tuple[int, ...], int], Request] = {}
        self._seeds = random.Random(config.seed)  # unseeded requests' seeds, in arrival order

    def _check_memory(self) -> None:
        """The weights and KV caches of the target and the draft against the machine's
        memory. The KV caches are mapped, not yet touched: one too large would fail under
        load, not here, so it is refused now."""
        runners = [r for r in (self.runner, getattr(getattr(self.speculator, "proposer", None),
                                                    "runner", None)) if r is not None]
        kv = sum(r.kv_cache.numel() * r.kv_cache.element_size() for r in runners)
        if self.device.type == "cpu":
            flag = ("--kv-cache-gib" if self.config.num_kv_blocks is None
                    else "--num-kv-blocks")
            refuse_beyond_memory(kv + sum(r.model.weight_bytes() for r in runners),
                                 f"{flag}: the weights and KV caches (the draft's included) "
                                 "take {:.1f} GiB, which does not")
            # the weights are resident by now, the caches not yet
            warn_beyond_available(kv, flag, available_memory())

    def _eos_token_ids(self, model: Qwen2ForCausalLM) -> frozenset[int]:
        if self.tokenizer is not None:
            return frozenset(self.tokenizer.eos_token_ids)
        eos = model.config.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else eos or [])

    # ---- request API -------------------------------------------------------------------

    def max_logprobs(self) -> int:
        """The most logprobs per position a request may ask for (--max-logprobs)."""
        cap = self.config.max_logprobs
        return self.model_config.vocab_size if cap == -1 else cap

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
        params = sampling_params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        if params.n != 1:
            raise RequestError(f"n must be 1 for one engine request, got {params.n}: add one "
                               "request per completion (LLM.generate and the server do)")
        if not is_int(priority):
            raise RequestError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and not self.scheduler.priority:
            raise RequestError(f"priority {priority} needs --scheduling-policy priority")
        if params.bad_words and params.bad_words_token_ids is None:
            params = with_bad_words(params, self.tokenizer)
        if -1 in (params.logprobs, params.prompt_logprobs):  # vLLM's: the whole vocabulary
            vocab = self.model_config.vocab_size
            params = dataclasses.replace(
                params, logprobs=vocab if params.logprobs == -1 else params.logprobs,
                prompt_logprobs=vocab if params.prompt_logprobs == -1 else params.prompt_logprobs)
        text, ids = self._tokenize(prompt)
        keep = params.truncate_prompt_tokens  # vLLM's: the prompt's last k tokens
        if keep is not None:
            ids = ids[-(self.config.max_model_len or len(ids) if keep == -1 else keep):]
        self._check_prompt(ids, params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        req = Request(request_id, ids, params, prompt=text, seed=seed, priority=priority,
                      group=group or request_id)
        if params.prompt_logprobs is not None and group is not None:
            # n choices of one prompt: the first scores it for all
            scorer = self._prompt_scorers.setdefault((group, tuple(ids), params.prompt_logprobs),
                                                     req)
            req.prompt_scorer = None if scorer is req else scorer
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if params.structured_outputs is not None:
            if self.structured is None:
                raise RequestError("structured_outputs needs a tokenizer: this engine has none")
            req.grammar_future = self.structured.submit(params.structured_outputs,
                                                        params.ignore_eos)
            self._compiling.append(req)
        self.outputs.add(req)
        self.scheduler.add(req)
        return req

    @property
    def requests(self) -> Mapping[str, Request]:
        """Unfinished requests by id (the scheduler's registry, read-only)."""
        return self.scheduler.requests

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt must be token ids: this engine has no tokenizer")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        assert max_len is not None
        if not ids:
            raise RequestError("prompt must not be empty")
        if len(ids) >= max_len:
            raise RequestError(
                f"prompt is {len(ids)} tokens, the maximum is {max_len - 1} (max_model_len "
                f"{max_len} includes at least one generated token)")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if any(token >= vocab for token in params.logit_bias or {}):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})")
        for name in ("allowed_token_ids", "stop_token_ids"):  # a stop id never sampled: a slip
            if any(token >= vocab for token in getattr(params, name) or []):
                raise RequestError(f"{name} must be token ids in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name) or 0
            if n > self.max_logprobs():
                raise RequestError(f"{name} {n} exceeds --max-logprobs ({self.max_logprobs()})")
            if n > vocab:
                raise RequestError(f"{name} must be <= the vocabulary size ({vocab}), got {n}")

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
        if self.speculator is not None:
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
        return None if self.speculator is None else self.speculator.figures()

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
        if self.speculator is not None and not culprits:
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
            return self._compute(sched), []
        except Exception:
            logger.exception("engine step failed; running it again in parts to find the "
                             "request that fails it")
        except BaseException:
            self.scheduler.discard_published(sched)  # their KV was never written
            self._forget_preempted(sched)
            raise
        self.scheduler.requeue_dependents(sched)
        result, culprits = isolate(self._compute, list(sched.scheduled))
        failed = []
        for s in culprits:
            self.scheduler.fail(s.request, sched)
            self._release(s.request)
            failed.append(self.outputs.make_output(s.request))
        return result, failed

    def _compute(self, sched: SchedulerOutput) -> StepResult:
        """One forward over `sched` and its sampling; no scheduling state changes."""
        inp = self.runner.prepare(sched, self.blocks)
        logits = self.runner.execute(inp)
        forward_end = time.perf_counter()
        prompt_logprobs = score_prompts(sched, logits[: inp.num_prompt_rows])
        sampled = self.sampler.sample(sched, logits[inp.num_prompt_rows :])
        return StepResult(prompt_logprobs, {id(r.scheduled): r for r in sampled}, forward_end)

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
        if self.speculator is None:
            return None
        return self.speculator.prefill_cap(self.scheduler)

    def _forget_preempted(self, sched: SchedulerOutput) -> None:
        """The speculator's state of the requests the step preempted goes (their KV did)."""
        if self.speculator is not None:
            for rid in sched.preempted:
                self.speculator.forget(rid)

    def _propose(self, sched: SchedulerOutput) -> None:
        """Drafts for the next step. A proposer that raises costs this step's drafts only:
        the draft model's progress is forgotten (it catches up later), and a request at
        fault fails alone in the next target step, which meets the same fault."""
        if self.speculator is None:
            return
        self._forget_preempted(sched)
        try:
            drafts, probs = self.speculator.propose(self.scheduler)
        except Exception:
            logger.exception("proposing drafts failed; this step goes without")
            for req in self.scheduler.running:
                self.speculator.forget(req.request_id)
            return
        self.scheduler.update_draft_token_ids(drafts, probs)

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
            if u.num_drafts and self.speculator is not None:
                req.spec_stats.record(u.num_drafts, u.num_accepted)
                self.stats.spec_stats.record(u.num_drafts, u.num_accepted)
            if (u.num_drafts or u.num_grammar_rejected) and self.speculator is not None:
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
            if out.metrics.spec_stats and self.speculator is not None:
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
