"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from braid.bad_words import BadWordIndex
from braid.files import read_json_object

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")

# Bounds that keep the sampler's float32 arithmetic finite whatever a request asks for (a
# value that rounds to 0 or overflows in float32 turns logits into inf and NaN):
# - a temperature below SAMPLING_EPS is greedy (vLLM's _SAMPLING_EPS): logits / T stays
#   finite for any logit below 3e33 in magnitude;
# - top_p is at least MIN_TOP_P: at or below it (below 1 / V for any vocabulary under 10^8
#   tokens) only the top token and its ties survive, as they do for any smaller p, and p
#   stays above 0 in float32;
# - repetition_penalty is clamped into REPETITION_PENALTY_BOUNDS: a logit divided or
#   multiplied by it stays finite below 3e33 in magnitude (at 1e-300 it is 0 in float32, and
#   a positive logit / 0 is inf; at 1e300 it is inf, and a zero logit * inf is NaN);
# - min_p in [0, 1], presence and frequency penalties in [-2, 2] and logit_bias in
#   [-100, 100] need no bound beyond their ranges: min_p scales a probability, a penalty
#   times a count (at most max_model_len) is finite, and a value too small for float32 is 0,
#   which is what it means.
SAMPLING_EPS = 1e-5
MIN_TOP_P = 1e-8
REPETITION_PENALTY_BOUNDS = (1e-5, 1e5)


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar, with vLLM's field names: exactly one of a JSON
    schema (`json`, a dict or its JSON text), a regular expression, a list of choices, a
    grammar (Lark, or GBNF as llama.cpp writes it) or any JSON object (`json_object`).
    JSON may have whitespace between its tokens as llama.cpp's JSON grammars allow it (one
    space, or a newline and up to 20 spaces or tabs), so a model cannot run on in whitespace;
    `whitespace_pattern` (a regex) replaces that rule, `disable_any_whitespace` allows none.
    `reasoning` ("qwen3" or "deepseek_r1", as the server's --reasoning-parser sets it): the
    grammar applies after the model's `<think>` block, which is free text
    (braid/structured/reasoning.py)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning not in (None, "qwen3", "deepseek_r1"):
            raise ValueError(f"reasoning must be qwen3 or deepseek_r1, got {self.reasoning!r}")
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)}, got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")

    @property
    def kinds(self) -> list[str]:
        return [f.name for f in fields(self) if f.name in STRUCTURED_KINDS
                and getattr(self, f.name) not in (None, False)]


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's): everything so far, only what
    is new since its last output, or nothing until it finishes (then everything)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class SamplingParams:
    """How to pick the tokens of one request.

    `top_k` of 0 or -1 disables top-k. `logprobs=n` returns the sampled token's logprob and the
    top-n logprobs per position (0: only the sampled token's; -1: the whole vocabulary, as
    vLLM, within --max-logprobs); `prompt_logprobs=n` the same for every prompt token after
    the first. `logit_bias` maps token ids to a bias added to their
    logits before penalties and sampling (greedy included); `allowed_token_ids` (as vLLM's)
    restricts every output token to those ids; `bad_words` (as vLLM's) are never generated:
    a word's last token is refused where the output so far ends with the rest of it. After
    `__post_init__`, `stop` and `stop_token_ids` are always lists (possibly empty).
    `structured_outputs` constrains the output to a grammar (braid/structured/); the request
    finishes when the grammar is complete. `detokenize=False` leaves the outputs' text empty
    (and logprobs' decoded tokens None) and skips the detokenizer; stop strings need it.
    `output_kind` (a RequestOutputKind) shapes what the engine's outputs carry; `LLM`
    always returns whole outputs. `prediction` (OpenAI's Predicted Outputs) is the text the
    output is expected to be: with speculation on, it drafts the tokens it predicts (the
    output is the same with it or without; braid/spec_decode/prediction.py).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k (-1: max_model_len)
    # bad_words as token id sequences; the engine fills it from bad_words at admission (as a
    # BadWordIndex: the words indexed, in arrays)
    bad_words_token_ids: list[list[int]] | BadWordIndex | None = None
    skip_special_tokens: bool = True
    # vLLM's. Its fast detokenizer, like braid's, writes special tokens as their text, and
    # the byte-level decoders of the models braid runs put no space between tokens, so the
    # text is the same either way (a slow sentencepiece tokenizer in vLLM would differ).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    prediction: str | None = None
    # prediction as token ids; the engine fills it from prediction at admission
    prediction_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, list | tuple) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list | tuple | None) or not all(
                is_int(t) for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be a list of token ids (integers), got "
                             f"{self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not is_int(self.output_kind) or self.output_kind not in set(RequestOutputKind):
            raise ValueError("output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or "
                             f"FINAL_ONLY), got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise ValueError(f"prediction must be a string, got {type(self.prediction).__name__}")
        self._validate()
        self._normalize()

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's)."""
        return copy.deepcopy(self)

    def _normalize(self) -> None:
        """Values past the bounds above, moved onto them (see SAMPLING_EPS)."""
        self.top_p = max(self.top_p, MIN_TOP_P)
        low, high = REPETITION_PENALTY_BOUNDS
        self.repetition_penalty = min(max(self.repetition_penalty, low), high)

    @property
    def greedy(self) -> bool:
        """Temperature below SAMPLING_EPS (0 included), or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but the model moves this request's argmax at every position:
        penalties, logit_bias, allowed_token_ids or bad words (min_tokens and a grammar
        aside)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias
                    or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def stop_strings(self) -> list[str]:
        """`stop` typed as a list (it always is one after `__post_init__`)."""
        assert isinstance(self.stop, list)
        return self.stop

    def _validate(self) -> None:
        self._check_types()
        self._check_ranges()
        self._check_lists()

    def _check_types(self) -> None:
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "seed", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not is_finite_number(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

    def _check_ranges(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.n >= 1, "n must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1 or 0 (disabled) or >= 1"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.logprobs is None or self.logprobs >= -1,
             "logprobs must be >= 0, or -1 (the whole vocabulary)"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= -1,
             "prompt_logprobs must be >= 0, or -1 (the whole vocabulary)"),
            (self.seed is None or -(2**63) <= self.seed < 2**64,
             "seed must be in [-2**63, 2**64 - 1]"),
            (self.truncate_prompt_tokens in (None, -1) or (self.truncate_prompt_tokens or 0) >= 1,
             "truncate_prompt_tokens must be -1 (max_model_len) or >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                name = message.split(" ", 1)[0]
                raise ValueError(f"{message}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.min_tokens and self.structured_outputs is not None:
            raise ValueError("min_tokens must be 0 with structured_outputs (the grammar decides "
                             f"where the output ends), got {self.min_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError(f"stop must not contain empty strings, got {self.stop!r}")
        if self.stop_strings and not self.detokenize:
            raise ValueError(f"stop strings need the output's text: set detokenize=True or "
                             f"use stop_token_ids, got stop={self.stop!r}")

    def _check_lists(self) -> None:
        if any(t < 0 for t in self.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids
                or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0, "
                             f"got {self.allowed_token_ids!r}")
        if self.bad_words is not None and any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not is_int(token):
                raise ValueError(f"logit_bias keys must be token ids (integers), got {token!r}")
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-100, 100], "
                                 f"got {token!r}: {bias!r}")


def bad_words_token_ids(words: Sequence[str],
                        encode: Callable[[list[str]], list[list[int]]]) -> list[list[int]]:
    """bad_words as vLLM tokenizes them: each word without its leading spaces, and after
    one space where that spells it with as many tokens starting with another one (a word
    inside a sentence). `encode` takes a list of texts (one call for all of them)."""
    bare_words = [word.lstrip() for word in words]
    ids = encode(bare_words + [" " + word for word in bare_words])
    out: list[list[int]] = []
    for bare, spaced in zip(ids[: len(words)], ids[len(words):], strict=True):
        out.append(bare)
        if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


# The generation_config.json fields vLLM takes as default sampling (HF name -> ours).
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                       "max_new_tokens": "max_tokens"}


def generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults a model's creator recommends, from `folder`'s
    generation_config.json ({} without one); ValueError naming the file for values a request
    could not take either."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    found = read_json_object(path)
    defaults = {ours: found[hf] for hf, ours in GENERATION_DEFAULTS.items()
                if found.get(hf) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {hf_names(str(e))}") from None
    return defaults


def hf_names(message: str) -> str:
    """A SamplingParams error about generation-config values, in their HF names."""
    return message.replace("max_tokens", "max_new_tokens")


def is_int(value: object) -> bool:
    """An integer, not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool), neither NaN nor infinite."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of choice j of a request with n > 1: seed + j, wrapped into the 64 bits a
    generator takes (None: unseeded)."""
    if seed is None:
        return None
    return seed + j - 2**64 if seed + j >= 2**64 else seed + j
