"""Builds the speculator an engine config asks for: the proposer (n-gram, or a draft model
loaded here unless one is given), the policy's state, and its warm-up forwards."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
import torch

from braid.config import ConfigError, EngineConfig
from braid.core.request import Request
from braid.core.scheduler import Scheduler
from braid.models.config import ModelConfig
from braid.models.interface import CausalLM
from braid.models.qwen2 import native_bf16
from braid.spec_decode.draft import DraftModelProposer
from braid.spec_decode.ngram import NgramProposer
from braid.spec_decode.proposer import Proposer
from braid.spec_decode.speculator import Speculation, Speculator
from braid.spec_decode.suffix import SuffixProposer, SuffixSettings
from braid.tokenizer import Tokenizer
from braid.worker.executor import InProcessExecutor

logger = logging.getLogger("braid")

TOKEN_SAMPLE = 1000  # token ids compared between the draft's tokenizer and the target's


def make_speculator(cfg: EngineConfig, executor: InProcessExecutor, scheduler: Scheduler,
                    draft: CausalLM | None = None, tokenizer: Tokenizer | None = None,
                    unsent: Callable[[Request], list[int]] = lambda req: []) -> Speculation:
    """Speculation off (the base class) without `speculative_config`. A draft model (loaded
    here unless given) runs behind `executor` and must share `tokenizer`, the target's;
    `unsent`: a request's outputs the executor has not been sent yet (StepInputs.unsent)."""
    spec = cfg.spec_config
    if spec is None:
        return Speculation()
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "suffix":
        proposer = SuffixProposer(SuffixSettings.of(spec))
    else:
        draft = draft or _load_draft(cfg, tokenizer)
        check_draft(cfg, executor.runner.model.config, draft.config)
        executor.start_draft(draft, spec, cfg.kv_dtype(draft.dtype, draft.quant_type is not None))
        proposer = DraftModelProposer(executor, draft.config, scheduler.blocks, unsent)
    assert cfg.max_model_len is not None
    speculator = Speculator(spec, proposer, cfg.max_model_len,
                            None if cfg.target_itl_ms is None else cfg.target_itl_ms / 1e3)
    speculator.warm_up(executor.runner, scheduler)
    return speculator


def check_draft(cfg: EngineConfig, target: ModelConfig, draft: ModelConfig) -> None:
    """A ConfigError where the draft model cannot draft for the target (the engine also runs
    this on the two config.json files before loading either)."""
    spec = cfg.spec_config
    assert spec is not None
    vocab = target.vocab_size
    if draft.vocab_size != vocab:
        raise ConfigError(f"--speculative-config: the draft model's vocabulary ("
                          f"{draft.vocab_size} tokens) differs from the target's ({vocab})")
    if spec.draft_vocab_size is not None and spec.draft_vocab_size > vocab:
        raise ConfigError(f"--speculative-config: draft_vocab_size {spec.draft_vocab_size} "
                          f"exceeds the vocabulary ({vocab} tokens)")
    # the draft reads positions up to the target's last (its rotary table ends at its own)
    if cfg.max_model_len is not None and draft.max_context < cfg.max_model_len:
        raise ConfigError(f"--speculative-config: the draft model's context "
                          f"({draft.max_context} tokens) is shorter than "
                          f"--max-model-len {cfg.max_model_len}; lower --max-model-len")


def check_draft_tokenizer(target: Tokenizer | None, draft_folder: Path) -> None:
    """A ConfigError where the draft's tokenizer gives a token another id than the target's:
    another size, or any token of a sample (TOKEN_SAMPLE ids spread over the vocabulary, and
    the last ones, where added and special tokens sit). The draft proposes ids, so they must
    mean the target's tokens. Nothing to compare without a tokenizer on either side (a
    warning where the draft's cannot be read)."""
    file = draft_folder / "tokenizer.json"
    if target is None or not file.is_file():
        return
    if target.file is not None and target.file.read_bytes() == file.read_bytes():
        return  # the same file (the default pair's): ~10 ms against ~0.3 s to compare ids
    try:
        draft = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception
        logger.warning("--speculative-config model: cannot read %s (%s); the draft's "
                       "vocabulary is taken to be the target's", file, e)
        return
    size = draft.get_vocab_size(with_added_tokens=True)
    if size != target.vocab_size:
        raise ConfigError(f"--speculative-config: the draft model's tokenizer has {size} "
                          f"tokens, the target's {target.vocab_size}: they must be the same")
    step = max(1, size // TOKEN_SAMPLE)
    for token_id in [*range(0, size, step), *range(max(0, size - TOKEN_SAMPLE), size)]:
        ours, theirs = target.backend.id_to_token(token_id), draft.id_to_token(token_id)
        if ours != theirs:
            raise ConfigError(f"--speculative-config: token id {token_id} is {theirs!r} in the "
                              f"draft model's tokenizer but {ours!r} in the target's: the "
                              "draft must share the target's tokenizer")


def _load_draft(cfg: EngineConfig, tokenizer: Tokenizer | None) -> CausalLM:
    from braid.models.build import load_model
    from braid.models.loader import model_folder

    spec = cfg.spec_config
    assert spec is not None and spec.model is not None
    check_draft_tokenizer(tokenizer, model_folder(spec.model))
    dtype = resolve_draft_dtype(spec.draft_dtype, cfg.torch_dtype, cfg.device)
    draft, _ = load_model(spec.model, dtype, cfg.device, spec.quantization or cfg.quantization,
                          dtype_given=spec.draft_dtype != "auto" or cfg.dtype != "auto",
                          with_tokenizer=False, max_model_len=cfg.max_model_len)
    return draft


def resolve_draft_dtype(name: str, target_dtype: Any, device: str = "cpu") -> Any:
    """A draft dtype name -> torch dtype; "auto" is bfloat16 where the CPU runs it natively
    and the target is float32, else the target's dtype."""
    if name != "auto":
        return getattr(torch, name)
    if (torch.device(device).type == "cpu" and target_dtype == torch.float32
            and native_bf16()):
        return torch.bfloat16
    return target_dtype
