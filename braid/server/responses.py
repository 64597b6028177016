"""Engine outputs -> OpenAI bodies: per-choice deltas, logprobs, usage and braid's figures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from braid.outputs import Logprob, RequestOutput
from braid.sampling_params import is_int
from braid.server.bodies import RawJSON
from braid.server.protocol import (
    BraidInfo,
    ChatLogprobs,
    CompletionLogprobs,
    CompletionTokensDetails,
    PromptLogprob,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from braid.tokenizer import Tokenizer

_MIN_LOGPROB = -9999.0  # JSON has no -inf


@dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: Sequence[dict[int, Logprob] | None] | None  # None: an echoed prompt's first


@dataclass(slots=True)
class ChoiceState:
    """One choice (one engine request) of a response, and how much of it was sent."""

    index: int
    request_id: str
    prompt_index: int
    sent_chars: int = 0
    sent_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens from the prefix cache, as the last output says
    # its prediction's drafts accepted and rejected, as the last output says
    prediction_tokens: tuple[int, int] = (0, 0)
    final: RequestOutput | None = None

    def advance(self, out: RequestOutput) -> Delta:
        """What `out` adds to what was sent (engine text and token ids are cumulative)."""
        c = out.outputs[0]
        self.cached_tokens = out.num_cached_tokens
        spec = out.metrics.spec_stats
        if spec:
            self.prediction_tokens = (spec.get("accepted_prediction_tokens", 0),
                                      spec.get("rejected_prediction_tokens", 0))
        delta = Delta(c.text[self.sent_chars:], c.token_ids[self.sent_tokens:],
                      None if c.logprobs is None else c.logprobs[self.sent_tokens:])
        self.sent_chars = max(self.sent_chars, len(c.text))
        self.sent_tokens = len(c.token_ids)
        if out.finished:
            self.final = out
        return delta


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:n]


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _named(tokenizer: Tokenizer, token_id: int, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or "token_id:<id>" (vLLM's
    return_tokens_as_token_ids: tokens JSON cannot spell are named exactly too)."""
    return f"token_id:{token_id}" if as_ids else token_text(tokenizer, token_id)


def _text(tokenizer: Tokenizer, token_id: int, lp: Logprob, as_ids: bool = False) -> str:
    if as_ids or lp.decoded_token is None:
        return _named(tokenizer, token_id, as_ids)
    return lp.decoded_token


def completion_logprobs(tokenizer: Tokenizer, delta: Delta, top_n: int,
                        offset: int, as_ids: bool = False) -> CompletionLogprobs:
    """Legacy completions logprobs; an entry of None (an echoed prompt's first token) gets
    null logprobs. As in vLLM (and OpenAI's legacy API), a position's top_logprobs hold its
    own token and the top `top_n`: up to top_n + 1 entries. `as_ids`: tokens as
    "token_id:<id>" (vLLM's return_tokens_as_token_ids; text_offset still counts text)."""
    result = CompletionLogprobs()
    for token_id, entry in zip(delta.token_ids, delta.logprobs or [], strict=False):
        text = token_text(tokenizer, token_id)
        result.tokens.append(_named(tokenizer, token_id, as_ids))
        result.token_logprobs.append(None if entry is None else _clamp(entry[token_id].logprob))
        result.top_logprobs.append(None if entry is None else {
            _text(tokenizer, t, lp, as_ids): _clamp(lp.logprob) for t, lp in entry.items()
            if t == token_id or (lp.rank is not None and lp.rank <= top_n)})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def prompt_logprobs(tokenizer: Tokenizer, out: RequestOutput
                    ) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or token id -> entry."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else {
        str(t): PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank,
                              decoded_token=_text(tokenizer, t, lp))
        for t, lp in entry.items()}
        for entry in out.prompt_logprobs]


def prompt_logprobs_json(tokenizer: Tokenizer, out: RequestOutput) -> RawJSON:
    """`prompt_logprobs` written straight to JSON text (the value `prompt_logprobs` would
    give), `POSITIONS` positions per json.dumps call: a long prompt's entries at top-20 are
    tens of thousands, which as pydantic models took ~1 s to build and write, holding the
    GIL in long calls while every stream waited."""
    entries = out.prompt_logprobs or []
    parts = [b"["]
    for start in range(0, len(entries), POSITIONS):
        plain = [None if entry is None else {
            str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                     "decoded_token": _text(tokenizer, t, lp)}
            for t, lp in entry.items()} for entry in entries[start:start + POSITIONS]]
        parts.append((b"," if start else b"") + json.dumps(plain)[1:-1].encode())
    parts.append(b"]")
    return RawJSON(b"".join(parts))


POSITIONS = 128  # prompt positions per json.dumps call (prompt_logprobs_json)


def chat_logprobs(tokenizer: Tokenizer, delta: Delta, top_n: int,
                  as_ids: bool = False) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(delta.token_ids, delta.logprobs or [], strict=False):
        assert entry is not None  # only echoed prompts have entries of None
        text = _named(tokenizer, token_id, as_ids)
        top = [_top_logprob(tokenizer, t, lp, as_ids) for t, lp in _top(entry, top_n)]
        content.append(TokenLogprob(token=text, logprob=_clamp(entry[token_id].logprob),
                                    bytes=list(tokenizer.token_bytes(token_id)),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def _top_logprob(tokenizer: Tokenizer, token_id: int, lp: Logprob,
                 as_ids: bool = False) -> TopLogprob:
    return TopLogprob(token=_text(tokenizer, token_id, lp, as_ids), logprob=_clamp(lp.logprob),
                      bytes=list(tokenizer.token_bytes(token_id)))


def usage(prompts: list[list[int]], choices: list[ChoiceState], predicted: bool = False
          ) -> UsageInfo:
    """Each prompt counts once however many choices it has (OpenAI's n semantics), and so do
    its cached tokens (its first choice's: the others share that choice's blocks).
    `predicted`: the request came with a prediction, whose drafts' fate the usage tells."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.sent_tokens for c in choices)
    first: dict[int, ChoiceState] = {}
    for c in choices:
        if c.prompt_index not in first or c.index < first[c.prompt_index].index:
            first[c.prompt_index] = c
    cached = sum(c.cached_tokens for c in first.values())  # known from the first output on
    details = CompletionTokensDetails(
        accepted_prediction_tokens=sum(c.prediction_tokens[0] for c in choices),
        rejected_prediction_tokens=sum(c.prediction_tokens[1] for c in choices),
    ) if predicted else None
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                     completion_tokens_details=details)


def braid_info(outputs: list[RequestOutput]) -> BraidInfo:
    """Preemptions and speculation figures; counters are summed over the choices."""
    spec: dict[str, Any] = {}
    if len(outputs) == 1:
        spec = dict(outputs[0].metrics.spec_stats)
    else:
        for out in outputs:
            _add_counts(spec, out.metrics.spec_stats)
        _rederive_rates(spec)
    return BraidInfo(num_preemptions=sum(o.metrics.num_preemptions for o in outputs), spec=spec)


def _add_counts(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(value, str):  # a mode, the same for every choice
            total.setdefault(key, value)
        elif is_int(value):
            total[key] = total.get(key, 0) + value
        elif isinstance(value, list) and all(isinstance(v, int) for v in value):
            have = total.setdefault(key, [])
            have.extend([0] * (len(value) - len(have)))
            for i, v in enumerate(value):
                have[i] += v


def _rederive_rates(spec: dict[str, Any]) -> None:
    """Ratios cannot be summed: recompute them from the summed counters (definitions in
    docs/architecture.md)."""
    drafts, drafted = spec.get("num_drafts", 0), spec.get("num_draft_tokens", 0)
    accepted = spec.get("num_accepted_tokens", 0)
    if drafted:
        spec["acceptance_rate"] = round(accepted / drafted, 4)
    if drafts:
        spec["mean_acceptance_length"] = round(1 + accepted / drafts, 4)
