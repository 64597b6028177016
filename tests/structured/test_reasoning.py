"""A grammar after a reasoning model's thinking: free text inside <think>...</think>, the
grammar from the answer's first token; with and without speculation."""

from __future__ import annotations

import re

import pytest

from braid.sampling_params import SamplingParams, StructuredOutputsParams
from braid.structured.reasoning import AfterReasoning
from braid.tokenizer import Tokenizer
from tests.engine.test_engine import make_engine
from tests.spec_decode.test_spec_engine import spec_engine
from tests.tiny import byte_tokenizer

OPEN, CLOSE = 259, 260  # the tags' ids: added after the 256 bytes and three specials


def thinking_tokenizer() -> Tokenizer:
    tok = byte_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    assert (tok.token_to_id("<think>"), tok.token_to_id("</think>")) == (OPEN, CLOSE)
    return Tokenizer(tok, {"eos_token": "<|endoftext|>"})


class Recorder:
    """An inner grammar that allows only token 7 and records what it is given."""

    def __init__(self) -> None:
        self.advanced: list[int] = []
        self.masked: list[list[int]] = []

    def advance(self, token: int) -> str | None:
        self.advanced.append(token)
        return None

    def num_valid(self, drafts):  # noqa: ANN001, ANN201
        return next((i for i, t in enumerate(drafts) if t != 7), len(drafts))

    def is_eos(self, token: int) -> bool:
        return False

    def fill_mask(self, drafts, out) -> None:  # noqa: ANN001
        self.masked.append(list(drafts))
        out.zero_()
        out[0] = 1 << 7

    def forced_tokens(self, limit: int) -> list[int]:
        return [7] * limit

    def take_mask_time(self) -> float:
        return 0.0


def test_the_grammar_starts_with_the_answer() -> None:
    import torch

    inner = Recorder()
    g = AfterReasoning(inner, "qwen3", OPEN, CLOSE)
    out = torch.zeros(9, dtype=torch.int32)
    g.fill_mask([], out)  # the first token: the grammar's, or <think>
    assert out[0] == 1 << 7 and out[OPEN // 32] & (1 << (OPEN % 32))
    assert g.num_valid([OPEN, 1, 2, CLOSE, 7, 8]) == 5  # thinking is free, the answer is not
    g.fill_mask([OPEN, 1], out)
    assert (out == -1).all() and g.forced_tokens(3) == []
    g.fill_mask([OPEN, CLOSE, 7], out)
    assert inner.masked[-1] == [7]
    for token in (OPEN, 5, 6, CLOSE):
        assert g.advance(token) is None
    assert inner.advanced == [] and g.forced_tokens(2) == [7, 7]
    g.advance(7)
    assert inner.advanced == [7]
    answer_now = AfterReasoning(Recorder(), "qwen3", OPEN, CLOSE)  # thinking turned off
    assert answer_now.num_valid([7, OPEN]) == 1
    answer_now.advance(7)
    assert answer_now.state == "answer"
    r1 = AfterReasoning(Recorder(), "deepseek_r1", OPEN, CLOSE)  # starts inside
    assert r1.num_valid([1, OPEN, CLOSE, 7, 7, 9]) == 5


REGEX = "[a-c]{4}"


@pytest.mark.parametrize("parser, bias, head", [
    ("qwen3", {OPEN: 40.0, CLOSE: 50.0}, [OPEN, CLOSE]),
    ("deepseek_r1", {CLOSE: 50.0}, [CLOSE]),
    (None, {OPEN: 40.0, CLOSE: 50.0}, []),
])
@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
def test_a_reasoning_reply_thinks_then_answers_in_the_grammar(parser: str | None, bias: dict,
                                                              head: list[int],
                                                              method: str | None) -> None:
    """Biased tags make the tiny model think (briefly) first; the answer after them obeys
    the grammar, and without a reasoning parser the tags are refused from the start."""
    tok = thinking_tokenizer()
    engine = (make_engine(tokenizer=tok) if method is None
              else spec_engine(method, 3, tokenizer=tok))
    engine.add_request("r", [5, 40, 77, 3, 100], SamplingParams(
        temperature=0, max_tokens=20, logit_bias=bias,
        structured_outputs=StructuredOutputsParams(regex=REGEX, reasoning=parser)))
    (out,) = [o for o in engine.run_until_done() if o.finished]
    tokens = out.outputs[0].token_ids
    assert tokens[:len(head)] == head, tokens
    assert re.fullmatch(REGEX, tok.decode(tokens[len(head):])), tokens
    assert out.outputs[0].finish_reason == "stop"


def test_an_unknown_reasoning_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning must be qwen3 or deepseek_r1"):
        StructuredOutputsParams(regex="a", reasoning="o1")
