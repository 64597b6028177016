"""Gemma 3 text decoder (Gemma3ForCausalLM: 270M, 1B, and the text layers of 4B-27B).

It is Qwen2ForCausalLM's model with Gemma's layer around the same attention and MLP:
- four norms a layer: before and after attention, before and after the MLP (the "after"
  norms apply to the sub-layer's output, before the residual add);
- every norm multiplies by (1 + weight): checkpoints store weight - 1; llama.cpp's GGUF files
  store 1 + weight (its loader gives them back as checkpoints have them), and braid keeps the
  multiplier, so a plain RMSNorm runs them;
- the MLP gates with GELU (tanh), the attention scales scores by 1 / sqrt(query_pre_attn_scalar),
  q and k heads are normalised before RoPE (ModelConfig.qk_norm);
- five of every six layers attend in a sliding window with RoPE base 10,000, the sixth to
  every position with the model's rope_theta and scaling (ModelConfig.layer_types);
- embeddings are scaled by sqrt(hidden_size); a final logit soft cap where the config sets one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import ModuleType

import torch
from torch import nn

from braid.kernels import kernel_isa
from braid.models.attention import AttentionMetadata
from braid.models.config import ModelConfig
from braid.models.quant import QuantWeight
from braid.models.qwen2 import (
    MLP,
    Attention,
    LinearFactory,
    Qwen2ForCausalLM,
    RMSNorm,
    compiled_projections,
)

Weight = tuple[str, torch.Tensor | QuantWeight]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory, layer: int = 0) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg, linear, layer)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(cfg, linear)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        x, h = self.pre_feedforward_layernorm.add_forward(
            x, self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta)))
        return x + self.post_feedforward_layernorm(self.mlp(h))

    def fused(self, ops: ModuleType) -> object:
        """This layer as one compiled call (ops.GemmaLayer: the operations of `forward` with
        quantized projections, bit for bit)."""
        attn = self.self_attn
        (qkv, o, gate_up, down), widths = compiled_projections(attn, self.mlp)
        norms = [n.weight.detach() for n in (
            self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm, attn.q_norm, attn.k_norm) if n is not None]
        return ops.GemmaLayer(norms, self.input_layernorm.eps, attn.num_heads, attn.num_kv_heads,
                              attn.kernel_scale, qkv, widths[0], o, gate_up, widths[2], down,
                              widths[3], kernel_isa())


class Gemma3ForCausalLM(Qwen2ForCausalLM):
    """Gemma 3's text model on Qwen2ForCausalLM's loading, LM head and KV cache."""

    layer_class = Gemma3DecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers' Gemma3TextScaledWordEmbedding: the scale in the embedding's dtype
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor, num_ids: int | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, num_ids)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        # (ids beyond num_ids stay -inf; greedy_tokens needs no cap: tanh keeps the order)
        return torch.where(logits.isfinite(), torch.tanh(logits / cap) * cap, logits)

    def load_weights(self, weights: Iterable[Weight]) -> None:
        """Checkpoint names and values (norm weights as weight - 1, see the module's doc)."""
        super().load_weights(_norm_multipliers(weights))


def _norm_multipliers(weights: Iterable[Weight]) -> Iterator[Weight]:
    """Each norm's stored weight w as the multiplier 1 + w its RMSNorm runs (in the model's
    dtype: a bfloat16 model rounds it, where transformers adds in float32 at each call)."""
    for name, tensor in weights:
        if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
            tensor = tensor.float() + 1.0
        yield name, tensor
