"""Qwen2 / Llama decoder over one flat batch of query tokens (see attention.py's contract).

One class serves both architectures: they differ only in the QKV bias (Qwen2 has one) and in
config values. Q/K/V and gate/up projections are fused so each layer runs 4 matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any, cast

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from braid.files import ModelLoadError
from braid.kernels import kernel_isa, quant_ops
from braid.models.attention import AttentionMetadata, attend_cached, paged_attention
from braid.models.config import ModelConfig, rope_scaling_kind
from braid.models.quant import (
    QuantEmbedding,
    QuantLinear,
    QuantWeight,
    bits_per_value,
    quantize_float,
    weights_to_huge_pages,
)

# Batch-size hint for oneDNN's weight layout: 4-16 token forwards (verification windows) are
# what speculation relies on being as cheap as a 1-token decode.
PACK_HINT = 16
# oneDNN runs a packed weight through a slower kernel when the input has 1 or 2 rows (see
# docs/benchmarks.md): smaller inputs are padded with zero rows to this many, which costs
# nothing (the forward streams the weight either way).
PACK_MIN_ROWS = 4
# Two-stage greedy head (Qwen2ForCausalLM.add_coarse_head): token ids whose coarse (Q4_0)
# logit is within this many of the row's best are scored again with the exact head. On the
# default draft (Q8_0 head) the exact argmax's coarse logit trailed the coarse maximum by at
# most 1.48 over 2,363 HumanEval and ShareGPT positions (0.87 at the 99.9th percentile),
# leaving 7 candidates a row on average (docs/benchmarks.md, The draft's LM head).
COARSE_MARGIN = 3.0
MAX_RESCORED = 4096  # candidates in one forward beyond which the exact head runs whole
KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the kernels read


class Linear(nn.Linear):
    """nn.Linear whose weight can be repacked once into oneDNN's blocked layout on CPU.

    Plain MKL sgemm repacks the weight on every call with more than one row, which makes a
    4-token forward cost about twice a 1-token one; the prepacked kernel keeps small batches at
    the memory-bandwidth cost of a decode (see benchmarks/bench_model.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_HINT)
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if rows < PACK_MIN_ROWS:
            x = F.pad(x, (0, 0, 0, PACK_MIN_ROWS - rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [],
                                                  "")[:rows]


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); without it
    oneDNN emulates bf16 and a bf16 matmul is several times slower than fp32."""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)()
               for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and (dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # The compiled one-pass kernel (quantized models: their int8 activations make its
        # last-bit differences from torch's irrelevant; float models stay torch's, which
        # transformers' reference matches).
        self.compiled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = quant_ops() if self.compiled and x.dtype == torch.float32 else None
        if ops is not None and x.device.type == "cpu":
            return ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, the norm of it): a residual add and the norm after it (the compiled
        kernel adds in place, in one pass, with the same results)."""
        ops = quant_ops() if self.compiled and x.dtype == torch.float32 else None
        if ops is not None and x.device.type == "cpu" and x.is_contiguous():
            return x, ops.add_rms_norm_(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self.forward(x)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half), as in Hugging Face Qwen2/Llama/Phi-3, with
    their linear, llama3, LongRoPE and YaRN scalings of the frequencies (`scaling`: config.json's
    rope_scaling; `long`: LongRoPE's long factors, else its short ones).

    A partial one (`rotary_dim` < head_dim, Phi-4-mini) turns the first rotary_dim
    dimensions of each head, pairing i with i + rotary_dim / 2. The tables stay D/2 wide, pairing
    i with i + D/2 as the kernels do: their columns past rotary_dim / 2 are an identity (cos 1,
    sin 0) for heads whose dimensions the loader reordered to match (`rotary_order`)."""

    cos: torch.Tensor  # [P, D/2]
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None, rotary_dim: int | None = None,
                 long: bool = False) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.scaling, self.long = scaling, long
        self.rotary_dim = rotary_dim or head_dim
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables in float64, in place (also after `to_empty`)."""
        if self.cos.is_meta:
            return
        r = self.rotary_dim
        inv_freq = scaled_frequencies(self.theta, r, self.scaling, self.long)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv_freq)
        scale = rope_attention_factor(self.scaling, self.max_positions)
        self.cos.fill_(1.0)  # (the columns of a partial embedding's pass dimensions)
        self.sin.zero_()
        self.cos[:, : r // 2].copy_(freqs.cos() * scale)  # [P, R/2]
        self.sin[:, : r // 2].copy_(freqs.sin() * scale)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] of these positions (looked up once per forward)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor | None:
    """For a partial rotary embedding: the order of a query or key head's dimensions that
    pairs each rotated i with i + D/2 (where the full embedding's kernels pair them), the pass
    dimensions between; None where every dimension turns. Reordering the query's and the
    key's the same way leaves every score as it was."""
    if rotary_dim == head_dim:
        return None
    half, rot = head_dim // 2, rotary_dim // 2
    passing = torch.arange(rotary_dim, head_dim)
    npass = half - rot
    return torch.cat([torch.arange(rot), passing[:npass], torch.arange(rot, rotary_dim),
                      passing[npass:]])


def rope_attention_factor(scaling: dict[str, Any] | None, max_positions: int) -> float:
    """What LongRoPE and YaRN multiply cos and sin by (transformers' attention_factor: the
    config's, else from the factor: sqrt(1 + ln(factor) / ln(original context)) for LongRoPE,
    whose factor is the config's or max_position_embeddings / original context;
    0.1 ln(factor) + 1 for YaRN, or the ratio of two such with its mscale and mscale_all_dim);
    1 for the other scalings."""
    kind = rope_scaling_kind(scaling)
    if kind not in ("longrope", "yarn"):
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    if kind == "longrope":
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()


def scaled_frequencies(theta: float, dim: int, scaling: dict[str, Any] | None,
                       long: bool = False) -> torch.Tensor:
    """The rotary frequencies of `dim` dimensions (float64), under transformers' linear,
    llama3, LongRoPE or YaRN scaling: linear divides them all by the factor; llama3 divides
    the low ones (wavelengths beyond the original context / low_freq_factor), keeps the high
    ones (below it / high_freq_factor) and blends the ones between; LongRoPE divides each by
    its own factor, from the long list (`long`) or the short one; YaRN keeps the frequencies
    that turn more than beta_fast times over the original context, divides those that turn
    less than beta_slow times by the factor, and ramps between them. A llama3 GGUF holds the
    same as one divisor per frequency (its rope_freqs tensor: "freq_factors")."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = rope_scaling_kind(scaling)
    if kind is None:
        return inv_freq
    assert scaling is not None
    if kind in ("freq_factors", "longrope"):  # each frequency divided by its own factor
        key = "factors" if kind == "freq_factors" else "long_factor" if long else "short_factor"
        return inv_freq / torch.tensor(scaling[key], dtype=inv_freq.dtype)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    original = float(scaling["original_max_position_embeddings"])
    if kind == "yarn":
        return _yarn(inv_freq, theta, dim, factor, original, scaling)
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(between, blended, scaled)


def _yarn(inv_freq: torch.Tensor, theta: float, dim: int, factor: float, original: float,
          scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's frequencies, as transformers computes them (its correction range: the
    dimensions whose frequencies turn beta_fast and beta_slow times over the original
    context, rounded outwards unless `truncate` is false)."""
    def dimension(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = dimension(float(scaling.get("beta_fast") or 32))
    high = dimension(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low)
            / (high - low if high != low else 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> x rotated by the tables of `RotaryEmbedding.tables` (on the CPU in
    float32, the compiled kernel in place of seven small ops: the same arithmetic)."""
    ops = quant_ops() if x.device.type == "cpu" and x.dtype == cos.dtype == torch.float32 \
        else None
    if ops is not None:
        x = x.contiguous()
        ops.rotate_(x, cos, sin)
        return x
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


LinearFactory = type[Linear] | type[QuantLinear]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory = Linear, layer: int = 0) -> None:
        super().__init__()
        self.window = cfg.layer_window(layer)  # None: attends to every earlier position
        self.kv_group = 0  # its layer group's block tables (KVLayout), bound by the runner
        self.scale = cfg.attention_scale  # None: 1 / sqrt(head_dim)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = linear(self.q_size, cfg.hidden_size, bias=False)
        # Qwen3: each q and k head RMS-normalised before RoPE
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_cache = torch.empty(0)  # [num_slots, KVH, D], bound by the runner
        self.v_cache = torch.empty(0)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self._norm_heads(self.qkv_proj(x))
        meta = meta.for_layer(self.kv_group, self.window)
        ops = quant_ops() if qkv.device.type == "cpu" and qkv.dtype == rope[0].dtype \
            == torch.float32 and self.k_cache.dtype in KV_CACHE_DTYPES else None
        if ops is not None and meta.kv_slots is not None:
            # q and k rotated, k and v written to the cache, in one pass (same arithmetic)
            q = ops.rope_qkv_to_cache(qkv, *rope, self.k_cache, self.v_cache,
                                      meta.slot_mapping, self.num_heads)
            return self.o_proj(attend_cached(q, self.k_cache, self.v_cache, meta, self.scale)
                               .flatten(1))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads rotated together: [T, H + KVH, D]
        qk = rotate(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(out.flatten(1))

    @property
    def kernel_scale(self) -> float:
        """What scores are scaled by, as the compiled layers take it (attend_cached's
        default where the model sets none)."""
        return self.scale if self.scale is not None else self.head_dim ** -0.5

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, q + 2 kv] with each q and k head normalised (Qwen3), else as it is."""
        if self.q_norm is None or self.k_norm is None:
            return qkv
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return torch.cat([q, k, v], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory = Linear) -> None:
        super().__init__()
        self.gate_up_proj = linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.gemma  # GELU (tanh) gating; else SiLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if isinstance(self.down_proj, QuantLinear):  # the compiled layer's activation
            ops = quant_ops()
            assert ops is not None, "QuantLinear needs the compiled kernels"
            rows = gate_up.reshape(-1, gate_up.shape[-1])
            act = ops.gelu_mul if self.gelu else ops.silu_mul
            return self.down_proj(act(rows, kernel_isa()).reshape(*gate_up.shape[:-1], -1))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, linear: LinearFactory = Linear, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, linear, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, linear)
        self.residual_scale = cfg.residual_multiplier  # Granite's (None: 1)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        x, h = self.post_attention_layernorm.add_forward(
            x, self._scaled(self.self_attn(self.input_layernorm(x), rope, meta)))
        return x + self._scaled(self.mlp(h))

    def _scaled(self, delta: torch.Tensor) -> torch.Tensor:
        return delta if self.residual_scale is None else delta * self.residual_scale

    def fused(self, ops: ModuleType) -> object:
        """This layer as one compiled call (ops.FusedLayer: the same operations as `forward`
        with quantized projections, bit for bit)."""
        attn = self.self_attn
        (qkv, o, gate_up, down), widths = compiled_projections(attn, self.mlp)
        bias = attn.qkv_proj.bias
        head_norms = [None if n is None else n.weight.detach() for n in (attn.q_norm, attn.k_norm)]
        return ops.FusedLayer(
            self.input_layernorm.weight.detach(), self.post_attention_layernorm.weight.detach(),
            self.input_layernorm.eps, attn.num_heads, qkv, None if bias is None else bias.detach(),
            widths[0], o, gate_up, widths[2], down, widths[3], *head_norms, attn.num_kv_heads,
            attn.kernel_scale, self.residual_scale or 1.0, kernel_isa())


Segments = list[tuple[int, torch.Tensor, int, int, int]]


def compiled_projections(attn: Attention, mlp: MLP) -> tuple[list[Segments], list[int]]:
    """A quantized layer's four projections (qkv, o, gate_up, down) as the compiled layers
    take them: each one's segments (first output row, blocks, kernel layout, values per row,
    GGML type), and each one's output width."""
    parts = [cast(QuantLinear, m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                             mlp.down_proj)]
    segments = [[(offset, w.data, w.layout, w.cols, int(w.qtype)) for offset, w in m.segments]
                for m in parts]
    return segments, [m.out_features for m in parts]


class DroppedLayer(nn.Module):
    """A part (a decoder layer, the embedding, the LM head) another pipeline stage runs."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError(f"{self.what} runs on another pipeline stage")


class Qwen2ForCausalLM(nn.Module):
    """Qwen2 (QKV bias) or Llama (no bias) causal LM; `forward` returns hidden states and
    `compute_logits` projects only the rows the caller needs.

    With `quant_type` (a GGML block format) the embedding, the projections and the LM head
    hold quantized weights: GGUF blocks load as they are, float tensors are quantized to
    `quant_type`, and a tied LM head shares the embedding's blocks."""

    embed_tokens: nn.Embedding | QuantEmbedding
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(self, cfg: ModelConfig, quant_type: GGMLQuantizationType | None = None
                 ) -> None:
        super().__init__()
        self.config = cfg
        self.quant_type = quant_type
        linear: LinearFactory = Linear if quant_type is None else QuantLinear
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if quant_type is None
                             else QuantEmbedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(cfg, linear, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, cfg.rotary_dim, cfg.long_rope)
        # Gemma 3's windowed layers rotate with their own base, unscaled
        self.local_rotary = (None if cfg.rope_local_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta))
        self.lm_head = (
            None if cfg.tie_word_embeddings and quant_type is None
            else linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.compiled = quant_type is not None
        self.coarse_head: QuantLinear | None = None  # see add_coarse_head
        # Quantized layers run as single compiled calls where they can (see `_fused_layers`);
        # False keeps the modules' forward (tests compare the two).
        self.fuse_layers = True
        self._fused: dict[int, object] | None = None  # compiled layers by index

    @property
    def dtype(self) -> torch.dtype:
        """Activations' (and the KV cache's) dtype."""
        return self.norm.weight.dtype

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (before the final norm)."""
        return self.forward_layers(self.embed(input_ids), positions, attn_metadata,
                                   range(len(self.layers)))

    def forward_layers(self, x: torch.Tensor, positions: torch.Tensor,
                       attn_metadata: AttentionMetadata, layers: range) -> torch.Tensor:
        """Hidden states [T, hidden] through the decoder layers `layers` (all of them, or a
        pipeline stage's share)."""
        ropes = self._layer_ropes(positions)
        fused = self._fused_layers(x, attn_metadata, layers)
        if fused is not None:
            for i in layers:
                attn = cast(DecoderLayer, self.layers[i]).self_attn  # get_submodule is slow
                meta = attn_metadata.for_layer(attn.kv_group, attn.window)
                x = fused[i].forward(x, attn.k_cache, attn.v_cache,  # type: ignore[attr-defined]
                                     *ropes[i], meta.slot_mapping, meta.kv_slots, meta.row_seq,
                                     meta.row_len, meta.row_start)
            return x
        for i in layers:
            x = self.layers[i](x, ropes[i], attn_metadata)
        return x

    def keep_layers(self, layers: range, ends: bool = True) -> None:
        """Drop the decoder layers outside `layers` (a pipeline stage keeps its own: their
        weights are freed; running another one is an error); without `ends` (a later stage:
        the first embeds the tokens and scores the rows) the embedding and LM head too."""
        for i in range(len(self.layers)):
            if i not in layers:
                self.layers[i] = DroppedLayer(f"decoder layer {i}")
        if not ends:
            self.embed_tokens = cast(nn.Embedding, DroppedLayer("the embedding"))
            self.lm_head = cast(Linear, DroppedLayer("the LM head"))
            self.coarse_head = None
        self._fused = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input tokens' embeddings [T, hidden] (times Granite's embedding_multiplier)."""
        x = self.embed_tokens(input_ids)
        scale = self.config.embedding_multiplier
        return x if scale is None else x * scale

    def _layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rotary tables: a NoPE layer (SmolLM3) gets cos 1 and sin 0, a rotation
        that leaves q and k exactly as they are, so every layer runs the same kernels; a
        windowed layer with its own base (Gemma 3) the local tables."""
        rope = self.rotary.tables(positions)
        cfg = self.config
        if cfg.no_rope_layers is None and self.local_rotary is None:
            return [rope] * len(self.layers)
        identity = (torch.ones_like(rope[0]), torch.zeros_like(rope[1]))
        local = None if self.local_rotary is None else self.local_rotary.tables(positions)
        return [identity if not cfg.rotates(i)
                else local if local is not None and cfg.layer_window(i) is not None
                else rope for i in range(len(self.layers))]

    def _fused_layers(self, x: torch.Tensor, meta: AttentionMetadata, layers: range
                      ) -> dict[int, object] | None:
        """The layers as compiled calls, where every operation has its compiled form:
        quantized weights, float32 activations on the CPU, a KV cache the kernels read
        (float32, float16 or bfloat16) and the row-by-row attention's metadata; None
        elsewhere (the modules run)."""
        if (not self.fuse_layers or self.quant_type is None or meta.kv_slots is None
                or not hasattr(self.layer_class, "fused")  # (OLMo 2's layer has none)
                or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous()
                or not layers
                or cast(DecoderLayer, self.layers[layers[0]]).self_attn.k_cache.dtype
                not in KV_CACHE_DTYPES):
            return None
        ops = quant_ops()
        if ops is None:
            return None
        if self._fused is None:
            self._fused = {}
        for i in layers:
            if i not in self._fused:
                self._fused[i] = cast(DecoderLayer, self.layers[i]).fused(ops)
        return self._fused

    def compute_logits(self, hidden: torch.Tensor, num_ids: int | None = None) -> torch.Tensor:
        """hidden [N, hidden] (rows already selected) -> logits [N, vocab] float32; with
        `num_ids`, only token ids below it are scored (the LM head's first rows) and the
        others get -inf."""
        vocab = self.config.vocab_size
        x = self.norm(hidden)
        n = vocab if num_ids is None else min(num_ids, vocab)
        if self.lm_head is None:
            assert isinstance(self.embed_tokens, nn.Embedding)
            logits = F.linear(x, self.embed_tokens.weight[:n])
        elif isinstance(self.lm_head, QuantLinear):
            logits = self.lm_head(x, n)
        elif n == vocab:
            logits = self.lm_head(x)
        elif self.lm_head.weight is not None:
            logits = F.linear(x, self.lm_head.weight[:n])
        else:  # packed for oneDNN (pack_linear_weights): the whole product, its first ids
            logits = self.lm_head(x)[:, :n]
        if self.config.logits_scaling is not None:  # Granite's (-inf stays -inf)
            logits = logits / self.config.logits_scaling
        if n == vocab:
            return logits.float()
        out = logits.new_full((logits.shape[0], vocab), float("-inf"), dtype=torch.float32)
        out[:, :n] = logits
        return out

    def add_coarse_head(self) -> bool:
        """Give `greedy_tokens` a coarse copy of the LM head: its values as Q4_0 (4.5 bits a
        value against the Q8_0 head's 8.5), which finds the few candidate ids that the exact
        head then scores. For a draft model, whose argmax is all speculation asks of it and
        whose head is a large part of its bytes (the default draft's Q8_0 head: 145 of its
        491 MB; the coarse copy adds 77 MB). False (nothing built) where the head is not one
        quantized matrix wider than Q4_0."""
        if self.coarse_head is not None:
            return True
        head = self._head_weight()
        if head is None or bits_per_value(head.qtype) <= bits_per_value(GGMLQuantizationType.Q4_0):
            return False
        coarse = QuantLinear(head.cols, head.rows)
        coarse.set_rows(0, head.requantized(GGMLQuantizationType.Q4_0))
        weights_to_huge_pages([coarse])
        self.coarse_head = coarse
        return True

    def _head_weight(self) -> QuantWeight | None:
        """The LM head where it is one quantized matrix without bias (else None)."""
        head = self.lm_head
        if not isinstance(head, QuantLinear) or head.bias is not None or len(head.segments) != 1:
            return None
        offset, w = head.segments[0]
        return w if offset == 0 and w.rows == self.config.vocab_size else None

    def greedy_tokens(self, hidden: torch.Tensor, num_ids: int | None = None) -> torch.Tensor:
        """hidden [N, hidden] -> each row's argmax token id (the lowest id on a tie), as
        compute_logits(hidden, num_ids).argmax(-1) would give. With a coarse head, the exact
        head scores only the ids whose coarse logit is within COARSE_MARGIN of their row's
        best: the same argmax unless the coarse error exceeds that margin (never seen on
        the default draft); a draft's tokens are verified either way."""
        head = self._head_weight()
        if self.coarse_head is None or head is None:
            return self.compute_logits(hidden, num_ids).argmax(dim=-1)
        x = self.norm(hidden).float()
        coarse = self.coarse_head(x, num_ids)
        rows, ids = (coarse >= coarse.amax(dim=1, keepdim=True) - COARSE_MARGIN).nonzero(
            as_tuple=True)
        if ids.numel() > MAX_RESCORED:
            return self.compute_logits(hidden, num_ids).argmax(dim=-1)
        subset, where = head.take_rows(ids)
        scores = subset.matmul(x)[rows, where]
        n = x.shape[0]
        best = torch.full((n,), float("-inf")).scatter_reduce(0, rows, scores, "amax")
        winners = torch.where(scores == best[rows], ids, self.config.vocab_size)
        return torch.full((n,), self.config.vocab_size).scatter_reduce(0, rows, winners, "amin")

    def weight_bytes(self) -> int:
        """Bytes of weights a forward streams (packed projections included)."""
        tensors: list[torch.Tensor] = list(self.parameters())
        tensors += [m.packed for m in self.modules() if isinstance(m, Linear)
                    and m.packed is not None]
        quantized = sum(m.weight_bytes() for m in self.modules()
                        if isinstance(m, QuantLinear) and m is not self.coarse_head)
        return sum(t.numel() * t.element_size() for t in tensors) + quantized

    @torch.no_grad()
    def pack_linear_weights(self) -> None:
        """Repack every projection for the CPU kernels (after loading; weights become opaque).
        A tied LM head gets its own packed copy: the embedding lookup needs the plain one."""
        if self.lm_head is None:
            cfg = self.config
            with torch.device("meta"):
                self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            assert isinstance(self.embed_tokens, nn.Embedding)
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def bind_kv_cache(self, kv_cache: torch.Tensor, layers: range | None = None,
                      rows: Mapping[int, int] | None = None,
                      kv_groups: Sequence[int] | None = None) -> None:
        """kv_cache [rows, 2, num_slots, KVH, D]; each of `layers` (default: every layer)
        gets views of its row (`rows[layer]`, by default its place in `layers`) and reads
        its layer group's block tables (`kv_groups[layer]`, by default group 0)."""
        layers = range(len(self.layers)) if layers is None else layers
        for j, i in enumerate(layers):
            attn = cast(Attention, self.layers[i].get_submodule("self_attn"))
            row = j if rows is None else rows[i]
            attn.k_cache = kv_cache[row, 0]
            attn.v_cache = kv_cache[row, 1]
            attn.kv_group = 0 if kv_groups is None else kv_groups[i]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
        """Load Hugging Face named tensors (or quantized blocks) one at a time, fusing q/k/v
        and gate/up; a weight the config does not describe, of another shape, or missing is a
        ModelLoadError (a config.json that does not match its checkpoint)."""
        params = dict(self.named_parameters())
        shapes = _expected_shapes(self.config)
        loaded: set[str] = set()
        for name, tensor in weights:
            target, offset = _fused_target(name, self.config)
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name not in shapes:
                raise ModelLoadError(f"unexpected weight {name!r} for this config "
                                     f"({self.config.architecture}, "
                                     f"{self.config.num_hidden_layers} layers)")
            shape = ((tensor.rows, tensor.cols) if isinstance(tensor, QuantWeight)
                     else tuple(tensor.shape))
            if shape != shapes[name]:
                raise ModelLoadError(f"weight {name!r} is {list(shape)} where the config "
                                     f"makes it {list(shapes[name])}")
            if (rows := _rotary_rows(name, self.config)) is not None:
                tensor = (QuantWeight(tensor.data[rows], tensor.qtype, tensor.cols, tensor.layout)
                          if isinstance(tensor, QuantWeight) else tensor[rows])
            module = self.get_submodule(target.rsplit(".", 1)[0])
            if isinstance(module, QuantLinear | QuantEmbedding) and target.endswith(".weight"):
                module.set_rows(offset, self._quantized(tensor, target.startswith("layers.")))
            elif target in params:
                if isinstance(tensor, QuantWeight):
                    tensor = tensor.dequantize()
                params[target][offset : offset + tensor.shape[0]].copy_(tensor)
            else:
                raise ModelLoadError(f"unexpected weight {name!r} for "
                                     f"{self.config.architecture}")
            loaded.add(name)
        missing = set(shapes) - loaded - ({"lm_head.weight"} if self.config.tie_word_embeddings
                                          else set())
        if missing:
            raise ModelLoadError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
        self._fused = None  # built again from the new weights on the next forward
        self.coarse_head = None  # a copy of the old head (add_coarse_head builds it again)
        if self.config.tie_word_embeddings and isinstance(self.lm_head, QuantLinear):
            assert isinstance(self.embed_tokens, QuantEmbedding) and self.embed_tokens.quant
            self.lm_head.segments = [(0, self.embed_tokens.quant)]
        if self.quant_type is not None and next(self.parameters()).device.type == "cpu":
            weights_to_huge_pages(self.modules())

    def _quantized(self, tensor: torch.Tensor | QuantWeight, projection: bool) -> QuantWeight:
        """Float tensors as `quant_type` blocks; GGUF blocks as they are, except a decoder
        layer's projection stored in a wider format than `quant_type` (`--quantization int4`
        on a GGUF: its layers in formats of more bits a value than Q4_0, Q4_1 to Q8_0, become
        Q4_0; the embedding and the LM head keep the file's format)."""
        assert self.quant_type is not None
        if not isinstance(tensor, QuantWeight):
            return quantize_float(tensor, self.quant_type)
        if projection and bits_per_value(tensor.qtype) > bits_per_value(self.quant_type):
            return quantize_float(tensor.dequantize(), self.quant_type)
        return tensor


_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _fused_target(name: str, cfg: ModelConfig) -> tuple[str, int]:
    """HF name -> (our parameter name, row offset inside the fused parameter)."""
    name = name.removeprefix("model.")
    parts = name.split(".")
    if len(parts) < 4 or parts[-2] not in _FUSED:
        return name, 0
    fused, idx = _FUSED[parts[-2]]
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    offsets = (0, q_size, q_size + kv_size) if fused == "qkv_proj" else (0, cfg.intermediate_size)
    return ".".join([*parts[:-2], fused, parts[-1]]), offsets[idx]


def _rotary_rows(name: str, cfg: ModelConfig) -> torch.Tensor | None:
    """For a partial rotary embedding, the rows of weight `name` in the order the model runs
    them: each query and key head's dimensions in `rotary_order` (q_proj, k_proj, their
    biases and head norms, Phi-3's fused qkv_proj); None for every other weight."""
    order = rotary_order(cfg.head_dim, cfg.rotary_dim)
    parts = name.split(".")
    if order is None or len(parts) < 2 or parts[-2] not in (
            "q_proj", "k_proj", "q_norm", "k_norm", "qkv_proj"):
        return None
    if parts[-2] in ("q_norm", "k_norm"):
        return order
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads,
             "qkv_proj": cfg.num_attention_heads + cfg.num_key_value_heads}[parts[-2]]
    rows = (torch.arange(heads)[:, None] * cfg.head_dim + order).flatten()
    if parts[-2] == "qkv_proj":  # q and k heads reordered, v's rows as they are
        rows = torch.cat([rows, torch.arange(cfg.num_key_value_heads * cfg.head_dim)
                          + len(rows)])
    return rows


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF names a checkpoint for this config provides, and their shapes (lm_head.weight
    is optional with tied embeddings)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                          "model.norm.weight": (h,),
                                          "lm_head.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.o_proj.weight": (h, q), p + "mlp.down_proj.weight": (h, inter)}
        if cfg.fused_weights:  # stored as the model runs them
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                       p + "mlp.gate_up_proj.weight": (2 * inter, h)}
        else:
            shapes |= {p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,),
                       p + "self_attn.k_norm.weight": (cfg.head_dim,)}
        if cfg.gemma:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,),
                       p + "post_feedforward_layernorm.weight": (h,)}
        if cfg.olmo:  # q and k normalised whole; no norm before a sub-layer
            del shapes[p + "input_layernorm.weight"]
            shapes |= {p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,),
                       p + "post_feedforward_layernorm.weight": (h,)}
    return shapes
