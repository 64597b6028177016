"""Build a ready model (weights loaded) and its tokenizer from a name or path."""

from __future__ import annotations

import logging
import time

import torch

from braid.models.loader import iter_weights, load_config, model_folder
from braid.models.qwen2 import Qwen2ForCausalLM, can_pack
from braid.tokenizer import Tokenizer

logger = logging.getLogger("braid")


def load_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Qwen2ForCausalLM, Tokenizer | None]:
    """Model (weights copied tensor by tensor into uninitialized parameters, so the peak is
    one model plus one tensor) and its tokenizer (None if the folder has none)."""
    start = time.perf_counter()
    folder = model_folder(name_or_path)
    cfg = load_config(folder)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    model.rotary.reset()
    model.load_weights(iter_weights(folder))
    if can_pack(device, dtype):
        model.pack_linear_weights()
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    logger.info("loaded %s (%s, %.2f B params) in %.1f s", name_or_path, cfg.architecture,
                sum(p.numel() for p in model.parameters()) / 1e9, time.perf_counter() - start)
    return model.eval(), tokenizer
