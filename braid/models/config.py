"""Architecture description shared by the model code and the loaders."""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("qwen2", "llama", "qwen3", "mistral", "phi3", "smollm3", "gemma3",
                           "granite", "ministral", "olmo2", "olmo3")
HF_CLASSES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
              "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
              "gemma3": "Gemma3ForCausalLM", "granite": "GraniteForCausalLM",
              "ministral": "MinistralForCausalLM", "olmo2": "Olmo2ForCausalLM",
              "olmo3": "Olmo3ForCausalLM"}
HF_MODEL_TYPES = {"gemma3": "gemma3_text"}  # config.json's model_type where it is not the name
# Architectures whose config.json `sliding_window` applies (to every layer, or to the layers
# `layer_types` names; Qwen2's needs use_sliding_window as well, and is refused then).
SLIDING_WINDOW_ARCHITECTURES = ("mistral", "phi3", "gemma3", "ministral", "olmo3")
# Architectures whose config.json gives each layer type its own RoPE (rope_parameters by
# "full_attention" / "sliding_attention"): the windowed layers run theirs unscaled
TYPED_ROPE_ARCHITECTURES = ("gemma3", "olmo3")
# OLMo 3: every fourth layer attends globally, the others in the window (transformers')
OLMO3_GLOBAL_EVERY = 4
LAYER_TYPES = ("sliding_attention", "full_attention")
# Architectures whose RoPE may turn only the first part of each head (Phi-4-mini's
# partial_rotary_factor)
PARTIAL_ROTARY_ARCHITECTURES = ("phi3",)
GRANITE_FIELDS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                  "logits_scaling")
# Gemma 3: every sixth layer attends globally, the others in the window (transformers'
# sliding_window_pattern and llama.cpp's, for files that do not list the layers)
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder of one of SUPPORTED_ARCHITECTURES, named as in Hugging Face
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
    # RoPE scaling as config.json spells it: None (plain RoPE), linear, llama3, longrope
    # (Phi-3.5 / Phi-4-mini) or yarn (Qwen's long contexts), with its
    # original_max_position_embeddings inside
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # Phi-4-mini: RoPE turns the first `rotary_dim` dimensions of each head, the rest pass
    partial_rotary_factor: float = 1.0
    # The longest sequence the model is served with (--max-model-len; None: its
    # max_position_embeddings). LongRoPE takes its long factors where this exceeds the
    # original context and its short ones otherwise, as llama.cpp chooses by its context size
    # (transformers chooses by each forward's length). Not part of config.json.
    context_length: int | None = field(default=None, hash=False, compare=False)
    # Mistral / Phi-3 / Gemma 3: a windowed layer's query attends to the last
    # `sliding_window` positions, its own included (`layer_window`)
    sliding_window: int | None = None
    # SmolLM3: per layer, 1 where it applies RoPE and 0 where it does not (NoPE); None: all do
    no_rope_layers: list[int] | None = field(default=None, hash=False)
    # Gemma 3: each layer "sliding_attention" (in the window, RoPE base rope_local_theta) or
    # "full_attention" (every position, rope_theta and rope_scaling); None: every layer in
    # the window where there is one
    layer_types: list[str] | None = field(default=None, hash=False)
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # scores scaled by its 1/sqrt (else head_dim's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Granite: embeddings times embedding_multiplier, each sub-layer's output times
    # residual_multiplier before its residual add, scores times attention_multiplier (in
    # place of 1 / sqrt(head_dim)), logits divided by logits_scaling
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None

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
        self._check_gemma_fields()
        if not _is_token_id(self.max_position_embeddings) or self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be an integer >= 1, got "
                             f"{self.max_position_embeddings!r}")
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_rope()
        eos = self.eos_token_id
        if not (self.bos_token_id is None or _is_token_id(self.bos_token_id)):
            raise ValueError(f"bos_token_id must be a token id, got {self.bos_token_id!r}")
        if not (eos is None or _is_token_id(eos)
                or (isinstance(eos, list) and all(_is_token_id(t) for t in eos))):
            raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}")

    def _check_rope(self) -> None:
        partial = self.partial_rotary_factor
        if (not isinstance(partial, numbers.Real) or isinstance(partial, bool)
                or not 0 < partial <= 1):
            raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {partial!r}")
        if partial != 1 and self.architecture not in PARTIAL_ROTARY_ARCHITECTURES:
            raise ValueError(f"partial_rotary_factor {partial} is not supported for "
                             f"{self.architecture} (braid rotates part of a head for "
                             f"{', '.join(PARTIAL_ROTARY_ARCHITECTURES)})")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {partial} rotates {self.rotary_dim} of "
                             f"head_dim {self.head_dim}: not an even number >= 2")
        if self.context_length is not None and (not _is_token_id(self.context_length)
                                                or self.context_length < 1):
            raise ValueError(f"context_length must be an integer >= 1, got "
                             f"{self.context_length!r}")
        scaling = self.rope_scaling
        kind = rope_scaling_kind(scaling)  # (a ValueError for unknown kinds)
        lists = {"freq_factors": ("factors",), "longrope": ("long_factor", "short_factor")}
        for key in lists.get(kind or "", ()):
            assert scaling is not None
            if len(scaling[key]) != self.rotary_dim // 2:
                raise ValueError(f"rope_scaling {kind}: {key} needs {self.rotary_dim // 2} "
                                 f"factors (one per rotary frequency), got {len(scaling[key])}")

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head RoPE turns (all but where partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def long_rope(self) -> bool:
        """Whether LongRoPE runs with its long factors (see `context_length`)."""
        scaling = self.rope_scaling
        if rope_scaling_kind(scaling) != "longrope":
            return False
        assert scaling is not None
        context = self.context_length or self.max_position_embeddings
        return context > int(scaling["original_max_position_embeddings"])

    def _check_gemma_fields(self) -> None:
        types = self.layer_types
        if types is not None and (not isinstance(types, list)
                                  or len(types) != self.num_hidden_layers
                                  or any(t not in LAYER_TYPES for t in types)):
            raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} per layer "
                             f"({self.num_hidden_layers}), got {types!r}")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping",
                     "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                     "logits_scaling"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Real)
                                      or isinstance(value, bool)
                                      or not 0 < float(value) < math.inf):
                raise ValueError(f"{name} must be a number > 0 or null, got {value!r}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (a model_type of SUPPORTED_ARCHITECTURES,
        Gemma 3's spelled gemma3_text).
        Fields that change the model's arithmetic in ways braid does not implement (RoPE
        scaling, a sliding window, another activation) are refused: ignoring them gave other
        logits."""
        _refuse_unimplemented(d)
        arch = {hf: name for name, hf in HF_MODEL_TYPES.items()}.get(d.get("model_type", ""),
                                                                     d.get("model_type", ""))
        heads = d["num_attention_heads"]
        gemma = arch == "gemma3"
        typed = "full_attention" if arch in TYPED_ROPE_ARCHITECTURES else None
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
            rope_theta=_rope_theta(d, typed, 1e6 if gemma else 1e4),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=d.get("tie_word_embeddings", gemma),
            attention_bias=d.get("attention_bias", arch == "qwen2"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            rope_scaling=_rope_scaling(d, typed),
            partial_rotary_factor=d.get("partial_rotary_factor", _rope_parameters(d, None).get(
                "partial_rotary_factor", 1.0)),
            sliding_window=(d.get("sliding_window") if arch in SLIDING_WINDOW_ARCHITECTURES
                            else None),
            no_rope_layers=_no_rope_layers(d) if arch == "smollm3" else None,
            **(_gemma3_fields(d) if gemma else {}),
            **({k: d.get(k, 1.0) for k in GRANITE_FIELDS} if arch == "granite" else {}),
            # Ministral: Mistral with windowed and global layers (all windowed by default)
            **({"layer_types": d.get("layer_types")} if arch == "ministral" else {}),
            **(_olmo3_fields(d) if arch == "olmo3" else {}),
        )

    @property
    def max_context(self) -> int:
        """The longest sequence braid runs: the model's positions."""
        return self.max_position_embeddings

    @property
    def context_limit(self) -> str:
        """What bounds `max_context`, in words (for errors)."""
        return "its max_position_embeddings"

    @property
    def attention_scale(self) -> float | None:
        """What scores are scaled by, where it is not 1 / sqrt(head_dim) (None)."""
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window decoder layer `layer` attends in (None: every earlier
        position)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends in, where all of them have one (Mistral, Phi-3):
        KV further back is never read again. None where any layer attends to everything."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return None if None in windows or not windows else self.sliding_window

    @property
    def gemma(self) -> bool:
        """Gemma 3's layer: norms after attention and after the MLP as well as before, GELU
        (tanh) gating, embeddings scaled by sqrt(hidden_size), per-layer RoPE bases."""
        return self.architecture == "gemma3"

    @property
    def olmo(self) -> bool:
        """OLMo 2's layer (OLMo 3's too): norms after attention and the MLP, none before; q
        and k normalised across all their heads."""
        return self.architecture in ("olmo2", "olmo3")

    @property
    def fused_weights(self) -> bool:
        """Checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj: Phi-3."""
        return self.architecture == "phi3"

    def rotates(self, layer: int) -> bool:
        """Whether decoder layer `layer` applies RoPE (SmolLM3's NoPE layers do not)."""
        return self.no_rope_layers is None or self.no_rope_layers[layer] == 1

    @property
    def qk_norm(self) -> bool:
        """Each query and key head is RMS-normalised (its own weights) before RoPE: Qwen3,
        Gemma 3."""
        return self.architecture in ("qwen3", "gemma3")

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json dict that `from_hf_dict` (and transformers) reads back."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)  # (a reader
             if f.name not in ("architecture", "context_length")}  # may edit its dicts)
        if self.partial_rotary_factor == 1:
            d.pop("partial_rotary_factor")
        if rope_scaling_kind(self.rope_scaling) == "longrope":  # (Phi-3 reads it beside)
            assert self.rope_scaling is not None
            d["original_max_position_embeddings"] = self.rope_scaling[
                "original_max_position_embeddings"]
        d["model_type"] = HF_MODEL_TYPES.get(self.architecture, self.architecture)
        d["architectures"] = [HF_CLASSES[self.architecture]]
        d["hidden_act"] = "silu"
        d["pad_token_id"] = None  # (Phi-3's default, 32000, lies outside small vocabularies)
        d["torch_dtype"] = "float32"
        if self.gemma:
            d["hidden_activation"] = d["hidden_act"] = "gelu_pytorch_tanh"
        if self.architecture in TYPED_ROPE_ARCHITECTURES:  # transformers 5 reads each layer
            full = {"rope_type": "default", **(self.rope_scaling or {}),  # type's RoPE here
                    "rope_theta": self.rope_theta}
            d["rope_parameters"] = {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": self.rope_local_theta
                                      or GEMMA3_LOCAL_ROPE_THETA}}
            for key in ("rope_theta", "rope_scaling", "rope_local_theta"):
                d.pop(key)
        else:  # (transformers warns of a Mistral config with layer_types, even null)
            for key in ("layer_types", "rope_local_theta"):
                if key != "layer_types" or self.architecture != "ministral":
                    d.pop(key)
        if not self.gemma:
            for key in ("query_pre_attn_scalar", "final_logit_softcapping"):
                d.pop(key)
        if self.architecture != "granite":
            for key in GRANITE_FIELDS:
                d.pop(key)
        return d

    def num_parameters(self) -> int:
        """Weights of the model (a tied LM head counted once)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = (h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.attention_bias
                + 2 * self.head_dim * self.qk_norm + (q + kv) * self.olmo)
        layer = attn + 3 * h * self.intermediate_size + (4 if self.gemma else 2) * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ROPE_SCALINGS = {"linear": ("factor",), "longrope": ("original_max_position_embeddings",),
                 "yarn": ("factor", "original_max_position_embeddings"),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                            "original_max_position_embeddings")}


def rope_scaling_kind(scaling: object) -> str | None:
    """None (plain RoPE) or the RoPE scaling braid runs ("linear", "llama3", "longrope",
    "yarn", with the keys transformers reads; "freq_factors", a llama3 GGUF's); ValueError
    naming anything else."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    lists = {"freq_factors": ("factors",),  # a GGUF's rope_freqs (llama.cpp's llama3)
             "longrope": ("long_factor", "short_factor")}.get(kind, ())
    for key in lists:
        factors = scaling.get(key)
        if not (isinstance(factors, list) and factors
                and all(_positive(f) for f in factors)):
            raise ValueError(f"rope_scaling {kind}: {key} must be a list of numbers > 0")
    if kind == "freq_factors":
        return kind
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling of type {kind!r} is not supported (braid runs plain, "
                         "linear, llama3, longrope and yarn RoPE)")
    optional = {"longrope": ("factor", "attention_factor"),
                "yarn": ("attention_factor", "mscale", "mscale_all_dim", "beta_fast",
                         "beta_slow")}.get(kind, ())
    for key in (*ROPE_SCALINGS[kind], *optional):
        value = scaling.get(key)
        if not _positive(value) and not (key in optional and value is None):
            raise ValueError(f"rope_scaling {kind}: {key} must be a number > 0, got {value!r}")
    if kind == "yarn" and not isinstance(scaling.get("truncate", True), bool):
        raise ValueError(f"rope_scaling yarn: truncate must be true or false, got "
                         f"{scaling['truncate']!r}")
    return str(kind)


def _positive(value: object) -> bool:
    """A finite number > 0 (not a bool)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and 0 < float(value) < math.inf)


def _rope_parameters(d: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    """transformers 5's rope_parameters (for Gemma 3: those of one layer type)."""
    parameters = d.get("rope_parameters")
    if layer_type is not None and isinstance(parameters, dict):
        parameters = parameters.get(layer_type)
    return parameters if isinstance(parameters, dict) else {}


def _rope_theta(d: dict[str, Any], layer_type: str | None, default: float) -> Any:
    return d.get("rope_theta", _rope_parameters(d, layer_type).get("rope_theta", default))


def _rope_scaling(d: dict[str, Any], layer_type: str | None = None) -> dict[str, Any] | None:
    """config.json's rope_scaling, or transformers 5's rope_parameters (which also holds
    rope_theta) where it scales."""
    scaling = d.get("rope_scaling")
    if scaling is None:
        scaling = _rope_parameters(d, layer_type)
        if scaling.get("rope_type", "default") == "default":
            return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind in ("su", "yarn") and d.get("model_type") == "phi3":  # older names (transformers')
        scaling = {**scaling, "rope_type": "longrope"}
        scaling.pop("type", None)
        kind = "longrope"
    if kind in ("longrope", "yarn") and "original_max_position_embeddings" not in scaling:
        scaling = {**scaling, "original_max_position_embeddings":  # Phi-3's, beside it
                   d.get("original_max_position_embeddings")}
    return scaling


def _gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own config.json keys (transformers' Gemma3TextConfig, older and newer)."""
    every = d.get("sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
    if d.get("layer_types") is None and (not isinstance(every, int) or every < 1):
        raise ValueError(f"sliding_window_pattern must be an integer >= 1, got {every!r}")
    types, local = _windowed_layers(d, every, "Gemma 3")
    return {"layer_types": types,
            "rope_local_theta": d.get("rope_local_base_freq",
                                      local.get("rope_theta", GEMMA3_LOCAL_ROPE_THETA)),
            "query_pre_attn_scalar": d.get("query_pre_attn_scalar", 256),
            "final_logit_softcapping": d.get("final_logit_softcapping")}


def _olmo3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's layer types and its windowed layers' RoPE: rope_theta, unscaled."""
    types, local = _windowed_layers(d, OLMO3_GLOBAL_EVERY, "OLMo 3")
    return {"layer_types": types,
            "rope_local_theta": local.get("rope_theta", _rope_theta(d, "full_attention", 1e4))}


def _windowed_layers(d: dict[str, Any], global_every: int, family: str
                     ) -> tuple[Any, dict[str, Any]]:
    """A family with windowed and global layers: the layer types (config.json's, else every
    `global_every`-th global) and its windowed layers' RoPE parameters (transformers'
    sliding_attention ones), which must be plain."""
    layers = d.get("num_hidden_layers")
    types = d.get("layer_types")
    if types is None and isinstance(layers, int):
        types = gemma3_layer_types(layers, global_every)
    local = _rope_parameters(d, "sliding_attention")
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.sliding_attention of type {local['rope_type']!r} is "
                         f"not supported ({family}'s windowed layers run plain RoPE)")
    return types, local


def gemma3_layer_types(layers: int, global_every: int = GEMMA3_GLOBAL_EVERY) -> list[str]:
    """Every `global_every`-th layer global, the others in the window."""
    return ["full_attention" if (i + 1) % global_every == 0 else "sliding_attention"
            for i in range(layers)]


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
    gemma = d.get("model_type") == HF_MODEL_TYPES["gemma3"]
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = d.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in (("gelu_pytorch_tanh", "gelu_tanh") if gemma else ("silu", "swish")):
        raise ValueError(f"{act_key} {act!r} is not supported (SiLU; GELU (tanh) for Gemma 3)")
    if d.get("model_type") == "gemma3" or d.get("text_config") is not None:
        raise ValueError("a multimodal Gemma 3 config (model_type gemma3, with text_config) is "
                         "not supported: braid runs the text model (model_type gemma3_text; "
                         "its GGUF files are text-only)")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if d.get(key):
            raise ValueError(f"{key} {d[key]!r} is not supported")


def _is_token_id(value: object) -> bool:
    """An integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
