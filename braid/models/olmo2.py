"""OLMo 2 decoder (Olmo2ForCausalLM: OLMo-2 1B-32B).

It is Qwen2ForCausalLM's model with OLMo 2's layer around the same MLP:
- no norm before attention or the MLP: each sub-layer's output is normalised before its
  residual add (post_attention_layernorm, post_feedforward_layernorm);
- the queries and the keys are RMS-normalised across all their heads at once (q_norm over
  num_heads * head_dim values, k_norm over num_key_value_heads * head_dim), before RoPE.
Its quantized layers run as modules (QuantLinear products) rather than one compiled call.
"""

from __future__ import annotations

import torch
from torch import nn

from braid.models.attention import AttentionMetadata
from braid.models.config import ModelConfig
from braid.models.qwen2 import MLP, Attention, LinearFactory, Qwen2ForCausalLM, RMSNorm


class Olmo2Attention(Attention):
    """Attention whose q and k are each normalised over their whole width."""

    def __init__(self, cfg: ModelConfig, linear: LinearFactory, layer: int = 0) -> None:
        super().__init__(cfg, linear, layer)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        assert self.q_norm is not None and self.k_norm is not None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v], dim=-1)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory, layer: int = 0) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Olmo2Attention(cfg, linear, layer)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg, linear)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(Qwen2ForCausalLM):
    """OLMo 2 on Qwen2ForCausalLM's loading, LM head and KV cache."""

    layer_class = Olmo2DecoderLayer
