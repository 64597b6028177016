"""Bootstrap: what an engine checks and reads around loading a model. The checks that need
only config.json files (context length, KV cache, memory, the draft against the target,
--tokenizer), the default sampling of --generation-config and --override-generation-config,
the tokenizer given by --tokenizer, the target's loading, and the memory check once the
weights are in. `braid serve` runs the first ones at start, benchmarks on the flags they
pass."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from braid.config import ConfigError, EngineConfig
from braid.sampling_params import (
    GENERATION_DEFAULTS,
    SamplingParams,
    generation_defaults,
    hf_names,
)
from braid.spec_decode.build import check_draft
from braid.tokenizer import Tokenizer
from braid.worker.memory import (
    available_memory,
    kv_cache_blocks,
    refuse_beyond_memory,
    warn_beyond_available,
)

if TYPE_CHECKING:
    import torch

    from braid.core.scheduler import Scheduler
    from braid.models.config import ModelConfig
    from braid.models.interface import CausalLM
    from braid.worker.executor import InProcessExecutor

logger = logging.getLogger("braid")


def sampling_defaults(config: EngineConfig, folder: Path | None) -> dict[str, Any]:
    """--generation-config's default sampling: auto, the model `folder`'s (None: a model
    given in memory has none); vllm, none; else the folder it names; then
    --override-generation-config's values over them."""
    defaults = _generation_config(config, folder)
    if config.override_generation_config:
        unknown = sorted(set(config.override_generation_config) - set(GENERATION_DEFAULTS))
        if unknown:
            raise ConfigError(f"--override-generation-config: {', '.join(unknown)} is not one "
                              f"of {', '.join(GENERATION_DEFAULTS)}")
        override = {GENERATION_DEFAULTS[name]: value
                    for name, value in config.override_generation_config.items()}
        try:
            SamplingParams(**override)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--override-generation-config: {hf_names(str(e))}") from None
        defaults = {**defaults, **override}
        logger.info("default sampling: %s, for what a request leaves unset", defaults)
    return defaults


def _generation_config(config: EngineConfig, folder: Path | None) -> dict[str, Any]:
    choice = config.generation_config
    if choice == "vllm":
        return {}
    if choice != "auto":
        folder = Path(choice)
        if not (folder / "generation_config.json").is_file():
            raise ConfigError(f"--generation-config {choice}: expected auto, vllm or a folder "
                              "holding a generation_config.json")
    if folder is None:
        return {}
    try:
        defaults = generation_defaults(folder)
    except ValueError as e:
        raise ConfigError(f"--generation-config: {e}") from None
    if defaults:
        logger.info("default sampling from %s: %s, for what a request leaves unset "
                    "(--generation-config vllm: none)", folder / "generation_config.json",
                    defaults)
    return defaults


class Checked(NamedTuple):
    folder: Path  # the target's
    tokenizer: Tokenizer | None  # --tokenizer's, loaded to check it


def check_before_loading(config: EngineConfig, draft: bool = True) -> Checked:
    """The checks that need only the models' config.json files (and --tokenizer's), before
    any weight loads: --max-model-len against the model, the KV cache against --block-size
    and the machine's memory, the draft's vocabulary against the target's (unless `draft` is
    False: a draft model given as an object), --tokenizer's against the target's.
    ConfigError or ModelLoadError naming what is wrong. `braid serve` runs them at start,
    benchmarks on the serve flags they pass (`check_serve_flags`)."""
    from braid.files import ModelLoadError
    from braid.models.build import loads_quantized
    from braid.models.loader import folder_of, load_config, model_folder, resolve_model_path

    path = resolve_model_path(config.model)
    folder = folder_of(path)
    model_config = load_config(folder)
    config.finalize(model_config.max_context, model_config.context_limit)
    quantized = loads_quantized(path, config.quantization)
    kv_cache_blocks(config, model_config, config.kv_dtype(config.torch_dtype, quantized))
    spec = config.spec_config
    if draft and spec is not None and spec.model is not None:
        try:
            draft_config = load_config(model_folder(spec.model))
        except ModelLoadError as e:
            raise ModelLoadError(f"--speculative-config model: {e}") from None
        check_draft(config, model_config, draft_config)
    tokenizer = (None if config.tokenizer is None
                 else load_tokenizer(config.tokenizer, model_config.vocab_size))
    return Checked(folder, tokenizer)


def load_tokenizer(name_or_path: str, vocab_size: int) -> Tokenizer:
    """--tokenizer's: a folder with tokenizer.json (config.json not needed), a GGUF file or a
    default model's name, with no more tokens than the model's vocabulary has rows."""
    from braid.files import ModelLoadError
    from braid.models.loader import model_folder

    folder = Path(name_or_path).expanduser()
    try:
        if not (folder / "tokenizer.json").is_file():
            folder = model_folder(name_or_path)
        tokenizer = Tokenizer.from_folder(folder)
    except ModelLoadError as e:
        raise ConfigError(f"--tokenizer {name_or_path}: {e}") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"--tokenizer {name_or_path}: its {tokenizer.vocab_size} tokens are "
                          f"more than the model's vocabulary ({vocab_size})")
    return tokenizer


def warn_without_tokenizer(model: str, folder: Path) -> None:
    from braid.models.gguf_loader import NO_TOKENIZER

    why = folder / NO_TOKENIZER
    reason = why.read_text().strip() if why.is_file() else "no tokenizer.json"
    logger.warning("%s: %s; it runs without a tokenizer, on token ids only (give one with "
                   "--tokenizer)", model, reason)


def eos_token_ids(model: CausalLM, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The tokenizer's end-of-sequence ids, or without one the model config's."""
    if tokenizer is not None:
        return frozenset(tokenizer.eos_token_ids)
    eos = model.config.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else eos or [])


def set_threads(threads: int) -> None:
    """torch's intra-op threads (--num-threads), with a warning where they outnumber the
    cores this process may use."""
    import torch

    torch.set_num_threads(threads)
    cores = len(os.sched_getaffinity(0))
    if threads > cores:
        logger.warning("--num-threads %d is more than the %d cores this process may use: the "
                       "threads share them and every step slows down", threads, cores)


class Target(NamedTuple):
    model: CausalLM
    tokenizer: Tokenizer | None
    sampling_defaults: dict[str, Any]  # what requests leave unset (sampling_defaults)


def load_target(config: EngineConfig, draft: bool) -> Target:
    """The target model and its tokenizer (or --tokenizer's), after the checks that need only
    config.json files (`draft`: the draft model's too)."""
    from braid.models.build import load_model

    checked = check_before_loading(config, draft=draft)
    defaults = sampling_defaults(config, checked.folder)
    model, tokenizer = load_model(config.model, config.torch_dtype, config.device,
                                  config.quantization, with_tokenizer=checked.tokenizer is None,
                                  max_model_len=config.max_model_len)
    if checked.tokenizer is not None:
        tokenizer = checked.tokenizer
    elif tokenizer is None:
        warn_without_tokenizer(config.model, checked.folder)
    return Target(model, tokenizer, defaults)


def make_executor(config: EngineConfig, model: CausalLM, num_blocks: int,
                  kv_dtype: torch.dtype, eos_token_ids: frozenset[int]) -> InProcessExecutor:
    """This process's executor: the whole model, or a pipeline's first stage
    (--pipeline-parallel-size) with the later stages in processes of their own."""
    from braid.worker.executor import InProcessExecutor
    from braid.worker.pipeline import PipelineExecutor

    kind = PipelineExecutor if config.pipeline_parallel_size > 1 else InProcessExecutor
    return kind(config, model, num_blocks, kv_dtype, eos_token_ids)


def check_memory(config: EngineConfig, weight_and_kv_bytes: tuple[int, int]) -> None:
    """The weights and KV caches (bytes, the draft model's included: the executor's)
    against the machine's memory. The KV caches are mapped, not yet touched: one too large
    would fail under load, not here, so it is refused now."""
    if not config.device.startswith("cpu"):
        return
    weights, kv = weight_and_kv_bytes
    flag = "--kv-cache-gib" if config.num_kv_blocks is None else "--num-kv-blocks"
    refuse_beyond_memory(kv + weights, f"{flag}: the weights and KV caches (the draft's "
                         "included) take {:.1f} GiB, which does not")
    # the weights are resident by now, the caches not yet
    warn_beyond_available(kv, flag, available_memory())


def make_scheduler(config: EngineConfig, num_blocks: int, model_config: ModelConfig
                   ) -> Scheduler:
    """The scheduler over a block manager of `num_blocks` KV blocks, as the config asks (a
    block table per layer group where the model mixes global and windowed layers)."""
    from braid.core.block_manager import BlockManager
    from braid.core.kv_groups import GroupedBlocks
    from braid.core.scheduler import Scheduler
    from braid.models.kv_layout import kv_layout
    from braid.worker.step import max_scored_rows

    assert config.max_num_batched_tokens is not None
    layout = kv_layout(model_config, config)
    blocks = (GroupedBlocks(num_blocks, config.block_size, config.enable_prefix_caching,
                            layout.windows, config.max_num_batched_tokens) if layout.hybrid
              else BlockManager(num_blocks, config.block_size, config.enable_prefix_caching))
    return Scheduler(
        blocks, config.max_num_batched_tokens, config.max_num_seqs,
        config.enable_chunked_prefill, priority=config.scheduling_policy == "priority",
        max_scored_rows=max_scored_rows(model_config.vocab_size))
