"""Structured output in the engine, on a tiny random model with a byte tokenizer: the mask
forces every output into its grammar; greedy and seeded outputs are the same with and without
speculation (n-gram drafts cut by the grammar, draft-model drafts masked by it), and sampled
ones keep the target's distribution; compiling never holds other requests back."""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import jsonschema
import pytest

from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams, StructuredOutputsParams
from braid.tokenizer import Tokenizer
from tests.engine.test_engine import make_engine
from tests.spec_decode.test_seeded import draft
from tests.spec_decode.test_spec_engine import spec_engine
from tests.tiny import byte_tokenizer

TOKENIZER = Tokenizer(byte_tokenizer(), {"eos_token": "<|endoftext|>"})
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5,
                                                            "maximum": 5}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["name", "size", "color", "flags", "inner"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "never", "maybe"]
REGEX = r"[a-c]{2}-[0-9]{2,3}"
LARK = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[xyz]/'


def constraint(i: int) -> StructuredOutputsParams | None:
    """Request i's constraint: a JSON schema, choices, a regex, a Lark grammar, any JSON
    object, or none (unconstrained requests share the batch)."""
    return [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(grammar=LARK),
        StructuredOutputsParams(json=SCHEMA),  # whitespace allowed, bounded
        None,
    ][i % 6]


def check(text: str, so: StructuredOutputsParams | None) -> None:
    if so is None:
        return
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json)
    elif so.choice is not None:
        assert text in so.choice
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    else:
        assert re.fullmatch(r"\([xyz](,[xyz]){0,2}\)", text), text


PROMPTS = [[5 + i, 40 + 3 * i, 77, 3 + i % 4, 100 + i] for i in range(12)]
GREEDY = SamplingParams(temperature=0, max_tokens=150)


def params(i: int, base: SamplingParams = GREEDY) -> SamplingParams:
    return replace(base, structured_outputs=constraint(i))


def run(engine: LLMEngine, arrivals: dict[int, list[int]], base: SamplingParams = GREEDY
        ) -> dict[str, tuple[str, list[int], str | None]]:
    """arrivals: step -> prompt indices added then (more than one batch; some arrive after
    the engine went idle). Returns (text, tokens, finish reason) by id; every output checked
    against its constraint."""
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), PROMPTS[i], params(i, base))
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.text, c.token_ids, c.finish_reason)
        step += 1
    for rid, (text, _, reason) in done.items():
        so = constraint(int(rid))
        if so is not None:
            assert reason == "stop", (rid, text)  # the grammar completed it
        check(text, so)
    return done


ARRIVALS = {0: [0, 1, 2, 3, 4, 5], 3: [6, 7], 400: [8, 9, 10, 11]}  # a burst, more, after idle

CONFIGS = {
    "chunks of 8": lambda: make_engine(tokenizer=TOKENIZER, max_num_batched_tokens=8),
    "prefill first": lambda: make_engine(tokenizer=TOKENIZER, enable_chunked_prefill=False),
    "preempted": lambda: make_engine(tokenizer=TOKENIZER, num_kv_blocks=40, max_model_len=160,
                                     max_num_batched_tokens=32),
    "ngram k3": lambda: spec_engine("ngram", 3, tokenizer=TOKENIZER, max_num_batched_tokens=32),
    "draft k3": lambda: draft(3, tokenizer=TOKENIZER, max_num_batched_tokens=32),
    "unrelated draft k4": lambda: draft(4, unrelated=True, tokenizer=TOKENIZER,
                                        max_num_batched_tokens=64),
    "goodput": lambda: spec_engine("draft_model", 4, policy="goodput", tokenizer=TOKENIZER,
                                   max_num_batched_tokens=32),
    "suffix k4": lambda: spec_engine("suffix", 4, tokenizer=TOKENIZER,
                                     max_num_batched_tokens=32),
}


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[str, list[int], str | None]]:
    return run(make_engine(tokenizer=TOKENIZER, max_num_batched_tokens=256), ARRIVALS)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_structured_output_is_the_same_with_and_without_speculation(
        reference, config: str) -> None:
    engine = CONFIGS[config]()
    assert run(engine, ARRIVALS) == reference
    if "preempted" in config:
        assert engine.stats.num_preemptions > 0
    if "k" in config.split()[-1]:
        assert engine.stats.spec_stats.num_accepted_tokens > 0
    if engine.config.spec_config is not None:  # a JSON schema's keys are forced: drafted
        assert engine.speculator.windows_by_source["grammar"] > 0  # type: ignore[attr-defined]
    assert engine.stats.grammar.num_masks > 0


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(reference) -> None:
    alone = make_engine(tokenizer=TOKENIZER)
    for i in (5, 11):
        alone.add_request(str(i), PROMPTS[i], GREEDY)
    want = {o.request_id: o.outputs[0].token_ids for o in alone.run_until_done() if o.finished}
    assert want == {rid: reference[rid][1] for rid in want}


def test_ngram_drafts_the_grammar_refuses_are_cut_and_count_as_rejected() -> None:
    """The regex allows one of two letters at each of 15 positions (so it forces none), no
    letter twice, and in the prompt each is followed by "!": every n-gram draft starts with
    a token the grammar refuses. All are cut before verification (and counted), and the
    acceptance the policy learns from counts them as rejected."""
    letters = "abcdefghijklmnopqrstuvwxyzABCD"
    regex = "".join(f"[{letters[i:i + 2]}]" for i in range(0, len(letters), 2))
    engine = spec_engine("ngram", 4, tokenizer=TOKENIZER)
    engine.add_request("r", list("".join(c + "!" for c in letters).encode()), SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)))
    (out,) = [o for o in engine.run_until_done() if o.finished]
    assert re.fullmatch(regex, out.outputs[0].text)
    assert engine.stats.spec_stats.num_draft_tokens == 0  # nothing left to verify
    assert engine.stats.grammar.num_rejected_drafts >= 4 * (len(letters) // 2 - 2)
    figures = engine.speculation_figures()
    assert figures is not None and figures.acceptance_estimate < 0.2


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_the_tokens_a_grammar_forces_are_drafted(method: str) -> None:
    """A regex that allows one text only: after the first token (the prefill's), the grammar
    forces the rest, which every method drafts in full windows, all accepted."""
    letters = "abcdefghijklmnopqrstuvwxyzABCD"
    engine = spec_engine(method, 4, tokenizer=TOKENIZER)
    engine.add_request("r", PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=letters)))
    (out,) = [o for o in engine.run_until_done() if o.finished]
    assert out.outputs[0].text == letters
    spec = engine.stats.spec_stats
    assert spec.num_accepted_tokens == spec.num_draft_tokens >= 4 * (len(letters) - 1) // 5
    assert engine.speculator.windows_by_source["grammar"] == spec.num_drafts  # type: ignore


@pytest.mark.parametrize(("method", "source", "options"), [
    ("ngram", "ngram", {}), ("suffix", "suffix", {}), ("suffix", "suffix", {"policy": "goodput"}),
    ("draft_model", "lookup", {"draft_prompt_lookup": True}),
    ("draft_model", "suffix", {"draft_suffix_decoding": True}),
])
def test_a_forced_run_is_continued_by_a_model_free_source(method: str, source: str,
                                                          options: dict) -> None:
    """The regex leaves the first letter free, then forces "=KEY=" and leaves six letters
    free; the prompt holds "=KEY=" followed by "abcdef". So from the forced run's end the
    source drafts on ("abc": 3 more fill the window of 8): windows of the forced tokens and
    the source's, verified in one, the output that of the engine without speculation. The
    forced drafts are the grammar's evidence (all accepted), the rest the source's."""
    regex = "[a-z]=KEY=[a-z]{6}"
    prompt = list(b"some text =KEY=abcdef more")
    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex=regex))

    def output(engine: LLMEngine) -> list[int]:
        engine.add_request("r", prompt, params)
        (out,) = [o for o in engine.run_until_done() if o.finished]
        assert re.fullmatch(regex, out.outputs[0].text)
        return out.outputs[0].token_ids

    want = output(make_engine(tokenizer=TOKENIZER))
    engine = spec_engine(method, 8, tokenizer=TOKENIZER, **options)
    assert output(engine) == want
    speculator = engine.speculator
    assert speculator.windows_by_source[f"grammar+{source}"] == 1  # type: ignore[attr-defined]
    grammar = speculator.free_acceptance["grammar"]  # type: ignore[attr-defined]
    assert grammar.global_trials == pytest.approx(5) and grammar.global_alpha > 0.95
    assert speculator.free_acceptance[source].global_trials > 0  # type: ignore[attr-defined]


def test_a_continued_forced_run_cut_to_its_forced_part_is_the_grammars_window() -> None:
    """A short step budget may verify fewer drafts than a continued forced run held: where
    only forced drafts were verified, the window is the grammar's, and its source learns
    nothing; where more were, the forced part is the grammar's evidence and the rest the
    source's."""
    speculator = spec_engine("suffix", 8, tokenizer=TOKENIZER).speculator
    request = SimpleNamespace(request_id="r")  # only its id is read
    speculator._looked_up["r"] = ("suffix", None, 3)
    speculator.on_verified(request, 2, 2)
    grammar, suffix = speculator.free_acceptance["grammar"], speculator.free_acceptance["suffix"]
    assert speculator.windows_by_source == {"grammar": 1}
    assert grammar.global_trials == pytest.approx(2) and suffix.global_trials == 0
    speculator._looked_up["r"] = ("suffix", None, 3)
    speculator.on_verified(request, 5, 4)  # 3 forced accepted, 1 of the suffix's 2
    assert speculator.windows_by_source["grammar+suffix"] == 1
    assert suffix.global_trials == pytest.approx(2)  # one accepted, then the rejection


def test_seeded_structured_output_is_unchanged_by_speculation() -> None:
    sampled = SamplingParams(temperature=1.0, max_tokens=150, seed=7)
    arrivals = {0: list(range(6))}

    def outputs(engine: LLMEngine) -> dict[str, list[int]]:
        return {rid: tokens for rid, (_, tokens, _) in run(engine, arrivals, sampled).items()}

    want = outputs(make_engine(tokenizer=TOKENIZER))
    assert outputs(draft(3, unrelated=True, tokenizer=TOKENIZER)) == want
    assert outputs(spec_engine("ngram", 3, tokenizer=TOKENIZER)) == want


def test_sampled_choices_keep_the_targets_distribution_under_rejection_sampling() -> None:
    """Unseeded temperature 1 choices: the same distribution with an unrelated draft whose
    samples are verified by rejection sampling as without speculation (total variation)."""
    so = StructuredOutputsParams(choice=CHOICES)
    p = SamplingParams(temperature=1.0, max_tokens=10, structured_outputs=so)

    def frequencies(engine: LLMEngine, n: int = 300) -> Counter[str]:
        for i in range(n):
            engine.add_request(str(i), PROMPTS[0], p)
        return Counter(o.outputs[0].text for o in engine.run_until_done() if o.finished)

    plain = frequencies(make_engine(tokenizer=TOKENIZER, seed=1, max_num_seqs=64))
    engine = draft(3, unrelated=True, tokenizer=TOKENIZER, seed=2, max_num_seqs=64,
                   draft_sampling="independent", verification="rejection")
    spec = frequencies(engine)
    assert engine.stats.spec_stats.num_drafts > 0
    assert set(plain) | set(spec) <= set(CHOICES) and len(plain) > 1
    tv = sum(abs(plain[c] - spec[c]) for c in CHOICES) / 2 / 300
    assert tv < 0.1, (plain, spec)


@pytest.mark.parametrize("sampling", ["coupled", "independent"])
def test_a_draft_row_its_constraints_leave_no_token_ends_the_draft_not_the_engine(
        sampling: str) -> None:
    """Sampled drafts verified by rejection sampling, where the draft's constraints leave a
    row no token: a draft vocabulary that stops below the EOS a complete choice allows, and
    allowed_token_ids that contradict the grammar half-way. The draft takes its end token
    there for certain (as the target does where its own row is empty), the grammar cuts it,
    and every request finishes as without speculation (an assertion took the engine down)."""
    eos = min(TOKENIZER.eos_token_ids)
    contradiction = SamplingParams(temperature=1.0, max_tokens=10, allowed_token_ids=[97],
                                   structured_outputs=StructuredOutputsParams(regex="ax"))
    choice = SamplingParams(temperature=1.0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    for draft_vocab_size in (None, eos):
        engine = draft(4, tokenizer=TOKENIZER, draft_sampling=sampling,
                       verification="rejection", draft_vocab_size=draft_vocab_size)
        for i in range(8):
            engine.add_request(str(i), PROMPTS[i % len(PROMPTS)], [choice, contradiction][i % 2])
        out = {int(o.request_id): o.outputs[0] for o in engine.run_until_done() if o.finished}
        assert len(out) == 8 and engine.stats.spec_stats.num_drafts > 0
        assert all(o.finish_reason == "stop" for o in out.values())
        assert {o.text for i, o in out.items() if i % 2 == 0} <= set(CHOICES)
        assert all(o.token_ids == [97, eos] for i, o in out.items() if i % 2)


def test_compiling_a_grammar_holds_no_other_request_back() -> None:
    """While a grammar compiles (its worker held here), other requests run; the structured
    one waits in its place and runs once its grammar is ready."""
    engine = make_engine(tokenizer=TOKENIZER)
    assert engine.structured is not None
    release = threading.Event()
    engine.structured.warm_up().result()
    blocker = engine.structured._worker.submit(release.wait)
    engine.add_request("json", PROMPTS[0], params(0))
    engine.add_request("plain", PROMPTS[1], replace(GREEDY, max_tokens=3))
    finished = [o.request_id for _ in range(8) for o in engine.step() if o.finished]
    assert finished == ["plain"] and engine.num_waiting == 1
    release.set()
    blocker.result()
    out = [o for o in engine.run_until_done() if o.finished]
    assert [o.request_id for o in out] == ["json"]
    check(out[0].outputs[0].text, constraint(0))


def test_abort_while_compiling_and_structured_without_tokenizer() -> None:
    engine = make_engine(tokenizer=TOKENIZER)
    engine.add_request("a", PROMPTS[0], params(1))
    engine.abort("a")
    assert not engine.has_unfinished_requests() and list(engine.run_until_done()) == []
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        make_engine().add_request("b", PROMPTS[0], params(1))


def test_ignore_eos_still_ends_when_the_grammar_is_complete() -> None:
    engine = make_engine(tokenizer=TOKENIZER)
    engine.add_request("r", PROMPTS[2], replace(params(1), ignore_eos=True, max_tokens=50))
    (out,) = [o for o in engine.run_until_done() if o.finished]
    assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop"
