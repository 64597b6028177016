"""Build a ready model (weights loaded) and its tokenizer from a name or path."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from braid.kernels import quant_ops
from braid.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from braid.models.gemma3 import Gemma3ForCausalLM
from braid.models.gguf_loader import iter_gguf_weights, quantized_types
from braid.models.loader import folder_of, iter_weights, load_config, resolve_model_path
from braid.models.olmo2 import Olmo2ForCausalLM
from braid.models.quant import QuantWeight, float_quant_type
from braid.models.qwen2 import Qwen2ForCausalLM, RotaryEmbedding, can_pack
from braid.tokenizer import Tokenizer

logger = logging.getLogger("braid")

Weights = Iterator[tuple[str, torch.Tensor | QuantWeight]]
# config.json's architecture -> the model class that runs it (models/config.py reads it)
FAMILIES: dict[str, type[Qwen2ForCausalLM]] = {
    name: Qwen2ForCausalLM for name in SUPPORTED_ARCHITECTURES} | {
    "gemma3": Gemma3ForCausalLM, "olmo2": Olmo2ForCausalLM, "olmo3": Olmo2ForCausalLM}


def load_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    quantization: str = "auto", dtype_given: bool = True, with_tokenizer: bool = True,
    max_model_len: int | None = None,
) -> tuple[Qwen2ForCausalLM, Tokenizer | None]:
    """Model (weights copied tensor by tensor into uninitialized parameters, so the peak is
    one model plus one tensor) and its tokenizer (None if the folder has none, or without
    `with_tokenizer`: a draft's, or where --tokenizer gives one, is never used).

    quantization: "auto" runs a GGUF's quantized blocks as they are (float checkpoints stay
    float), "none" dequantizes everything to `dtype`, "int8" / "int4" quantize a float
    checkpoint's weights to Q8_0 / Q4_0 blocks at load ("int4" on a GGUF re-quantizes the
    decoder layers stored wider than Q4_0, see Qwen2ForCausalLM._quantized). `dtype_given`:
    asked for by hand (a default needs no note that quantized weights run in float32).
    `max_model_len`: the longest sequence it will run (LongRoPE's choice of factors, see
    ModelConfig.context_length)."""
    start = time.perf_counter()
    path = resolve_model_path(name_or_path)
    folder = folder_of(path)
    cfg = replace(load_config(folder), context_length=max_model_len)
    if cfg.long_rope:
        logger.info("%s: LongRoPE with its long factors (--max-model-len %d exceeds the "
                    "original context, %d)", name_or_path, cfg.context_length or
                    cfg.max_position_embeddings,
                    (cfg.rope_scaling or {})["original_max_position_embeddings"])
    quant_type, weights = _weights(path, cfg, quantization, device)
    if quant_type is not None:
        if dtype != torch.float32 and dtype_given:
            logger.info("%s: its quantized weights run with float32 activations (the kernels "
                        "take and give float32); %s applies to float weights "
                        "(--quantization none)", name_or_path, dtype)
        dtype = torch.float32  # the kernels take and give float32 activations
    with torch.device("meta"):
        model = FAMILIES[cfg.architecture](cfg, quant_type).to(dtype)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset()
    model.load_weights(weights)
    if quant_type is None and can_pack(device, dtype):
        model.pack_linear_weights()
    tokenizer = (Tokenizer.from_folder(folder)
                 if with_tokenizer and (folder / "tokenizer.json").is_file() else None)
    release_freed_memory()
    params = cfg.num_parameters()
    logger.info("loaded %s (%s, %s params, %s, %.2f GB of weights) in %.1f s",
                name_or_path, cfg.architecture,
                f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M",
                "float" if quant_type is None else "quantized", model.weight_bytes() / 1e9,
                time.perf_counter() - start)
    return model.eval(), tokenizer


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim). Loading copies
    each weight through buffers of a few MB (the file's bytes, repacked panels, merged
    projections) that glibc's heap keeps, resident, once freed."""
    with contextlib.suppress(OSError, AttributeError):  # another C library: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _weights(path: Path, cfg: ModelConfig, quantization: str, device: str | torch.device
             ) -> tuple[GGMLQuantizationType | None, Weights]:
    """The model's quantization (the block format float tensors get, None: float) and its
    weights."""
    quant_type = None
    if loads_quantized(path, quantization):
        quant_type = float_quant_type(quantization) or GGMLQuantizationType.Q8_0
    elif (path.is_file() and quantization == "auto" and torch.device(device).type == "cpu"
          and quant_ops() is not None):
        logger.info("%s holds float weights (F16/BF16/F32), which run as floats of "
                    "--dtype; --quantization int8 runs them as Q8_0 blocks on the "
                    "quantized kernels instead (~1 byte a value, decode several times "
                    "faster than float32)", path.name)
    if quant_type is not None and not _kernels_for(device):
        quant_type = None
    if path.is_file():
        return quant_type, iter_gguf_weights(path, cfg, quantized=quant_type is not None)
    return quant_type, iter_weights(path)


def loads_quantized(path: Path, quantization: str) -> bool:
    """Whether `load_model` gives the model at `path` quantized weights (where the CPU
    kernels build): --quantization int8 / int4, or a GGUF holding quantized tensors unless
    --quantization none."""
    if quantization in ("int8", "int4"):
        return True
    return path.is_file() and quantization != "none" and bool(quantized_types(path))


def _kernels_for(device: str | torch.device) -> bool:
    """Quantized weights run on the CPU kernels; without them (another device, no compiler)
    the model loads in float instead."""
    if torch.device(device).type != "cpu":
        logger.warning("quantized kernels run on the CPU only: loading float weights on %s",
                       device)
        return False
    return quant_ops() is not None
