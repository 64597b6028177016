"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response

from braid.outputs import RequestOutput
from braid.server.errors import bad_request, prompt_too_long
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
    prompt_logprobs,
    prompt_logprobs_json,
)
from braid.server.serving import (
    Job,
    ServerContext,
    capped,
    check_fan_out,
    check_model,
    check_room,
    check_structured,
    event_stream,
    force_usage,
    kept_prompt_tokens,
    make_job,
    prepared,
    request_id,
    request_params,
    respond,
    sse,
    sse_chunk,
    submit,
    whole_vocabulary,
)
from braid.tokenizer import PromptTooLong, Tokenizer


async def create_completion(ctx: ServerContext, body: CompletionRequest,
                            raw: Request) -> Response:
    model = check_model(ctx, body.model)
    check_fan_out(ctx, num_prompts(body.prompt), body.n)
    force_usage(ctx, body)
    whole_vocabulary(ctx, body, "logprobs", "prompt_logprobs")
    # echo with logprobs returns the prompt's logprobs too
    echo_logprobs = body.logprobs if body.echo and body.prompt_logprobs is None else None
    # echo with max_tokens 0 scores the prompt and generates nothing, as in vLLM: the engine
    # generates one token, which the response leaves out
    score_only = body.echo and body.max_tokens == 0
    max_tokens = 1 if score_only else capped(ctx, body.max_tokens)
    params = request_params(body, max_tokens, body.logprobs, prompt_logprobs=echo_logprobs,
                            defaults=ctx.default_sampling)
    await check_structured(ctx, body)
    keep = kept_prompt_tokens(ctx, body.truncate_prompt_tokens)
    try:
        prompts = await asyncio.to_thread(
            tokenize_prompts, ctx.tokenizer, fill_in_middle(ctx.tokenizer, body),
            ctx.max_model_len - 1 if keep is None else None, body.add_special_tokens)
    except PromptTooLong as e:
        raise prompt_too_long(str(e), ctx.max_model_len, "prompt") from None
    if keep is not None:
        prompts = [p[-keep:] for p in prompts]
    check_room(ctx, prompts, max_tokens, "max_tokens", "prompt")
    params = await prepared(ctx, params)
    job = make_job("cmpl", prompts, params, body.n, request_id(body, raw))
    if score_only:
        job.view = _prompt_only
    await submit(ctx, job, priority=body.priority)
    return await respond(ctx, job, raw, body.stream, lambda: _stream(ctx, job, body, model),
                         lambda finals: _response(ctx, job, body, model, finals))


def fill_in_middle(tokenizer: Tokenizer, body: CompletionRequest
                   ) -> str | list[int] | list[str] | list[list[int]]:
    """The request's prompt; with a `suffix` (OpenAI's legacy field), each text prompt as
    the model's fill-in-the-middle prompt, so the completion is what goes between prompt and
    suffix (code infill, as llama.cpp's /infill gives it). 400 naming `suffix` for a model
    without those tokens, a token-id prompt, or echo."""
    if not body.suffix:
        return body.prompt
    if body.echo:
        raise bad_request("suffix: cannot go with echo", "suffix")
    if body.truncate_prompt_tokens is not None:  # it would cut the prompt's FIM tokens away
        raise bad_request("suffix: cannot go with truncate_prompt_tokens", "suffix")
    texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not all(isinstance(t, str) for t in texts):
        raise bad_request("suffix: fill in the middle needs text prompts, not token ids",
                          "suffix")
    filled = [tokenizer.fill_in_middle(cast(str, t), body.suffix) for t in texts]
    if None in filled:
        raise bad_request("suffix: this model has no fill-in-the-middle tokens (such as "
                          "Qwen2.5-Coder's <|fim_prefix|>)", "suffix")
    prompts = cast(list[str], filled)
    return prompts[0] if isinstance(body.prompt, str) else prompts


def num_prompts(prompt: object) -> int:
    """How many prompts a completion request's prompt field holds (of any JSON value: a body
    is counted before it is validated)."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def tokenize_prompts(tokenizer: Tokenizer, prompt: str | list[int] | list[str] | list[list[int]],
                     max_tokens: int | None = None, add_special_tokens: bool = True
                     ) -> list[list[int]]:
    """One prompt or a batch, as token ids (the engine checks lengths and ids; texts longer
    than `max_tokens` raise PromptTooLong before their ids are built)."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens, max_tokens)]
    if not prompt or isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p, add_special_tokens, max_tokens) if isinstance(p, str)
            else list(p) for p in prompt]


def _echo(ctx: ServerContext, body: CompletionRequest, out: RequestOutput) -> Delta:
    """The prompt as an echoed prefix: its text, ids and (with logprobs) its logprobs."""
    if not body.echo:
        return Delta("", [], None)
    ids = out.prompt_token_ids
    return Delta(ctx.tokenizer.decode(ids, skip_special_tokens=False), list(ids),
                 out.prompt_logprobs)


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """`out` without what was generated (for echo with max_tokens 0)."""
    c = out.outputs[0]
    return dataclasses.replace(out, outputs=[dataclasses.replace(
        c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
        finish_reason="length" if out.finished else None, stop_reason=None)])


def _logprobs(ctx: ServerContext, body: CompletionRequest, delta: Delta,
              offset: int) -> CompletionLogprobs | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(ctx.tokenizer, delta, body.logprobs, offset,
                               body.return_tokens_as_token_ids or ctx.return_tokens_as_token_ids)


def _response(ctx: ServerContext, job: Job, body: CompletionRequest, model: str,
              finals: list[RequestOutput]) -> CompletionResponse:
    choices = []
    scored: dict[int, Any] = {}  # prompt index -> its prompt logprobs, which its choices share
    for choice, out in zip(job.choices, finals, strict=True):
        c = out.outputs[0]
        delta = _joined(_echo(ctx, body, out), Delta(c.text, c.token_ids, c.logprobs))
        if body.prompt_logprobs is not None and choice.prompt_index not in scored:
            scored[choice.prompt_index] = prompt_logprobs_json(ctx.tokenizer, out)
        choices.append(CompletionChoice(
            index=choice.index, text=delta.text, logprobs=_logprobs(ctx, body, delta, 0),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        # written as it is (bodies.py): a response with prompt logprobs is always written
        # in pieces (Job.with_logprobs)
        choices[-1].prompt_logprobs = scored.get(choice.prompt_index)
    return CompletionResponse(id=job.id, model=model, choices=choices,
                              usage=job.usage(), braid=braid_info(finals))


def _joined(head: Delta, tail: Delta) -> Delta:
    if not head.token_ids:
        return tail
    logprobs = None if tail.logprobs is None else [*(head.logprobs or []), *tail.logprobs]
    return Delta(head.text + tail.text, head.token_ids + tail.token_ids, logprobs)


def _stream(ctx: ServerContext, job: Job, body: CompletionRequest, model: str):  # noqa: ANN202
    # choice index -> text_offset of its next token: the characters of the tokens sent so far,
    # as the whole response counts them (a chunk's text can trail its tokens while part of a
    # stop string is held back)
    offsets: dict[int, int] = {}

    def render(choice: ChoiceState, delta: Delta, out: RequestOutput) -> list[str]:
        first = choice.index not in offsets
        if not first and not delta.text and not out.finished and body.logprobs is None:
            return []
        c = out.outputs[0]
        if first:
            delta = _joined(_echo(ctx, body, out), delta)
        start = offsets.get(choice.index, 0)
        logprobs = _logprobs(ctx, body, delta, start)
        offsets[choice.index] = start if logprobs is None or not logprobs.tokens else (
            logprobs.text_offset[-1] + len(logprobs.tokens[-1]))
        chunk = CompletionStreamResponse(id=job.id, model=model, choices=[CompletionChoice(
            index=choice.index, text=delta.text, logprobs=logprobs,
            finish_reason=c.finish_reason if out.finished else None,
            stop_reason=c.stop_reason if out.finished else None,
            prompt_logprobs=prompt_logprobs(ctx.tokenizer, out) if first and
            body.prompt_logprobs is not None else None)])
        if out.finished:
            chunk.braid = braid_info([out])
        return [sse_chunk(chunk, body, job)]

    def tail() -> list[str]:
        if not body.include_usage:
            return []
        finals = [c.final for c in job.choices if c.final is not None]
        return [sse(CompletionStreamResponse(id=job.id, model=model, choices=[],
                                             usage=job.usage(),
                                             braid=braid_info(finals)))]

    return event_stream(ctx, job, [], render, tail)
