"""A request as the engine takes it in: its prompt tokenized and truncated, its parameters
checked against the model and the engine's options (a RequestError naming the field),
vLLM's -1 logprobs made the vocabulary, its bad words and its prediction tokenized, an
unseeded request seeded.
No engine state changes here; `LLMEngine.add_request` queues what this returns."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from braid.bad_words import BadWordIndex
from braid.config import EngineConfig
from braid.core.request import Request
from braid.sampling_params import SamplingParams, bad_words_token_ids, is_int
from braid.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request the engine cannot serve (too long, bad ids); the message names the field."""


def refusal(add: Callable[..., object], args: tuple) -> Exception | None:
    """None where `add(*args)` took the request, else the error that refused it."""
    try:
        add(*args)
    except Exception as e:
        return e
    return None


def with_bad_words(params: SamplingParams, tokenizer: Tokenizer | None) -> SamplingParams:
    """`params` with its bad_words as token ids, indexed (braid/bad_words.py). It takes a
    tokenizer call per word (100,000 words: ~1.5 s): the server does it in a worker thread
    before it adds the request."""
    if tokenizer is None:
        raise RequestError("bad_words needs a tokenizer: this engine has none")
    return dataclasses.replace(params, bad_words_token_ids=BadWordIndex(bad_words_token_ids(
        params.bad_words or [],
        lambda texts: tokenizer.encode_batch(texts, add_special_tokens=False))))


def with_prediction(params: SamplingParams, tokenizer: Tokenizer | None,
                    max_model_len: int | None) -> SamplingParams:
    """`params` with its prediction as token ids (at most max_model_len of them: no output is
    longer). The server does it in a worker thread before it adds the request."""
    if tokenizer is None:
        raise RequestError("prediction needs a tokenizer: this engine has none")
    text = params.prediction or ""
    if max_model_len is not None:
        text = text[:tokenizer.max_token_chars * max_model_len]  # the rest predicts nothing
    ids = tokenizer.encode(text, add_special_tokens=False)[:max_model_len]
    return dataclasses.replace(params, prediction_token_ids=ids)


class InputProcessor:
    def __init__(self, config: EngineConfig, vocab_size: int,
                 tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self._seeds = random.Random(config.seed)  # unseeded requests' seeds, in arrival order

    def max_logprobs(self) -> int:
        """The most logprobs per position a request may ask for (--max-logprobs)."""
        cap = self.config.max_logprobs
        return self.vocab_size if cap == -1 else cap

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                priority: int = 0, group: str | None = None) -> Request:
        if params.n != 1:
            raise RequestError(f"n must be 1 for one engine request, got {params.n}: add one "
                               "request per completion (LLM.generate and the server do)")
        if not is_int(priority):
            raise RequestError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise RequestError(f"priority {priority} needs --scheduling-policy priority")
        if params.bad_words and params.bad_words_token_ids is None:
            params = with_bad_words(params, self.tokenizer)
        if params.prediction and params.prediction_token_ids is None:
            params = with_prediction(params, self.tokenizer, self.config.max_model_len)
        if -1 in (params.logprobs, params.prompt_logprobs):  # vLLM's: the whole vocabulary
            vocab = self.vocab_size
            params = dataclasses.replace(
                params, logprobs=vocab if params.logprobs == -1 else params.logprobs,
                prompt_logprobs=vocab if params.prompt_logprobs == -1 else params.prompt_logprobs)
        text, ids = self._tokenize(prompt)
        keep = params.truncate_prompt_tokens  # vLLM's: the prompt's last k tokens
        if keep is not None:
            ids = ids[-(self.config.max_model_len or len(ids) if keep == -1 else keep):]
        self._check_prompt(ids, params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        return Request(request_id, ids, params, prompt=text, seed=seed, priority=priority,
                       group=group or request_id)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("prompt must be token ids: this engine has no tokenizer")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.config.max_model_len
        assert max_len is not None
        if not ids:
            raise RequestError("prompt must not be empty")
        if len(ids) >= max_len:
            raise RequestError(
                f"prompt is {len(ids)} tokens, the maximum is {max_len - 1} (max_model_len "
                f"{max_len} includes at least one generated token)")
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if any(token >= vocab for token in params.logit_bias or {}):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})")
        for name in ("allowed_token_ids", "stop_token_ids"):  # a stop id never sampled: a slip
            if any(token >= vocab for token in getattr(params, name) or []):
                raise RequestError(f"{name} must be token ids in [0, {vocab})")
        if not all(is_int(t) and 0 <= t < vocab for t in params.prediction_token_ids or []):
            raise RequestError(f"prediction_token_ids must be token ids in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name) or 0
            if n > self.max_logprobs():
                raise RequestError(f"{name} {n} exceeds --max-logprobs ({self.max_logprobs()})")
            if n > vocab:
                raise RequestError(f"{name} must be <= the vocabulary size ({vocab}), got {n}")
