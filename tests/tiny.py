"""Tiny random Qwen2 / Llama models for tests, with the transformers reference beside them."""

from __future__ import annotations

import torch

from braid.models.config import ModelConfig
from braid.models.qwen2 import Qwen2ForCausalLM

VOCAB = 256


def tiny_config(arch: str = "qwen2", **overrides: object) -> ModelConfig:
    values: dict = dict(
        architecture=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=arch == "qwen2", attention_bias=arch == "qwen2",
        bos_token_id=1, eos_token_id=2,
    )
    values.update(overrides)
    return ModelConfig(**values)


def hf_model(cfg: ModelConfig, seed: int = 0):  # -> transformers PreTrainedModel
    """A transformers model with random weights (larger std than the default so logits vary)."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face named random weights (those of `hf_model(cfg, seed)`)."""
    return dict(hf_model(cfg, seed).state_dict())


def braid_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Qwen2ForCausalLM:
    model = Qwen2ForCausalLM(cfg)
    model.load_weights(weights)
    return model.eval()
