"""A step that raises fails only the request at fault (braid/engine/isolation.py): the step
runs again in parts, the request that fails alone ends with "error", requests that read KV
another request of the step computes go back to waiting, and every other request's output is
what it is without the failure, with speculation off and on."""

from __future__ import annotations

from dataclasses import replace

import pytest

from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams, StructuredOutputsParams
from braid.tokenizer import Tokenizer
from braid.worker.lifetime import ExecutorBroken
from tests.engine.test_engine import make_engine
from tests.spec_decode.test_spec_engine import spec_engine
from tests.tiny import byte_tokenizer

TOKENIZER = Tokenizer(byte_tokenizer(), {"eos_token": "<|endoftext|>"})
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
SHARED = list(b"the same prompt, two blocks and more")  # block_size 4
BROKEN = SamplingParams(temperature=0, max_tokens=12,
                        structured_outputs=StructuredOutputsParams(regex="[a-z]{20}"))


def engine_for(speculation: str | None) -> LLMEngine:
    if speculation is None:
        return make_engine(tokenizer=TOKENIZER)
    return spec_engine(speculation, 3, tokenizer=TOKENIZER)


def add_broken(engine: LLMEngine, request_id: str) -> None:
    """A structured request whose grammar goes into error before its first step, as one
    that hits a grammar engine limit does: computing its mask raises GrammarError."""
    req = engine.add_request(request_id, list(b"broken"), BROKEN)
    assert req.grammar_future is not None
    state = req.grammar_future.result()
    assert state.advance(ord("0")) == "error"  # a refused token: the matcher stays in error


def finished(engine: LLMEngine) -> dict[str, tuple[str | None, list[int]]]:
    return {o.request_id: (o.outputs[0].finish_reason, o.outputs[0].token_ids)
            for o in engine.run_until_done() if o.finished}


def reference(speculation: str | None) -> dict[str, tuple[str | None, list[int]]]:
    engine = engine_for(speculation)
    add_innocents(engine)
    return finished(engine)


def add_innocents(engine: LLMEngine) -> None:
    engine.add_request("greedy", list(b"hello there"), GREEDY)
    engine.add_request("seeded", list(b"once upon"), SEEDED)
    engine.add_request("a", SHARED, GREEDY)
    engine.add_request("b", SHARED, replace(GREEDY, max_tokens=9))  # admitted onto a's blocks


@pytest.mark.parametrize("speculation", [None, "ngram"])
def test_the_request_that_fails_a_step_fails_alone(speculation: str | None) -> None:
    engine = engine_for(speculation)
    add_broken(engine, "broken")
    add_innocents(engine)  # all admitted in the broken request's first step
    out = finished(engine)
    assert out.pop("broken")[0] == "error"
    assert out == reference(speculation)
    assert engine.blocks.num_used_blocks == 0


def test_a_request_that_breaks_mid_output_fails_alone() -> None:
    engine = engine_for("ngram")
    add_innocents(engine)
    late = engine.add_request("late", list(b"abc"), BROKEN)
    assert late.grammar_future is not None
    late.grammar_future.result()  # compiled: it runs beside the others from the first step
    out: dict[str, tuple[str | None, list[int]]] = {}
    while not late.output_token_ids:
        out |= {o.request_id: (o.outputs[0].finish_reason, o.outputs[0].token_ids)
                for o in engine.step() if o.finished}
    assert late.grammar is not None and late.grammar.advance(ord("0")) == "error"
    out |= finished(engine)
    assert out.pop("late")[0] == "error"
    assert out == reference("ngram")


def test_a_step_that_fails_for_everyone_fails_everyone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault of the step itself (every part raises): each request ends with "error", the
    blocks are all freed, and the engine serves the next requests."""
    engine = engine_for(None)
    add_innocents(engine)
    plain = engine.runner.execute

    def fail(*args: object) -> object:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.runner, "execute", fail)
    out = {o.request_id: o.outputs[0].finish_reason for o in engine.step()}
    assert out == {"greedy": "error", "seeded": "error", "a": "error"}  # b went back
    monkeypatch.setattr(engine.runner, "execute", plain)
    assert finished(engine)["b"] == reference(None)["b"]
    add_innocents(engine)
    assert finished(engine) == reference(None)


@pytest.mark.parametrize("first", [ExecutorBroken, RuntimeError])
def test_a_broken_executor_is_not_blamed_on_a_request(monkeypatch: pytest.MonkeyPatch,
                                                      first: type[Exception]) -> None:
    """An executor that can run no step again (a pipeline stage gone) ends the step with its
    error: at once, or where the step had failed otherwise first (say, the first stage's own
    layers), while it runs again in parts. No request is failed as the culprit, and the
    step's blocks are not published."""
    engine = engine_for(None)
    add_innocents(engine)
    calls = []

    def failing(*args: object) -> object:
        calls.append(args)
        if len(calls) == 1:
            raise first("the first failure")
        raise ExecutorBroken("the pipeline broke: a stage is gone")

    monkeypatch.setattr(engine.runner, "execute", failing)
    with pytest.raises(ExecutorBroken):
        engine.step()
    assert len(calls) == (1 if first is ExecutorBroken else 2)
    assert not any(r.is_finished for r in engine.requests.values())
