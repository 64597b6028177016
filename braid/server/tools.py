"""Tool calling for chat completions, as vLLM's hermes parser does it for Qwen2.5.

The tools go to the model through its chat template; a call comes back as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` in the text, parsed into
`tool_calls` (streamed as vLLM's hermes parser does: a call's id and name once its head is
in, then its arguments text as it grows; text before and between calls streams as content).
An output that is nothing but such a call without the tags (or a ```json block of one, or
Llama 3's form: `<|python_tag|>` then {"name", "parameters"} objects, vLLM's llama3_json;
Mistral's: `[TOOL_CALLS]` then a list of calls; Phi-4-mini's: `functools` then a list of
calls, vLLM's phi4_mini_json; or a Python list of calls with literal
keyword arguments, `[get_weather(city="Paris"), ...]`, as Llama 3.2 and 4 write them, vLLM's
pythonic) is a call too (`bare_calls`). `tool_choice`:
- "none": the model sees the tools, its text stays text.
- "auto": the model decides; calls are parsed out of its text.
- "required": the grammar forces a JSON array of one or more calls of the given functions,
  each with arguments valid for that function's parameters (vLLM's format); streamed the
  same way (`required_progress`).
- a named function: the grammar forces that function's arguments, the whole output.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from braid.sampling_params import StructuredOutputsParams
from braid.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    TokenizeChatRequest,
    ToolCall,
)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # what Llama 3 writes before its calls
MISTRAL_TAG = "[TOOL_CALLS]"  # what Mistral writes before its list of calls
PHI4_TAG = "functools"  # what Phi-4-mini writes before its list of calls
TAGS = (PYTHON_TAG, MISTRAL_TAG, PHI4_TAG)  # before bare calls, one at most


def tool_mode(body: ChatCompletionRequest) -> str | None:
    """"auto", "required", "named" or None (no tools, or tool_choice "none"); ValueError
    naming the field for a choice that does not fit the tools."""
    choice = body.tool_choice
    names = [t.function.name for t in body.tools or []]
    if choice is None:
        return "auto" if names else None
    if isinstance(choice, str):
        if choice != "none" and not names:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return None if choice == "none" else choice
    if choice.function.name not in names:
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools "
                         f"({', '.join(map(repr, names)) or 'none given'})")
    return "named"


def tool_constraint(body: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The grammar that makes "required" and named tool choices valid calls (checked by the
    grammar engine later; `tool_schemas` names the tool at fault when it refuses it)."""
    mode = tool_mode(body)
    tools = body.tools or []
    if mode == "named":
        return StructuredOutputsParams(json=_parameters(tools, _named_index(body)))
    if mode != "required":
        return None
    try:
        return _required_calls(body)
    except RecursionError:
        raise ToolSchemaError("tools: parameters nested too deeply") from None


class ToolSchemaError(ValueError):
    """A tool's parameters that the grammar engine cannot take (a 400 naming `tools`)."""


def _required_calls(body: ChatCompletionRequest) -> StructuredOutputsParams:
    """An array of one or more calls, each of one of the tools, with its parameters."""
    tools = body.tools or []
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t.function.name]},
        # within the array's schema: its own references ("#/$defs/...") rebased to it
        "parameters": _rebased(_parameters(tools, i),
                               f"#/items/anyOf/{i}/properties/parameters")},
        "required": ["name", "parameters"], "additionalProperties": False}
        for i, t in enumerate(tools)]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if body.parallel_tool_calls is False:
        array["maxItems"] = 1
    return StructuredOutputsParams(json=array)


def tool_schemas(body: ChatCompletionRequest) -> list[tuple[str, StructuredOutputsParams]]:
    """(field, its schema as a constraint) of each tool whose parameters the tool choice's
    grammar holds: where the grammar engine refuses the whole, one of these is at fault."""
    tools = body.tools or []
    mode = tool_mode(body)
    indexes = [_named_index(body)] if mode == "named" else range(len(tools)) \
        if mode == "required" else []
    return [(f"tools.{i}.function.parameters", StructuredOutputsParams(json=_parameters(tools, i)))
            for i in indexes]


def _named_index(body: ChatCompletionRequest) -> int:
    assert not isinstance(body.tool_choice, str) and body.tool_choice is not None
    name = body.tool_choice.function.name
    return next(i for i, t in enumerate(body.tools or []) if t.function.name == name)


def _parameters(tools: list[Any], i: int) -> dict[str, Any]:
    """Tool i's parameters schema (an empty object where it has none)."""
    schema: dict[str, Any] = tools[i].function.parameters or {"type": "object", "properties": {}}
    return schema


# keywords whose values are data, not schemas: a "$ref" inside them is not a reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local references ("#" and "#/...") pointing into it where it sits
    at JSON pointer `base` of a larger schema."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, base)
    return out


def template_messages(body: ChatCompletionRequest | TokenizeChatRequest) -> list[dict[str, Any]]:
    """Messages for the chat template: an assistant's earlier calls carry their arguments as
    objects (OpenAI sends JSON strings; Qwen's template writes them with tojson)."""
    messages = [m.as_template_dict() for m in body.messages]
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            if isinstance(fn.get("arguments"), str):
                # else written as it came (too deep for the parser, too)
                with contextlib.suppress(json.JSONDecodeError, RecursionError):
                    fn["arguments"] = json.loads(fn["arguments"])
    return messages


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"chatcmpl-tool-{secrets.token_hex(12)}",
                    function=FunctionCall(name=name, arguments=arguments))


def as_delta(index: int, call: ToolCall, arguments: str | None = None) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=call.id, function=DeltaFunctionCall(
        name=call.function.name, arguments=call.function.arguments if arguments is None
        else arguments))


@dataclass
class HermesParser:
    """`<tool_call>` blocks out of a growing text: `feed` returns the new content (text
    outside calls, holding back what may be the start of a tag) and the calls completed.
    A block that is not a JSON call stays content, as the model wrote it."""

    limit: int | None = None  # at most this many calls (parallel_tool_calls false: 1)
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content, done = [], []
        while True:
            if not self._in_call:
                i = self._buffer.find(CALL_OPEN)
                if i < 0:
                    keep = partial_tag(self._buffer, CALL_OPEN)
                    content.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:i])
                self._buffer, self._in_call = self._buffer[i + len(CALL_OPEN):], True
            else:
                j = self._buffer.find(CALL_CLOSE)
                if j < 0:
                    break
                block, self._buffer = self._buffer[:j], self._buffer[j + len(CALL_CLOSE):]
                self._in_call = False
                call = self._parse(block)
                if call is None:
                    content.append(CALL_OPEN + block + CALL_CLOSE)
                elif self.limit is None or len(self.calls) < self.limit:
                    self.calls.append(call)
                    done.append(call)
        return "".join(content), done

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: an unclosed call (cut by max_tokens) is still parsed if
        its JSON is complete; anything else held back is content."""
        if self._in_call:
            call = self._parse(self._buffer)
            if call is not None and (self.limit is None or len(self.calls) < self.limit):
                self.calls.append(call)
                self._buffer, self._in_call = "", False
                return "", [call]
            rest = CALL_OPEN + self._buffer
        else:
            rest = self._buffer
        self._buffer, self._in_call = "", False
        return rest, []

    def partial(self) -> tuple[str, str] | None:
        """(name, arguments text so far) of the call being written, once its name and the
        start of its arguments are in; the arguments text is always a prefix of the finished
        call's (what may be the block's closing brace or tag is held back)."""
        if not self._in_call or (m := _CALL_HEAD.match(self._buffer)) is None:
            return None
        text = self._buffer[m.end():]
        return m.group(1), _written(text[:len(text) - partial_tag(text, CALL_CLOSE)])

    @staticmethod
    def _parse(block: str) -> ToolCall | None:
        value = _json_value(block)
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            arguments = value.get("arguments", value.get("parameters", {}))
            return new_call(value["name"], _arguments_text(block, arguments))
        # Qwen's head, then arguments that are not JSON (a small model's slip, or cut by
        # max_tokens): a call with the arguments as written, as its stream has sent them
        # (OpenAI's arguments "may not be valid JSON"; the client validates them)
        if (m := _CALL_HEAD.match(block)) is not None:
            return new_call(m.group(1), _written(block[m.end():]))
        return None


# A call's head as Qwen writes it; its arguments then stream as the model writes them.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')


def _written(text: str) -> str:
    """The arguments text after a call's head, without the call object's closing brace."""
    text = text.rstrip()
    return text[:-1].rstrip() if text.endswith("}") else text


def _arguments_text(block: str, arguments: Any) -> str:
    """The arguments as the model wrote them when the block has the usual head (so a stream
    of its text and the finished call agree), else as JSON."""
    if (m := _CALL_HEAD.match(block)) is not None:
        text = _written(block[m.end():])
        try:
            if json.loads(text) == arguments:
                return text
        except (json.JSONDecodeError, RecursionError):  # RecursionError: deep nesting
            pass
    return json.dumps(arguments, ensure_ascii=False)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def bare_calls(text: str, names: set[str], limit: int | None) -> list[ToolCall]:
    """Calls written without `<tool_call>` tags: the whole output, fences, Llama 3's
    `<|python_tag|>`, Mistral's `[TOOL_CALLS]` and Phi-4-mini's `functools` aside, is one
    call, a list of calls or
    calls one after another (with whitespace or Llama 3.2's "; " between), each {"name": a
    tool's name, "arguments" (or Llama 3's "parameters"): an object}. Small Qwen models
    answer so too (Qwen2.5-Coder-1.5B writes a ```json block); vLLM's llama3_json, mistral
    and phi4_mini_json parsers read Llama 3's, Mistral's and Phi-4-mini's. Anything else stays
    text."""
    body = text.strip()
    body = next((body.removeprefix(t).strip() for t in TAGS if body.startswith(t)), body)
    if body.startswith("```"):
        body = body.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    items = _json_values(body, separators=";") or _pythonic_calls(body)
    if len(items) == 1 and isinstance(items[0], list):
        items = items[0]
    if not items or not all(isinstance(c, dict) and c.get("name") in names
                            and isinstance(_call_arguments(c), dict) for c in items):
        return []
    calls = [new_call(c["name"], json.dumps(_call_arguments(c), ensure_ascii=False))
             for c in items]
    return calls[:limit]


MAX_PYTHONIC_CHARS = 65_536  # a longer output is not parsed as Python (ast's time and depth)


def _pythonic_calls(text: str) -> list[dict[str, Any]]:
    """`[f(a=1, b="x"), g()]` (vLLM's pythonic form) as [{"name", "arguments"}], read with
    `ast` (nothing is evaluated: arguments must be literals); [] for anything else."""
    if not (text.startswith("[") and text.endswith("]")) or len(text) > MAX_PYTHONIC_CHARS:
        return []
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List):
            return []
        calls = [c for c in tree.elts if isinstance(c, ast.Call) and isinstance(
            c.func, ast.Name) and not c.args and all(k.arg is not None for k in c.keywords)]
        if len(calls) != len(tree.elts):
            return []
        found = [{"name": c.func.id,  # type: ignore[attr-defined]
                  "arguments": {k.arg: ast.literal_eval(k.value) for k in c.keywords}}
                 for c in calls]
        json.dumps(found, allow_nan=False)  # sets, bytes, complex, inf: not JSON, not a call
        return found
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return []


def _call_arguments(call: dict[str, Any]) -> Any:
    return call.get("arguments", call.get("parameters", {}))


def _json_values(text: str, separators: str = "") -> list[Any]:
    """The JSON values `text` is made of, one after another with whitespace (or one of
    `separators`) between (a model writing two calls as two objects); [] where it is
    anything else."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: deep nesting
            return []
        values.append(value)
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] in separators:
            i += 1
            while i < len(text) and text[i].isspace():
                i += 1
    return values


def _argument_delta(index: int, arguments: str, sent: str) -> list[DeltaToolCall]:
    rest = arguments[len(sent):] if arguments.startswith(sent) else ""
    return [DeltaToolCall(index=index, type=None, function=DeltaFunctionCall(
        arguments=rest))] if rest else []


def _may_be_bare(text: str) -> bool:
    """The output so far could still be a bare call (whitespace, or it opens with JSON, a
    fence, Llama 3's `<|python_tag|>` or Phi-4-mini's `functools`)."""
    head = text.lstrip()
    return (not head or head[0] in "{[`"
            or any(t.startswith(head) or head.startswith(t) for t in (PYTHON_TAG, PHI4_TAG)))


_REQUIRED_HEAD = re.compile(r'\s*,?\s*\{\s*"name"\s*:\s*')
_PARAMETERS_HEAD = re.compile(r'\s*,\s*"parameters"\s*:\s*')
_REQUIRED_END = re.compile(r"\s*\}")


def required_progress(text: str) -> list[tuple[str, str]]:
    """The calls a "required" output has begun so far, for streaming: each one's name once
    it is whole, and its parameters' text as far as it goes. The grammar writes a JSON array
    of {"name": ..., "parameters": {...}}, keys in that order; text of another shape (a
    whitespace rule of the request's own) gives what precedes it."""
    decoder = json.JSONDecoder()
    start = re.match(r"\s*\[", text)
    calls: list[tuple[str, str]] = []
    pos = start.end() if start else len(text)
    while head := _REQUIRED_HEAD.match(text, pos):
        try:
            name, pos = decoder.raw_decode(text, head.end())
        except (json.JSONDecodeError, RecursionError):  # not whole yet (or too deep)
            break
        params = _PARAMETERS_HEAD.match(text, pos)
        if params is None:  # the name goes out first
            calls.append((name, ""))
            break
        try:
            _, pos = decoder.raw_decode(text, params.end())
        except (json.JSONDecodeError, RecursionError):  # RecursionError: deep nesting
            calls.append((name, text[params.end():]))
            break
        calls.append((name, text[params.end():pos]))
        end = _REQUIRED_END.match(text, pos)
        if end is None:
            break
        pos = end.end()
    return calls


def _json_value(text: str) -> Any:
    """The JSON value `text` is, or None where it is not whole JSON (cut short)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: deep nesting
        return None


def required_calls(text: str) -> list[ToolCall]:
    """The calls of a "required" output (a JSON array of {name, parameters}); none where
    max_tokens or a stop string cut it short. Each call's arguments are its parameters' text
    as the model wrote it, as a stream sends them (re-encoded where the keys came in
    another order)."""
    items = _json_value(text)
    if items is None:
        return []
    written = required_progress(text)
    if len(written) == len(items):
        return [new_call(name, arguments) for name, arguments in written]
    return [new_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
            for c in items]


class ChoiceTools:
    """One choice's text turned into content and tool calls, whole or as stream deltas."""

    def __init__(self, mode: str, body: ChatCompletionRequest) -> None:
        self.mode = mode
        self._name = None if isinstance(body.tool_choice, str) or body.tool_choice is None \
            else body.tool_choice.function.name
        self._parser = HermesParser(limit=1 if body.parallel_tool_calls is False else None)
        self._names = {t.function.name for t in body.tools or []}
        self._text: list[str] = []
        self._held: str | None = ""  # auto: the start of the output, while it may be bare
        self._space = ""  # auto: content's trailing whitespace, held (see `_content`)
        self._open: tuple[int, str, str] | None = None  # streamed call: index, id, args sent
        self._named: ToolCall | None = None
        self._required: list[ToolCall] = []  # "required": the calls streamed so far
        self.calls: list[ToolCall] = []

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished choice."""
        if self.mode == "named":
            assert self._name is not None
            self.calls = [new_call(self._name, text)]
            return None, self.calls
        if self.mode == "required":  # cut before the array closed: the text is content
            self.calls = required_calls(text)
            return (None if self.calls else text or None), self.calls
        bare = bare_calls(text, self._names, self._parser.limit)
        if bare:
            self.calls = bare
            return None, bare
        content, _ = self._parser.feed(text)
        rest, _ = self._parser.finish()
        self.calls = self._parser.calls
        content += rest
        return (content.strip() or None) if self.calls else content, self.calls

    def delta(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content delta, tool call deltas) for the text a stream chunk adds."""
        if self.mode == "named":
            assert self._name is not None
            if self._named is None:
                self._named = new_call(self._name, "")
                self.calls = [self._named]
                return "", [as_delta(0, self._named, text)]
            return "", [DeltaToolCall(index=0, type=None, function=DeltaFunctionCall(
                arguments=text))] if text else []
        if self.mode == "required":
            self._text.append(text)
            return self._required_delta("".join(self._text), finished)
        if self._held is not None:  # the output may be a bare call: hold it until known
            self._held += text
            if _may_be_bare(self._held) and not finished:
                return "", []
            text, self._held = self._held, None
            if finished and (bare := bare_calls(text, self._names, self._parser.limit)):
                self.calls = bare
                return "", [as_delta(i, c) for i, c in enumerate(bare)]
        first = len(self._parser.calls)
        content, _ = self._parser.feed(text)
        if finished:
            rest, _ = self._parser.finish()
            content += rest
        self.calls = self._parser.calls
        content = self._content(content, finished)
        deltas = []
        for i, call in enumerate(self.calls[first:], start=first):
            if self._open is not None and self._open[0] == i:  # its head went out already
                _, call.id, sent = self._open
                self._open = None
                deltas += _argument_delta(i, call.function.arguments, sent)
            else:
                deltas.append(as_delta(i, call))
        return content, deltas + self._stream_open()

    def _content(self, content: str, finished: bool) -> str:
        """The content to send now, so that a stream adds up to whole()'s: trailing
        whitespace waits for more content (the "\n" before, between and after calls is not
        content), and at the end goes out only if the output made no call. Whitespace that
        opens an output still goes out before content that follows it."""
        text = self._space + content
        if finished:
            self._space = ""
            return text.rstrip() if self.calls else text
        sent = text.rstrip()
        self._space = text[len(sent):]
        return sent

    def _required_delta(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """A "required" output streamed as vLLM streams it: each call's id and name once
        its name is whole, then its arguments (the parameters' text) as they grow. At the
        end, an array cut short before any call began is the content, as whole() has it."""
        deltas = []
        for i, (name, arguments) in enumerate(required_progress(text)):
            if i == len(self._required):
                self._required.append(new_call(name, ""))
                deltas.append(as_delta(i, self._required[i], ""))
            call = self._required[i]
            deltas += _argument_delta(i, arguments, call.function.arguments)
            if arguments.startswith(call.function.arguments):
                call.function.arguments = arguments
        if not finished:
            return "", deltas
        self.calls = self._required if _json_value(text) is not None else []
        return "" if self._required else text, deltas

    def _stream_open(self) -> list[DeltaToolCall]:
        """Deltas of the call being written: its id and name first, then its arguments as
        they grow (vLLM's hermes streaming)."""
        index, partial = len(self._parser.calls), self._parser.partial()
        limit = self._parser.limit
        if partial is None or (limit is not None and index >= limit):
            return []
        name, arguments = partial
        if self._open is None:
            call = new_call(name, "")
            self._open = (index, call.id, "")
            return [as_delta(index, call, "")] + self._stream_open()
        _, call_id, sent = self._open
        if len(arguments) <= len(sent) or not arguments.startswith(sent):
            return []
        self._open = (index, call_id, arguments)
        return _argument_delta(index, arguments, sent)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (a named call is "stop")."""
        return "tool_calls" if self.calls and reason == "stop" and self.mode != "named" \
            else reason
