"""A reasoning model's thinking, split from its answer as vLLM's `--reasoning-parser` does:
the text inside `<think>...</think>` becomes the message's `reasoning_content`, the rest its
`content` (tool calls are read from the content only). Streamed as the text comes; a tag split
between two deltas is held back until it is whole.

- "qwen3": Qwen3 thinks in a `<think>` block that opens its reply (a reply that does not open
  with one is all answer: thinking turned off).
- "deepseek_r1": the chat template opens `<think>` in the prompt (DeepSeek-R1 and its
  distills), so the reply starts inside the reasoning (a `<think>` it writes anyway is
  dropped) and everything before `</think>` is reasoning.

A reply that opens its reasoning and never closes it (max_tokens reached while thinking) is
all reasoning, whole or streamed alike (vLLM's whole-reply qwen3 parser returns it as content
instead, tags and all). A grammar (response_format, a required or named tool) applies after
the reasoning, as vLLM's does (braid/structured/reasoning.py), where the tags are single
tokens (else it constrains the whole reply, reasoning included).
"""

from __future__ import annotations

from braid.server.tools import partial_tag
from braid.structured.reasoning import CLOSE, OPEN, PARSERS


class ReasoningSplitter:
    """One choice's text -> (reasoning, content) pieces, fed in order."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}: expected one of {PARSERS}")
        self.parser = parser
        self.state = "start"  # then "reasoning" and "content"
        self.held = ""  # text that may still be the start of a tag
        self.seen_reasoning = False

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        if self.state == "start":
            text = self._open(text, finished)
            if self.state == "start":
                return "", ""
        reasoning = ""
        if self.state == "reasoning":
            end = text.find(CLOSE)
            if end >= 0:
                reasoning, text, self.state = text[:end], text[end + len(CLOSE):], "content"
            else:
                keep = 0 if finished else partial_tag(text, CLOSE)
                reasoning, self.held, text = text[:len(text) - keep], text[len(text) - keep:], ""
        return reasoning, text

    def _open(self, text: str, finished: bool) -> str:
        """Decide how the reply starts; the text after a leading `<think>`."""
        stripped = text.lstrip()
        if stripped.startswith(OPEN):
            self.state, self.seen_reasoning = "reasoning", True
            return stripped[len(OPEN):]
        if not finished and OPEN.startswith(stripped):  # "", "<", "<thi": not known yet
            self.held = text
            return text
        self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        self.seen_reasoning = self.state == "reasoning"
        return text


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole reply's (reasoning_content or None, content)."""
    splitter = ReasoningSplitter(parser)
    reasoning, content = splitter.feed(text, finished=True)
    return (reasoning if splitter.seen_reasoning else None), content
