"""GGUF files: metadata -> a cached Hugging Face style folder (config.json, tokenizer files),
and the weights read straight from the GGUF each load, quantized blocks as they are or
dequantized to float.

The folder is written once per GGUF content (keyed by its sha256) to a temporary folder that
is renamed into place, so an interrupted conversion never leaves a half cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from braid.files import ModelLoadError, cache_root
from braid.models.config import (
    GEMMA3_GLOBAL_EVERY,
    GEMMA3_LOCAL_ROPE_THETA,
    OLMO3_GLOBAL_EVERY,
    SLIDING_WINDOW_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    gemma3_layer_types,
)
from braid.models.gguf_index import GGUFTensor, read_tensors
from braid.models.quant import QuantWeight, runnable

logger = logging.getLogger("braid")

ROPE_FREQS = "rope_freqs.weight"  # a llama3 GGUF's divisor of each rotary frequency
# A LongRoPE GGUF's (Phi-3.5, Phi-4-mini): the long and the short divisors
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = (ROPE_FREQS, ROPE_LONG, ROPE_SHORT)  # in the config, not weights
NO_TOKENIZER = "no-tokenizer.txt"  # in a conversion without a tokenizer: the reason

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k and v in one tensor
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",  # Gemma 3: after attention
    "post_ffw_norm": "post_feedforward_layernorm",  # and after the MLP
}
# Gemma 3's ffn_norm is the norm before its MLP (Llama's is after attention, the same place)
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {"ffn_norm": "pre_feedforward_layernorm"}
# OLMo 2's norms after attention and after the MLP (it has none before them)
_OLMO2_LAYER_NAMES = _LAYER_NAMES | {"attn_post_norm": "post_attention_layernorm",
                                     "ffn_post_norm": "post_feedforward_layernorm"}
LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES, "olmo2": _OLMO2_LAYER_NAMES,  # else _LAYER_NAMES
               "olmo3": _OLMO2_LAYER_NAMES}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Bump when the converted folder's content changes, so stale caches are not reused (older
# versions of the same GGUF's folder are removed: version 1 held 6 GB of float32 weights).
CONVERSION_VERSION = 5  # 4: SentencePiece tokenizers (such files had none), more pre-tokenizers;
# 5: partial rotary and LongRoPE (Phi-3.5, Phi-4-mini: before, their RoPE was read as plain)
Tensor = ReaderTensor | GGUFTensor
FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                         GGMLQuantizationType.BF16, GGMLQuantizationType.F64})
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


# ---------------------------------------------------------------------------------------------
# sha256 of a GGUF, remembered by (path, size, mtime) so a cached load does not re-hash GBs.


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}"
    ) as bar:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _index_file() -> Path:
    return cache_root() / "sha256-index.json"


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _read_index() -> dict[str, str]:
    try:
        return dict(json.loads(_index_file().read_text()))
    except (OSError, ValueError):
        return {}


def remember_sha256(path: Path, sha256: str) -> None:
    # Entries of files that no longer exist are dropped (keys are "path:size:mtime").
    index = {k: v for k, v in _read_index().items() if Path(k.rsplit(":", 2)[0]).exists()}
    index[_stat_key(path)] = sha256
    try:
        _write_atomic(_index_file(), json.dumps(index, indent=1).encode())
    except OSError as e:  # a read-only cache: the index only saves hashing next time
        logger.debug("cannot remember the sha256 of %s in %s (%s)", path, _index_file(), e)


def gguf_sha256(path: Path) -> str:
    sha = _read_index().get(_stat_key(path))
    if sha is None:
        sha = sha256_file(path)
        remember_sha256(path, sha)
    return sha


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Reading: metadata, config, tensor names.


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises assorted errors on short or garbled files
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from e


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    try:
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except UnicodeDecodeError as e:  # a string value that is not UTF-8
        raise ModelLoadError(f"GGUF {reader.data.filename}: metadata that is not UTF-8 "
                             f"text ({e})") from None


def hf_shape(tensor: Tensor) -> tuple[int, ...]:
    # GGUF lists dims fastest-first (ggml ne[]); PyTorch's [out_features, in_features] is reversed.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def hf_name(gguf_name: str, architecture: str = "") -> str:
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if part == "ffn_up" and architecture == "phi3":  # gate and up in one tensor
            return f"model.layers.{layer}.mlp.gate_up_proj.{kind}"
        names = LAYER_NAMES.get(architecture, _LAYER_NAMES)
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(
        f"unexpected GGUF tensor {gguf_name!r}: not part of a decoder braid runs"
    )


def _single_int(value: Any) -> int:
    """head_count_kv may be stored per layer; the model code supports one value for all layers."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"per-layer head counts {sorted(set(value))} are not supported")
        value = value[0]
    return int(value)


def _f32_to_float(value: Any) -> float:
    """GGUF stores float32: 1e-6 reads back as 9.99999997e-07; keep the short decimal HF uses."""
    return float(str(np.float32(value)))


def _architecture(meta: dict[str, Any], source: Path) -> str:
    """The GGUF's architecture, where braid runs it (else a ModelLoadError naming it)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {source}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(arch)


def config_from_metadata(
    meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: Path,
    rope_tensors: dict[str, list[float]] | None = None,
) -> ModelConfig:
    """The model's config from the GGUF's metadata, tensor shapes and its RoPE tensors (by
    name, ROPE_TENSORS): a llama3 GGUF's rope_freqs (one divisor per rotary frequency), a
    LongRoPE one's long and short factors."""
    arch = _architecture(meta, source)

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF {source} lacks metadata key {arch}.{name}")
        return value

    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"GGUF {source} has no token_embd.weight tensor")
    rope_scaling = _rope_scaling(meta, arch, key, source, rope_tensors or {})
    # llama.cpp writes OLMo 3 as olmo2 with a window
    family = "olmo3" if arch == "olmo2" and meta.get("olmo2.attention.sliding_window") else arch
    try:
        hidden, heads = int(key("embedding_length")), _single_int(key("attention.head_count"))
        # (no heads: the config's own check names the key)
        head_dim = int(key("attention.key_length", hidden // max(heads, 1)))
        return ModelConfig(
            architecture=family,
            # The embedding's rows, which may exceed the token list (padding rows), size it.
            vocab_size=shapes["token_embd.weight"][0],
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=_single_int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=_f32_to_float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=_f32_to_float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 32768)),
            tie_word_embeddings="output.weight" not in shapes,
            attention_bias="blk.0.attn_q.bias" in shapes,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            rope_scaling=rope_scaling,
            # (0: none, as llama.cpp writes Phi-4-mini's)
            sliding_window=(meta.get(f"{arch}.attention.sliding_window") or None
                            if family in SLIDING_WINDOW_ARCHITECTURES else None),
            # the fraction of a head RoPE turns (Phi-4-mini's rope.dimension_count)
            partial_rotary_factor=int(key("rope.dimension_count", head_dim)) / max(head_dim, 1),
            **(_gemma3_fields(meta, hidden, heads, head_dim) if arch == "gemma3" else {}),
            # llama.cpp's SmolLM3: every fourth layer without RoPE, as transformers' default
            no_rope_layers=([int((i + 1) % 4 != 0) for i in range(int(key("block_count")))]
                            if arch == "smollm3" else None),
            **(_granite_fields(meta, source) if arch == "granite" else {}),
            **(_olmo3_fields(meta) if family == "olmo3" else {}),
        )
    except ModelLoadError:  # a missing key, named already
        raise
    except ValueError as e:  # an impossible size: ModelConfig's check names the key
        raise ModelLoadError(f"GGUF {source}: {e}") from None


def _rope_scaling(meta: dict[str, Any], arch: str, key: Callable[..., Any], source: Path,
                  rope_tensors: dict[str, list[float]]) -> dict[str, Any] | None:
    """The RoPE scaling as transformers' rope_scaling spells it, from `rope.scaling.type` (linear,
    yarn) or the RoPE tensors (rope_freqs: "freq_factors"; LongRoPE's)."""
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear", "yarn"):
        raise ModelLoadError(f"GGUF {source}: {arch}.rope.scaling.type {scaling!r} is not "
                             "supported (braid runs plain, linear and yarn RoPE)")
    if rope_tensors and (scaling not in (None, "none")
                         or (ROPE_FREQS in rope_tensors and len(rope_tensors) > 1)):
        raise ModelLoadError(f"GGUF {source}: {', '.join(sorted(rope_tensors))} and "
                             f"rope.scaling.type {scaling} cannot scale RoPE together")
    if ROPE_FREQS in rope_tensors:
        return {"rope_type": "freq_factors", "factors": rope_tensors[ROPE_FREQS]}
    if rope_tensors:
        return _long_rope(rope_tensors, key, source)
    if scaling in (None, "none"):
        return None
    factor = {"rope_type": scaling, "factor": _f32_to_float(key("rope.scaling.factor"))}
    return factor | _yarn_fields(meta, arch, key, source) if scaling == "yarn" else factor


def _yarn_fields(meta: dict[str, Any], arch: str, key: Callable[..., Any], source: Path
                 ) -> dict[str, Any]:
    """YaRN's original context and betas under llama.cpp's keys. Its attention factor, log
    multiplier and extrapolation factor (DeepSeek's and other files', where llama.cpp's
    meaning differs from transformers') are refused, named."""
    for name in ("yarn_attn_factor", "yarn_log_multiplier", "yarn_ext_factor"):
        if f"{arch}.rope.scaling.{name}" in meta and not (
                name == "yarn_ext_factor" and meta[f"{arch}.rope.scaling.{name}"] == 1):
            raise ModelLoadError(f"GGUF {source}: {arch}.rope.scaling.{name} is not supported "
                                 "(braid runs YaRN as transformers' rope_scaling spells it)")
    return {"original_max_position_embeddings": int(key("rope.scaling.original_context_length",
                                                        None)),
            **{beta: _f32_to_float(meta[f"{arch}.rope.scaling.yarn_{beta}"])
               for beta in ("beta_fast", "beta_slow")
               if f"{arch}.rope.scaling.yarn_{beta}" in meta}}


def _long_rope(rope_tensors: dict[str, list[float]], key: Callable[..., Any],
               source: Path) -> dict[str, Any]:
    """LongRoPE as transformers spells it, from llama.cpp's rope_factors_long / _short tensors,
    original context and attention factor (llama.cpp's from max / original context)."""
    if set(rope_tensors) != {ROPE_LONG, ROPE_SHORT}:
        raise ModelLoadError(f"GGUF {source}: LongRoPE needs both {ROPE_LONG} and "
                             f"{ROPE_SHORT}; it has {', '.join(sorted(rope_tensors))}")
    return {"rope_type": "longrope", "long_factor": rope_tensors[ROPE_LONG],
            "short_factor": rope_tensors[ROPE_SHORT],
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length",
                                                        None)),
            "attention_factor": _f32_to_float(key("rope.scaling.attn_factor", 1.0))}


def _granite_fields(meta: dict[str, Any], source: Path) -> dict[str, Any]:
    """Granite's multipliers under llama.cpp's names, which it requires (an attention scale of
    0 means 1 / sqrt(head size) to it)."""
    keys = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
            "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
    fields = {}
    for name, key in keys.items():
        if f"granite.{key}" not in meta:
            raise ModelLoadError(f"GGUF {source} lacks metadata key granite.{key}")
        value = _f32_to_float(meta[f"granite.{key}"])
        fields[name] = None if name == "attention_multiplier" and value == 0 else value
    return fields


def _layer_types(meta: dict[str, Any], arch: str, global_every: int) -> list[str]:
    """Each layer windowed or global: as the file lists them (llama.cpp's
    sliding_window_pattern, a flag per layer or a period), else every `global_every`-th
    global (what llama.cpp fixes for the family)."""
    layers = int(meta[f"{arch}.block_count"])
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    if isinstance(pattern, int) and pattern > 0:
        return gemma3_layer_types(layers, pattern)
    return gemma3_layer_types(layers, global_every)


def _olmo3_fields(meta: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3 in llama.cpp's olmo2 file: its layer types (every fourth global by default) and
    its windowed layers' RoPE (freq_base_swa, else the model's, unscaled)."""
    base = meta.get("olmo2.rope.freq_base_swa", meta.get("olmo2.rope.freq_base", 10000.0))
    return {"layer_types": _layer_types(meta, "olmo2", OLMO3_GLOBAL_EVERY),
            "rope_local_theta": _f32_to_float(base)}


def _gemma3_fields(meta: dict[str, Any], hidden: int, heads: int, head_dim: int
                   ) -> dict[str, Any]:
    """What llama.cpp fixes for Gemma 3 rather than storing: every sixth layer global (unless
    the file lists the windowed layers), RoPE base 10,000 in the window, scores scaled by
    1 / sqrt(head size), except the 27B model's 1 / sqrt(hidden / heads)."""
    layers = int(meta["gemma3.block_count"])
    types = _layer_types(meta, "gemma3", GEMMA3_GLOBAL_EVERY)
    cap = meta.get("gemma3.final_logit_softcapping")
    return {"layer_types": types,
            "rope_local_theta": _f32_to_float(meta.get("gemma3.rope.freq_base_swa",
                                                       GEMMA3_LOCAL_ROPE_THETA)),
            "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
            "final_logit_softcapping": None if cap is None else _f32_to_float(cap)}


# ---------------------------------------------------------------------------------------------
# Tensors: dequantize, undo llama.cpp's rope permutation, stream into one safetensors file.


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's `permute`: per head, rows (dim/2, 2) -> (2, dim/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: Tensor) -> np.ndarray:
    if tensor.tensor_type not in FLOAT_TYPES and len(tensor.shape) == 2:
        rows, cols = hf_shape(tensor)
        qw = QuantWeight(torch.from_numpy(np.array(tensor.data).reshape(rows, -1)),
                         tensor.tensor_type, cols)
        if runnable(qw.qtype, cols):  # the compiled kernel dequantizes in one pass
            return qw.dequantize().numpy()
    array = _gguf_dequantize(tensor, tensor.data)
    return np.ascontiguousarray(array, dtype=np.float32).reshape(hf_shape(tensor))


def _gguf_dequantize(tensor: Tensor, data: np.ndarray) -> np.ndarray:
    """gguf-py's values of `data` (the tensor's blocks, or some of them); a ModelLoadError
    naming the tensor for a format gguf-py cannot read."""
    try:
        return dequantize(data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"tensor {tensor.name}: unsupported GGUF tensor type {tensor.tensor_type.name}"
        ) from e


def convert_tensor(tensor: Tensor, config: ModelConfig) -> np.ndarray:
    """Float32 in the HF layout (and values: a Gemma norm's weight - 1, see gemma3.py)."""
    array = dequantize_tensor(tensor)
    if (heads := _rope_rows(tensor, config)) is not None:
        array = unpermute_rope(array, heads)
    if config.gemma and tensor.name.endswith("norm.weight"):
        array = array - 1.0
    return np.array(array, dtype=np.float32, order="C")  # a writable copy, not the file map


def _rope_rows(tensor: Tensor, config: ModelConfig) -> int | None:
    """Heads whose rows llama.cpp's converter permuted (the q/k of Llama and of the models
    it converts as Llama: SmolLM3, Granite), else None."""
    if config.architecture not in ("llama", "smollm3", "granite"):
        return None
    if ".attn_q." in tensor.name:
        return config.num_attention_heads
    if ".attn_k." in tensor.name:
        return config.num_key_value_heads
    return None


def read_tensor(tensor: Tensor, config: ModelConfig, quantized: bool
                ) -> torch.Tensor | QuantWeight:
    """One GGUF tensor under its HF layout: quantized blocks kept as rows of bytes when
    `quantized` (and the tensor is a quantized matrix), else dequantized to float32."""
    if not quantized or tensor.tensor_type in FLOAT_TYPES or len(tensor.shape) != 2:
        return torch.from_numpy(convert_tensor(tensor, config))
    rows, cols = hf_shape(tensor)
    data = np.asarray(tensor.data).reshape(rows, -1)  # [rows, bytes per row]
    if not runnable(tensor.tensor_type, cols):  # re-quantized from gguf-py's values later
        _gguf_dequantize(tensor, data[:1])  # a format it cannot read fails here, named
    if (heads := _rope_rows(tensor, config)) is not None:
        data = unpermute_rope(data, heads)
    return QuantWeight(torch.from_numpy(np.array(data)), tensor.tensor_type, cols)


def iter_gguf_weights(path: Path, config: ModelConfig, quantized: bool
                      ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """(HF name, tensor) for every tensor of the GGUF, one at a time (see read_tensor)."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    for tensor in tqdm(read_tensors(path), desc=f"Loading {path.name}", unit="tensor",
                       leave=False):
        if tensor.name not in ROPE_TENSORS:  # in the config (rope_scaling), not weights
            yield (hf_name(tensor.name, config.architecture),
                   read_tensor(tensor, config, quantized))


def quantized_types(path: Path) -> set[GGMLQuantizationType]:
    """The block formats of the GGUF's tensors (float types excluded)."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return {t.tensor_type for t in read_tensors(path)} - FLOAT_TYPES


# ---------------------------------------------------------------------------------------------
# The cached folder.


def gguf_to_hf_folder(gguf_path: Path) -> Path:
    """The cached HF-style folder of this GGUF, converting it on first use."""
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    sha = gguf_sha256(gguf_path)
    folder = cache_root() / "hf" / f"{sha}-v{CONVERSION_VERSION}"
    if not (folder / "config.json").is_file():
        try:
            convert_gguf(gguf_path, folder)
        except OSError as e:
            raise ModelLoadError(f"cannot write the conversion of {gguf_path} under "
                                 f"{folder.parent} ({e.strerror or e}): point BRAID_CACHE_DIR "
                                 "at a writable folder") from None
    for old in folder.parent.glob(f"{sha}-v*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in folder.parent.glob(f".{sha}-v*"):  # a conversion killed half-way, an hour ago
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > 3600:
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def convert_gguf(gguf_path: Path, folder: Path) -> None:
    from braid.models.gguf_tokenizer import NoUsableTokenizer, write_gguf_tokenizer

    reader = open_gguf(gguf_path)
    meta = read_metadata(reader)
    config = config_from_metadata(
        meta, {t.name: hf_shape(t) for t in reader.tensors}, gguf_path,
        {t.name: [float(f) for f in np.asarray(t.data, np.float32)]
         for t in reader.tensors if t.name in ROPE_TENSORS})
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        try:
            write_gguf_tokenizer(meta, tmp)
        except NoUsableTokenizer as e:  # token ids still work, and --tokenizer gives one
            (tmp / NO_TOKENIZER).write_text(f"{e}\n")  # why, for each load to say
        except OSError:
            raise
        except Exception as e:  # ids out of range, malformed merges (IndexError, TypeError,
            # the tokenizers library's bare Exception), or our own check: name the file
            raise ModelLoadError(f"GGUF {gguf_path}: its tokenizer cannot be built ({e})"
                                 ) from None
        (tmp / "source.txt").write_text(f"{gguf_path.resolve()}\n")
        _write_json(tmp / "generation_config.json", _generation_config(config, meta))
        _write_json(tmp / "config.json", config.to_hf_dict())
        _publish(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _generation_config(config: ModelConfig, meta: dict[str, Any]) -> dict[str, Any]:
    """BOS and the tokens that end generation: the file's EOS, and its end-of-turn and
    end-of-message tokens where it names them (llama.cpp's EOT / EOM)."""
    eos = config.eos_token_id
    ends = [*([] if eos is None else [eos] if isinstance(eos, int) else eos),
            *(meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
              if isinstance(meta.get(k), int))]
    return {"bos_token_id": config.bos_token_id,
            "eos_token_id": ends[0] if len(set(ends)) == 1 else list(dict.fromkeys(ends)) or None}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _publish(tmp: Path, folder: Path) -> None:
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
    try:
        os.rename(tmp, folder)
    except OSError:
        # Another process finished the same conversion first; theirs is complete, keep it.
        if not (folder / "config.json").is_file():
            raise
