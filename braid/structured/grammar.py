"""Grammars for structured output, on llguidance: a request's `StructuredOutputsParams` become
an llguidance grammar, and a `GrammarState` follows the request's output tokens and gives the
token mask of any position, including positions after drafts that are not accepted yet.

llguidance was chosen over xgrammar by measurement on this CPU with the 151,936-token
vocabulary (docs/benchmarks.md, structured output): a JSON schema compiles in under 1 ms
against xgrammar's ~20 ms, so no request waits on a compile; a mask costs ~20 us (xgrammar's
~4 us), both well under 1% of a step; it needs no other package (xgrammar pulls triton and
transformers); and it checks and rolls back drafts (`validate_tokens`, `rollback`).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import llguidance
import torch

from braid.core.request import Grammar
from braid.core.stats import GrammarStats
from braid.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


# What a spec may weigh: its JSON schema's text, regex, grammar or choices together. It bounds
# the stack a compile needs (worker.py), the compile's time and memory, and the per-token
# cost of the grammar's longest literal (~0.5 us per character each mask).
MAX_GRAMMAR_BYTES = 256 * 1024
# llguidance converts GBNF to Lark in Python, in time quadratic in the number of rules (1,000
# rules take ~0.1 s, 20,000 took 28 s with the GIL held).
MAX_GBNF_RULES = 1000
# llguidance's own limits. Initial lexer fuel bounds regex analysis: `((a{100}){100}){100}`
# fails at its first mask in ~0.2 s instead of ~2 s, a 200 kB literal fails, an enum of
# 10,000 values passes. Items and fuel per step bound a mask's work, lexer states a
# matcher's memory (1-2 kB each); errors stay one line (no parser state dumps).
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=200_000, step_lexer_fuel=100_000, step_max_items=20_000,
    max_lexer_states=50_000, max_grammar_size=200_000, verbose_errors=False)


class GrammarError(RuntimeError):
    """A grammar that hit one of llguidance's limits (or refused a token) while a request
    generated: that request ends with finish reason "error"."""


def spec_key(params: StructuredOutputsParams) -> tuple[str, str, str | None]:
    """(kind, its text, whitespace rule): what a compiled grammar depends on. JSON schemas
    and choices are JSON text; ValueError naming the kind for a schema too deeply nested to
    write out."""
    kind = params.kinds[0]
    value = getattr(params, kind)
    try:
        text = json.dumps(value) if kind in ("json", "choice") and not isinstance(
            value, str) else value
    except RecursionError:
        raise ValueError(f"{kind} is not valid: nested too deeply") from None
    whitespace = None if params.disable_any_whitespace else (
        params.whitespace_pattern or JSON_WHITESPACE)
    return kind, "" if text is True else str(text), whitespace


def grammar_for(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`; ValueError naming the field when the schema, regex
    or grammar is invalid or larger than the limits. Compiling recurses deeply on chains of
    rules: call it through a GrammarWorker (worker.py), never on a thread's default stack."""
    kind, text, whitespace = spec_key(params)
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{kind} is too large: {len(text.encode())} bytes, the limit is "
                         f"{MAX_GRAMMAR_BYTES}")
    if kind == "grammar" and text.count("::=") > MAX_GBNF_RULES:
        raise ValueError(f"grammar has {text.count('::=')} GBNF rules, the limit is "
                         f"{MAX_GBNF_RULES}")
    try:
        return _grammar(kind, text, whitespace)
    except RecursionError:
        raise ValueError(f"{kind} is not valid: nested too deeply") from None


def closed_objects(schema: object) -> object:
    """The schema with `additionalProperties: false` on every object that lists its
    properties and says nothing of others: as vLLM's default backend (xgrammar's strict
    mode) and OpenAI's strict schemas, an answer has the keys its schema names and no
    others (JSON Schema itself allows any). An object made of several schemas stays open, as
    closing one part would refuse the keys of another (`_open_parts`); so does one whose
    `required` names keys it does not list, and whatever is under `not` or `if`."""
    return _closed(schema, _open_parts(schema), ())


Path = tuple[str, ...]  # JSON pointer tokens from the schema's root
_COMBINED = {"allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependentRequired",
             "additionalProperties", "patternProperties", "unevaluatedProperties"}
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed(schema: object, open_parts: set[Path], path: Path) -> object:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _NAMED:
        if isinstance(out.get(key), dict):  # name -> schema
            out[key] = {name: _closed(s, open_parts, (*path, key, name))
                        for name, s in out[key].items()}
    for key in ("allOf", "anyOf", "oneOf", "prefixItems", "items"):
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, open_parts, (*path, key, str(i)))
                        for i, s in enumerate(out[key])]
    for key in ("items", "additionalProperties", "then", "else", "contains"):
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], open_parts, (*path, key))
    required = out.get("required", [])
    if (isinstance(out.get("properties"), dict) and path not in open_parts
            and not _COMBINED & out.keys() and isinstance(required, list)
            and all(isinstance(r, str) for r in required)
            and set(required) <= out["properties"].keys()):
        out["additionalProperties"] = False
    return out


def _open_parts(schema: object) -> set[Path]:
    """The schemas that are one part of an object made of several: allOf's branches, the
    anyOf / oneOf branches of an object with properties, what such a part or a $ref beside
    properties points to, and on through $refs and unions from there."""
    todo: list[Path] = []
    stack: list[tuple[object, Path]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack += [(v, (*path, str(i))) for i, v in enumerate(node)]
        elif isinstance(node, dict):
            keys = ["allOf", *(("anyOf", "oneOf") if "properties" in node else ())]
            todo += [(*path, key, str(i)) for key in keys if isinstance(node.get(key), list)
                     for i in range(len(node[key]))]
            if "properties" in node and (ref := _pointer(node.get("$ref"))) is not None:
                todo.append(ref)
            stack += [(v, (*path, str(k))) for k, v in node.items()]
    parts: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in parts:
            continue
        parts.add(path)
        node = _at(schema, path)
        if isinstance(node, dict):
            if (ref := _pointer(node.get("$ref"))) is not None:
                todo.append(ref)
            todo += [(*path, key, str(i)) for key in ("anyOf", "oneOf")
                     if isinstance(node.get(key), list) for i in range(len(node[key]))]
    return parts


def _pointer(ref: object) -> Path | None:
    """A local $ref ("#/$defs/a~1b") as path tokens; None for others."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    tokens = urllib.parse.unquote(ref[1:]).split("/")[1:]
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in tokens)


def _at(schema: object, path: Path) -> object:
    for token in path:
        if isinstance(schema, dict):
            schema = schema.get(token)
        elif isinstance(schema, list) and token.isdigit() and int(token) < len(schema):
            schema = schema[int(token)]
        else:
            return None
    return schema


# What llama.cpp's JSON grammars allow between tokens: nothing, a space, or a newline and an
# indentation of up to 20 spaces or tabs (unbounded whitespace lets a model loop in it).
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


def _grammar(kind: str, text: str, whitespace: str | None) -> str:
    options: JsonCompileOptions = {"whitespace_flexible": whitespace is not None,
                                   "whitespace_pattern": whitespace}
    try:
        if kind in ("json", "json_object"):
            schema = text if kind == "json" else '{"type": "object"}'
            # closed where llguidance takes it so; else the schema as given, whose error (if
            # any) names what is wrong with it (closing broke it, or it is too odd to walk)
            with contextlib.suppress(ValueError, TypeError, RecursionError):
                closed = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(closed_objects(json.loads(schema))), defaults=options)
                if not llguidance.LLMatcher.validate_grammar(closed, limits=LIMITS):
                    return closed
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif kind == "choice":
            # one regex, a single lexeme: llguidance's own choice grammar makes each choice a
            # rule alternative, and its parser stops a request mid-output past 2000 of them
            choices = "|".join(map(re.escape, json.loads(text)))
            grammar = llguidance.grammar_from("regex", f"(?:{choices})")
        else:
            assert kind in ("regex", "grammar")
            grammar = llguidance.grammar_from(kind, text)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"{kind} is not valid: {first_line(str(e))}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=LIMITS)
    if error:
        raise ValueError(f"{kind} is not valid: {first_line(error)}")
    return grammar


def first_line(message: str, limit: int = 300) -> str:
    """An llguidance message as one line of at most `limit` characters."""
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."



class GrammarState:
    """One request's grammar, advanced by its output tokens. Drafts never advance it: a mask
    after drafts consumes them, computes, and rolls them back. A matcher that hits one of
    llguidance's limits stays in error: `fill_mask` then raises GrammarError (the request
    fails alone) and `on_error` is told, so the compiled grammar it was copied from, whose
    lexer it shares, is not handed out again."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: Collection[int],
                 stats: GrammarStats, on_error: Callable[[], None] | None = None) -> None:
        self._matcher = matcher
        self._eos_token_ids = frozenset(eos_token_ids)
        self._stats = stats
        self._on_error = on_error
        self._unbilled = 0.0  # seconds of masks since `take_mask_time` last asked

    def advance(self, token: int) -> str | None:
        """Consume an output token: "stop" once the grammar is complete (nothing but EOS
        could follow), "error" if it refuses the token (the mask should have prevented it)."""
        if not self._matcher.consume_token(token):
            self._failed()
            return "error"
        return "stop" if self._matcher.is_stopped() else None

    def _failed(self) -> None:
        if self._on_error is not None and self._matcher.is_error():
            self._on_error()
            self._on_error = None

    @contextmanager
    def _after(self, tokens: Sequence[int]) -> Iterator[None]:
        """The matcher in the state after `tokens` (which it accepts), rolled back on exit."""
        if tokens:
            self._matcher.consume_tokens(list(tokens))
        try:
            yield
        finally:
            if tokens:
                self._matcher.rollback(len(tokens))

    def num_valid(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar accepts from the current state: up to the
        first it refuses, or up to and including an EOS where the grammar may end (nothing
        after it can matter)."""
        n = self._matcher.validate_tokens(list(drafts)) if drafts else 0
        if n < len(drafts) and self.is_eos(drafts[n]):
            with self._after(drafts[:n]):
                n += self._matcher.is_accepting()
        return n

    def is_eos(self, token: int) -> bool:
        return token in self._eos_token_ids

    def fill_mask(self, drafts: Sequence[int], out: torch.Tensor) -> None:
        """The allowed tokens after the output and then `drafts`, as a bitmask into `out`
        [ceil(V / 32)] int32 (bit i of word w: token 32 w + i). A position after a draft the
        grammar refuses, or after an EOS, is never used (the draft is rejected, or the
        output ends there); it gets everything allowed. GrammarError if the matcher is (or
        goes) into error."""
        self._check()
        start = time.perf_counter()
        n = self._matcher.validate_tokens(list(drafts)) if drafts else 0
        if n < len(drafts) or any(map(self.is_eos, drafts)):
            out.fill_(-1)
            return
        with self._after(drafts):
            self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
            if self._matcher.is_accepting():  # any of the model's EOS tokens may end it
                for t in self._eos_token_ids:
                    if t < out.numel() * 32:
                        out[t // 32] |= bit(t % 32)
        seconds = time.perf_counter() - start
        self._unbilled += seconds
        self._stats.num_masks += 1
        self._stats.mask_time += seconds
        self._check()

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here, the only continuation it
        allows (llguidance's fast-forward tokens: the forced bytes, tokenized as the
        tokenizer would, less a last token a longer one could replace); none in error."""
        if limit <= 0 or self._matcher.is_error():
            return []
        start = time.perf_counter()
        tokens = self._matcher.compute_ff_tokens()[:limit]
        self._unbilled += time.perf_counter() - start
        return tokens

    def take_mask_time(self) -> float:
        """Seconds spent on this request's masks since the last call."""
        seconds, self._unbilled = self._unbilled, 0.0
        return seconds

    def _check(self) -> None:
        if self._matcher.is_error():
            self._failed()
            raise GrammarError(f"the grammar failed: {first_line(self._matcher.get_error())}")


def bit(i: int) -> int:
    """Bit i of an int32 word, as a signed value."""
    return -(1 << 31) if i == 31 else 1 << i


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def window_bitmask(grammar: Grammar, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[1 + len(drafts), ceil(V / 32)] int32: row j, the tokens `grammar` allows after its
    output and then drafts[:j] (a verification window's positions)."""
    out = torch.empty(1 + len(drafts), bitmask_width(vocab_size), dtype=torch.int32)
    for j in range(1 + len(drafts)):
        grammar.fill_mask(drafts[:j], out[j])
    return out


def bitmask_after(grammar: Grammar, drafts: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[ceil(V / 32)] int32: the tokens `grammar` allows after its output and then `drafts`."""
    out = torch.empty(bitmask_width(vocab_size), dtype=torch.int32)
    grammar.fill_mask(drafts, out)
    return out


_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 bitmasks -> [R, V] bool."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
