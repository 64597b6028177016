"""POST /v1/chat/completions: the model's chat template, then a completion."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import Response
from pydantic import TypeAdapter, ValidationError

from braid.outputs import RequestOutput
from braid.sampling_params import StructuredOutputsParams
from braid.server.errors import APIError, bad_request, prompt_too_long
from braid.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenizeChatRequest,
)
from braid.server.reasoning import ReasoningSplitter, split_reasoning
from braid.server.responses import (
    ChoiceState,
    Delta,
    braid_info,
    chat_logprobs,
    prompt_logprobs,
)
from braid.server.serving import (
    Job,
    ServerContext,
    capped,
    check_grammar,
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
from braid.server.tools import (
    ChoiceTools,
    ToolSchemaError,
    template_messages,
    tool_constraint,
    tool_mode,
    tool_schemas,
)
from braid.tokenizer import (
    TEMPLATE_VARIABLES,
    ContinuationError,
    PromptTooLong,
    Tokenizer,
    compile_chat_template,
)


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest,
                                 raw: Request) -> Response:
    model = check_model(ctx, body.model)
    force_usage(ctx, body)
    check_template_fields(body, ctx.trust_request_chat_template)  # may set tools
    whole_vocabulary(ctx, body, "top_logprobs", "prompt_logprobs")
    if (body.top_logprobs or 0) > 0 and not body.logprobs:  # vLLM lets 0 go without
        raise bad_request("top_logprobs: set logprobs to true to get top_logprobs",
                          "top_logprobs")
    if (body.top_logprobs or 0) > ctx.max_logprobs:  # the engine would name "logprobs"
        raise bad_request(f"top_logprobs {body.top_logprobs} exceeds --max-logprobs "
                          f"({ctx.max_logprobs})", "top_logprobs")
    # OpenAI's newer name wins where both are set; errors name the field the client used
    use_new_name = body.max_completion_tokens is not None
    asked = capped(ctx, body.max_completion_tokens if use_new_name else body.max_tokens)
    asked_field = "max_completion_tokens" if use_new_name else "max_tokens"
    try:
        mode, constraint = tool_mode(body), tool_constraint(body)
    except ToolSchemaError as e:
        raise bad_request(str(e), "tools") from None
    except ValueError as e:
        raise bad_request(f"tool_choice: {e}", "tool_choice") from None
    params = request_params(
        body, asked, (body.top_logprobs or 0) if body.logprobs else None,
        {"max_tokens": asked_field} if use_new_name else None, constraint=constraint,
        defaults=ctx.default_sampling)
    if ctx.reasoning_parser and params.structured_outputs is not None:  # after the thinking
        params = replace(params, structured_outputs=replace(
            params.structured_outputs, reasoning=ctx.reasoning_parser))
    await check_structured(ctx, body)
    await _check_tool_grammar(ctx, body, constraint)
    keep = kept_prompt_tokens(ctx, body.truncate_prompt_tokens)
    prompt = await asyncio.to_thread(render_chat, ctx.tokenizer, body,
                                     ctx.max_model_len if keep is None else None)
    if keep is not None:
        prompt = prompt[-keep:]
    check_room(ctx, [prompt], asked, asked_field, "messages")
    params = await prepared(ctx, params)
    job = make_job("chatcmpl", [prompt], params, body.n, request_id(body, raw))
    await submit(ctx, job, prompt_field="messages", priority=body.priority)
    tools = {c.index: ChoiceTools(mode, body) for c in job.choices} if mode else {}
    return await respond(ctx, job, raw, body.stream,
                         lambda: _stream(ctx, job, body, model, tools),
                         lambda finals: _response(ctx, job, body, model, finals, tools))


async def _check_tool_grammar(ctx: ServerContext, body: ChatCompletionRequest,
                              constraint: StructuredOutputsParams | None) -> None:
    """400 naming `tools` where the grammar of a required or named tool choice is refused:
    which tool's parameters are at fault, where one is."""
    if constraint is None:
        return
    try:
        await check_grammar(ctx, constraint)
    except ValueError as e:
        for where, schema in tool_schemas(body):
            try:
                await check_grammar(ctx, schema)
            except ValueError as alone:
                raise bad_request(f"{where}: not a JSON schema the grammar takes: "
                                  f"{str(alone).removeprefix('json ')}", "tools") from None
        raise bad_request(f"tools: the tool choice's grammar is refused: {e}", "tools") from None


def render_chat(tokenizer: Tokenizer, body: ChatCompletionRequest | TokenizeChatRequest,
                max_model_len: int | None = None) -> list[int]:
    """The conversation through the chat template, as token ids (400 naming `messages` when
    the template refuses it or it leaves no room in `max_model_len` for a generated token)."""
    messages = template_messages(body)
    try:
        text = tokenizer.apply_chat_template(
            messages, body.add_generation_prompt,
            [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            chat_template=body.chat_template, continue_final_message=body.continue_final_message,
            **{"documents": body.documents, **(body.chat_template_kwargs or {})})
    except ContinuationError as e:
        raise bad_request(str(e), "continue_final_message") from None
    except jinja2.TemplateSyntaxError as e:  # the server's (check_template_fields compiled
        # a request's own before this)
        raise APIError(500, f"the model's chat template does not compile (line {e.lineno}: "
                       f"{e.message}); start the server with a working --chat-template") from None
    except Exception as e:  # template errors are the conversation's fault (jinja raise_exception)
        raise bad_request(f"messages: the chat template rejected them: {e}", "messages") from None
    try:
        return tokenizer.encode(text, add_special_tokens=body.add_special_tokens,
                                max_tokens=None if max_model_len is None else max_model_len - 1)
    except PromptTooLong as e:
        assert max_model_len is not None
        raise prompt_too_long(f"messages: {e}", max_model_len, "messages") from None


def check_template_fields(body: ChatCompletionRequest | TokenizeChatRequest,
                          trust_request_chat_template: bool) -> None:
    """As vLLM: chat_template_kwargs may set add_generation_prompt, continue_final_message,
    chat_template and tools over the fields of those names (moved onto `body` here, checked
    as the fields are), and documents (a plain template variable); `messages` stays the
    request's. Then 400s naming chat_template for a request's own template unless the
    server trusts them (a template runs in a sandbox, but can loop for as long as it likes)
    or one that is not Jinja. (Both continue_final_message and add_generation_prompt is the
    tokenizer's ContinuationError, a 400 from render_chat.)"""
    kwargs = dict(body.chat_template_kwargs or {})
    kwargs.pop("tokenize", None)  # as vLLM drops it: the server tokenizes the text itself
    if "messages" in kwargs:
        raise bad_request("chat_template_kwargs: 'messages' is the request's own field, not a "
                          "template variable", "chat_template_kwargs")
    for name in sorted(TEMPLATE_VARIABLES & set(kwargs)):
        value = kwargs.pop(name)
        try:
            field = type(body).model_fields[name]
            setattr(body, name, TypeAdapter(Any if field.annotation is None else field.annotation)
                    .validate_python(value))
        except ValidationError as e:
            raise bad_request(f"chat_template_kwargs.{name}: {e.errors()[0]['msg']}",
                              "chat_template_kwargs") from None
    body.chat_template_kwargs = kwargs
    if body.chat_template is not None:
        if not trust_request_chat_template:
            raise bad_request("chat_template: request chat templates need the server started "
                              "with --trust-request-chat-template", "chat_template")
        try:
            compile_chat_template(body.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise bad_request(f"chat_template: not a valid Jinja template (line {e.lineno}: "
                              f"{e.message})", "chat_template") from None


def _logprobs(ctx: ServerContext, body: ChatCompletionRequest, delta: Delta) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    return chat_logprobs(ctx.tokenizer, delta, body.top_logprobs or 0,
                         body.return_tokens_as_token_ids or ctx.return_tokens_as_token_ids)


def _echoed(body: ChatCompletionRequest) -> str:
    """With `echo` (vLLM's), what leads each reply: the last message's content where the
    reply continues it (no generation prompt, or an assistant's last message)."""
    last = body.messages[-1]
    if not body.echo or (body.add_generation_prompt and last.role != "assistant"):
        return ""
    return str(last.as_template_dict()["content"])


def response_role(ctx: ServerContext, body: ChatCompletionRequest) -> str:
    """The reply's role, as vLLM names it: --response-role after a generation prompt, else
    the role of the message the reply continues."""
    return ctx.response_role if body.add_generation_prompt else body.messages[-1].role


def _response(ctx: ServerContext, job: Job, body: ChatCompletionRequest, model: str,
              finals: list[RequestOutput], tools: dict[int, ChoiceTools]
              ) -> ChatCompletionResponse:
    choices = []
    echoed = _echoed(body)
    for choice, out in zip(job.choices, finals, strict=True):
        c = out.outputs[0]
        role = response_role(ctx, body)
        reasoning, text = (split_reasoning(ctx.reasoning_parser, c.text)
                           if ctx.reasoning_parser else (None, c.text))
        message, reason = ChatResponseMessage(role=role, content=echoed + text,
                                              reasoning_content=reasoning), c.finish_reason
        if (t := tools.get(choice.index)) is not None:
            content, calls = t.whole(text)
            message, reason = ChatResponseMessage(
                role=role, content=echoed + (content or "") if echoed else content,
                reasoning_content=reasoning, tool_calls=calls), t.finish_reason(reason)
        choices.append(ChatChoice(
            index=choice.index, message=message,
            logprobs=_logprobs(ctx, body, Delta(c.text, c.token_ids, c.logprobs)),
            finish_reason=reason, stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=job.id, model=model, choices=choices,
                                  usage=job.usage(), braid=braid_info(finals),
                                  prompt_logprobs=prompt_logprobs(ctx.tokenizer, finals[0]))


def _stream(ctx: ServerContext, job: Job, body: ChatCompletionRequest, model: str,  # noqa: ANN202
            tools: dict[int, ChoiceTools]):
    def chunk(index: int, delta: DeltaMessage, **fields: object) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(id=job.id, model=model, choices=[
            ChatStreamChoice(index=index, delta=delta, **fields)])  # type: ignore[arg-type]

    splitters = ({c.index: ReasoningSplitter(ctx.reasoning_parser) for c in job.choices}
                 if ctx.reasoning_parser else {})

    def render(choice: ChoiceState, delta: Delta, out: RequestOutput) -> list[str]:
        c = out.outputs[0]
        reasoning, text = (splitters[choice.index].feed(delta.text, out.finished)
                           if splitters else ("", delta.text))
        message, reason = DeltaMessage(content=(text or None) if splitters else text,
                                       reasoning_content=reasoning or None), c.finish_reason
        if (t := tools.get(choice.index)) is not None:
            content, calls = t.delta(text, out.finished)
            message = DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                                   tool_calls=calls or None)
            reason = t.finish_reason(reason)
        if not (message.content or message.reasoning_content or message.tool_calls) \
                and not out.finished and not body.logprobs:
            return []
        body_chunk = chunk(choice.index, message,
                           logprobs=_logprobs(ctx, body, delta),
                           finish_reason=reason if out.finished else None,
                           stop_reason=c.stop_reason if out.finished else None)
        if out.finished:
            body_chunk.braid = braid_info([out])
            body_chunk.choices[0].prompt_logprobs = prompt_logprobs(ctx.tokenizer, out)
        return [sse_chunk(body_chunk, body, job)]

    def tail() -> list[str]:
        if not body.include_usage:
            return []
        finals = [c.final for c in job.choices if c.final is not None]
        return [sse(ChatCompletionStreamResponse(id=job.id, model=model, choices=[],
                                                 usage=job.usage(),
                                                 braid=braid_info(finals)))]

    role = response_role(ctx, body)
    head = [sse_chunk(chunk(c.index, DeltaMessage(role=role, content=_echoed(body))), body, job)
            for c in job.choices]
    return event_stream(ctx, job, head, render, tail)
