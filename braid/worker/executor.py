"""The engine's one way to the tensors. An Executor runs a step's forward and sampling over
what the scheduler decided, and keeps the draft's probabilities until the window that
verifies them; the engine orchestrates and never touches a tensor itself.

`InProcessExecutor` runs the model in this process: the one implementation today. Running it
in other processes or on other machines ([M15]) goes behind the same interface; a step's
input is still the scheduler's own records (requests by reference), which such an executor
will have to turn into plain, picklable ones first."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from braid.config import EngineConfig
from braid.core.block_manager import BlockManager
from braid.core.scheduler import SchedulerOutput
from braid.models.interface import CausalLM
from braid.outputs import PackedLogprobs
from braid.worker.runner import ModelRunner
from braid.worker.step import StepSample, StepSampler, score_prompts


@dataclass(slots=True)
class StepResult:
    """What a step computed: prompt logprobs by request id, and each scheduled request's
    sample (by the identity of its ScheduledRequest)."""

    prompt_logprobs: dict[str, PackedLogprobs] = field(default_factory=dict)
    samples: dict[int, StepSample] = field(default_factory=dict)
    forward_end: float = 0.0  # time.perf_counter() when its (last) forward ended

    def merge(self, other: StepResult) -> None:
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.samples.update(other.samples)

    def in_order(self, sched: SchedulerOutput) -> list[StepSample]:
        return [self.samples[id(s)] for s in sched.scheduled]


class Executor(ABC):
    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """One forward over `sched` and its sampling. It writes KV only into the slots the
        scheduler reserved and changes no scheduling state, so a step that raised can run
        again in parts (braid/engine/isolation.py)."""

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
    def __init__(self, config: EngineConfig, model: CausalLM, blocks: BlockManager,
                 kv_dtype: torch.dtype, eos_token_ids: frozenset[int]) -> None:
        device = torch.device(config.device)
        self.runner = ModelRunner(model, blocks.num_blocks, config.block_size, device, kv_dtype)
        self.sampler = StepSampler(device, eos_token_ids, config.spec_config)
        self.blocks = blocks

    def execute(self, sched: SchedulerOutput) -> StepResult:
        inp = self.runner.prepare(sched, self.blocks)
        logits = self.runner.execute(inp)
        forward_end = time.perf_counter()
        prompt_logprobs = score_prompts(sched, logits[: inp.num_prompt_rows])
        sampled = self.sampler.sample(sched, logits[inp.num_prompt_rows :])
        return StepResult(prompt_logprobs, {id(r.scheduled): r for r in sampled}, forward_end)

    def set_draft_probs(self, probs: Mapping[str, torch.Tensor],
                        drafts: Mapping[str, list[int]], cuts: Mapping[str, int]) -> None:
        self.sampler.set_draft_probs(probs, drafts, cuts)

    @property
    def weight_and_kv_bytes(self) -> tuple[int, int]:
        return self.runner.weight_and_kv_bytes
