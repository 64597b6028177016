"""POST /v1/completions."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from braid.outputs import RequestOutput
from braid.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from braid.server.responses import (
    ChoiceState,
    Delta,
    braid_info,
    completion_logprobs,
    usage,
)
from braid.server.serving import (
    Job,
    ServerContext,
    check_model,
    event_stream,
    make_job,
    request_params,
    respond,
    sse,
    submit,
)
from braid.tokenizer import Tokenizer


async def create_completion(ctx: ServerContext, body: CompletionRequest,
                            raw: Request) -> Response:
    model = check_model(ctx, body.model)
    params = request_params(body, body.max_tokens, body.logprobs)
    prompts = await asyncio.to_thread(tokenize_prompts, ctx.tokenizer, body.prompt)
    job = make_job("cmpl", prompts, params, body.n)
    await submit(ctx, job)
    return await respond(ctx, job, raw, body.stream, lambda: _stream(ctx, job, body, model),
                         lambda finals: _response(ctx, job, body, model, finals))


def tokenize_prompts(tokenizer: Tokenizer,
                     prompt: str | list[int] | list[str] | list[list[int]]) -> list[list[int]]:
    """One prompt or a batch, as token ids (the engine checks lengths and ids)."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt or isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _logprobs(ctx: ServerContext, body: CompletionRequest, delta: Delta,
              offset: int) -> CompletionLogprobs | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(ctx.tokenizer, delta, body.logprobs, offset)


def _response(ctx: ServerContext, job: Job, body: CompletionRequest, model: str,
              finals: list[RequestOutput]) -> CompletionResponse:
    choices = []
    for choice, out in zip(job.choices, finals, strict=True):
        c = out.outputs[0]
        delta = Delta(c.text, c.token_ids, c.logprobs)
        choices.append(CompletionChoice(
            index=choice.index, text=c.text, logprobs=_logprobs(ctx, body, delta, 0),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(id=job.id, model=model, choices=choices,
                              usage=usage(job.prompts, job.choices), braid=braid_info(finals))


def _stream(ctx: ServerContext, job: Job, body: CompletionRequest, model: str):  # noqa: ANN202
    def render(choice: ChoiceState, delta: Delta, out: RequestOutput) -> list[str]:
        if not delta.text and not out.finished and body.logprobs is None:
            return []
        c = out.outputs[0]
        offset = choice.sent_chars - len(delta.text)
        chunk = CompletionStreamResponse(id=job.id, model=model, choices=[CompletionChoice(
            index=choice.index, text=delta.text, logprobs=_logprobs(ctx, body, delta, offset),
            finish_reason=c.finish_reason if out.finished else None,
            stop_reason=c.stop_reason if out.finished else None)])
        if out.finished:
            chunk.braid = braid_info([out])
        return [sse(chunk)]

    def tail() -> list[str]:
        if not body.include_usage:
            return []
        finals = [c.final for c in job.choices if c.final is not None]
        return [sse(CompletionStreamResponse(id=job.id, model=model, choices=[],
                                             usage=usage(job.prompts, job.choices),
                                             braid=braid_info(finals)))]

    return event_stream(ctx, job, [], render, tail)
