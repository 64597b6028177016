"""Build a ready model (weights loaded) and its tokenizer from a name or path."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from braid.models.config import ModelConfig
from braid.models.errors import ModelLoadError
from braid.models.loader import model_folder, safetensors_files
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
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    model.rotary.reset()
    model.load_weights(_iter_weights(folder))
    if can_pack(device, dtype):
        model.pack_linear_weights()
    tokenizer = Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file() else None
    logger.info("loaded %s (%s, %.2f B params) in %.1f s", name_or_path, cfg.architecture,
                sum(p.numel() for p in model.parameters()) / 1e9, time.perf_counter() - start)
    return model.eval(), tokenizer


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64}


def _iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of the folder's safetensors files, read one at a time with plain file reads:
    unlike a memory map, the file's pages never count toward this process's memory, so the
    peak stays at one model plus the largest tensor."""
    files = safetensors_files(folder)
    with tqdm(desc="Loading weights", unit="tensor", leave=False) as bar:
        for file in files:
            for name, tensor in _read_safetensors(file):
                yield name, tensor
                bar.update(1)


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if info["dtype"] not in _DTYPES:
                raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            start, end = info["data_offsets"]
            f.seek(8 + size + start)
            buf = tensor.view(-1).view(torch.uint8).numpy()
            if end - start != buf.nbytes or f.readinto(buf.data) != buf.nbytes:
                raise ModelLoadError(f"{path}: tensor {name} is truncated")
            yield name, tensor
