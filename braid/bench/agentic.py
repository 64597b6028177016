"""An agentic workload: multi-turn tool-calling sessions. Each session is a task from one of
a few families (trip planning, order support, flight booking) over a fixed set of tools;
the model's tool calls (JSON objects naming a tool, in Hermes `<tool_call>` blocks as Qwen
writes them, or fenced or bare as small models often do) get deterministic
results fed back as tool messages, until it answers without a call or its turns run out.
Sessions of one family run beside each other, so outputs recur across requests as they do
in agent loops (the same calls, the same answer shapes), which is where drafting from
earlier outputs pays."""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any


def _function(name: str, description: str, **params: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(params),
                       "properties": {p: {"type": "string", "description": d}
                                      for p, d in params.items()}}}}


TOOLS = [
    _function("get_weather", "The weather forecast for a city on a date.",
              city="the city", date="the date, YYYY-MM-DD"),
    _function("convert_currency", "Converts an amount between currencies.",
              amount="the amount", from_currency="ISO code", to_currency="ISO code"),
    _function("get_order", "An order's status and tracking number.", order_id="the order id"),
    _function("track_shipment", "Where a shipment is.", tracking_number="the tracking number"),
    _function("search_flights", "Flights between two airports on a date.",
              origin="IATA code", destination="IATA code", date="the date, YYYY-MM-DD"),
    _function("book_flight", "Books a flight for a passenger.", flight_id="the flight id",
              passenger="the passenger's full name"),
]
SYSTEM = ("You are a support and travel assistant. Use the tools to get facts; call one tool "
          "at a time and wait for its result. When you have what you need, answer briefly.")
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Porto"]
AIRPORTS = ["CDG", "HND", "LIM", "OSL", "CAI", "DEN", "HAN", "OPO"]
CURRENCIES = ["EUR", "JPY", "PEN", "NOK", "EGP", "VND"]
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
FAMILIES = [
    "I am travelling to {city} on 2026-07-{day:02d}. Check the weather there, and convert "
    "{amount} USD to {currency} for my budget.",
    "Where is my order {order}? If it has shipped, tell me where the package is now.",
    "Find flights from {origin} to {destination} on 2026-08-{day:02d} and book the cheapest "
    "one for {name}.",
]
_OBJECT_START = re.compile(r'\{\s*"name"')


@dataclass
class Session:
    """One conversation: its messages so far and the turns it may still take."""

    family: int
    messages: list[dict[str, Any]]
    turns_left: int
    num_calls: int = 0
    replies: list[str] = field(default_factory=list)

    def add_reply(self, text: str) -> bool:
        """The model's reply; True when the session goes on (the reply called tools whose
        results are now in the messages, and turns are left)."""
        self.replies.append(text)
        self.turns_left -= 1
        calls = tool_calls(text)
        if not calls:
            self.messages.append({"role": "assistant", "content": text})
            return False
        ids = [f"call_{self.num_calls + i}" for i in range(len(calls))]
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {
                "name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for i, c in zip(ids, calls, strict=True)]})
        for i, c in zip(ids, calls, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": i,
                                  "content": tool_result(c["name"], c["arguments"])})
        self.num_calls += len(calls)
        return self.turns_left > 0

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them (a call's arguments as an object; the
        messages themselves are OpenAI's, arguments as JSON text, as a server takes them)."""
        out = []
        for m in self.messages:
            if m.get("tool_calls"):
                m = {**m, "content": "", "tool_calls": [
                    {**c, "function": {**c["function"],
                                       "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]}
            out.append(m)
        return out


def sessions(num: int, max_turns: int = 4, seed: int = 0) -> list[Session]:
    """`num` sessions, the families in turn, their details drawn with `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        family = i % len(FAMILIES)
        origin, destination = rng.sample(AIRPORTS, 2)
        task = FAMILIES[family].format(
            city=rng.choice(CITIES), day=rng.randint(1, 28), amount=rng.randint(2, 40) * 50,
            currency=rng.choice(CURRENCIES), order=f"A{rng.randint(10000, 99999)}",
            origin=origin, destination=destination, name=rng.choice(NAMES))
        out.append(Session(family, [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": task}], max_turns))
    return out


def tool_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls in a reply, as {"name", "arguments"}: each JSON object with a "name"
    in it, in a Hermes block, a fenced block or bare (small models, the default target
    among them, write all three, and wrap bare ones in extra braces copied from the
    template's example); malformed ones are dropped."""
    calls, decoder, end = [], json.JSONDecoder(), 0
    for match in _OBJECT_START.finditer(text):
        if match.start() < end:
            continue  # inside the call before
        try:
            call, end = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments")
            calls.append({"name": call["name"],
                          "arguments": arguments if isinstance(arguments, dict) else {}})
    return calls


def tool_result(name: str, arguments: dict[str, Any]) -> str:
    """A tool's result: JSON made from a hash of the call, so the same call always answers
    the same."""
    seed = int(hashlib.sha256(json.dumps([name, arguments], sort_keys=True).encode())
               .hexdigest()[:8], 16)
    rng = random.Random(seed)
    results: dict[str, Any] = {
        "get_weather": {"forecast": rng.choice(["sunny", "cloudy", "rain", "snow"]),
                        "high_c": rng.randint(-5, 35), "low_c": rng.randint(-15, 20)},
        "convert_currency": {"rate": round(rng.uniform(0.1, 150), 4),
                             "converted": round(rng.uniform(10, 100000), 2)},
        "get_order": {"status": rng.choice(["processing", "shipped", "delivered"]),
                      "tracking_number": f"1Z{rng.randint(10**8, 10**9 - 1)}"},
        "track_shipment": {"location": rng.choice(CITIES), "eta_days": rng.randint(1, 9)},
        "search_flights": {"flights": [
            {"flight_id": f"F{rng.randint(100, 999)}", "price_usd": rng.randint(120, 1400),
             "departs": f"{rng.randint(5, 22):02d}:{rng.choice(['00', '30'])}"}
            for _ in range(3)]},
        "book_flight": {"confirmation": f"BK{rng.randint(10**5, 10**6 - 1)}",
                        "status": "confirmed"},
    }
    return json.dumps(results.get(name, {"error": f"unknown tool {name}"}))
