"""The agentic workload's sessions: tool calls parsed from Hermes blocks, answered the same
way every time, and turns that end with an answer or the turn limit."""

from __future__ import annotations

import json

from braid.bench.agentic import FAMILIES, TOOLS, sessions, tool_calls, tool_result


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_session_feeds_tool_results_back_until_the_answer() -> None:
    (s,) = sessions(1, max_turns=4)
    assert [m["role"] for m in s.messages] == ["system", "user"]
    assert s.add_reply(call("get_weather", city="Oslo", date="2026-07-01"))
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant", "tool"]
    assert s.messages[-1]["content"] == tool_result("get_weather",
                                                    {"city": "Oslo", "date": "2026-07-01"})
    made = s.messages[-2]["tool_calls"][0]  # OpenAI's shape, as a server takes it
    assert s.messages[-1]["tool_call_id"] == made["id"]
    assert json.loads(made["function"]["arguments"]) == {"city": "Oslo", "date": "2026-07-01"}
    templated = s.template_messages()[-2]["tool_calls"][0]["function"]["arguments"]
    assert templated == {"city": "Oslo", "date": "2026-07-01"}
    assert not s.add_reply("It will be sunny.")  # an answer ends it
    assert s.num_calls == 1 and len(s.replies) == 2


def test_turns_run_out_and_malformed_calls_are_dropped() -> None:
    (s,) = sessions(1, max_turns=2)
    assert s.add_reply(call("get_order", order_id="A1") + call("track_shipment",
                                                                 tracking_number="1Z"))
    assert s.num_calls == 2 and [m["role"] for m in s.messages][-2:] == ["tool", "tool"]
    assert not s.add_reply(call("get_order", order_id="A2"))  # the second turn was the last
    assert tool_calls("<tool_call>{not json}</tool_call> <tool_call>[1]</tool_call>") == []
    fenced = '```json\n{"name": "get_order", "arguments": {"order_id": "A3"}}\n```'
    assert tool_calls(fenced) == [{"name": "get_order", "arguments": {"order_id": "A3"}}]
    bare = '{{"name": "get_order", "arguments": {"order_id": "A3"}}}'
    assert tool_calls(bare) == tool_calls(fenced)


def test_sessions_cycle_the_families_and_results_are_deterministic() -> None:
    made = sessions(7, seed=3)
    assert [s.family for s in made] == [i % len(FAMILIES) for i in range(7)]
    assert [s.messages for s in made] == [s.messages for s in sessions(7, seed=3)]
    assert tool_result("book_flight", {"flight_id": "F1", "passenger": "A"}) == \
        tool_result("book_flight", {"passenger": "A", "flight_id": "F1"})
    assert "unknown tool" in tool_result("nope", {})
    names = {t["function"]["name"] for t in TOOLS}
    assert {"get_weather", "book_flight", "search_flights"} <= names
