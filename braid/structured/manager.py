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

from braid.engine.stats import GrammarStats
from braid.sampling_params import StructuredOutputsParams
from braid.structured.grammar import GrammarState, grammar_for
from braid.tokenizer import Tokenizer

_MAX_CACHED = 128  # compiled grammars kept, least recently used dropped first


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
        return llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                                      eos_token=eos if eos is not None else min(
                                          self._eos_token_ids, default=0))

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
