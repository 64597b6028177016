"""Tiny random Qwen2 / Llama models for tests, with the transformers reference beside them."""

from __future__ import annotations

import torch

from braid.models.build import FAMILIES
from braid.models.config import ModelConfig, gemma3_layer_types
from braid.models.qwen2 import Qwen2ForCausalLM

# 256 byte-level tokens + 3 specials, rounded up (embedding rows past the tokenizer are unused).
VOCAB = 272
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_config(arch: str = "qwen2", **overrides: object) -> ModelConfig:
    values: dict = dict(
        architecture=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=arch == "qwen2", attention_bias=arch == "qwen2",
        bos_token_id=256, eos_token_id=256,
    )
    if arch in ("ministral", "olmo3"):  # a windowed layer (shorter than the prompts) and a
        values |= dict(sliding_window=8,  # global one
                       layer_types=["sliding_attention", "full_attention"])
    if arch == "granite":  # multipliers far from 1, so each one shows
        values |= dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                       attention_multiplier=0.1, logits_scaling=4.0)
    if arch == "gemma3":  # a window shorter than the tests' prompts; a scale not head_dim's
        values |= dict(tie_word_embeddings=True, sliding_window=8, rope_local_theta=10000.0,
                       query_pre_attn_scalar=24, layer_types=gemma3_layer_types(2, 2))
    values.update(overrides)
    if arch == "olmo3" and "rope_local_theta" not in overrides:  # its windowed layers' RoPE:
        values["rope_local_theta"] = values["rope_theta"]  # the model's base, unscaled
    if ("num_hidden_layers" in overrides and arch in ("gemma3", "ministral", "olmo3")
            and "layer_types" not in overrides):
        values["layer_types"] = gemma3_layer_types(int(values["num_hidden_layers"]), 2)
    return ModelConfig(**values)


def hf_model(cfg: ModelConfig, seed: int = 0):  # -> transformers PreTrainedModel
    """A transformers model with random weights (larger std than the default so logits vary)."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face named random weights (those of `hf_model(cfg, seed)`)."""
    return dict(hf_model(cfg, seed).state_dict())


def braid_model(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], packed: bool = False
) -> Qwen2ForCausalLM:
    model = FAMILIES[cfg.architecture](cfg)
    model.load_weights(weights.items())
    if packed:
        model.pack_linear_weights()
    return model.eval()


def byte_tokenizer():  # -> tokenizers.Tokenizer
    """Byte-level BPE without merges: one token per byte (ids 0..255), then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from braid.models.gguf_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def save_tiny_model(folder, arch: str = "qwen2", seed: int = 0, **overrides: object):
    """Write a complete Hugging Face style model folder (config, safetensors, tokenizer with a
    chat template) that braid loads like any real model. Returns the folder path."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    weights = {k: v.contiguous() for k, v in random_weights(cfg, seed).items()
               if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(weights, str(folder / "model.safetensors"))
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE,
    }))
    return folder
