"""Architecture description shared by the model code and the loaders."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("qwen2", "llama", "qwen3", "mistral", "phi3", "smollm3")
HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
              "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
# Architectures whose config.json `sliding_window` applies to every layer when set (Qwen2's
# needs use_sliding_window as well, and is refused then).
SLIDING_WINDOW_ARCHITECTURES = ("mistral", "phi3")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Qwen2 / Llama / Qwen3 decoder, named as in Hugging Face
    config.json."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # QKV bias: True for Qwen2
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # RoPE scaling as config.json spells it: None (plain RoPE), linear or llama3
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # Mistral / Phi-3: each position attends to the last `sliding_window` positions. braid
    # attends to all of them, which is the same while a sequence fits the window: the
    # context is capped there (`max_context`; vLLM's --disable-sliding-window).
    sliding_window: int | None = None
    # SmolLM3: per layer, 1 where it applies RoPE and 0 where it does not (NoPE); None: all do
    no_rope_layers: list[int] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            low = 0 if name == "num_hidden_layers" else 1  # no layers: a tokenizer-only file
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                    or not 0 < float(value) < math.inf):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.sliding_window is not None and (not _is_token_id(self.sliding_window)
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 or null, got "
                             f"{self.sliding_window!r}")
        layers = self.no_rope_layers
        if layers is not None and (not isinstance(layers, list)
                                   or len(layers) != self.num_hidden_layers
                                   or any(v not in (0, 1) or isinstance(v, bool)
                                          for v in layers)):
            raise ValueError(f"no_rope_layers must be a 0 / 1 per layer "
                             f"({self.num_hidden_layers}), got {layers!r}")
        if not _is_token_id(self.max_position_embeddings) or self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be an integer >= 1, got "
                             f"{self.max_position_embeddings!r}")
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        scaling = self.rope_scaling
        if rope_scaling_kind(scaling) == "freq_factors":  # (a ValueError for unknown kinds)
            assert scaling is not None
            if len(scaling["factors"]) != self.head_dim // 2:
                raise ValueError(f"rope_scaling freq_factors: {self.head_dim // 2} factors "
                                 f"expected (head_dim / 2), got {len(scaling['factors'])}")
        eos = self.eos_token_id
        if not (self.bos_token_id is None or _is_token_id(self.bos_token_id)):
            raise ValueError(f"bos_token_id must be a token id, got {self.bos_token_id!r}")
        if not (eos is None or _is_token_id(eos)
                or (isinstance(eos, list) and all(_is_token_id(t) for t in eos))):
            raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (model_type qwen2, llama or qwen3).
        Fields that change the model's arithmetic in ways braid does not implement (RoPE
        scaling, a sliding window, another activation) are refused: ignoring them gave other
        logits."""
        _refuse_unimplemented(d)
        arch = d.get("model_type", "")
        heads = d["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=(heads if d.get("num_key_value_heads") is None
                                 else d["num_key_value_heads"]),
            head_dim=d.get("head_dim") or (
                d["hidden_size"] // heads if isinstance(heads, int) and heads > 0 else 0),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 1e4)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch == "qwen2"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            rope_scaling=_rope_scaling(d),
            sliding_window=(d.get("sliding_window") if arch in SLIDING_WINDOW_ARCHITECTURES
                            else None),
            no_rope_layers=_no_rope_layers(d) if arch == "smollm3" else None,
        )

    @property
    def max_context(self) -> int:
        """The longest sequence braid runs exactly: the model's positions, within its
        sliding window where it has one."""
        return min(self.max_position_embeddings,
                   self.sliding_window or self.max_position_embeddings)

    @property
    def context_limit(self) -> str:
        """What bounds `max_context`, in words (for errors)."""
        if self.max_context < self.max_position_embeddings:
            return ("its sliding_window: braid attends to every earlier position, the same "
                    "as the window only within it")
        return "its max_position_embeddings"

    @property
    def fused_weights(self) -> bool:
        """Checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj: Phi-3."""
        return self.architecture == "phi3"

    def rotates(self, layer: int) -> bool:
        """Whether decoder layer `layer` applies RoPE (SmolLM3's NoPE layers do not)."""
        return self.no_rope_layers is None or self.no_rope_layers[layer] == 1

    @property
    def qk_norm(self) -> bool:
        """Each query and key head is RMS-normalised (its own weights) before RoPE: Qwen3."""
        return self.architecture == "qwen3"

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict that `from_hf_dict` (and transformers) reads back."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "architecture"}
        d["model_type"] = self.architecture
        d["architectures"] = [HF_CLASSES[self.architecture]]
        d["hidden_act"] = "silu"
        d["pad_token_id"] = None  # (Phi-3's default, 32000, lies outside small vocabularies)
        d["torch_dtype"] = "float32"
        return d

    def num_parameters(self) -> int:
        """Weights of the model (a tied LM head counted once)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = (h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.attention_bias
                + 2 * self.head_dim * self.qk_norm)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ROPE_SCALINGS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                            "original_max_position_embeddings")}


def rope_scaling_kind(scaling: object) -> str | None:
    """None (plain RoPE) or the RoPE scaling braid runs ("linear", "llama3", with the keys
    transformers reads); ValueError naming anything else."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "freq_factors":  # a GGUF's rope_freqs tensor (llama.cpp's form of llama3)
        factors = scaling.get("factors")
        if not (isinstance(factors, list) and factors
                and all(isinstance(f, float) and 0 < f < math.inf for f in factors)):
            raise ValueError("rope_scaling freq_factors: factors must be a list of numbers > 0")
        return kind
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling of type {kind!r} is not supported (braid runs plain, "
                         "linear and llama3 RoPE)")
    for key in ROPE_SCALINGS[kind]:
        value = scaling.get(key)
        if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                or not 0 < float(value) < math.inf):
            raise ValueError(f"rope_scaling {kind}: {key} must be a number > 0, got {value!r}")
    return str(kind)


def _rope_scaling(d: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's rope_scaling, or transformers 5's rope_parameters (which also holds
    rope_theta) where it scales."""
    if d.get("rope_scaling") is not None:
        return d["rope_scaling"]
    parameters = d.get("rope_parameters")
    if isinstance(parameters, dict) and parameters.get("rope_type", "default") != "default":
        return parameters
    return None


def _no_rope_layers(d: dict[str, Any]) -> Any:
    """SmolLM3's RoPE layers as transformers reads them: the list, else every
    `no_rope_layer_interval`-th layer without."""
    if d.get("no_rope_layers") is not None:
        return d["no_rope_layers"]
    interval, layers = d.get("no_rope_layer_interval", 4), d.get("num_hidden_layers")
    if not isinstance(interval, int) or interval < 1 or not isinstance(layers, int):
        raise ValueError(f"no_rope_layer_interval must be an integer >= 1, got {interval!r}")
    return [int((i + 1) % interval != 0) for i in range(layers)]


def _refuse_unimplemented(d: dict[str, Any]) -> None:
    layers = d.get("num_hidden_layers")
    if d.get("use_sliding_window") and not (  # transformers: from layer max_window_layers on
            isinstance(layers, int) and d.get("max_window_layers", 0) >= layers):
        raise ValueError("use_sliding_window is not supported (braid attends to every "
                         "earlier position)")
    partial = d.get("partial_rotary_factor",
                    (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (braid rotates "
                         "every dimension of a head)")
    if (d.get("hidden_act") or "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (SiLU only)")


def _is_token_id(value: object) -> bool:
    """An integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
