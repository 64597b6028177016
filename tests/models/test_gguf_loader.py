from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from braid.files import cache_root
from braid.models import gguf_loader
from braid.models.gguf_loader import gguf_to_hf_folder
from braid.models.loader import ModelLoadError, load_model_files
from tests.conftest import tiny_vocab, write_gguf

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 256, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
RNG = np.random.default_rng(0)


def hparams(**extra: object) -> dict[str, object]:
    return dict(context_length=512, embedding_length=HIDDEN, feed_forward_length=FFN,
                block_count=LAYERS, head_count=HEADS, head_count_kv=KV_HEADS,
                layer_norm_rms_eps=1e-5, rope_freq_base=1e6) | extra


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def random_kquant(rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Random K-quant blocks (the package cannot quantize to K types) with sane f16 scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # layout: ql, qh, scales, d
        raw[..., -2:] = scale
    else:  # Q4_K: d, dmin, scales, qs
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    return raw.reshape(rows, -1)


def layer_tensors(i: int, q: np.ndarray, k: np.ndarray, bias: bool) -> dict:
    down_type = Q.Q4_K if i == 0 else Q.Q6_K
    tensors = {
        f"blk.{i}.attn_norm.weight": (rand(HIDDEN), None),
        f"blk.{i}.attn_q.weight": (quantize(q, Q.Q8_0), Q.Q8_0),
        f"blk.{i}.attn_k.weight": (quantize(k, Q.Q4_0), Q.Q4_0),
        f"blk.{i}.attn_v.weight": (quantize(rand(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q5_0), Q.Q5_0),
        f"blk.{i}.attn_output.weight": (rand(HIDDEN, HIDDEN).astype(np.float16), None),
        f"blk.{i}.ffn_norm.weight": (rand(HIDDEN), None),
        f"blk.{i}.ffn_gate.weight": (quantize(rand(FFN, HIDDEN), Q.BF16), Q.BF16),
        f"blk.{i}.ffn_up.weight": (rand(FFN, HIDDEN), None),
        f"blk.{i}.ffn_down.weight": (random_kquant(HIDDEN, FFN, down_type), down_type),
    }
    if bias:
        for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            tensors[f"blk.{i}.attn_{name}.bias"] = (rand(rows * HEAD_DIM), None)
    return tensors


def tiny_qwen2(path: Path) -> tuple[Path, dict]:
    tensors = {"token_embd.weight": (rand(len(tiny_vocab()), HIDDEN), None),
               "output_norm.weight": (rand(HIDDEN), None)}
    for i in range(LAYERS):
        q, k = rand(HEADS * HEAD_DIM, HIDDEN), rand(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors.update(layer_tensors(i, q, k, bias=True))
    return write_gguf(path, "qwen2", tensors, hparams()), tensors


def reference(array: np.ndarray, qtype: Q | None) -> torch.Tensor:
    if qtype is None:
        return torch.from_numpy(array.astype(np.float32))
    return torch.from_numpy(dequantize(array, qtype))


def test_qwen2_gguf_weights_and_config(tmp_path: Path) -> None:
    path, tensors = tiny_qwen2(tmp_path / "tiny.gguf")
    loaded = load_model_files(str(path))
    expected_names = {gguf_loader.hf_name(n) for n in tensors}
    assert set(loaded.weights) == expected_names
    assert "lm_head.weight" not in loaded.weights
    for name, (array, qtype) in tensors.items():
        got = loaded.weights[gguf_loader.hf_name(name)]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, reference(array, qtype), rtol=0, atol=0)
    assert loaded.weights["model.layers.0.self_attn.q_proj.weight"].shape == (HIDDEN, HIDDEN)
    assert loaded.weights["model.layers.0.mlp.down_proj.weight"].shape == (HIDDEN, FFN)
    cfg = loaded.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "qwen2", len(tiny_vocab()), HIDDEN, FFN)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        LAYERS, HEADS, KV_HEADS)
    assert (cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (
        HEAD_DIM, pytest.approx(1e-5), 1e6, 512)
    assert cfg.tie_word_embeddings and cfg.attention_bias
    assert cfg.eos_token_id == tiny_vocab().index("<|im_end|>")
    assert cfg.bos_token_id == tiny_vocab().index("<|endoftext|>")


def test_cached_folder_is_complete_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_qwen2(tmp_path / "tiny.gguf")
    folder = gguf_to_hf_folder(path)
    assert folder.parent == cache_root() / "hf"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file()
    assert not list(folder.glob("*.safetensors"))  # weights are read from the GGUF itself
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"

    def fail(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_loader, "convert_gguf", fail)
    monkeypatch.setattr(gguf_loader, "sha256_file", fail)
    assert gguf_to_hf_folder(path) == folder
    assert load_model_files(str(path)).folder == folder


def test_interrupted_conversion_leaves_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_qwen2(tmp_path / "tiny.gguf")

    def interrupted(*args: object) -> None:  # after the tokenizer files, before config.json
        raise KeyboardInterrupt

    real = gguf_loader._write_json
    monkeypatch.setattr(gguf_loader, "_write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf_to_hf_folder(path)
    hf = cache_root() / "hf"
    assert not any(p.name.startswith(gguf_loader.gguf_sha256(path)) for p in hf.iterdir())
    assert not [p for p in hf.iterdir() if p.name.startswith(".")]  # no temp folder left
    monkeypatch.setattr(gguf_loader, "_write_json", real)
    assert (gguf_to_hf_folder(path) / "config.json").is_file()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama Q/K weights."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama_rope_permutation_round_trips(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": (rand(len(tiny_vocab()), HIDDEN), None),
               "output_norm.weight": (rand(HIDDEN), None),
               "output.weight": (rand(len(tiny_vocab()), HIDDEN), None)}
    originals = {}
    for i in range(LAYERS):
        q, k = rand(HEADS * HEAD_DIM, HIDDEN), rand(KV_HEADS * HEAD_DIM, HIDDEN)
        originals[i] = (q, k)
        layer = layer_tensors(i, q, k, bias=False)
        layer[f"blk.{i}.attn_q.weight"] = (llama_cpp_permute(q, HEADS), None)
        layer[f"blk.{i}.attn_k.weight"] = (llama_cpp_permute(k, KV_HEADS), None)
        tensors.update(layer)
    path = write_gguf(tmp_path / "llama.gguf", "llama", tensors, hparams())
    loaded = load_model_files(str(path))
    assert loaded.config.architecture == "llama"
    assert not loaded.config.tie_word_embeddings and not loaded.config.attention_bias
    assert "lm_head.weight" in loaded.weights
    for i, (q, k) in originals.items():
        attn = f"model.layers.{i}.self_attn"
        torch.testing.assert_close(loaded.weights[f"{attn}.q_proj.weight"], torch.from_numpy(q))
        torch.testing.assert_close(loaded.weights[f"{attn}.k_proj.weight"], torch.from_numpy(k))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model_files(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        gguf_to_hf_folder(tmp_path / "nope.gguf")


def test_truncated_file(tmp_path: Path) -> None:
    path, _ = tiny_qwen2(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as err:
        load_model_files(str(path))
    assert "\n" not in str(err.value)


def test_metadata_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path, _ = tiny_qwen2(tmp_path / "tiny.gguf")
    path.write_bytes(path.read_bytes().replace(b"qwen2", b"qw\xffn2", 1))
    with pytest.raises(ModelLoadError, match=f"GGUF {path}: metadata that is not UTF-8"):
        load_model_files(str(path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "mamba.gguf", "mamba",
                      {"token_embd.weight": (rand(len(tiny_vocab()), HIDDEN), None)})
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model_files(str(path))


def test_rope_scaling_and_no_heads_are_load_errors(tmp_path: Path) -> None:
    """A GGUF's linear RoPE scaling is taken; YaRN without its original context and
    LongRoPE as a scaling type (llama.cpp keeps its factors in tensors) are refused naming the
    key, and a GGUF with no attention heads names the key (a ZeroDivisionError)."""
    from gguf import RopeScalingType

    _, tensors = tiny_qwen2(tmp_path / "tiny.gguf")
    linear = write_gguf(tmp_path / "linear.gguf", "qwen2", tensors, hparams() | {
        "rope_scaling_type": RopeScalingType.LINEAR, "rope_scaling_factor": 4.0})
    assert load_model_files(str(linear)).config.rope_scaling == {"rope_type": "linear",
                                                                 "factor": 4.0}
    for name, extra, message in (
            ("yarn", {"rope_scaling_type": RopeScalingType.YARN, "rope_scaling_factor": 4.0},
             "lacks metadata key qwen2.rope.scaling.original_context_length"),
            ("longrope", {"rope_scaling_type": RopeScalingType.LONGROPE},
             "qwen2.rope.scaling.type 'longrope' is not supported"),
            ("headless", {"head_count": 0}, "num_attention_heads must be an integer >= 1")):
        path = write_gguf(tmp_path / f"{name}.gguf", "qwen2", tensors, hparams() | extra)
        with pytest.raises(ModelLoadError, match=message):
            load_model_files(str(path))


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": (rand(len(tiny_vocab()), HIDDEN), None),
               "output_norm.weight": (np.ones(HIDDEN, np.int32), None)}
    path = write_gguf(tmp_path / "int.gguf", "qwen2", tensors, hparams())
    message = "tensor output_norm.weight: unsupported GGUF tensor type I32"
    with pytest.raises(ModelLoadError, match=message):
        load_model_files(str(path))


@pytest.mark.real_model
def test_real_target_converts(target_gguf: Path) -> None:
    loaded = load_model_files(str(target_gguf))
    cfg = loaded.config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (
        "qwen2", 151936, 1536, 28)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (12, 2, 128)
    assert cfg.attention_bias and cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6
    assert loaded.weights["model.layers.0.self_attn.k_proj.weight"].shape == (256, 1536)
    assert loaded.weights["model.layers.0.mlp.down_proj.weight"].shape == (1536, 8960)
    assert all(w.dtype == torch.float32 for w in loaded.weights.values())


def test_a_cache_that_cannot_be_written_is_named(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """BRAID_CACHE_DIR is expanded ("~/..." from a unit file); a cache that cannot be
    written (here a file) is a load error naming it and the variable, not an OSError
    traceback from the sha256 index, which is only a speed-up; a conversion killed half-way
    more than an hour ago leaves no folder behind, a running one's is kept."""
    import os
    import time

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("BRAID_CACHE_DIR", "~/braid-cache")
    assert cache_root() == tmp_path / "braid-cache"
    path, _ = tiny_qwen2(tmp_path / "tiny.gguf")
    folder = gguf_to_hf_folder(path)
    stale, running = (folder.parent / f".{folder.name}.{n}" for n in ("old", "new"))
    for tmp in (stale, running):
        tmp.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert gguf_to_hf_folder(path) == folder
    assert not stale.exists() and running.exists()
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("BRAID_CACHE_DIR", str(tmp_path / "a-file"))
    with pytest.raises(ModelLoadError, match="cannot write the conversion of .* under .*a-file"
                       ".*: point BRAID_CACHE_DIR at a writable folder"):
        gguf_to_hf_folder(path)


def test_broken_tokenizer_metadata_is_a_load_error_naming_the_file(tmp_path: Path) -> None:
    """An eos id past the token list (an IndexError while building the tokenizer)."""
    from gguf import TokenType

    from tests.conftest import MERGES

    _, tensors = tiny_qwen2(tmp_path / "tiny.gguf")
    tokenizer = {"tokenizer_model": "gpt2", "tokenizer_pre": "qwen2", "token_list": tiny_vocab(),
                 "token_merges": MERGES, "eos_token_id": 10**6,
                 "token_types": [TokenType.NORMAL] * len(tiny_vocab())}
    path = write_gguf(tmp_path / "eos.gguf", "qwen2", tensors, hparams() | tokenizer,
                      tokenizer=False)
    with pytest.raises(ModelLoadError, match=f"GGUF {path}: its tokenizer cannot be built"):
        load_model_files(str(path))


def test_a_gguf_without_a_tokenizer_loads_and_takes_one_from_the_flag(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A GGUF with no tokenizer metadata (or one braid cannot build) loads without a
    tokenizer, with a warning, and --tokenizer gives it one (vLLM's way with GGUFs); it was
    refused, --tokenizer or not."""
    from braid.config import EngineConfig
    from braid.engine.engine import LLMEngine

    with_tokenizer, tensors = tiny_qwen2(tmp_path / "tiny.gguf")
    bare = write_gguf(tmp_path / "bare.gguf", "qwen2", tensors, hparams(), tokenizer=False)
    options = {"num_kv_blocks": 64, "block_size": 4, "max_model_len": 64,
               "log_stats_interval": 0}
    for _ in range(2):  # converted, then from the cache: each load says so
        caplog.clear()
        engine = LLMEngine(EngineConfig(model=str(bare), **options))
        assert engine.tokenizer is None
        assert ("GGUF has no tokenizer metadata (tokenizer.ggml.tokens); it runs without a "
                "tokenizer, on token ids only (give one with --tokenizer)") in caplog.text
    engine = LLMEngine(EngineConfig(model=str(bare), tokenizer=str(with_tokenizer), **options))
    assert engine.tokenizer is not None and engine.tokenizer.encode("hello the") == [
        tiny_vocab().index("hello"), tiny_vocab().index("Ġthe")]


def test_a_llama3_gguf_s_rope_freqs_scale_rope_as_transformers_llama3(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.x's llama3 RoPE scaling as a rope_freqs tensor, one divisor
    per rotary frequency (its convert script's formula below): braid's rotary tables from it
    equal those of the config.json form, which equal transformers' (test_qwen2.py); the
    tensor was refused as "not part of a plain decoder"."""
    import math

    from braid.models.qwen2 import RotaryEmbedding

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    factors = []
    for i in range(0, HEAD_DIM, 2):
        wavelength = 2 * math.pi * 1e6 ** (i / HEAD_DIM)  # rope_freq_base 1e6, as hparams()
        if wavelength < 64 / 4.0:
            factors.append(1.0)
        elif wavelength > 64 / 1.0:
            factors.append(8.0)
        else:
            smooth = (64 / wavelength - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    assert 1.0 in factors and 8.0 in factors and len(set(factors)) > 2  # all three bands
    _, tensors = tiny_qwen2(tmp_path / "tiny.gguf")
    path = write_gguf(tmp_path / "llama3.gguf", "qwen2",
                      {**tensors, "rope_freqs.weight": (np.array(factors, np.float32), None)},
                      hparams())
    from braid.models.build import load_model

    model, _ = load_model(str(path))  # the quantized path: the tensor is no weight
    assert model.config.rope_scaling is not None
    assert model.config.rope_scaling["rope_type"] == "freq_factors"
    theirs = RotaryEmbedding(HEAD_DIM, 512, 1e6, llama3)
    # (the factors are float32 in the file: ~1e-6 at the last positions)
    torch.testing.assert_close(model.rotary.cos, theirs.cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.rotary.sin, theirs.sin, atol=1e-5, rtol=0)
    assert not torch.allclose(model.rotary.cos, RotaryEmbedding(HEAD_DIM, 512, 1e6).cos,
                              atol=1e-2)


def test_a_float_gguf_gets_a_hint_toward_int8(tmp_path: Path, caplog) -> None:
    """F16 / F32 tensors only: `auto` keeps them float (float32, 4 bytes a value) and says
    that --quantization int8 runs them on the quantized kernels; int8 does."""
    import logging

    from braid.kernels import quant_ops
    from braid.models.build import load_model
    from braid.models.quant import QuantLinear

    tensors = {"token_embd.weight": (rand(len(tiny_vocab()), HIDDEN), None),
               "output_norm.weight": (rand(HIDDEN), None)}
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for i in range(LAYERS):
        for name in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{name}.weight"] = (rand(HIDDEN), None)
        for name, shape in shapes.items():  # the matrices as F16, their biases F32
            tensors[f"blk.{i}.{name}.weight"] = (rand(*shape).astype(np.float16), None)
            if name in ("attn_q", "attn_k", "attn_v"):
                tensors[f"blk.{i}.{name}.bias"] = (rand(shape[0]), None)
    path = write_gguf(tmp_path / "float.gguf", "qwen2", tensors, hparams())
    with caplog.at_level(logging.INFO, logger="braid"):
        model, _ = load_model(str(path))
    hinted = "float.gguf holds float weights (F16/BF16/F32), which run as floats" in caplog.text
    assert hinted == (quant_ops() is not None)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    if quant_ops() is not None:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="braid"):
            model, _ = load_model(str(path), quantization="int8")
        assert "holds float weights" not in caplog.text
        assert any(isinstance(m, QuantLinear) for m in model.modules())


def gguf_names(hf_weights: dict[str, torch.Tensor], arch: str = "qwen2"
               ) -> dict[str, torch.Tensor]:
    """Hugging Face names -> llama.cpp's (what its convert script writes for Qwen2, Qwen3,
    Phi-3 and Gemma 3: no rope permutation; Gemma's norms stored as 1 + weight)."""
    names = gguf_loader.LAYER_NAMES.get(arch, gguf_loader._LAYER_NAMES)
    layer = {v: k for k, v in names.items()}
    if arch in ("olmo2", "olmo3"):
        layer["post_attention_layernorm"] = "attn_post_norm"
    layer["mlp.gate_up_proj"] = "ffn_up"  # Phi-3's gate and up, one tensor
    top = {v: k for k, v in gguf_loader._GLOBAL_NAMES.items()}
    out = {}
    for name, tensor in hf_weights.items():
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1.0
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            i, rest = base.removeprefix("model.layers.").split(".", 1)
            out[f"blk.{i}.{layer[rest]}.{kind}"] = tensor
        else:
            out[f"{top[base]}.{kind}"] = tensor
    return out


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3", "smollm3", "granite", "olmo2",
                                  "olmo3"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q8_0"])
def test_a_gguf_of_another_family_gives_transformers_logits(tmp_path: Path, arch: str,
                                                              quantized: bool) -> None:
    """Qwen3 (q and k heads RMS-normalised before RoPE: `attn_q_norm` / `attn_k_norm`),
    Phi-3 (q/k/v in one `attn_qkv`, gate and up in one `ffn_up`, a sliding window in
    `phi3.attention.sliding_window`) and Gemma 3 (a windowed and a global layer by
    `gemma3.attention.sliding_window_pattern`, `post_attention_norm` / `post_ffw_norm`,
    norms stored as 1 + weight) and SmolLM3 (q/k permuted as Llama's, its fourth layer without
    RoPE as llama.cpp fixes it), Granite (permuted too; its four multipliers under llama.cpp's
    keys) and OLMo 2 (q and k normalised whole, `attn_post_norm` / `ffn_post_norm`; OLMo 3
    as an olmo2 file with a window and its pattern), written as llama.cpp writes them: logits
    equal to transformers' on the same weights up to float32 rounding; with the projections
    stored as Q8_0 (run on the kernels), transformers' on those weights' values up to the int8
    activations' rounding."""
    from braid.models.build import load_model

    window = {"phi3": 200, "gemma3": 4, "olmo3": 4}.get(arch)  # (shorter than the prompt)
    overrides: dict = {}
    if arch == "gemma3":
        overrides = {"query_pre_attn_scalar": HEAD_DIM}  # llama.cpp's
    elif arch == "smollm3":
        overrides = {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]}
    cfg, hf = tiny_family(arch, rope_theta=1e6, sliding_window=window, **overrides)
    extra = {"sliding_window": window} if window else {}
    if arch in ("gemma3", "olmo3"):
        extra["sliding_window_pattern"] = [True, False]
    if arch == "smollm3":
        extra["block_count"] = 4
    if arch == "granite":
        extra |= {"embedding_scale": cfg.embedding_multiplier, "logit_scale": cfg.logits_scaling,
                  "residual_scale": cfg.residual_multiplier,
                  "attention_scale": cfg.attention_multiplier}
    path = llama_cpp_file(tmp_path / f"{arch}.gguf", hf, arch, quantized,
                          permuted=arch in ("smollm3", "granite"), **extra)
    model, _ = load_model(str(path))
    assert model.config.architecture == arch
    assert model.config.qk_norm == (arch in ("qwen3", "gemma3"))
    assert model.config.no_rope_layers == cfg.no_rope_layers
    assert model.config.max_context == 512 and model.config.sliding_window == window
    assert (model.quant_type is not None) == quantized
    assert_logits(model, hf, [3, 200, 17, 17, 90, 41, 5, 260], quantized)


def llama_cpp_file(path: Path, hf, arch: str, quantized: bool, extra_tensors: dict | None = None,
                   permuted: bool = False, **keys: object) -> Path:
    """`hf`'s weights as llama.cpp writes a GGUF of `arch` (Q8_0 projections where
    `quantized`, whose values `hf` then takes; q and k rows in llama.cpp's Llama order where
    `permuted`; OLMo 3 as an olmo2 file), with `keys` beside the tiny hparams."""
    tensors: dict = {}
    for name, t in gguf_names(dict(hf.state_dict()), arch).items():
        array = t.numpy()
        if quantized and array.ndim == 2 and "token_embd" not in name:
            tensors[name] = (quantize(array, Q.Q8_0), Q.Q8_0)
            t.copy_(torch.from_numpy(dequantize(tensors[name][0], Q.Q8_0)))
        else:
            tensors[name] = (array, None)
        if permuted and (".attn_q." in name or ".attn_k." in name):
            blocks, qtype = tensors[name]
            tensors[name] = (llama_cpp_permute(blocks, HEADS if ".attn_q." in name
                                               else KV_HEADS), qtype)
    return write_gguf(path, "olmo2" if arch == "olmo3" else arch,
                      tensors | (extra_tensors or {}),
                      hparams(key_length=HEAD_DIM, value_length=HEAD_DIM, **keys))


def tiny_family(arch: str, **overrides: object):  # -> (ModelConfig, transformers model)
    from tests.tiny import hf_model, tiny_config

    cfg = tiny_config(arch, **{"vocab_size": len(tiny_vocab()), "hidden_size": HIDDEN,
                               "intermediate_size": FFN, "num_attention_heads": HEADS,
                               "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
                               "rope_theta": 1e4, "rms_norm_eps": 1e-5,
                               "tie_word_embeddings": True} | overrides)
    return cfg, hf_model(cfg, seed=3)


def assert_logits(model, hf, ids: list[int], quantized: bool) -> None:
    from tests.models.test_qwen2 import PagedRun

    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = PagedRun(model).step({"a": ids})["a"]
    if quantized:
        assert ((got - expected).norm() / expected.norm()).item() < 2e-2
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q8_0"])
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_a_phi4_mini_gguf_gives_transformers_logits(tmp_path: Path, quantized: bool,
                                                    long: bool) -> None:
    """A Phi-4-mini-shaped GGUF as llama.cpp writes it: 3/4 of each head turned
    (`phi3.rope.dimension_count`), LongRoPE's factors as the `rope_factors_long` /
    `rope_factors_short` tensors with `rope.scaling.original_context_length` and
    `rope.scaling.attn_factor`, no window (`sliding_window` 0). Served with a context past the
    original one (--max-model-len) it runs the long factors, within it the short ones, as
    transformers does on sequences that long; on the compiled layer (Q8_0) too."""
    from braid.models.build import load_model
    from tests.models.test_qwen2 import long_rope

    scaling = long_rope(0.75, HEAD_DIM) | {"original_max_position_embeddings": 8}
    _, hf = tiny_family("phi3", partial_rotary_factor=0.75, rope_scaling=scaling)
    factors = {f"rope_factors_{which}.weight": (np.array(scaling[f"{which}_factor"],
                                                         np.float32), None)
               for which in ("long", "short")}
    factor = 512 / 8  # llama.cpp's attention factor: from the context lengths
    path = llama_cpp_file(tmp_path / "phi4.gguf", hf, "phi3", quantized, factors,
                          rope_freq_base=1e4, sliding_window=0, rope_dimension_count=12,
                          rope_scaling_orig_ctx_len=8,
                          rope_scaling_attn_factors=(1 + np.log(factor) / np.log(8)) ** 0.5)
    model, _ = load_model(str(path), max_model_len=512 if long else 8)
    assert model.config.sliding_window is None and model.config.rotary_dim == 12
    assert model.config.long_rope == long
    assert_logits(model, hf, [3, 200, 17, 17, 90, 41, 5, 260, 11, 9, 30, 31][:12 if long else 8],
                  quantized)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q8_0"])
def test_a_yarn_gguf_gives_transformers_logits(tmp_path: Path, quantized: bool) -> None:
    """A Qwen3 GGUF with YaRN as llama.cpp writes it (`rope.scaling.type` yarn, its factor,
    original context and betas) runs as transformers' yarn rope_scaling does, past the
    original context; llama.cpp's own YaRN attention factor is refused, named."""
    from braid.models.build import load_model
    from tests.models.test_qwen2 import YARN

    yarn = YARN | {"original_max_position_embeddings": 8, "beta_fast": 16.0, "beta_slow": 2.0}
    _, hf = tiny_family("qwen3", rope_scaling=yarn)
    keys = dict(rope_freq_base=1e4, rope_scaling_type=gguf.RopeScalingType.YARN,
                rope_scaling_factor=4.0, rope_scaling_orig_ctx_len=8,
                rope_scaling_yarn_beta_fast=16.0, rope_scaling_yarn_beta_slow=2.0)
    path = llama_cpp_file(tmp_path / "yarn.gguf", hf, "qwen3", quantized, **keys)
    model, _ = load_model(str(path))
    assert model.config.rope_scaling == yarn
    assert_logits(model, hf, [3, 200, 17, 17, 90, 41, 5, 260, 11, 9, 30, 31], quantized)
    path = llama_cpp_file(tmp_path / "attn.gguf", hf, "qwen3", quantized,
                          rope_scaling_yarn_attn_factor=1.2, **keys)
    with pytest.raises(ModelLoadError, match="qwen3.rope.scaling.yarn_attn_factor is not "):
        load_model(str(path))


def spm_metadata(arch: str, add_space_prefix: bool) -> dict:
    """A small SentencePiece vocabulary as llama.cpp stores one ("llama"): control tokens,
    the 256 byte-fallback tokens, user-defined runs of newlines and spaces, then pieces whose
    file order (Gemma) and scores (the others) give opposite merge orders for "hello"."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "x", "ll", "he", "hell", "hello", "el",
              "▁w", "▁wo", "▁wor", "▁world", "▁hello", "ld"]
    scores = [0.0] * len(pieces)
    scores[pieces.index("el")] = 5.0  # by score: "e"+"l" first, so "hello" is never formed
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n",
              "\n\n", "  ", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [3, 3, 3, 2, 3, 3, 4, 4, 4, *([6] * 256), *([1] * len(pieces))]
    return {"general.architecture": arch, "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [-1000.0] * (9 + 256) + scores,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": add_space_prefix}


def test_a_sentencepiece_gguf_tokenizer_merges_as_sentencepiece() -> None:
    """A SentencePiece GGUF (Gemma's, Llama 2's) gets a tokenizer: pieces merged by file order
    for Gemma and by score otherwise, spaces spelled U+2581 (with a leading one where the file
    asks), characters outside the vocabulary as their bytes, user-defined runs of newlines and
    spaces whole, control tokens special; decoding gives the text back. Such files loaded
    without a tokenizer."""
    from braid.models.gguf_tokenizer import gguf_backend
    from braid.tokenizer import Tokenizer

    gemma = gguf_backend(spm_metadata("gemma3", add_space_prefix=False))
    text = "hello world\n\nhé  x<start_of_turn>"
    encoding = gemma.encode(text)
    assert encoding.tokens == ["<bos>", "hello", "▁world", "\n\n", "h", "<0xC3>", "<0xA9>", "  ",
                               "x", "<start_of_turn>"]
    assert gemma.decode(encoding.ids, skip_special_tokens=True) == "hello world\n\nhé  x"
    with_template = Tokenizer(gemma, {"eos_token": "<eos>"})
    assert with_template.eos_token_ids == {1, 5}  # and <end_of_turn>, which ends Gemma's turns
    metadata = spm_metadata("llama", add_space_prefix=True)
    del metadata["tokenizer.ggml.add_bos_token"]  # (Llama 2's files: llama.cpp adds BOS)
    by_score = gguf_backend(metadata)
    encoding = by_score.encode("hello world")
    assert encoding.tokens == ["<bos>", "▁", "h", "el", "l", "o", "▁world"]
    assert by_score.decode(encoding.ids, skip_special_tokens=True) == "hello world"
    world = Tokenizer(by_score, {})
    assert world.token_bytes(by_score.token_to_id("▁world")) == b" world"
    assert world.token_bytes(by_score.token_to_id("<0xC3>")) == b"\xc3"


def test_a_gguf_s_end_of_turn_token_ends_generation(tmp_path: Path) -> None:
    """A file naming an end-of-turn token (llama.cpp's `tokenizer.ggml.eot_token_id`, as
    Gemma's instruct files do beside their <eos>) stops generation there too."""
    from braid.models.gguf_loader import gguf_to_hf_folder
    from braid.tokenizer import Tokenizer

    _, tensors = tiny_qwen2(tmp_path / "tiny.gguf")
    eot = tiny_vocab().index("<|im_start|>")  # (a special token END_TOKENS does not name)
    path = write_gguf(tmp_path / "eot.gguf", "qwen2", tensors, hparams() | {"eot_token_id": eot})
    folder = gguf_to_hf_folder(path)
    eos = tiny_vocab().index("<|im_end|>")
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [
        eos, eot]
    assert Tokenizer.from_folder(folder).eos_token_ids >= {eos, eot}


def test_byte_level_pre_tokenizers_split_as_the_models_own() -> None:
    """A GGUF's `tokenizer.ggml.pre` picks how text is split before merging: for every name
    transformers' GGUF loader also knows, the same pieces as its split (Qwen 2 and 3.5,
    Llama 3, o200k's gpt-4o, Mistral's tekken); SmolLM's and StarCoder's split every digit
    alone before GPT-2's rule (they fell back to GPT-2's alone: "12345" was one piece)."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from braid.models.gguf_tokenizer import PRE_TOKENIZER_SPLITS, _pre_tokenizer

    text = ("Hello WORLD, it's 12345 apples!\n\n  x/y  café ÉTÉ 日本語ですね\tdon'T "
            "camelCaseWord HTTPServer x2+y3=5\r\n")

    def pieces(pre: pre_tokenizers.PreTokenizer) -> list[str]:
        return [p for p, _ in pre.pre_tokenize_str(text)]

    shared = set(PRE_TOKENIZER_SPLITS) & set(GGUF_PRE_TOKENIZER_SPLITS)
    assert {"qwen2", "qwen35", "llama3", "gpt-4o", "tekken"} <= shared
    for name in sorted(shared):
        theirs = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        assert pieces(_pre_tokenizer(name)) == pieces(theirs), name
    smollm = pieces(_pre_tokenizer("smollm"))
    first = smollm.index("1")
    assert smollm[first:first + 5] == ["1", "2", "3", "4", "5"]
    assert "Ġ12345" in pieces(_pre_tokenizer("gpt-2"))


def test_a_granite_gguf_without_one_of_its_multipliers_is_refused(tmp_path: Path) -> None:
    """llama.cpp requires Granite's four multipliers; a file without one was run as if it were
    1 (unscaled attention scores), now it is refused naming the key."""
    _, tensors = tiny_qwen2(tmp_path / "tiny.gguf")
    tensors = {n: t for n, t in tensors.items() if ".bias" not in n}
    path = write_gguf(tmp_path / "granite.gguf", "granite", tensors, hparams() | {
        "embedding_scale": 2.0, "residual_scale": 0.5, "logit_scale": 3.0})
    with pytest.raises(ModelLoadError, match="lacks metadata key granite.attention.scale"):
        load_model_files(str(path))
