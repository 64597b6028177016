"""The engine's one way to the tensors. An Executor runs a step's forward and sampling over
what the scheduler decided, and keeps the draft's probabilities until the window that
verifies them; the engine orchestrates and never touches a tensor itself.

A step comes as a `StepInput` and goes back as a `StepResult` (step_io.py): plain records
that pickle, so an executor may run the model in other processes or on other machines
([M15]) behind this same interface. `InProcessExecutor` runs it in this process: the one
implementation today."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from braid.config import EngineConfig
from braid.models.interface import CausalLM
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
    def set_draft_probs(self, probs: Mapping[str, torch.Tensor],
                        drafts: Mapping[str, list[int]], cuts: Mapping[str, int]) -> None:
        """The q [k, V] of the drafts just proposed, by request id (StepSampler's)."""

    @property
    @abstractmethod
    def weight_and_kv_bytes(self) -> tuple[int, int]:
        """The target's weights and KV cache, in bytes (the memory check)."""

    def shutdown(self) -> None:  # noqa: B027 - nothing to release in process
        """Release what it holds (processes, connections)."""


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig, model: CausalLM, num_blocks: int,
                 kv_dtype: torch.dtype, eos_token_ids: frozenset[int]) -> None:
        device = torch.device(config.device)
        self.runner = ModelRunner(model, num_blocks, config.block_size, device, kv_dtype)
        self.sampler = StepSampler(device, eos_token_ids, config.spec_config)
        self.requests: dict[str, WorkerRequest] = {}  # by request id, until it finishes

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

    def set_draft_probs(self, probs: Mapping[str, torch.Tensor],
                        drafts: Mapping[str, list[int]], cuts: Mapping[str, int]) -> None:
        self.sampler.set_draft_probs(probs, drafts, cuts)

    @property
    def weight_and_kv_bytes(self) -> tuple[int, int]:
        return self.runner.weight_and_kv_bytes
