"""The default pair under JSON schemas: every output validates, and greedy output with the
draft (k = 3, its own rows masked by the grammar too) equals greedy output without it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from braid.config import EngineConfig
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.real_model

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "enum": {"type": "object", "properties": {
        "language": {"enum": ["python", "rust", "go"]},
        "typed": {"type": "boolean"}}, "required": ["language", "typed"]},
    "array": {"type": "object", "properties": {
        "primes": {"type": "array", "items": {"type": "integer"}, "minItems": 3,
                   "maxItems": 5}}, "required": ["primes"]},
}
QUESTIONS = {
    "nested": "Give a fictional person's name and address as JSON.",
    "enum": "Which language is Django written in, and is it statically typed? JSON please.",
    "array": "List the first few prime numbers as JSON.",
}


def chat_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], True)
    return tokenizer.encode(text, add_special_tokens=False)


def run(target: Any, draft: Any | None) -> tuple[dict[str, list[int]], dict[str, str], Any]:
    model, tokenizer = target
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"}
    engine = LLMEngine(EngineConfig(max_model_len=1024, kv_cache_gib=0.25, log_stats_interval=0,
                                    speculative_config=spec if draft else None),
                       model=model, tokenizer=tokenizer, draft_model=draft[0] if draft else None)
    for name, schema in SCHEMAS.items():
        engine.add_request(name, chat_ids(tokenizer, QUESTIONS[name]), SamplingParams(
            temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(
                json=schema)))
    outs = [o for o in engine.run_until_done() if o.finished]
    return ({o.request_id: o.outputs[0].token_ids for o in outs},
            {o.request_id: o.outputs[0].text for o in outs}, engine.stats)


def test_schemas_validate_and_the_draft_changes_nothing(default_target: Any,
                                                        default_draft: Any) -> None:
    plain, texts, _ = run(default_target, None)
    for name, text in texts.items():
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    spec, _, stats = run(default_target, default_draft)
    print(f"structured output with the draft, k = 3: {stats.spec_stats.as_dict()}, "
          f"{stats.grammar}")
    assert spec == plain
    assert stats.spec_stats.acceptance_rate > 0.3
