"""A step reaches the executor as plain records (braid/worker/step_io.py), and so do the draft
model's calls (braid/worker/draft.py): pickled whole each way, with no scheduler object
inside, it gives every request the tokens, logprobs and prompt
logprobs the in-process step gives, over many steps (prefill chunks, decodes, preemption,
speculation windows, grammars, penalties, bad words, an abort, a second batch after the
engine went idle), and the worker forgets the requests that ended."""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from braid.config import SpecConfig
from braid.engine import grammars
from braid.engine.engine import LLMEngine
from braid.models.interface import CausalLM
from braid.outputs import RequestOutput
from braid.sampling_params import SamplingParams, StructuredOutputsParams
from braid.spec_decode.draft import DraftModelProposer
from braid.tokenizer import Tokenizer
from braid.worker.draft import DraftResult, DraftSpan
from braid.worker.executor import Executor, InProcessExecutor
from braid.worker.step_io import StepInput, StepResult
from tests.engine.test_engine import make_engine
from tests.spec_decode.test_spec_engine import spec_engine
from tests.tiny import byte_tokenizer

TOKENIZER = Tokenizer(byte_tokenizer(), {"eos_token": "<|endoftext|>"})
# The braid modules a step's records may name; the scheduler's and the engine's never.
RECORDS = {"braid.worker.step_io", "braid.worker.runner", "braid.sampling_params",
           "braid.outputs", "braid.bad_words", "braid.worker.draft"}


class RecordsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("braid") and module not in RECORDS:
            raise pickle.UnpicklingError(f"{module}.{name} is not a step record")
        return super().find_class(module, name)


def across(obj: Any) -> Any:
    """`obj` as a process on the other side of a pipe gets it."""
    return RecordsOnly(io.BytesIO(pickle.dumps(obj))).load()


class PicklingExecutor(Executor):
    """The in-process executor behind a pickle round trip each way."""

    def __init__(self, inner: InProcessExecutor) -> None:
        self.inner = inner
        self.steps: list[StepInput] = []
        self.draft_calls: list[list[DraftSpan]] = []

    def execute(self, step: StepInput) -> StepResult:
        step = across(step)
        self.steps.append(step)
        return across(self.inner.execute(step))

    def start_draft(self, model: CausalLM, spec: SpecConfig, kv_dtype: torch.dtype) -> None:
        self.inner.start_draft(model, spec, kv_dtype)

    def propose_drafts(self, spans: list[DraftSpan]) -> DraftResult:
        spans = across(spans)
        self.draft_calls.append(spans)
        return across(self.inner.propose_drafts(spans))

    def set_drafts(self, drafts: Mapping[str, list[int]], cuts: Mapping[str, int]) -> None:
        self.inner.set_drafts(*across((dict(drafts), dict(cuts))))

    @property
    def weight_and_kv_bytes(self) -> tuple[int, int]:
        return self.inner.weight_and_kv_bytes


def requests() -> dict[str, tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(3)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=gen).tolist()
    return {
        "greedy": (prompt(70), SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)),
        "seeded": (prompt(9), SamplingParams(temperature=0.9, seed=4, max_tokens=30,
                                             ignore_eos=True, repetition_penalty=1.3,
                                             frequency_penalty=0.4, logprobs=3)),
        "unseeded-scored": (prompt(40), SamplingParams(temperature=0, max_tokens=6,
                                                       prompt_logprobs=2, logprobs=1,
                                                       ignore_eos=True)),
        "grammar": (list(b"digits: "), SamplingParams(
            temperature=0.7, seed=1, max_tokens=10,
            structured_outputs=StructuredOutputsParams(regex="[0-9]{3,8}"))),
        "bad-words": (prompt(25), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                 bad_words=["ab", "c"], min_tokens=5)),
        "aborted": (prompt(30), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
    }


def outputs(engine: LLMEngine) -> dict[str, tuple]:
    """Two batches, the second after the engine went idle; "aborted" leaves after 25 steps."""
    done: dict[str, RequestOutput] = {}
    for batch in ("1", "2"):
        for name, (prompt, params) in requests().items():
            req = engine.add_request(f"{name}-{batch}", prompt, params)
            if req.grammar_future is not None:  # compiled before the first step, every run
                req.grammar_future.result()
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps == 25:
                engine.abort(f"aborted-{batch}")
            done |= {o.request_id: o for o in engine.step() if o.finished}
    return {rid: (o.outputs[0].token_ids, o.outputs[0].logprobs, list(o.prompt_logprobs or []))
            for rid, o in done.items() if not rid.startswith("aborted")}


def engine_for(speculation: str | None) -> LLMEngine:
    # 40 blocks of 4 tokens hold the batch's prompts but not their outputs: requests get
    # preempted and recompute
    options = {"tokenizer": TOKENIZER, "num_kv_blocks": 40, "max_model_len": 160,
               "max_num_batched_tokens": 32}
    if speculation is None:
        return make_engine(**options)
    return spec_engine(speculation, 3, verification="rejection", **options)


@pytest.mark.parametrize("speculation", [None, "ngram", "draft_model"])
def test_a_pickled_step_gives_what_the_in_process_step_gives(
        speculation: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each run's batches are the same: the grammar compiled before the first step, and its
    # masks never rest its request (resting follows measured time). Batches composed
    # otherwise round the tiny float model's logits otherwise.
    monkeypatch.setattr(grammars, "GRAMMAR_SHARE", float("inf"))
    expected = outputs(engine_for(speculation))
    engine = engine_for(speculation)
    inner = engine.executor
    assert isinstance(inner, InProcessExecutor)
    engine.executor = PicklingExecutor(inner)
    proposer = getattr(engine.speculator, "proposer", None)
    if isinstance(proposer, DraftModelProposer):  # its draft model's forwards too
        proposer.executor = engine.executor
    got = outputs(engine)
    assert got == expected
    assert engine.stats.num_preemptions > 0
    if speculation is not None:
        assert any(s.num_spec_tokens for step in engine.executor.steps for s in step.spans)
    if speculation == "draft_model":  # the draft's calls crossed too, with the outputs the
        # worker had not been sent
        calls = engine.executor.draft_calls
        assert any(s.new_output_ids for spans in calls for s in spans)
    assert any(s.grammar_bitmask is not None for step in engine.executor.steps
               for s in step.spans)
    # each request's fixed parts crossed once; the worker holds none of the ended requests
    new = [r.request_id for step in engine.executor.steps for r in step.new_requests]
    assert len(new) == len(set(new)) and set(got) <= set(new)
    assert set(inner.requests) <= {f"{name}-2" for name in requests()}
    assert not set(inner.requests) & set(engine.executor.steps[-1].finished)


def test_the_draft_s_q_rows_go_only_to_the_drafts_it_drew_in_its_last_call() -> None:
    """Rejection sampling needs the q rows a draft was drawn from, and only those: a request
    whose next drafts come from elsewhere (a prompt lookup, forced tokens), or a round in
    which the draft model did not run, verifies one-hot drafts. Stale rows attached to a
    lookup's drafts verified them against the wrong q (not lossless): it passed every other
    test, so this one asks the executor directly."""
    from braid.worker.draft import DraftSpan
    from braid.worker.runner import QuerySpan
    from braid.worker.step import WorkerRequest

    engine = spec_engine("draft_model", 3, verification="rejection",
                         draft_sampling="independent")
    executor = engine.executor
    assert isinstance(executor, InProcessExecutor)
    params = SamplingParams(temperature=0.8)
    executor.requests["a"] = WorkerRequest([5, 6, 7, 8], params, seed=3)

    def propose() -> list[int]:
        span = DraftSpan("a", QuerySpan([5, 6, 7, 8], 0, [0, 1, 2], 1), 3)
        return executor.propose_drafts([span]).drafts[0]

    drawn = propose()
    executor.set_drafts({"a": drawn}, {})
    q = executor.sampler.draft_probs["a"]
    assert q.shape[0] == 3 and torch.allclose(q.sum(-1), torch.ones(3))
    executor.set_drafts({"a": [9, 10, 11]}, {})  # a lookup's drafts, the model not called
    assert "a" not in executor.sampler.draft_probs
    drawn = propose()
    executor.set_drafts({"a": drawn[:1]}, {})  # cut by a grammar: its first row still serves
    assert "a" in executor.sampler.draft_probs
    propose()
    other = [t + 1 for t in drawn]
    executor.set_drafts({"a": other}, {})  # the model drew, the request took other drafts
    assert "a" not in executor.sampler.draft_probs
