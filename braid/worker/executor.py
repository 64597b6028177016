"""The engine's one way to the tensors. An Executor runs a step's forward and sampling over
what the scheduler decided, and the draft model's forwards over the spans the proposer names,
keeping the draft's probabilities until the window that verifies them; the engine
orchestrates and never touches a tensor itself.

A step comes as a `StepInput` and goes back as a `StepResult` (step_io.py): plain records
that pickle, so an executor may run the model in other processes or on other machines
([M15]) behind this same interface. `InProcessExecutor` runs it in this process: the one
implementation today."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import torch

from braid.config import EngineConfig, SpecConfig
from braid.models.interface import CausalLM
from braid.models.kv_layout import kv_layout
from braid.worker.draft import DraftResult, DraftSpan, DraftWorker
from braid.worker.runner import ModelRunner
from braid.worker.step import StepSampler, WorkerRequest, score_prompts
from braid.worker.step_io import StepInput, StepResult


class Executor(ABC):
    @abstractmethod
    def execute(self, step: StepInput) -> StepResult:
        """One forward over `step` and its sampling. It writes KV only into the slots the
        scheduler reserved and changes no scheduling state, so a step that raised can run
        again in parts (braid/engine/isolation.py): the requests and outputs a step brings
        are taken in before anything that can fail."""

    @abstractmethod
    def start_draft(self, model: CausalLM, spec: SpecConfig, kv_dtype: torch.dtype) -> None:
        """Run `model` as the draft model (its own KV cache on the target's block layout)."""

    @abstractmethod
    def propose_drafts(self, spans: list[DraftSpan]) -> DraftResult:
        """The draft model's drafts for each span (DraftWorker.propose); the q rows of
        sampled ones stay here until `set_drafts`."""

    @abstractmethod
    def set_drafts(self, drafts: Mapping[str, list[int]], cuts: Mapping[str, int]) -> None:
        """The drafts the next step verifies, by request id (those of every running request:
        they replace the last ones), and where a grammar cut them
        (Scheduler.update_draft_token_ids): the draft model's q rows of those it drafted go
        to the sampler (StepSampler.set_draft_probs)."""

    @property
    @abstractmethod
    def weight_and_kv_bytes(self) -> tuple[int, int]:
        """The weights and KV caches, in bytes, the draft model's included (the memory
        check)."""

    @property
    def draft_runner(self) -> ModelRunner | None:
        """The draft model's runner where it runs in this process (warm-up timing)."""
        return None

    @property
    def draft_coarse_head(self) -> bool:
        """Whether the draft's greedy forwards take its two-stage LM head."""
        return False

    def shutdown(self) -> None:  # noqa: B027 - nothing to release in process
        """Release what it holds (processes, connections)."""


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, model: CausalLM, num_blocks: int,
                 kv_dtype: torch.dtype, eos_token_ids: frozenset[int],
                 runner: ModelRunner | None = None) -> None:
        """runner: the target's (default: a ModelRunner of `model`; a pipeline's)."""
        device = torch.device(config.device)
        self.runner = runner or ModelRunner(model, num_blocks, config.block_size, device,
                                            kv_dtype, layout=kv_layout(model.config, config))
        self.sampler = StepSampler(device, eos_token_ids, config.spec_config)
        self.requests: dict[str, WorkerRequest] = {}  # by request id, until it finishes
        self.block_size, self.num_blocks = config.block_size, num_blocks
        self.eos_token_ids = eos_token_ids
        self.draft: DraftWorker | None = None
        # A request's live grammar by id (None: none), for the draft's rows: the engine's
        # objects, which only an executor in its process can read (one elsewhere drafts such
        # requests unconstrained: drafts the target's grammar then cuts, never wrong tokens)
        self.grammar_of: Callable[[str], Any] = lambda request_id: None

    def execute(self, step: StepInput) -> StepResult:
        self._take_in(step)
        inp = self.runner.build_input([s.query for s in step.spans])
        logits = self.runner.execute(inp)
        forward_end = time.perf_counter()
        prompt_logprobs = score_prompts(step.spans, self.requests,
                                        logits[: inp.num_prompt_rows])
        samples = self.sampler.sample(step.spans, self.requests, logits[inp.num_prompt_rows :])
        return StepResult(prompt_logprobs, samples, forward_end)

    def _take_in(self, step: StepInput) -> None:
        for request_id in step.finished:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            self.requests[new.request_id] = WorkerRequest(
                new.prompt_token_ids, new.sampling_params, new.seed)
        for s in step.spans:
            self.requests[s.request_id].output_token_ids += s.new_output_ids

    def start_draft(self, model: CausalLM, spec: SpecConfig, kv_dtype: torch.dtype) -> None:
        self.draft = DraftWorker(model, self.num_blocks, self.block_size, self.runner.device,
                                 spec, kv_dtype, self.eos_token_ids)

    def propose_drafts(self, spans: list[DraftSpan]) -> DraftResult:
        assert self.draft is not None, "no draft model (start_draft)"
        return self.draft.propose(spans, self.requests, self.grammar_of)

    def set_drafts(self, drafts: Mapping[str, list[int]], cuts: Mapping[str, int]) -> None:
        self.sampler.set_draft_probs({} if self.draft is None else self.draft.take_probs(drafts),
                                     drafts, cuts)

    @property
    def weight_and_kv_bytes(self) -> tuple[int, int]:
        weights, kv = self.runner.weight_and_kv_bytes
        if self.draft is not None:
            draft_weights, draft_kv = self.draft.runner.weight_and_kv_bytes
            weights, kv = weights + draft_weights, kv + draft_kv
        return weights, kv

    @property
    def draft_runner(self) -> ModelRunner | None:
        return None if self.draft is None else self.draft.runner

    @property
    def draft_coarse_head(self) -> bool:
        return self.draft is not None and self.draft.coarse_head
