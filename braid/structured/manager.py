"""Compiles requests' grammars off the engine loop and hands each request its `GrammarState`.

Every llguidance compile runs on the GrammarWorker (worker.py): one job at a time, each on a
thread with a large stack, so no grammar can overflow a stack (the server's event loop and the
engine thread never compile). A grammar is compiled once per spec and checked by computing its
first mask on two copies (a lexer limit shows there, and copies share the lexer, so the second
copy finds what the first left); only a grammar that passed is kept, and one that fails later
in a request (a limit hit mid-output) is dropped, so a failure is never served as a success.
Each request gets a copy of the kept matcher (~10 us). The tokenizer's llguidance view is built
once, on the first structured request or by `warm_up` (~1.6 s: the server does it at start-up).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future
from functools import cached_property

import llguidance
import tokenizers
import torch

from braid.core.request import Grammar
from braid.core.stats import GrammarStats
from braid.sampling_params import StructuredOutputsParams
from braid.structured.grammar import (
    LIMITS,
    GrammarState,
    bitmask_width,
    first_line,
    grammar_for,
    spec_key,
)
from braid.structured.reasoning import CLOSE, OPEN, AfterReasoning
from braid.structured.worker import GrammarWorker
from braid.tokenizer import Tokenizer

logger = logging.getLogger("braid")

_MAX_CACHED = 128  # compiled grammars kept, least recently used dropped first
_MAX_CACHED_BYTES = 64 * 2**20  # and at most this much grammar text among them

SpecKey = tuple[str, str, str | None]


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
        # compiled grammars and their text's size (worker only)
        self._compiled: OrderedDict[SpecKey, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self._failed: set[SpecKey] = set()  # kept grammars a request saw fail (any thread)
        self._lock = threading.Lock()  # guards _failed
        self.stats = stats

    @cached_property
    def _worker(self) -> GrammarWorker:
        return GrammarWorker()

    @cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        eos = self._tokenizer.eos_token_id
        return grammar_tokenizer(self._tokenizer, self._vocab_size,
                                 eos if eos is not None else min(self._eos_token_ids, default=0))

    def warm_up(self) -> Future[llguidance.LLTokenizer]:
        """Build the tokenizer's llguidance view in the background now."""
        return self._worker.submit(lambda: self._ll_tokenizer)

    def validate(self, params: StructuredOutputsParams) -> Future[None]:
        """Compile and check `params`' grammar (kept for the request that follows): the
        future's ValueError names the field where it is invalid or too large or complex."""
        return self._worker.submit(self._check, params)

    def _check(self, params: StructuredOutputsParams) -> None:
        self._template(params)

    def submit(self, params: StructuredOutputsParams, ignore_eos: bool) -> Future[Grammar]:
        """The request's grammar state, compiled on the worker."""
        eos = () if ignore_eos else self._eos_token_ids
        return self._worker.submit(self._state, params, eos)

    def _state(self, params: StructuredOutputsParams, eos: Collection[int]) -> Grammar:
        key = spec_key(params)
        matcher = self._template(params)
        state: Grammar = GrammarState(matcher.deep_copy(), eos, self.stats,
                                      on_error=lambda: self._forget(key))
        tags = self._reasoning_tags
        if params.reasoning is not None and tags is not None:
            state = AfterReasoning(state, params.reasoning, *tags)
        return state

    @cached_property
    def _reasoning_tags(self) -> tuple[int, int] | None:
        """The ids of <think> and </think>, where both are single tokens (else a grammar
        constrains the whole reply, reasoning included)."""
        ids = [self._tokenizer.backend.token_to_id(tag) for tag in (OPEN, CLOSE)]
        if ids[0] is None or ids[1] is None:
            logger.warning("%s and %s are not single tokens of this tokenizer: a grammar "
                           "constrains the whole reply, reasoning included", OPEN, CLOSE)
            return None
        return ids[0], ids[1]

    def _forget(self, key: SpecKey) -> None:
        with self._lock:
            self._failed.add(key)

    def _template(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The kept matcher of `params`' grammar, compiled and checked if need be."""
        key = spec_key(params)
        with self._lock:
            if key in self._failed:
                self._failed.discard(key)
                self._compiled.pop(key, None)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key][0]
        grammar = grammar_for(params)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, limits=LIMITS)
        self._dry_run(matcher, params.kinds[0])
        self._compiled[key] = (matcher, len(grammar))
        while len(self._compiled) > _MAX_CACHED or (len(self._compiled) > 1 and sum(
                size for _, size in self._compiled.values()) > _MAX_CACHED_BYTES):
            self._compiled.popitem(last=False)
        return matcher

    def _dry_run(self, matcher: llguidance.LLMatcher, kind: str) -> None:
        """ValueError naming `kind` where the grammar fails to compile or its first mask hits
        a limit."""
        if matcher.is_error():
            raise ValueError(f"{kind} is not valid: {first_line(matcher.get_error())}")
        mask = torch.empty(bitmask_width(self._vocab_size), dtype=torch.int32)
        for copy in (matcher.deep_copy(), matcher.deep_copy()):
            copy.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            if copy.is_error():
                raise ValueError(f"{kind} is too complex for the grammar engine: "
                                 f"{first_line(copy.get_error())}")

    def shutdown(self) -> None:
        if "_worker" in self.__dict__:
            self._worker.shutdown()
