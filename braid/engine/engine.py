"""The engine: add_request / step / abort over one scheduler, one runner and one sampler."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from braid.config import ConfigError, EngineConfig
from braid.engine.block_manager import BlockManager
from braid.engine.output import OutputProcessor
from braid.engine.request import Request
from braid.engine.runner import ModelRunner, kv_bytes_per_token, prompt_logprob_rows
from braid.engine.sampler import Sampler, SamplingMetadata, gather_logprobs
from braid.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from braid.engine.stats import EngineStats, StepStats
from braid.models.qwen2 import Qwen2ForCausalLM
from braid.outputs import RequestOutput
from braid.sampling_params import SamplingParams
from braid.spec_decode.build import make_speculator
from braid.spec_decode.cost_model import attention_work
from braid.spec_decode.rejection_sampler import rejection_sample
from braid.spec_decode.speculator import SpeculatorFigures
from braid.tokenizer import Tokenizer

logger = logging.getLogger("braid")


class RequestError(ValueError):
    """A request the engine cannot serve (too long, bad ids); the message names the field."""


@dataclass(slots=True)
class _Sampled:
    """What one step produced for one scheduled request."""

    scheduled: ScheduledRequest
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: Qwen2ForCausalLM | None = None,
        tokenizer: Tokenizer | None = None,
        draft_model: Qwen2ForCausalLM | None = None,
    ) -> None:
        torch.set_num_threads(config.threads)
        if model is None:
            from braid.models.build import load_model

            model, tokenizer = load_model(config.model, config.torch_dtype, config.device,
                                          config.quantization)
        config.finalize(model.config.max_position_embeddings)
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.device = torch.device(config.device)
        num_blocks = self._num_kv_blocks(model)
        self.blocks = BlockManager(num_blocks, config.block_size)
        assert config.max_num_batched_tokens is not None
        self.scheduler = Scheduler(
            self.blocks, config.max_num_batched_tokens, config.max_num_seqs,
            config.enable_chunked_prefill,
        )
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.device)
        self.sampler = Sampler()
        self.outputs = OutputProcessor(tokenizer, self._eos_token_ids(model),
                                       config.max_model_len or 0)
        self.speculator = make_speculator(config, self.runner, self.scheduler, draft_model)
        self.stats = EngineStats(num_kv_blocks=num_blocks)
        self._generator = torch.Generator().manual_seed(config.seed)

    def _num_kv_blocks(self, model: Qwen2ForCausalLM) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            num = cfg.num_kv_blocks
        else:
            per_block = kv_bytes_per_token(model, cfg.torch_dtype) * cfg.block_size
            num = int(cfg.kv_cache_gib * 2**30 // per_block)
        assert cfg.max_model_len is not None
        if num * cfg.block_size < cfg.max_model_len:
            raise ConfigError(
                f"KV cache of {num} blocks holds fewer than --max-model-len "
                f"({cfg.max_model_len}) tokens: raise --kv-cache-gib or --num-kv-blocks")
        return num

    def _eos_token_ids(self, model: Qwen2ForCausalLM) -> frozenset[int]:
        if self.tokenizer is not None:
            return frozenset(self.tokenizer.eos_token_ids)
        eos = model.config.eos_token_id
        return frozenset([eos] if isinstance(eos, int) else eos or [])

    # ---- request API -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        params = sampling_params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        self._check_prompt(ids, params)
        req = Request(request_id, ids, params, prompt=text)
        if arrival_time is not None:
            req.arrival_time = arrival_time
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
        sched = self.scheduler.schedule(self._prefill_cap())
        if sched.is_empty:
            return []
        context = sum(s.request.num_computed_tokens for s in sched.scheduled)
        attention = sum(attention_work(s.num_new_tokens, s.request.num_computed_tokens)
                        for s in sched.scheduled)
        rows = sum(1 + s.num_spec_tokens for s in sched.scheduled if s.needs_logits)
        inp = self.runner.prepare(sched, self.blocks)
        logits = self.runner.execute(inp)
        forward_time = time.perf_counter() - start
        self._score_prompts(sched, logits[: inp.num_prompt_rows])
        logits = logits[inp.num_prompt_rows :]
        sampled = self._sample(sched, logits)
        outputs = self._update(sched, sampled)
        target_time = time.perf_counter() - start
        if self.speculator is not None:
            self.speculator.observe_step(sched.num_batched_tokens, attention, rows, target_time)
        self._propose(sched)
        self._record(sched, context, forward_time, time.perf_counter() - start)
        return outputs

    def _prefill_cap(self) -> int | None:
        """The ITL target's prefill cap, computed for the step about to be scheduled (from
        the requests running and waiting now, so new arrivals always count)."""
        if self.speculator is None:
            return None
        return self.speculator.prefill_cap(self.scheduler)

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> list[_Sampled]:
        """One result per scheduled request, in scheduling order (`logits` holds the rows
        of those that sample, in that order)."""
        to_sample = [s for s in sched.scheduled if s.needs_logits]
        tokens: list[list[int]] = []
        if to_sample and any(s.num_spec_tokens for s in to_sample):
            tokens = self._verify(to_sample, logits)
        elif to_sample:
            out = self.sampler(logits, self._sampling_metadata(to_sample, logits))
            tokens = [[t] for t in out.sampled_token_ids.tolist()]
        logprobs = self._logprobs(to_sample, logits, tokens) if to_sample else None
        results, i = [], 0
        for s in sched.scheduled:
            if not s.needs_logits:
                results.append(_Sampled(s, [], None))
                continue
            results.append(_Sampled(s, tokens[i], None if logprobs is None else logprobs[i]))
            i += 1
        return results

    def _score_prompts(self, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        """Append prompt logprobs from `logits` [P, V]: the rows `prompt_logprob_rows` chose,
        in scheduling order (raw model logprobs, like sampled tokens' logprobs)."""
        if not logits.shape[0]:
            return
        r = 0
        for s in sched.scheduled:
            req = s.request
            rows = prompt_logprob_rows(req, s.num_new_tokens)
            if not rows:
                continue
            first = req.num_computed_tokens + rows.start  # position scoring token first + 1
            targets = torch.tensor(req.prompt_token_ids[first + 1 : first + 1 + len(rows)])
            n = req.sampling_params.prompt_logprobs or 0
            lp = gather_logprobs(logits[r : r + len(rows)].log_softmax(dim=-1), targets, n)
            ids, values = lp.token_ids.tolist(), lp.logprobs.tolist()
            req.prompt_logprobs += [dict(zip(i, v, strict=True)) for i, v in zip(ids, values,
                                                                                  strict=True)]
            r += len(rows)

    def _sampling_metadata(
        self, to_sample: list[ScheduledRequest], logits: torch.Tensor
    ) -> SamplingMetadata:
        """One row per window position; row j of a window sees its first j drafts as output
        (so penalties and min_tokens apply as if those drafts had been accepted)."""
        rows = [(s, j) for s in to_sample for j in range(1 + s.num_spec_tokens)]
        return SamplingMetadata.build(
            params=[s.request.sampling_params for s, _ in rows],
            prompt_token_ids=[s.request.prompt_token_ids for s, _ in rows],
            output_token_ids=[s.request.output_token_ids + s.request.spec_token_ids[:j]
                              for s, j in rows],
            generators=[s.request.generator if not s.num_spec_tokens else None for s, _ in rows],
            vocab_size=logits.shape[-1],
            device=self.device,
            eos_token_ids=self.outputs.eos_token_ids,
        )

    def _verify(self, to_sample: list[ScheduledRequest], logits: torch.Tensor) -> list[list[int]]:
        """Rejection sampling of every window (those with k = 0 are plain samples)."""
        out = rejection_sample(
            logits,
            [s.request.spec_token_ids[: s.num_spec_tokens] for s in to_sample],
            None,  # drafts are greedy / n-gram: q is one-hot
            self._sampling_metadata(to_sample, logits),
            [s.request.generator for s in to_sample],
        )
        ids = out.output_token_ids.tolist()
        return [row[: n + 1] for row, n in zip(ids, out.num_accepted.tolist(), strict=True)]

    def _logprobs(
        self, to_sample: list[ScheduledRequest], logits: torch.Tensor, tokens: list[list[int]]
    ) -> list[list[dict[int, float]]] | None:
        """{token: logprob} for each emitted token (raw model logprobs) and the top-n."""
        wanted = [s.request.sampling_params.logprobs for s in to_sample]
        if all(n is None for n in wanted):
            return None
        rows: list[int] = []
        starts = [0]
        for s, t in zip(to_sample, tokens, strict=True):
            rows += range(starts[-1], starts[-1] + len(t))
            starts.append(starts[-1] + 1 + s.num_spec_tokens)
        flat = [t for ts in tokens for t in ts]
        top = max(n or 0 for n in wanted)
        lp = gather_logprobs(logits[rows].log_softmax(dim=-1), torch.tensor(flat), top)
        ids, values = lp.token_ids.tolist(), lp.logprobs.tolist()
        out, r = [], 0
        for n, t in zip(wanted, tokens, strict=True):
            k = 1 + (n or 0)
            out.append([dict(zip(ids[r + j][:k], values[r + j][:k], strict=True))
                        for j in range(len(t))])
            r += len(t)
        return out

    def _propose(self, sched: SchedulerOutput) -> None:
        if self.speculator is None:
            return
        for rid in sched.preempted:
            self.speculator.forget(rid)
        self.scheduler.update_draft_token_ids(self.speculator.propose(self.scheduler))

    def _update(self, sched: SchedulerOutput, sampled: list[_Sampled]) -> list[RequestOutput]:
        """Hand the step's tokens to the scheduler, then the figures and outputs of every
        request that emitted some."""
        updates = self.scheduler.update_from_output(
            sched, [r.token_ids for r in sampled], self._check_stop)
        logprobs = {id(r.scheduled.request): r.logprobs for r in sampled}
        outputs = []
        for u in updates:
            req = u.request
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if (lp := logprobs[id(req)]) is not None:
                self.outputs.add_logprobs(req, lp[: u.num_new_tokens])
            if u.num_drafts and self.speculator is not None:
                req.spec_stats.record(u.num_drafts, u.num_accepted)
                self.stats.spec_stats.record(u.num_drafts, u.num_accepted)
                self.speculator.on_verified(req, u.num_drafts, u.num_accepted)
            self.stats.add_generated(u.num_new_tokens)
            if u.finish_reason is not None:
                self._release(req)
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
        ))
        self.stats.maybe_log(self.config.log_stats_interval)

    def run_until_done(self) -> Iterator[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()
