"""Grammars from StructuredOutputsParams, and a request's grammar state: masks after drafts,
draft validation, completion."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from braid.core.stats import GrammarStats
from braid.sampling_params import StructuredOutputsParams
from braid.structured.grammar import (
    GrammarState,
    allowed_tokens,
    bitmask_width,
    closed_objects,
    grammar_for,
)
from tests.tiny import VOCAB, byte_tokenizer

EOS = 256
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def ll_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(byte_tokenizer().to_str(), n_vocab=VOCAB, eos_token=EOS)


def state(ll_tokenizer: llguidance.LLTokenizer, **spec: object) -> GrammarState:
    grammar = grammar_for(StructuredOutputsParams(**spec))  # type: ignore[arg-type]
    return GrammarState(llguidance.LLMatcher(ll_tokenizer, grammar), {EOS, 258}, GrammarStats())


def mask(g: GrammarState, drafts: list[int]) -> torch.Tensor:
    out = torch.zeros(bitmask_width(VOCAB), dtype=torch.int32)
    g.fill_mask(drafts, out)
    return allowed_tokens(out.unsqueeze(0), VOCAB)[0]


def ids(text: str) -> list[int]:
    return list(text.encode())  # the byte tokenizer: one token per byte


@pytest.mark.parametrize("spec, field", [
    ({"json": {"type": "objectx"}}, "json"),
    ({"regex": "a[b"}, "regex"),
    ({"grammar": "start: foo"}, "grammar"),
    ({"grammar": "root ::= (("}, "grammar"),
])
def test_invalid_specs_name_their_field(spec: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} is not valid"):
        grammar_for(StructuredOutputsParams(**spec))


@pytest.mark.parametrize("spec", [{}, {"regex": "a", "choice": ["b"]}, {"choice": []},
                                  {"choice": ["a", 1]}, {"json_object": False}])
def test_exactly_one_constraint(spec: dict) -> None:
    with pytest.raises(ValueError, match="structured_outputs|choice"):
        StructuredOutputsParams(**spec)


def test_the_mask_after_drafts_is_the_mask_after_consuming_them(ll_tokenizer) -> None:
    g = state(ll_tokenizer, json=SCHEMA, disable_any_whitespace=True)
    prefix = ids('{"ok":')
    after = mask(g, prefix)
    assert after.nonzero().flatten().tolist() == sorted(ids("tf"))  # true or false
    assert mask(g, []).nonzero().flatten().tolist() == ids("{")  # drafts were rolled back
    for token in prefix:
        assert g.advance(token) is None
    assert torch.equal(mask(g, []), after)


def test_drafts_are_valid_up_to_the_first_refused_token(ll_tokenizer) -> None:
    g = state(ll_tokenizer, choice=["yes", "no"])
    assert g.num_valid(ids("yes")) == 3
    assert g.num_valid(ids("yep")) == 2
    assert g.num_valid(ids("x")) == 0
    assert mask(g, ids("yx")).all()  # after a refused draft: unused, everything allowed
    # any of the model's EOS ids is valid where the grammar may end, and nothing after it
    assert g.num_valid([*ids("no"), 258, *ids("no")]) == 3
    assert g.num_valid([*ids("n"), 258]) == 1
    assert mask(g, [*ids("no"), 258]).all()


def test_thousands_of_choices_and_regex_characters_in_them(ll_tokenizer) -> None:
    """A choice is taken literally, whatever regex characters it holds, and any number of
    them works (llguidance's own choice grammar stopped requests past 2000)."""
    choices = [f"opt {i} (a|b)*.$" for i in range(5000)]
    g = state(ll_tokenizer, choice=choices)
    text = ids(choices[4321])
    assert g.num_valid(text) == len(text)
    assert g.num_valid(ids("opt 4321 a")) == len("opt 4321 ")
    assert [g.advance(t) for t in text][-1] == "stop"


def test_the_grammar_stops_the_request_when_complete(ll_tokenizer) -> None:
    g = state(ll_tokenizer, regex="ab|abc")
    assert [g.advance(t) for t in ids("ab")] == [None, None]
    allowed = mask(g, [])
    assert allowed[ord("c")] and allowed[EOS] and allowed[258]  # every EOS id once accepting
    assert g.advance(ord("c")) == "stop"
    assert state(ll_tokenizer, regex="ab").advance(ord("x")) == "error"


def test_json_whitespace_is_bounded_unless_disabled(ll_tokenizer) -> None:
    pretty = json.dumps({"ok": True}, indent=2)
    assert state(ll_tokenizer, json=SCHEMA).num_valid(ids(pretty)) == len(pretty)
    runaway = "{" + " " * 30
    assert state(ll_tokenizer, json=SCHEMA).num_valid(ids(runaway)) < len(runaway)
    assert state(ll_tokenizer, json=SCHEMA, disable_any_whitespace=True).num_valid(
        ids(pretty)) == 1
    loose = state(ll_tokenizer, json=SCHEMA, whitespace_pattern=r"[ ]*")
    assert loose.num_valid(ids(runaway)) == len(runaway)


def test_objects_have_the_keys_their_schema_names(ll_tokenizer) -> None:
    """As vLLM's default backend (xgrammar's strict mode) and OpenAI's strict schemas: an
    object lists its keys unless its schema opens it (additionalProperties); the model
    added keys of its own, or of another tool's schema, before. allOf branches stay open."""
    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "pet": {"type": "object",
                                                       "properties": {"kind": {}}}},
              "required": ["name"]}
    extra, nested = '{"name": "x", "age": 3}', '{"name": "x", "pet": {"kind": 1, "age": 3}}'
    for text in (extra, nested):
        refused_at = text.index(', "age"') + 1
        assert state(ll_tokenizer, json=person).num_valid(ids(text)) <= refused_at + 2
    ok = '{"name": "x", "pet": {"kind": 1}}'
    assert state(ll_tokenizer, json=person).num_valid(ids(ok)) == len(ok)
    opened = {**person, "additionalProperties": True}
    assert state(ll_tokenizer, json=opened).num_valid(ids(extra)) == len(extra)
    both = {"allOf": [{"type": "object", "properties": {"name": {}}},
                      {"type": "object", "properties": {"age": {}}}]}
    assert state(ll_tokenizer, json=both).num_valid(ids(extra)) == len(extra)
    # a property named "properties" is a name, not a schema keyword
    named = {"type": "object", "properties": {"properties": {"type": "integer"}}}
    assert closed_objects(named) == {**named, "additionalProperties": False}


BASE = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


@pytest.mark.parametrize("schema, instance", [
    # inheritance: allOf of a $ref and the object's own properties, or a $ref beside them
    ({"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}],
      "properties": {"name": {"type": "string"}}}, {"id": 1, "name": "x"}),
    ({"$defs": {"Base": BASE}, "$ref": "#/$defs/Base", "properties": {"name": {}}},
     {"id": 1, "name": "x"}),
    ({"$defs": {"A": BASE, "B": {"properties": {"name": {}}}},
      "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}, {"id": 1, "name": "x"}),
    ({"properties": {"kind": {}}, "allOf": [{"properties": {"id": {}}}]}, {"kind": 1, "id": 1}),
    # anyOf branches that narrow the object's own properties
    ({"type": "object", "properties": {"kind": {"type": "string"}, "a": {"type": "integer"}},
      "anyOf": [{"properties": {"kind": {"const": "x"}}}, {"required": ["a"]}]},
     {"kind": "x", "a": 1}),
    # required beyond the listed properties
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, {"a": 1, "b": 2}),
    # parts found through nested $defs, escaped names, a chain of $refs, a union
    ({"properties": {"p": {"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/properties/p/$defs/"
                                                                 "Base"}],
                           "properties": {"name": {}}}}}, {"p": {"id": 1, "name": "x"}}),
    ({"$defs": {"a/b": BASE}, "allOf": [{"$ref": "#/$defs/a~1b"}], "properties": {"n": {}}},
     {"id": 1, "n": 2}),
    ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": BASE}, "allOf": [{"$ref": "#/$defs/A"}],
      "properties": {"n": {}}}, {"id": 1, "n": 2}),
    ({"$defs": {"U": {"anyOf": [BASE, {"properties": {"k": {}}}]}},
      "allOf": [{"$ref": "#/$defs/U"}], "properties": {"n": {}}}, {"id": 1, "n": 2}),
])
def test_objects_made_of_several_schemas_stay_open(ll_tokenizer, schema: dict,
                                                   instance: dict) -> None:
    """Closing one part of an object built from several would refuse another part's keys
    (or make the schema unsatisfiable): such objects keep JSON Schema's default."""
    text = json.dumps(instance)
    assert state(ll_tokenizer, json=schema).num_valid(ids(text)) == len(text)


def test_an_inherited_tool_schema_under_tool_choice_required(ll_tokenizer) -> None:
    """A tool's parameters built on a base ($ref in allOf) move into the array "required"
    asks for, their references rebased: the base stays open there too."""
    from braid.server.protocol import ChatCompletionRequest
    from braid.server.tools import tool_constraint

    parameters = {"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}],
                  "properties": {"note": {"type": "string"}}}
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice=
                                 "required", tools=[{"type": "function", "function": {
                                     "name": "f", "parameters": parameters}}])
    constraint = tool_constraint(body)
    assert constraint is not None
    text = json.dumps([{"name": "f", "parameters": {"id": 1, "note": "x"}}])
    assert state(ll_tokenizer, json=constraint.json).num_valid(ids(text)) == len(text)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {}}, "required": None},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {},
                                            "required": True}}},
    {"type": "object", "properties": {"a": {}}, "allOf": 1},
])
def test_malformed_schemas_are_named_not_crashed_on(schema: dict) -> None:
    """Closing objects walks a schema before llguidance has checked it: a malformed one is
    still the 400 naming `json` (it was a TypeError, a 500)."""
    with pytest.raises(ValueError, match="json is not valid"):
        grammar_for(StructuredOutputsParams(json=schema))


def test_pydantic_schemas_take_their_instances_and_no_other_keys(ll_tokenizer) -> None:
    """What clients send most: a pydantic model's schema ($defs and $refs, optional nested
    models, lists of models, a dict of models, a union) takes a valid instance whole and
    refuses a key the model does not have, at every level."""
    import pydantic

    class Pet(pydantic.BaseModel):
        kind: str
        age: int | None = None

    class Cat(pydantic.BaseModel):
        lives: int

    class Person(pydantic.BaseModel):
        name: str
        pet: Pet | None = None
        pets: list[Pet] = []
        by_name: dict[str, Pet] = {}
        friend: Pet | Cat

    schema = Person.model_json_schema()
    good = {"name": "a", "pet": {"kind": "dog", "age": 3}, "pets": [{"kind": "cat"}],
            "by_name": {"rex": {"kind": "dog"}}, "friend": {"lives": 9}}
    text = json.dumps(Person.model_validate(good).model_dump())
    assert state(ll_tokenizer, json=schema).num_valid(ids(text)) == len(text)
    for where in ("pet", "pets", "by_name", "friend", None):
        bad = json.loads(text)
        target = {"pet": bad["pet"], "pets": bad["pets"][0], "by_name": bad["by_name"]["rex"],
                  "friend": bad["friend"], None: bad}[where]
        target["zzz"] = 1  # last, so everything before it is valid
        bad_text = json.dumps(bad)
        assert state(ll_tokenizer, json=schema).num_valid(ids(bad_text)) < len(bad_text), where


def test_grammar_kinds(ll_tokenizer) -> None:
    lark = state(ll_tokenizer, grammar='start: "a" ("b" | "c")+')
    assert lark.num_valid(ids("abcb")) == 4 and lark.num_valid(ids("aa")) == 1
    gbnf = state(ll_tokenizer, grammar='root ::= "x" [0-9]+')
    assert gbnf.num_valid(ids("x12")) == 3 and gbnf.num_valid(ids("xa")) == 1
    anything = state(ll_tokenizer, json_object=True)
    text = '{"a": [1, {"b": null}]}'
    assert anything.num_valid(ids(text)) == len(text)
    assert anything.num_valid(ids("[1]")) == 0  # an object, not any JSON value


def test_allowed_tokens_unpacks_llguidance_bitmasks(ll_tokenizer) -> None:
    """Bit i of word w is token 32 w + i, as llguidance's own masking reads it."""
    import llguidance.torch as lgt

    g = state(ll_tokenizer, regex="[a-z_]+")
    bitmask = torch.zeros(1, bitmask_width(VOCAB), dtype=torch.int32)
    g.fill_mask([], bitmask[0])
    logits = torch.zeros(1, VOCAB)
    lgt.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(allowed_tokens(bitmask, VOCAB), logits > float("-inf"))
    assert allowed_tokens(bitmask, VOCAB)[0].nonzero().flatten().tolist() == sorted(
        ids("abcdefghijklmnopqrstuvwxyz_"))


@pytest.mark.parametrize("text", ["<tool_call>{}</tool_call>", "hi<|im_end|>"])
def test_added_tokens_text_is_text_in_grammars(text: str) -> None:
    """A grammar asking for the text of an added token: of one that is not special (Qwen's
    <tool_call>) the model may write the token or spell it out, of a special one (<|im_end|>)
    only spell it out; the grammar completes either way. Before, the tokenizer's view handed
    llguidance the token for such text, it refused it, and the request ended in an error."""
    import re

    from tokenizers import AddedToken

    from braid.structured.manager import grammar_tokenizer
    from braid.tokenizer import Tokenizer

    backend = byte_tokenizer()
    backend.add_tokens([AddedToken("<tool_call>", special=False),
                        AddedToken("</tool_call>", special=False)])  # ids 259, 260
    view = grammar_tokenizer(Tokenizer(backend, {}), VOCAB, EOS)
    for pick in (max, min):  # max: the added token where it is allowed, min: bytes
        grammar = grammar_for(StructuredOutputsParams(regex=re.escape(text)))
        g = GrammarState(llguidance.LLMatcher(view, grammar), {EOS, 258}, GrammarStats())
        out: list[int] = []
        reason = None
        while reason is None and len(out) < 40:
            out.append(pick(mask(g, []).nonzero().squeeze(1).tolist()))
            reason = g.advance(out[-1])
        assert reason == "stop", (pick, out, view.decode_str(out))
        assert view.decode_str(out) == text
        assert 258 not in out  # <|im_end|> the token is never its text
    assert view.tokenize_str("<tool_call>x<|im_end|>")[0] == 259
