"""One validated engine configuration; the CLI flags are derived from its fields."""

from __future__ import annotations

import argparse
import decimal
import json
import logging
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from braid.sampling_params import SamplingParams, is_finite_number, is_int

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


DTYPES = ("auto", "float32", "bfloat16", "float16")  # --dtype, --kv-cache-dtype, draft_dtype
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other --dtype names
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # --quantization and the draft's


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the option (flag)."""


@dataclass
class SpecConfig:
    """Speculative decoding, vLLM-shaped: {"method": "ngram" | "draft_model", ...}."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft model (name or path) for method "draft_model"
    policy: str = "goodput"  # how k is chosen per request and step: "fixed" or "goodput"
    # The draft model's dtype. "auto": bfloat16 on a CPU that multiplies bf16 in hardware
    # (the draft forward then takes ~half the time; outputs do not change, the target
    # verifies every draft), else the target's dtype.
    draft_dtype: str = "auto"
    # The draft model's --quantization (None: the target's).
    quantization: str | None = None
    # How drafts are verified for requests that sample: "rejection" (standard rejection
    # sampling with the draft's q: the target's distribution, the most accepted drafts) or
    # "coupled" (accepted iff equal to the target's own draw at that position: output
    # identical to decoding without speculation). Seeded requests are always verified
    # coupled, so their output never depends on speculation.
    verification: str = "rejection"
    # How the draft model picks its tokens for requests that sample: "greedy" (its argmax),
    # "coupled" (a draw from its own distribution with the keyed number the target's draw at
    # that position uses), "independent" (a draw with numbers of its own) or "auto":
    # independent where verification is rejection sampling, greedy where it is coupled (what
    # accepted most in docs/benchmarks.md, Sampling with speculation). Greedy requests always
    # draft greedily.
    draft_sampling: str = "auto"
    # The draft model proposes only token ids below this (None: its whole vocabulary), and
    # its LM head computes only those rows. In a byte-level BPE vocabulary the low ids are
    # the earliest merges, the common tokens (96% of HumanEval's tokens lie below 32768 of
    # Qwen2.5's 151,936), and the head is a large part of a small draft's bytes. Lossless:
    # the target verifies every draft; a token at or above the limit is never proposed.
    draft_vocab_size: int | None = None
    # Greedy drafts through a two-stage LM head: a Q4_0 copy of the draft's head (where it is
    # quantized wider, as the default draft's Q8_0 one) picks the few candidate ids, the exact
    # head scores them (Qwen2ForCausalLM.add_coarse_head). The draft streams ~14% fewer bytes
    # a forward for the same argmax in every position measured; lossless either way.
    draft_coarse_head: bool = True
    # Prompt lookup beside the draft model: a request whose last prompt_lookup_min..max
    # tokens occurred earlier in its sequence takes what followed them there as its drafts,
    # with no draft forward (the draft catches up on those tokens the next time it runs for
    # the request); the goodput policy plans such drafts as free and learns their acceptance
    # apart from the model's; a lookup shorter than the request's k, or one not worth
    # verifying, leaves the request to the model. Code repeats names and lines. Lossless
    # either way (the target verifies every draft). Method ngram drafts only by lookup.
    draft_prompt_lookup: bool = True
    # Suffix decoding beside the draft model: a request whose context recurs in its own text
    # or in other requests' outputs (method suffix's corpora and settings) takes the
    # continuation as that step's drafts, with no draft forward, where no prompt lookup
    # did; priced and learned as a source of its own, like prompt lookups.
    draft_suffix_decoding: bool = False
    # Method suffix and draft_suffix_decoding (vLLM's names): the matched context is at
    # most max_tree_depth tokens; the outputs of the last max_cached_requests finished
    # requests stay in the shared corpus; a match of m tokens drafts at most
    # max_spec_factor * m tokens, while the draft's estimated probability stays >=
    # min_token_prob (braid/spec_decode/suffix.py).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    MAX_TOKENS = 16
    METHODS = ("ngram", "draft_model", "suffix")
    # keys that configure the draft model: an ngram config naming one is a mistake
    DRAFT_MODEL_KEYS = frozenset({"model", "draft_dtype", "quantization", "draft_vocab_size",
                                  "draft_coarse_head", "draft_prompt_lookup",
                                  "draft_suffix_decoding"})
    POLICIES = ("fixed", "goodput")
    DRAFT_SAMPLING = ("auto", "greedy", "coupled", "independent")
    VERIFICATION = ("coupled", "rejection")

    def verification_for(self, params: SamplingParams) -> str:
        """How one request's drafts are verified (for greedy requests both are exact)."""
        return "coupled" if params.seed is not None or params.greedy else self.verification

    def draft_sampling_for(self, params: SamplingParams) -> str:
        """How the draft model draws one request's drafts."""
        if params.greedy:
            return "greedy"
        if self.draft_sampling != "auto":
            return self.draft_sampling
        return "independent" if self.verification_for(params) == "rejection" else "greedy"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key {unknown[0]!r} "
                              f"(known: {', '.join(sorted(known))})")
        if "method" not in d and "model" in d:  # as vLLM: a draft model names its method
            d = {**d, "method": "draft_model"}
        if "method" not in d or "num_speculative_tokens" not in d:
            raise ConfigError("--speculative-config needs 'method' (or a draft 'model') and "
                              "'num_speculative_tokens'")
        if d["method"] != "draft_model" and (
                draft_only := sorted(set(d) & cls.DRAFT_MODEL_KEYS)):
            raise ConfigError(f"--speculative-config: {draft_only[0]!r} is only for method "
                              "draft_model")  # accepted and ignored before
        if not (d["method"] == "suffix" or d.get("draft_suffix_decoding")) and (
                suffix_only := sorted(k for k in d if k.startswith("suffix_decoding_"))):
            raise ConfigError(f"--speculative-config: {suffix_only[0]!r} is only for method "
                              "suffix or draft_suffix_decoding")
        spec = cls(**d)
        spec.validate()
        return spec

    def validate(self) -> None:
        where = "--speculative-config"
        if self.method not in self.METHODS:
            raise ConfigError(f"{where}: method must be one of {', '.join(self.METHODS)}, "
                              f"got {self.method!r}")
        if not is_int(self.num_speculative_tokens) or not (
                1 <= self.num_speculative_tokens <= self.MAX_TOKENS):
            raise ConfigError(f"{where}: num_speculative_tokens must be an integer in "
                              f"[1, {self.MAX_TOKENS}], got {self.num_speculative_tokens!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if not is_int(getattr(self, name)):
                raise ConfigError(f"{where}: {name} must be an integer, got "
                                  f"{getattr(self, name)!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"{where}: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.policy not in self.POLICIES:
            raise ConfigError(f"{where}: policy must be one of {', '.join(self.POLICIES)}, "
                              f"got {self.policy!r}")
        if self.draft_dtype not in DTYPES:
            raise ConfigError(f"{where}: draft_dtype must be one of {', '.join(DTYPES)}, "
                              f"got {self.draft_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"{where}: quantization must be one of "
                              f"{', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        for name, allowed in (("draft_sampling", self.DRAFT_SAMPLING),
                              ("verification", self.VERIFICATION)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{where}: {name} must be one of {', '.join(allowed)}, "
                                  f"got {getattr(self, name)!r}")
        if self.draft_vocab_size is not None and (
                self.method != "draft_model" or not is_int(self.draft_vocab_size)
                or self.draft_vocab_size < 1):
            raise ConfigError(f"{where}: draft_vocab_size must be a positive integer, for "
                              f"method draft_model, got {self.draft_vocab_size!r}")
        if not isinstance(self.draft_coarse_head, bool):
            raise ConfigError(f"{where}: draft_coarse_head must be true or false, got "
                              f"{self.draft_coarse_head!r}")
        for name in ("draft_prompt_lookup", "draft_suffix_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{where}: {name} must be true or false, got "
                                  f"{getattr(self, name)!r}")
        if self.method == "draft_model" and self.model is None:
            self.model = DEFAULT_DRAFT
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f"{where}: 'model' is only for method draft_model")
        self._validate_suffix(where)
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"{where}: 'model' must be a model name or path, got "
                              f"{self.model!r}")

    def _validate_suffix(self, where: str) -> None:
        for name in ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            value = getattr(self, name)
            if not is_int(value) or value < (2 if name.endswith("depth") else 0):
                raise ConfigError(f"{where}: {name} must be an integer >= "
                                  f"{2 if name.endswith('depth') else 0}, got {value!r}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not is_finite_number(factor) or not factor > 0:
            raise ConfigError(f"{where}: suffix_decoding_max_spec_factor must be a number > 0, "
                              f"got {factor!r}")
        if not is_finite_number(prob) or not 0 <= prob <= 1:
            raise ConfigError(f"{where}: suffix_decoding_min_token_prob must be a number in "
                              f"[0, 1], got {prob!r}")


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineConfig:
    model: str = _opt(DEFAULT_TARGET, "default model name, GGUF file or Hugging Face folder")
    tokenizer: str | None = _opt(
        None, "the tokenizer (and chat template) to use instead of the model's own, as vLLM's "
        "--tokenizer: a folder with tokenizer.json, a GGUF file or a default model's name")
    dtype: str = _opt("auto", "weights/activations dtype: auto (float32 on CPU), float32 "
                      "(or vLLM's float), bfloat16, float16 (or half)")
    device: str = _opt("cpu", "torch device")
    quantization: str = _opt(
        "auto", "weights: auto (a GGUF's quantized blocks run as they are on the CPU "
        "kernels; float checkpoints stay float), none (dequantize to --dtype), int8 / int4 "
        "(quantize a float checkpoint's weights at load; int4 also re-quantizes a GGUF's "
        "decoder layers stored in wider formats to Q4_0)")
    max_num_batched_tokens: int | None = _opt(
        None, "token budget: query tokens in one forward (default 128 with chunked prefill, "
        "max_model_len without)", human=True)
    max_num_seqs: int = _opt(64, "most requests running at once")
    scheduling_policy: str = _opt(
        "fcfs", "fcfs (first come, first served) or priority (a request's `priority`, lower "
        "first, then arrival: which waiting request runs next, which running one is preempted "
        "first)")
    max_model_len: int | None = _opt(None, "longest prompt + output (default min(4096, "
                                     "model); as vLLM's, 32k is 32000 and 32K 32768)",
                                     human=True)
    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_dtype: str = _opt(
        "auto", "KV cache element type: auto (float16 for a model on quantized weights, as "
        "llama.cpp's default f16 cache; else the model's activation dtype, float32 with "
        "--quantization none), float32, float16 or bfloat16 (a 16-bit cache holds twice the "
        "tokens in --kv-cache-gib and attention reads half the bytes; keys and values are "
        "rounded to 16 bits, which moves logits slightly)")
    kv_cache_gib: float = _opt(2.0, "KV cache size in GiB (ignored when --num-kv-blocks is set)")
    num_kv_blocks: int | None = _opt(None, "KV cache size in blocks")
    disable_hybrid_kv_cache_manager: bool = _opt(
        False, "one block table for every layer of a model that mixes global and "
        "sliding-window layers (Gemma 3), as vLLM's flag: each block holds every layer's KV "
        "and windowed layers keep theirs for every position (default: a table per layer "
        "group, windowed groups' KV bounded by the window)")
    enable_chunked_prefill: bool = _opt(True, "split prompts into chunks that ride along with "
                                        "decodes (off: classic prefill-first scheduling)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV of full blocks another request "
                                       "computed with the same prefix (automatic prefix "
                                       "caching; off: --no-enable-prefix-caching)")
    max_logprobs: int = _opt(
        20, "most log probabilities per position a request may ask for (logprobs, "
        "top_logprobs, prompt_logprobs), as vLLM's; -1: the whole vocabulary")
    seed: int = _opt(0, "seed of the engine's random generator (unseeded requests)")
    num_threads: int | None = _opt(None, "torch CPU threads (default: the cores available)")
    pipeline_parallel_size: int = _opt(
        1, "processes the decoder layers are split over (pipeline stages on this machine, "
        "passing hidden states with torch.distributed; each holds its share of the layers "
        "and of the KV cache: docs/scaling.md)")
    distributed_executor_backend: str = _opt(
        "mp", "where replicas (serve --data-parallel-size) and pipeline stages run: local "
        "processes (mp), or Ray actors on the nodes of the Ray cluster this machine belongs "
        "to (ray; docs/scaling.md)")
    speculative_config: dict[str, Any] | None = _opt(
        None, "speculative decoding as JSON, e.g. "
        '\'{"method": "draft_model", "num_speculative_tokens": 3}\'', json=True)
    target_itl_ms: float | None = _opt(
        None, "inter-token latency target: the speculation policy picks the prefill chunk and "
        "the draft lengths so the predicted step time stays under it (needs chunked prefill "
        "and a goodput speculative config)")
    log_stats_interval: float = _opt(10.0, "seconds between one-line stats logs (0: off)")
    generation_config: str = _opt(
        "auto", "default sampling as vLLM takes it: auto (the model folder's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens, for what a request leaves unset), vllm (none), or a folder holding one")
    override_generation_config: dict[str, Any] | None = _opt(
        None, "default sampling set by hand, as vLLM's, e.g. '{\"temperature\": 0.5}': "
        "merged over --generation-config's (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens: the default max_tokens, and on the server every "
        "request's limit)", json=True)

    def __post_init__(self) -> None:
        self._check_types()
        self._check_positive("max_num_seqs", "block_size", "kv_cache_gib",
                             "pipeline_parallel_size")
        self._check_positive_or_none("max_num_batched_tokens", "max_model_len", "num_kv_blocks",
                                     "num_threads")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be auto, float32 (float), bfloat16 or float16 "
                              f"(half), got {self.dtype!r}")
        if self.kv_cache_dtype.startswith("fp8"):
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype}: braid has no 8-bit KV "
                              "cache; with no scale per block, fp8 raised the default model's "
                              "perplexity by a third (e4m3) to tenfold (e5m2) (docs/"
                              "benchmarks.md, KV cache type). float16 or bfloat16 halve the cache")
        if self.kv_cache_dtype not in DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(DTYPES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ConfigError("--distributed-executor-backend must be mp or ray, got "
                              f"{self.distributed_executor_backend!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError("--scheduling-policy must be fcfs or priority, got "
                              f"{self.scheduling_policy!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, "
                              f"got {self.quantization!r}")
        if self.max_logprobs < -1:
            raise ConfigError(f"--max-logprobs must be -1 (no limit) or >= 0, got "
                              f"{self.max_logprobs}")
        if self.log_stats_interval < 0:
            raise ConfigError("--log-stats-interval must be >= 0")
        self._check_device()
        self.spec_config = (None if self.speculative_config is None
                     else SpecConfig.from_dict(self.speculative_config))
        self._check_itl_target()

    def _check_types(self) -> None:
        """Each field holds what its annotation says (LLM(...) passes values unparsed);
        the speculative config may also come as its JSON text, as on the command line."""
        for f in fields(self):
            if f.metadata.get("json") and isinstance(getattr(self, f.name), str):
                setattr(self, f.name, _json_arg(_flag(f.name), ConfigError)(getattr(self, f.name)))
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if not f.init or (value is None and "None" in kind):
                continue
            if kind.startswith("bool"):
                ok, want = isinstance(value, bool), "true or false"
            elif kind.startswith("int"):
                ok, want = is_int(value), "an integer"
            elif kind.startswith("float"):
                ok, want = is_finite_number(value), "a finite number"
            elif kind.startswith("str"):
                ok, want = isinstance(value, str), "a string"
            else:
                ok, want = isinstance(value, dict), "a JSON object"
            if not ok:
                raise ConfigError(f"{_flag(f.name)} must be {want}, got {value!r}")

    def _check_device(self) -> None:
        import torch

        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"--device: {e}") from None
        if device.type not in ("cpu", "cuda"):  # meta, mps, ...: no kernels or no data
            raise ConfigError(f"--device {self.device}: braid runs on cpu or cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: this torch build or machine has no CUDA")

    def _check_itl_target(self) -> None:
        if self.target_itl_ms is None:
            return
        if self.target_itl_ms <= 0:
            raise ConfigError(f"--target-itl-ms must be > 0, got {self.target_itl_ms}")
        if not self.enable_chunked_prefill:
            raise ConfigError("--target-itl-ms needs chunked prefill (drop "
                              "--no-enable-chunked-prefill)")
        if self.spec_config is None or self.spec_config.policy != "goodput":
            raise ConfigError("--target-itl-ms needs --speculative-config with policy goodput "
                              "(its step-cost model picks the prefill chunk)")

    spec_config: SpecConfig | None = field(init=False, default=None, metadata={"cli": False})

    def _check_positive(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_flag(name)} must be > 0, got {getattr(self, name)}")

    def _check_positive_or_none(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{_flag(name)} must be > 0, got {value}")

    def finalize(self, model_max_len: int, limit: str = "context") -> None:
        """Fill defaults that depend on the model and check the combinations (`limit`: what
        bounds `model_max_len`, for the error)."""
        if self.max_model_len is None:
            self.max_model_len = min(4096, model_max_len)
        elif self.max_model_len > model_max_len:
            raise ConfigError(f"--max-model-len {self.max_model_len} exceeds the model's "
                              f"{model_max_len} ({limit})")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 128 if self.enable_chunked_prefill else self.max_model_len
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                f"--max-model-len ({self.max_model_len}) without chunked prefill: a whole "
                "prompt must fit one step (lower --max-model-len or enable chunked prefill)")

    @property
    def torch_dtype(self) -> Any:
        import torch

        if self.dtype == "auto":
            return torch.float32
        return getattr(torch, self.dtype)

    def kv_dtype(self, model_dtype: Any, quantized: bool = False) -> Any:
        """The KV cache's torch dtype for a model whose activations are `model_dtype` (and
        whose weights are `quantized`). auto: float16 beside quantized weights (their float32
        activations; half the bytes for ~0.2% perplexity, docs/benchmarks.md, KV cache type), else
        the activation dtype (float checkpoints and --quantization none, the reference)."""
        import torch

        if self.kv_cache_dtype == "auto":
            return torch.float16 if quantized else model_dtype
        return getattr(torch, self.kv_cache_dtype)

    @property
    def threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_args(parser: argparse.ArgumentParser, cls: type = EngineConfig) -> None:
    """One flag per config field, named after it; defaults stay the dataclass's own."""
    group = parser.add_argument_group("engine options")
    for f in fields(cls):
        if not f.init:
            continue
        kwargs: dict[str, Any] = {"help": f.metadata.get("help"), "default": argparse.SUPPRESS}
        if f.metadata.get("json"):
            kwargs["type"] = _json_arg(_flag(f.name))
        elif f.default is not MISSING and isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.metadata.get("human"):
            kwargs["type"] = human_int
        else:
            kwargs["type"] = _scalar_type(f)
        group.add_argument(_flag(f.name), **kwargs)


def config_from_args(args: argparse.Namespace, cls: type = EngineConfig) -> Any:
    """The config the parsed flags give; `braid serve MODEL` (vLLM's positional model_tag)
    wins over --model, as in vLLM, and vLLM's --disable-log-stats sets
    --log-stats-interval 0."""
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    tag = getattr(args, "model_tag", None)
    if tag is not None and "model" in names:
        if values.get("model", tag) != tag:  # flags left unset are absent (SUPPRESS)
            logging.getLogger("braid").warning(
                "the model is given twice: serving %s (MODEL), not --model %s", tag,
                values["model"])
        values["model"] = tag
    if getattr(args, "disable_log_stats", False) and "log_stats_interval" in names:
        values["log_stats_interval"] = 0.0  # vLLM's --disable-log-stats
    return cls(**values)


def _scalar_type(f: Any) -> Any:
    text = str(f.type)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


_MULTIPLIERS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """argparse type, as vLLM's human-readable integers: 32k = 32000, 32K = 32768,
    25.6k = 25600."""
    try:
        if text[-1:] in _MULTIPLIERS:
            value = decimal.Decimal(text[:-1]) * _MULTIPLIERS[text[-1]]  # 1.1k: exactly 1100
            if value == value.to_integral_value():
                return int(value)
        else:
            return int(text)
    except (ValueError, ArithmeticError):  # decimal's InvalidOperation, an infinite value
        pass
    raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 32k (32000) or 32K "
                                     f"(32768), got {text!r}")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = float(text)
    if not 0 <= value < math.inf:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not 0 < value < math.inf:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


# argparse names a type in "invalid <name> value: 'x'" where int() or float() fails
positive_int.__name__ = "integer"
non_negative_float.__name__ = positive_float.__name__ = "number"


def comma_list(kind: Any) -> Any:
    """argparse type: comma-separated values, each parsed by `kind` (at least one)."""
    def parse(text: str) -> list[Any]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError("give at least one value")
        values = []
        for part in parts:
            try:
                values.append(kind(part))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{part}: {e}") from None
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r} is not a number") from None
        return values

    parse.__name__ = f"comma-separated {getattr(kind, '__name__', 'value')}"
    return parse


def _json_arg(flag: str, error: type[Exception] = argparse.ArgumentTypeError) -> Any:
    # argparse names the flag itself ("argument --x: ..."); other callers' errors name it here
    prefix = "" if error is argparse.ArgumentTypeError else f"{flag}: "

    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise error(f"{prefix}invalid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise error(f"{prefix}expected a JSON object")
        return value

    return parse
