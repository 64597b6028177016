"""The output side of requests: detokenization, stop rules, logprobs, RequestOutput.

The scheduler appends tokens (it owns output_token_ids) and asks `check_stop` after each;
this module keeps each request's text and judges its stop conditions. A token's work does
not grow with the request's lists: stop token ids are a set, stop strings an automaton fed
only the new characters (`StopStrings`), and logprobs' texts come from the tokenizer's
per-id table."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from braid.core.request import Request
from braid.outputs import (
    CompletionOutput,
    PackedLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from braid.sampling_params import RequestOutputKind
from braid.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("braid")


@dataclass(slots=True)
class _Sent:
    """What a DELTA request's outputs carried so far."""

    text: int = 0
    tokens: int = 0
    logprobs: int = 0
    prompt_logprobs: bool = False

    def take(self, text: str, tokens: list[int], logprobs: SampleLogprobs, scored: bool
             ) -> tuple[str, list[int], SampleLogprobs, bool]:
        """The parts of the request's output so far that no earlier output carried (prompt
        logprobs: whether they go in this one), counted as carried."""
        new = text[self.text:], tokens[self.tokens:], logprobs[self.logprobs:]
        self.text, self.tokens, self.logprobs = len(text), len(tokens), len(logprobs)
        first_scored = scored and not self.prompt_logprobs
        self.prompt_logprobs = scored
        return (*new, first_scored)


_NO_STOP = 1 << 62  # a list index past any request's stop strings


class StopStrings:
    """A request's stop strings as an Aho-Corasick automaton over characters, fed the text as
    it grows: a character costs O(1) amortized, whatever the number of stop strings. Its state
    is the longest tail of the text so far that begins some stop string (a trie node); each
    node knows the first stop string, in the request's order, that ends there (through its
    failure links), and the longest tail that is a stop's proper prefix (the text to hold back
    while streaming). Built in O(total characters of the stop strings)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._goto: list[dict[str, int]] = [{}]
        self._first = [_NO_STOP]
        depth = [0]
        for index, stop in enumerate(stops):
            node = 0
            for ch in stop:
                if ch not in self._goto[node]:
                    self._goto[node][ch] = len(self._goto)
                    self._goto.append({})
                    self._first.append(_NO_STOP)
                    depth.append(depth[node] + 1)
                node = self._goto[node][ch]
            self._first[node] = min(self._first[node], index)
        self._fail = [0] * len(self._goto)
        self._hold = [0] * len(self._goto)
        self._link(depth)
        self._state = 0

    def _link(self, depth: list[int]) -> None:
        """Failure links breadth first: a node's fail is finished before its children's."""
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            fail = self._fail[node]
            self._first[node] = min(self._first[node], self._first[fail])
            self._hold[node] = depth[node] if self._goto[node] else self._hold[fail]
            for ch, child in self._goto[node].items():
                self._fail[child] = self._step(fail, ch) if node else 0
                queue.append(child)

    def _step(self, node: int, ch: str) -> int:
        while node and ch not in self._goto[node]:
            node = self._fail[node]
        return self._goto[node].get(ch, 0)

    def feed(self, text: str) -> tuple[str, int] | None:
        """Advance over `text`, the text's new characters. Of the stop strings that end
        inside it, the first in the request's list and where it starts (an offset into
        `text`, negative when it began before), at its first end, as vLLM's
        `check_stop_strings` finds it; None if none ends there."""
        node, best, end = self._state, _NO_STOP, 0
        for i, ch in enumerate(text):
            node = self._step(node, ch)
            if self._first[node] < best:
                best, end = self._first[node], i + 1
        self._state = node
        if best == _NO_STOP:
            return None
        return self.stops[best], end - len(self.stops[best])

    @property
    def held(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string:
        held back while streaming so a stop string is never half-shown."""
        return self._hold[self._state]


@dataclass(slots=True)
class _Output:
    """The output side's state of one request."""

    stop_ids: frozenset[int]
    text: str = ""
    detok: IncrementalDetokenizer | None = None
    stops: StopStrings | None = None
    sent: _Sent | None = None  # with output_kind DELTA


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._outputs: dict[str, _Output] = {}

    def add(self, req: Request) -> None:
        p = req.sampling_params
        out = _Output(stop_ids=frozenset(p.stop_token_ids or ()))
        if p.output_kind == RequestOutputKind.DELTA:
            out.sent = _Sent()
        if self.tokenizer is not None and p.detokenize:
            out.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                               p.skip_special_tokens)
            out.stops = StopStrings(p.stop_strings) if p.stop_strings else None
        self._outputs[req.request_id] = out

    def check_stop(self, req: Request, token: int) -> str | None:
        """`token` was just appended to `req`: extend its text and return the finish reason
        if the token ends it ("stop" or "length"). A failure here (detokenizer, stop strings)
        finishes that request alone with reason "error", and the others go on."""
        try:
            return self._stop_reason(req, token)
        except Exception:
            logger.exception("request %s failed while appending its tokens", req.request_id)
            return "error"

    def _stop_reason(self, req: Request, token: int) -> str | None:
        reason = self._check_token(req, token)
        if reason is None:
            reason = self._check_text(req, token)
        elif req.sampling_params.include_stop_str_in_output:
            self._extend_text(req, token)  # a stop token's text is kept too (as vLLM does)
        if reason is None and _length_reached(req, self.max_model_len):
            reason = "length"
        return reason

    def add_logprobs(self, req: Request, logprobs: SampleLogprobs) -> None:
        """Logprobs of the tokens just appended to `req` (as many as were appended)."""
        tokens = req.output_token_ids[len(req.output_token_ids) - len(logprobs):]
        req.cumulative_logprob += sum(entry[token].logprob
                                      for entry, token in zip(logprobs, tokens, strict=True))
        req.logprobs += self._decoded(req, logprobs)

    def add_prompt_logprobs(self, req: Request, logprobs: PackedLogprobs) -> None:
        """Logprobs of the prompt tokens a step scored (the next ones in order), with their
        texts where the request is detokenized."""
        if self.tokenizer is not None and req.sampling_params.detokenize:
            logprobs.with_texts([self.tokenizer.token_text(t) for t in logprobs.token_ids])
        req.prompt_logprobs.extend(logprobs)

    def _decoded(self, req: Request, logprobs: SampleLogprobs) -> SampleLogprobs:
        """The entries with each token's text (special tokens included), where there is a
        tokenizer and the request is detokenized."""
        if self.tokenizer is not None and req.sampling_params.detokenize:
            for entry in logprobs:
                for token, lp in entry.items():
                    lp.decoded_token = self.tokenizer.token_text(token)
        return logprobs

    def _check_token(self, req: Request, token: int) -> str | None:
        p = req.sampling_params
        if req.num_output_tokens <= p.min_tokens - 1:
            return None
        if token in self._outputs[req.request_id].stop_ids:
            req.stop_reason = token
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        return None

    def _extend_text(self, req: Request, token: int) -> str:
        """Append `token`'s text to req's text; returns that text ("" without a detokenizer)."""
        out = self._outputs[req.request_id]
        if out.detok is None:
            return ""
        new = out.detok.add(token)
        out.text += new
        return new

    def _check_text(self, req: Request, token: int) -> str | None:
        """Stop strings: of those that end in the token's new text (the text before it was
        checked already), the first in the request's list, at its first end (vLLM's)."""
        new = self._extend_text(req, token)
        out = self._outputs[req.request_id]
        if out.stops is None:
            return None
        found = out.stops.feed(new)
        p = req.sampling_params
        if found is None or req.num_output_tokens < p.min_tokens:
            return None
        stop, start = found
        at = len(out.text) - len(new) + start
        out.text = out.text[: at + len(stop) if p.include_stop_str_in_output else at]
        req.stop_reason = stop
        return "stop"

    def finish(self, req: Request) -> None:
        """Release the detokenizer; text it held back is kept unless a stop string cut it."""
        req.finish_time = time.monotonic()
        out = self._outputs[req.request_id]
        if out.detok is not None and not isinstance(req.stop_reason, str):
            out.text += out.detok.flush()
        out.detok = out.stops = None

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output now: everything so far, or with output_kind DELTA what is
        new since its last one (prompt logprobs once, in the first output that has them;
        cumulative_logprob stays the running sum, as vLLM's)."""
        out = (self._outputs.pop(req.request_id) if req.is_finished
               else self._outputs[req.request_id])
        text = out.text
        if not req.is_finished and out.stops is not None:
            text = text[: len(text) - out.stops.held]
        scored = _prompt_scored(req)
        with_logprobs = req.sampling_params.logprobs is not None
        tokens, logprobs = req.output_token_ids, req.logprobs
        if out.sent is not None:
            text, tokens, logprobs, scored = out.sent.take(text, tokens, logprobs, scored)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(tokens),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(logprobs) if with_logprobs else None,
            cumulative_logprob=req.cumulative_logprob if with_logprobs else None,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.is_finished,
            # complete once scored, never changed after: every output shares it
            prompt_logprobs=req.prompt_scores if scored else None,
            num_cached_tokens=req.num_cached_tokens or 0,
            metrics=RequestMetrics(
                arrival_time=req.arrival_time,
                first_token_time=req.first_token_time,
                finish_time=req.finish_time,
                num_preemptions=req.num_preemptions,
                first_scheduled_time=req.first_scheduled_time,
                last_token_time=req.last_token_time,
                spec_stats=req.spec_stats.as_dict() if req.spec_stats.num_drafts else {},
            ),
        )


class PromptScorers:
    """n choices of one prompt asking for its logprobs: the first scores the prompt for all
    (the others read its entries, `Request.prompt_scorer`), within one group."""

    def __init__(self) -> None:
        # (group, prompt, prompt_logprobs) -> the request that scores that prompt
        self._scorers: dict[tuple[str, tuple[int, ...], int], Request] = {}

    def add(self, req: Request) -> None:
        n = req.sampling_params.prompt_logprobs
        if n is not None and req.group is not None:
            scorer = self._scorers.setdefault((req.group, tuple(req.prompt_token_ids), n), req)
            req.prompt_scorer = None if scorer is req else scorer

    def finish(self, req: Request) -> None:
        n = req.sampling_params.prompt_logprobs
        if req.prompt_scorer is None and n is not None:
            key = (req.group, tuple(req.prompt_token_ids), n)
            if self._scorers.get(key) is req:
                del self._scorers[key]


def _prompt_scored(req: Request) -> bool:
    """Whether the request asked for prompt logprobs and every prompt token has them."""
    return req.sampling_params.prompt_logprobs is not None and req.prompt_scored


def _length_reached(req: Request, max_model_len: int) -> bool:
    max_tokens = req.sampling_params.max_tokens
    if max_tokens is not None and req.num_output_tokens >= max_tokens:
        return True
    return req.num_tokens >= max_model_len
