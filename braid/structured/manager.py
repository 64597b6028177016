"""Compiles requests' grammars off the engine loop and hands each request its `GrammarState`.

Compilation runs on one worker thread (llguidance drops the GIL while it builds a matcher);
the scheduler admits a request once its grammar is ready, and the others go on meanwhile.
A compiled grammar is kept per spec, and each request gets a copy of it (~10 us). The
tokenizer's llguidance view is built once, on the first structured request or by `warm_up`
(~1.6 s, holding the GIL: the server does it at start-up).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property

import llguidance
import tokenizers

from braid.engine.stats import GrammarStats
from braid.sampling_params import StructuredOutputsParams
from braid.structured.grammar import GrammarState, grammar_for
from braid.tokenizer import Tokenizer

_MAX_CACHED = 128  # compiled grammars kept, least recently used dropped first


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos: int) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it. Read from its JSON, llguidance takes every added
    token spelled <...> for a special one (never text) yet tokenizes text with a tokenizer
    that finds added tokens inside text: a grammar asking for the text "<tool_call>" (Qwen's
    tool calls: an added token, not a special one) or "<|im_end|>" was handed that token,
    refused it, and the request ended in an error. For byte-level BPE, braid gives it each
    token's bytes, the special tokens that really are special, and a tokenization that spells
    their text out, as the model's own special tokens never stand for text."""
    spec = tokenizer.backend.to_str()  # ~0.1 s for a 150k vocabulary: once
    if not tokenizer.byte_level:
        return llguidance.LLTokenizer(spec, n_vocab=vocab_size, eos_token=eos)
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_ByteLevelView(tokenizer, spec, vocab_size, eos)),
        n_vocab=vocab_size, eos_token=eos)


class _ByteLevelView:
    """What llguidance.TokenizerWrapper reads: token bytes, special ids, and text -> ids. Ids
    past the tokenizer's vocabulary (a model's embedding rows beyond it) are special tokens
    of their own, never text."""

    def __init__(self, tokenizer: Tokenizer, spec: str, vocab_size: int, eos: int) -> None:
        self.eos_token_id = eos
        self.bos_token_id = None
        backend = tokenizer.backend
        known = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = [i for i, token in backend.get_added_tokens_decoder().items()
                                  if token.special]
        self.special_token_ids += range(known, vocab_size)
        self.tokens = [tokenizer.token_bytes(i) for i in range(known)]
        self.tokens += [f"<[{i}]>".encode() for i in range(known, vocab_size)]
        self._text = tokenizers.Tokenizer.from_str(spec)  # a copy, to change its encoding
        self._text.encode_special_tokens = True  # "<|im_end|>" in text is text

    def __call__(self, text: str) -> list[int]:  # str only: llguidance passes bytes if taken
        return self._text.encode(text, add_special_tokens=False).ids


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: Collection[int], stats: GrammarStats) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = frozenset(eos_token_ids)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # worker only
        self.stats = stats

    @cached_property
    def _executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix="braid-grammar")

    @cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        eos = self._tokenizer.eos_token_id
        return grammar_tokenizer(self._tokenizer, self._vocab_size,
                                 eos if eos is not None else min(self._eos_token_ids, default=0))

    def warm_up(self) -> Future[llguidance.LLTokenizer]:
        """Build the tokenizer's llguidance view in the background now."""
        return self._executor.submit(lambda: self._ll_tokenizer)

    def submit(self, params: StructuredOutputsParams, ignore_eos: bool) -> Future[GrammarState]:
        """The request's grammar state, compiled on the worker thread."""
        grammar = grammar_for(params)
        eos = () if ignore_eos else self._eos_token_ids
        return self._executor.submit(self._compile, grammar, eos)

    def _compile(self, grammar: str, eos_token_ids: Collection[int]) -> GrammarState:
        matcher = self._compiled.pop(grammar, None)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar)
            if matcher.is_error():
                raise ValueError(f"grammar failed to compile: {matcher.get_error()}")
        self._compiled[grammar] = matcher
        while len(self._compiled) > _MAX_CACHED:
            self._compiled.popitem(last=False)
        return GrammarState(matcher.deep_copy(), eos_token_ids, self.stats)

    def shutdown(self) -> None:
        if "_executor" in self.__dict__:
            self._executor.shutdown(wait=False, cancel_futures=True)
