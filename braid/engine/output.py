"""The output side of requests: detokenization, stop rules, logprobs, RequestOutput.

The scheduler appends tokens (it owns output_token_ids) and asks `check_stop` after each;
this module keeps each request's text and judges its stop conditions."""

from __future__ import annotations

import time
from dataclasses import dataclass

from braid.engine.request import Request
from braid.outputs import CompletionOutput, RequestMetrics, RequestOutput, SampleLogprobs
from braid.sampling_params import RequestOutputKind
from braid.tokenizer import IncrementalDetokenizer, Tokenizer


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


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._text: dict[str, str] = {}
        self._sent: dict[str, _Sent] = {}

    def add(self, req: Request) -> None:
        self._text[req.request_id] = ""
        if req.sampling_params.output_kind == RequestOutputKind.DELTA:
            self._sent[req.request_id] = _Sent()
        if self.tokenizer is not None and req.sampling_params.detokenize:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.sampling_params.skip_special_tokens)

    def check_stop(self, req: Request, token: int) -> str | None:
        """`token` was just appended to `req`: extend its text and return the finish reason
        if the token ends it ("stop" or "length")."""
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

    def add_prompt_logprobs(self, req: Request, logprobs: SampleLogprobs) -> None:
        """Logprobs of the prompt tokens a step scored (the next ones in order)."""
        req.prompt_logprobs += self._decoded(req, logprobs)

    def _decoded(self, req: Request, logprobs: SampleLogprobs) -> SampleLogprobs:
        """The entries with each token's text (special tokens included), where there is a
        tokenizer and the request is detokenized."""
        if self.tokenizer is not None and req.sampling_params.detokenize:
            for entry in logprobs:
                for token, lp in entry.items():
                    lp.decoded_token = self.tokenizer.decode([token], skip_special_tokens=False)
        return logprobs

    def _check_token(self, req: Request, token: int) -> str | None:
        p = req.sampling_params
        if req.num_output_tokens <= p.min_tokens - 1:
            return None
        if token in (p.stop_token_ids or []):
            req.stop_reason = token
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        return None

    def _extend_text(self, req: Request, token: int) -> tuple[str, str] | None:
        """(text before, text after) `token`'s text joins req's text; None: no tokenizer."""
        detok = self._detok.get(req.request_id)
        if detok is None:
            return None
        old = self._text[req.request_id]
        text = old + detok.add(token)
        self._text[req.request_id] = text
        return old, text

    def _check_text(self, req: Request, token: int) -> str | None:
        extended = self._extend_text(req, token)
        if extended is None:
            return None
        old, text = extended
        p = req.sampling_params
        if not p.stop_strings or req.num_output_tokens < p.min_tokens:
            return None
        for stop in p.stop_strings:
            # Only the new text (plus an overlap for stops split across tokens) can match.
            at = text.find(stop, max(0, len(old) - len(stop) + 1))
            if at >= 0:
                end = at + len(stop) if p.include_stop_str_in_output else at
                self._text[req.request_id] = text[:end]
                req.stop_reason = stop
                return "stop"
        return None

    def finish(self, req: Request) -> None:
        """Release the detokenizer; text it held back is kept unless a stop string cut it."""
        req.finish_time = time.monotonic()
        detok = self._detok.pop(req.request_id, None)
        if detok is not None and not isinstance(req.stop_reason, str):
            self._text[req.request_id] += detok.flush()

    def make_output(self, req: Request) -> RequestOutput:
        """The request's output now: everything so far, or with output_kind DELTA what is
        new since its last one (prompt logprobs once, in the first output that has them;
        cumulative_logprob stays the running sum, as vLLM's)."""
        text = self._text[req.request_id]
        if req.is_finished:
            self._text.pop(req.request_id, None)
        else:
            text = text[: len(text) - _partial_stop_len(text, req.sampling_params.stop_strings)]
        scored = _prompt_scored(req)
        with_logprobs = req.sampling_params.logprobs is not None
        tokens, logprobs = req.output_token_ids, req.logprobs
        sent = (self._sent.pop(req.request_id, None) if req.is_finished
                else self._sent.get(req.request_id))
        if sent is not None:
            text, tokens, logprobs, scored = sent.take(text, tokens, logprobs, scored)
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
            prompt_logprobs=list(req.prompt_logprobs) if scored else None,
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


def _prompt_scored(req: Request) -> bool:
    """Whether the request asked for prompt logprobs and every prompt token has them."""
    return (req.sampling_params.prompt_logprobs is not None
            and len(req.prompt_logprobs) >= req.num_prompt_tokens)


def _length_reached(req: Request, max_model_len: int) -> bool:
    max_tokens = req.sampling_params.max_tokens
    if max_tokens is not None and req.num_output_tokens >= max_tokens:
        return True
    return req.num_tokens >= max_model_len


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string: held
    back while streaming so a stop string is never half-shown."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
