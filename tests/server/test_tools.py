"""Tool calling over a real server with the openai client (tiny random model: required and
named tool choices, which the grammar makes valid calls), and the hermes parser that reads
`<tool_call>` blocks out of a model's text, whole and in stream pieces."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from braid.server.protocol import ChatCompletionRequest
from braid.server.tools import ChoiceTools, HermesParser, template_messages
from tests.server.conftest import ServerProcess

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def chat(server: ServerProcess, stream: bool, **kwargs: Any) -> tuple[Any, list[dict], str]:
    """(content, tool calls as dicts, finish reason), from one response or a whole stream."""
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    kwargs = {"model": server.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 150,
              "temperature": 0, **kwargs}
    if not stream:
        res = c.chat.completions.create(**kwargs)
        m = res.choices[0].message
        return m.content, [t.model_dump() for t in m.tool_calls or []], \
            res.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for ch in c.chat.completions.create(stream=True, **kwargs):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            call = calls.setdefault(t.index, {"id": t.id, "type": "function",
                                              "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += t.function.name or ""
            call["function"]["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["id"] and call["type"] == "function"
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_valid_arguments(server: ServerProcess, stream: bool) -> None:
    content, calls, finish = chat(server, stream, tool_choice={
        "type": "function", "function": {"name": "get_time"}})
    assert content is None and finish == "stop"  # OpenAI's reason for a forced call
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    check_calls(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_gives_valid_calls(server: ServerProcess, stream: bool) -> None:
    """One call or more (a random model would add calls until max_tokens, so a logit bias
    toward "]" ends the array as soon as the grammar allows); at most one when parallel
    tool calls are off."""
    content, calls, finish = chat(server, stream, tool_choice="required",
                                  logit_bias={str(ord("]")): 8})
    assert content is None and finish == "tool_calls"
    check_calls(calls)
    _, one, finish = chat(server, stream, tool_choice="required", parallel_tool_calls=False)
    assert len(one) == 1 and finish == "tool_calls"
    check_calls(one)


@pytest.mark.parametrize("stream", [False, True])
def test_required_call_cut_short_comes_back_as_text(server: ServerProcess, stream: bool) -> None:
    """max_tokens ends a "required" output before its array closes: no call, finish "length",
    and what the model wrote is the content (it used to vanish: no call and no content)."""
    content, calls, finish = chat(server, stream, tool_choice="required", max_tokens=6)
    assert calls == [] and finish == "length"
    assert content and content.startswith("["), content


# references within a tool's own schema, as pydantic writes them ($defs) and older
# generators do (definitions), and one to its root (a recursive tree)
UNITS = {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}},
         "definitions": {"City": {"enum": ["Paris", "Oslo"]}},
         "properties": {"unit": {"$ref": "#/$defs/Unit"}, "city": {"$ref": "#/definitions/City"},
                        "also": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}},
         "required": ["unit", "city"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tools_with_references(server: ServerProcess, stream: bool) -> None:
    """A tool's own "#/$defs/..." references hold inside the array of calls "required" asks
    for (they were "Pointer does not exist" 400s), and for a named call."""
    tools = [*TOOLS, {"type": "function", "function": {"name": "convert", "parameters": UNITS}}]
    for choice in ("required", {"type": "function", "function": {"name": "convert"}}):
        _, calls, _ = chat(server, stream, tools=tools, tool_choice=choice,
                           parallel_tool_calls=False)
        assert len(calls) == 1, calls
        name = calls[0]["function"]["name"]
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]),
                            {**SCHEMAS, "convert": UNITS}[name])


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_json_calls_come_back_as_tool_calls(server: ServerProcess, stream: bool) -> None:
    """Llama 3's form (vLLM's llama3_json): `<|python_tag|>` and {"name", "parameters"}
    objects, "; " between two calls (a grammar makes the tiny model write it)."""
    regex = (r'<\|python_tag\|>\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}; '
             r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}')
    content, calls, finish = chat(server, stream,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert content is None and finish == "tool_calls"
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    check_calls(calls)


def test_stream_and_whole_agree(server: ServerProcess) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs: dict[str, Any] = {"tool_choice": choice, "parallel_tool_calls": False}
        whole, streamed = chat(server, False, **kwargs), chat(server, True, **kwargs)
        assert [c["function"] for c in whole[1]] == [c["function"] for c in streamed[1]]


@pytest.mark.parametrize("body, field", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "bogus"}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {
        "$ref": "#/$defs/Nowhere"}}}], "tool_choice": {"type": "function", "function": {
            "name": "bad"}}}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(server: ServerProcess, body: dict,
                                                    field: str) -> None:
    res = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                     json={"model": server.model, "messages": MESSAGES, **body})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == field, res.json()
    if field == "tools" and "tool_choice" in body:  # the tool's schema, by its place
        assert res.json()["error"]["message"].startswith(
            f"tools.{len(body['tools']) - 1}.function.parameters: not a JSON schema"), res.text
    res = httpx.post(f"{server.url}/v1/completions", timeout=30,
                     json={"model": server.model, "prompt": "hi", "tools": TOOLS})
    assert res.status_code == 400 and res.json()["error"]["param"] == "tools"


TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '{"zone": "UTC"}}\n</tool_call>')


@pytest.mark.parametrize("piece", [1, 3, 7, len(TEXT)])
def test_hermes_parser_reads_calls_in_any_pieces(piece: int) -> None:
    parser, content, calls = HermesParser(), "", []
    for i in range(0, len(TEXT), piece):
        text, done = parser.feed(TEXT[i:i + piece])
        assert "<" not in text  # a tag is never leaked as content, even split
        content += text
        calls += done
    rest, done = parser.finish()
    content, calls = content + rest, calls + done
    assert content.strip() == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]


def test_hermes_parser_keeps_what_is_not_a_call() -> None:
    parser = HermesParser(limit=1)
    text = "a < b\n<tool_call>\nnot json\n</tool_call>" + TEXT
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    assert (content + rest).startswith("a < b\n<tool_call>\nnot json\n</tool_call>")
    assert [c.function.name for c in calls + more] == ["get_weather"]  # limit 1
    cut = HermesParser()
    assert cut.feed('<tool_call>\n{"name": "f", "arguments": {}}')[1] == []
    assert cut.finish()[1][0].function.name == "f"  # complete JSON, closing tag cut off


def test_earlier_calls_reach_the_template_with_object_arguments() -> None:
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    messages = template_messages(body)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}


BARE = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "days": 1}\n}\n```'


@pytest.mark.parametrize("text, is_call", [
    (BARE, True), ('{"name": "get_time", "arguments": {"zone": "CET"}}', True),
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]', True),
    ('```json\n{"name": "get_time", "arguments": {"zone": "CET"}}\n{"name": "get_weather", '
     '"arguments": {"city": "Oslo", "days": 1}}\n```', True),
    # Llama 3's forms (vLLM's llama3_json): "parameters", <|python_tag|>, "; " between calls
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', True),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", '
     '"parameters": {"city": "Oslo", "days": 1}}', True),
    ('<|python_tag|>{"name": "get_time", "parameters": {}} and then', False),
    ("<|python_tag|>print(1)", False), ("<b>bold</b>", False),
    # Mistral's (vLLM's mistral parser): [TOOL_CALLS] and a list
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": '
     '"get_weather", "arguments": {"city": "Oslo", "days": 2}}]', True),
    ("[TOOL_CALLS] not json", False),
    # Phi-4-mini's (vLLM's phi4_mini_json parser): functools and a list
    ('functools[{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": '
     '"get_weather", "arguments": {"city": "Oslo", "days": 2}}]', True),
    ('functools[{"name": "get_time", "arguments": {}}] then', False),
    ("functional programming", False), ("[TOOL_CALLS]functools[]", False),
    # Llama 3.2's pythonic form (vLLM's pythonic parser): literal keyword arguments only
    ('[get_time(zone="CET"), get_weather(city="Oslo", days=2)]', True),
    ("[get_time()]", True), ('[get_weather(city="Paris", days=[1, 2][0])]', False),
    ('[get_time(zone=open("/etc/passwd").read())]', False), ("[get_time(1)]", False),
    ('[unknown(zone="CET")]', False), ('[get_time(zone={"CET"})]', False),
    ("[get_time(zone=b'CET')]", False), ("[get_time(zone=1e999)]", False), ("[1, 2]", False),
    ("[" * 5000 + "]" * 5000, False),
    ('{"name": "get_time", "arguments": {}} and then', False),
    ('{"name": "unknown_tool", "arguments": {}}', False),
    ('{"city": "Paris"}', False), ("Sure: " + BARE, False), ("It is sunny.", False),
])
def test_a_bare_call_without_tags_is_a_call(text: str, is_call: bool) -> None:
    """Small models (the default Qwen2.5-Coder-1.5B among them) write the call as bare JSON or
    a ```json block: a call when that is the whole output and names a tool; the stream holds
    such an output back until it is known, so a call never also arrives as content."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    content, calls = ChoiceTools("auto", body).whole(text)
    stream, streamed, deltas = ChoiceTools("auto", body), "", []
    for i in range(0, len(text), 4):
        piece, d = stream.delta(text[i:i + 4], i + 4 >= len(text))
        streamed, deltas = streamed + piece, deltas + d
    if is_call:
        assert content is None and calls and not streamed
        assert [(d.function.name, d.function.arguments) for d in deltas] == [
            (c.function.name, c.function.arguments) for c in calls]
        assert stream.finish_reason("stop") == "tool_calls"
    else:
        assert content == text and not calls and streamed == text and not deltas


def stream_in_pieces(stream: ChoiceTools, text: str, piece: int
                     ) -> tuple[str, dict[int, dict], list[int]]:
    """(content, calls by index as id / name / arguments, the offset of each argument
    delta) of `text` streamed `piece` characters a chunk; each delta's id and name are its
    call's."""
    content, calls, offsets = "", {}, []
    for i in range(0, len(text), piece):
        part, deltas = stream.delta(text[i:i + piece], i + piece >= len(text))
        content += part
        for d in deltas:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name,
                                              "arguments": ""})
            assert d.id in (None, call["id"]) and d.function.name in (None, call["name"])
            call["arguments"] += d.function.arguments or ""
            if d.function.arguments:
                offsets.append(i)
    return content, calls, offsets


@pytest.mark.parametrize("piece", [1, 5, len(TEXT)])
def test_streamed_calls_arrive_name_first_then_growing_arguments(piece: int) -> None:
    """As vLLM's hermes parser streams: a call's id and name once its head is in, then its
    arguments in pieces; the pieces add up to the finished call's arguments."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    whole_content, whole_calls = ChoiceTools("auto", body).whole(TEXT)
    stream = ChoiceTools("auto", body)
    content, calls, offsets = stream_in_pieces(stream, TEXT, piece)
    assert content == whole_content == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole_calls]
    assert [c["id"] for c in calls.values()] == [c.id for c in stream.calls]
    if piece == 1:
        assert len(offsets) > 10  # arguments arrived as they were written


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize("text, content", [
    ("\n" + CALL + "\n" + CALL + "\n\n", None),  # whitespace only around the calls
    ("Sure.\n\n" + CALL + "\n" + CALL + " \n", "Sure."),
    ("A\n" + CALL + "\nB\n", "A\n\nB"),  # text on both sides: what is between it kept
    ("No call here.\n\n  ", "No call here.\n\n  "),  # no call: the text as written
    ("  \n", "  \n"),
])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_stream_and_whole_agree_on_whitespace_around_calls(text: str, content: str | None,
                                                           piece: int) -> None:
    """The whitespace a model writes before, between and after its calls is not content,
    streamed or whole (the stream used to send each "\n" as content); without calls the text
    goes out as written."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    whole_content, whole_calls = ChoiceTools("auto", body).whole(text)
    streamed, calls, _ = stream_in_pieces(ChoiceTools("auto", body), text, piece)
    assert whole_content == content and (streamed or None) == content
    assert len(calls) == len(whole_calls) == text.count("<tool_call>")


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}},\n'
            ' {"name": "get_time", "parameters": { "zone" : "CET" }}]')


@pytest.mark.parametrize("piece", [1, 7, len(REQUIRED)])
@pytest.mark.parametrize("cut", [None, 70])
def test_required_calls_stream_name_first_then_growing_arguments(piece: int,
                                                                 cut: int | None) -> None:
    """tool_choice "required" streams as the other modes do (it sent every call at the end):
    a call's id and name once its name is written, then its arguments in pieces adding up
    to the whole response's, the model's spacing kept. An array cut short (max_tokens) after
    a call began is no call at the end, as in the whole response."""
    text = REQUIRED[:cut]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 tool_choice="required")
    whole_content, whole_calls = ChoiceTools("required", body).whole(text)
    stream = ChoiceTools("required", body)
    content, calls, offsets = stream_in_pieces(stream, text, piece)
    assert content == ""
    if cut is None:
        assert whole_content is None and [c.function.arguments for c in whole_calls] == [
            '{"city": "Paris", "days": 2}', '{ "zone" : "CET" }']
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in whole_calls]
        assert [c["id"] for c in calls.values()] == [c.id for c in stream.calls]
        assert stream.finish_reason("stop") == "tool_calls"
    else:
        assert whole_calls == [] and whole_content == text
        assert stream.calls == [] and stream.finish_reason("length") == "length"
    if piece == 1:  # the first arguments came before the first call was written
        assert offsets and offsets[0] < REQUIRED.index("Paris")


SLIP = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n'
        '</tool_call>')
CUT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'


@pytest.mark.parametrize("text, arguments", [(SLIP, '{"city": Paris}'), (CUT, '{"city": "Pa'),
                                             (TEXT, '{"city": "Oslo", "days": 2}')])
@pytest.mark.parametrize("piece", [1, 5])
def test_stream_and_whole_agree_on_arguments_that_are_not_json(text: str, arguments: str,
                                                               piece: int) -> None:
    """Arguments a small model got wrong, or that max_tokens cut: a call with the arguments
    as written (OpenAI's may be invalid JSON), streamed or whole. The stream used to send
    the call's head and arguments and then the whole block again as content, while the
    whole response had no call."""
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    content, calls = ChoiceTools("auto", body).whole(text)
    stream, streamed, args = ChoiceTools("auto", body), "", {}
    for i in range(0, len(text), piece):
        part, deltas = stream.delta(text[i:i + piece], i + piece >= len(text))
        streamed += part
        for d in deltas:
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == args[0] == arguments
    assert [c.function.arguments for c in calls] == list(args.values())
    assert content == streamed and "<" not in streamed
