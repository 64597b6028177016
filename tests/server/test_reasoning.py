"""--reasoning-parser: a reasoning model's <think> block as reasoning_content, the rest as
content, whole and streamed alike (any cut of the text into deltas gives the same split), over
a real server with the openai client; tool calls read from the content only."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from braid.server.reasoning import ReasoningSplitter, split_reasoning
from tests.server.conftest import ENGINE_FLAGS, ServerProcess

CASES = [  # (parser, reply, reasoning_content, content)
    ("qwen3", "<think>Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."),
    ("qwen3", "\n<think>\nhm\n</think>\n\n4", "\nhm\n", "\n\n4"),
    ("qwen3", "The answer is 4.", None, "The answer is 4."),  # thinking turned off
    ("qwen3", "<think>still thinking when max_tokens came", "still thinking when max_tokens "
     "came", ""),
    ("qwen3", "4 <think>not a reasoning block</think>", None,
     "4 <think>not a reasoning block</think>"),
    ("qwen3", "<think></think>4", "", "4"),
    ("qwen3", "", None, ""),
    ("deepseek_r1", "Let me see.</think>4", "Let me see.", "4"),
    ("deepseek_r1", "<think>Let me see.</think>4", "Let me see.", "4"),
    ("deepseek_r1", "no end tag at all", "no end tag at all", ""),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
]


@pytest.mark.parametrize("parser, reply, reasoning, content", CASES)
def test_a_whole_reply_splits_as_vllm_s_parsers(parser: str, reply: str,
                                                reasoning: str | None, content: str) -> None:
    assert split_reasoning(parser, reply) == (reasoning, content)


@pytest.mark.parametrize("parser, reply, reasoning, content", CASES)
def test_any_cut_into_deltas_gives_the_whole_reply_s_split(parser: str, reply: str,
                                                           reasoning: str | None,
                                                           content: str) -> None:
    rng = random.Random(reply)
    cuts = [[1] * len(reply), [len(reply)]] + [
        [rng.randint(1, 4) for _ in range(len(reply))] for _ in range(20)]
    for sizes in cuts:
        splitter, got_reasoning, got_content, at = ReasoningSplitter(parser), "", "", 0
        pieces = []
        for size in sizes:
            if at >= len(reply):
                break
            pieces.append(reply[at:at + size])
            at += size
        for i, piece in enumerate(pieces or [""]):
            r, c = splitter.feed(piece, finished=i == len(pieces or [""]) - 1)
            got_reasoning, got_content = got_reasoning + r, got_content + c
            assert "<think>" not in r and "</think>" not in r
        assert (got_reasoning if splitter.seen_reasoning else None, got_content) == (
            reasoning, content), sizes


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningSplitter("o1")


@pytest.fixture(scope="module")
def reasoning_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("reasoning"), *ENGINE_FLAGS,
                         "--reasoning-parser", "qwen3")
    yield proc
    assert proc.stop() == 0, proc.log()


# The tiny model's text is random: a grammar makes it write a reasoning block, an answer and,
# with tools, a tool call after the reasoning.
THINK = r"<think>[a-z]{4,8}</think>[a-z]{2,5}"
CALL = (r'<think>[a-z]{3}</think><tool_call>\n\{"name": "get_time", "arguments": '
        r'\{"zone": "[a-z]{2}"\}\}\n</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}, "required": ["zone"]}}}]


def ask(server: ServerProcess, stream: bool, regex: str, **extra: Any
        ) -> tuple[str | None, str | None, list, str | None]:
    """(reasoning_content, content, tool calls, finish_reason) of one greedy chat reply."""
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    kwargs: dict[str, Any] = dict(model=server.model, max_tokens=120, temperature=0,
                                  messages=[{"role": "user", "content": "Think first."}],
                                  extra_body={"structured_outputs": {"regex": regex}}, **extra)
    if not stream:
        choice = c.chat.completions.create(**kwargs).choices[0]
        message = choice.message.model_dump()
        return (message.get("reasoning_content"), message["content"],
                [(t["function"]["name"], json.loads(t["function"]["arguments"]))
                 for t in message.get("tool_calls") or []], choice.finish_reason)
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.model_dump()
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for t in delta.get("tool_calls") or []:
            name, args = calls.get(t["index"], ("", ""))
            fn = t.get("function") or {}
            calls[t["index"]] = (name + (fn.get("name") or ""), args + (fn.get("arguments") or ""))
        finish = chunk.choices[0].finish_reason or finish
    return (reasoning or None, content or None,
            [(n, json.loads(a)) for n, a in calls.values()], finish)


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_splits_the_reasoning_from_the_answer(reasoning_server: ServerProcess,
                                                         stream: bool) -> None:
    reasoning, content, calls, finish = ask(reasoning_server, stream, THINK)
    whole = ask(reasoning_server, False, THINK)
    assert reasoning is not None and reasoning.isalpha() and 4 <= len(reasoning) <= 8
    assert content is not None and content.isalpha() and "think" not in content
    assert (reasoning, content, calls) == whole[:3] and finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_after_the_reasoning(reasoning_server: ServerProcess,
                                                 stream: bool) -> None:
    reasoning, content, calls, finish = ask(reasoning_server, stream, CALL, tools=TOOLS)
    assert reasoning is not None and len(reasoning) == 3
    assert not content and finish == "tool_calls"
    assert len(calls) == 1 and calls[0][0] == "get_time" and len(calls[0][1]["zone"]) == 2


def test_without_the_flag_the_think_block_stays_in_the_content(server: ServerProcess) -> None:
    reasoning, content, _, _ = ask(server, False, THINK)
    assert reasoning is None and content is not None and content.startswith("<think>")
