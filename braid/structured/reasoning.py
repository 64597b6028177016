"""A grammar that applies after a reasoning model's thinking, as vLLM applies structured
output once its reasoning parser sees the reasoning end: while the model thinks, every token
is allowed; from the first token of its answer, the request's grammar.

- "qwen3": a reply that opens with `<think>` thinks until `</think>`; one that does not is
  all answer (thinking turned off), so the reply's first token may be `<think>` or what the
  grammar allows.
- "deepseek_r1": the chat template opens `<think>` in the prompt, so the reply starts inside
  the reasoning and thinks until `</think>`.

Both tags must be single tokens of the model's tokenizer (added tokens, as in Qwen3's and the
R1 distills'); the grammar manager wraps a request's grammar only then."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from braid.core.request import Grammar

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class AfterReasoning:
    """`inner` (a request's grammar) from the end of its reasoning on. States: "start"
    (qwen3: the first token decides), "reasoning", "answer" (the grammar's)."""

    def __init__(self, inner: Grammar, parser: str, open_id: int, close_id: int) -> None:
        self.inner = inner
        self.open_id, self.close_id = open_id, close_id
        self.state = "start" if parser == "qwen3" else "reasoning"

    def _split(self, tokens: Sequence[int]) -> tuple[str, int]:
        """The state after `tokens`, and how many of them are reasoning (the rest, answer)."""
        state = self.state
        for i, token in enumerate(tokens):
            if state == "answer" or (state == "start" and token != self.open_id):
                return "answer", i
            if state == "start":
                state = "reasoning"
            elif token == self.close_id:
                state = "answer"
        return state, len(tokens)

    def advance(self, token: int) -> str | None:
        self.state, reasoning = self._split([token])
        return None if reasoning else self.inner.advance(token)

    def num_valid(self, drafts: Sequence[int]) -> int:
        state, reasoning = self._split(drafts)
        return reasoning + (self.inner.num_valid(drafts[reasoning:]) if state == "answer" else 0)

    def is_eos(self, token: int) -> bool:
        return self.inner.is_eos(token)

    def fill_mask(self, drafts: Sequence[int], out: Any) -> None:
        state, reasoning = self._split(drafts)
        if state == "reasoning":
            out.fill_(-1)
            return
        self.inner.fill_mask(drafts[reasoning:], out)
        if state == "start":  # or it opens its thinking
            # imported here: grammar.py needs torch, and the CLI reads this module's tags
            # starting without it
            from braid.structured.grammar import bit

            out[self.open_id // 32] |= bit(self.open_id % 32)

    def forced_tokens(self, limit: int) -> list[int]:
        return self.inner.forced_tokens(limit) if self.state == "answer" else []

    def take_mask_time(self) -> float:
        return self.inner.take_mask_time()
