"""The grammar manager: compiles on the large-stack worker, refuses grammars past the limits
with a ValueError naming the field, and never hands out a compiled grammar that failed."""

from __future__ import annotations

import pytest

from braid.core.stats import GrammarStats
from braid.sampling_params import StructuredOutputsParams
from braid.structured.grammar import MAX_GBNF_RULES, MAX_GRAMMAR_BYTES, GrammarError
from braid.structured.manager import StructuredOutputManager
from braid.structured.worker import run_on_large_stack
from braid.tokenizer import Tokenizer
from tests.tiny import VOCAB, byte_tokenizer

EOS = 256


@pytest.fixture(scope="module")
def manager() -> StructuredOutputManager:
    return StructuredOutputManager(Tokenizer(byte_tokenizer(), {}), VOCAB, {EOS}, GrammarStats())


def chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "ok"\n'


def test_a_deep_chain_of_rules_compiles_on_the_worker(manager: StructuredOutputManager) -> None:
    """10,000 chained rules need ~50 MiB of stack to compile (a thread's default is 8)."""
    state = manager.submit(StructuredOutputsParams(grammar=chain(10_000)), False).result()
    assert [state.advance(t) for t in b"ok"] == [None, "stop"]


@pytest.mark.parametrize("spec, message", [
    ({"regex": "a" * (MAX_GRAMMAR_BYTES + 1)}, "^regex is too large"),
    ({"choice": ["a" * 1000] * (MAX_GRAMMAR_BYTES // 1000)}, "^choice is too large"),
    ({"json": {"enum": ["a" * 1000] * (MAX_GRAMMAR_BYTES // 1000)}}, "^json is too large"),
    ({"grammar": "root ::= r0\n" + "".join(f"r{i} ::= \"x\"\n" for i in range(MAX_GBNF_RULES))},
     "^grammar has 1001 GBNF rules"),
    ({"regex": "((a{100}){100}){100}"}, "^regex is too complex for the grammar engine"),
    ({"regex": "a[b"}, "^regex is not valid"),
])
def test_limits_are_value_errors_naming_the_field(manager: StructuredOutputManager,
                                                  spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        manager.validate(StructuredOutputsParams(**spec)).result()


def test_a_failed_compile_is_not_kept(manager: StructuredOutputManager) -> None:
    spec = StructuredOutputsParams(regex="((a{100}){100}){100}")
    for _ in range(2):  # the second try compiles again and fails again
        with pytest.raises(ValueError, match="too complex"):
            manager.submit(spec, False).result()


def test_a_grammar_that_failed_in_a_request_is_compiled_anew(
        manager: StructuredOutputManager) -> None:
    """Copies of a compiled grammar share its lexer: one that failed in a request is dropped,
    and the next request gets a fresh compile that works."""
    spec = StructuredOutputsParams(regex="ab")
    first = manager.submit(spec, False).result()
    kept = next(m for key, (m, _) in manager._compiled.items() if key[:2] == ("regex", "ab"))
    assert first.advance(ord("x")) == "error"  # a refused token puts the matcher in error
    with pytest.raises(GrammarError, match="the grammar failed"):
        first.fill_mask([], _mask())
    second = manager.submit(spec, False).result()
    assert all(m is not kept for m, _ in manager._compiled.values())
    assert [second.advance(t) for t in b"ab"] == [None, "stop"]


def test_run_on_large_stack_returns_and_raises() -> None:
    assert run_on_large_stack(lambda x: x + 1, 1) == 2
    with pytest.raises(KeyError):
        run_on_large_stack(lambda: {}["missing"])


def _mask():  # -> torch.Tensor
    import torch

    from braid.structured.grammar import bitmask_width

    return torch.zeros(bitmask_width(VOCAB), dtype=torch.int32)
