"""What every generation endpoint shares: validation, admission, output streams, SSE.

One HTTP request is a `Job`: one engine request per choice (n choices per prompt, ids
`{job id}-{i}`), all delivering to one asyncio queue, so n > 1 and batched prompts need
nothing from the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from braid.engine.input import RequestError, with_bad_words, with_prediction
from braid.engine.process import EngineDied
from braid.outputs import RequestOutput
from braid.sampling_params import SamplingParams, StructuredOutputsParams, choice_seed
from braid.server.bodies import INLINE_BYTES, json_response, off_loop
from braid.server.engine_loop import AsyncEngine, OutputQueue, RequestFailed, ShuttingDown
from braid.server.errors import APIError, bad_request, field_of, prompt_too_long
from braid.server.protocol import SamplingRequest, StreamOptions, UsageInfo
from braid.server.responses import ChoiceState, Delta, usage
from braid.structured.manager import StructuredOutputManager
from braid.tokenizer import Tokenizer

if TYPE_CHECKING:
    from braid.server.replicas import Replicas

logger = logging.getLogger("braid.server")
DISCONNECT_POLL_S = 0.5


@dataclass
class ServerContext:
    engine: AsyncEngine | Replicas
    tokenizer: Tokenizer
    model_names: list[str]
    max_model_len: int
    max_waiting_requests: int
    retry_after_s: int = 1
    trust_request_chat_template: bool = False  # a request's own chat_template is accepted
    return_tokens_as_token_ids: bool = False  # every response's logprobs tokens as ids
    root: str | None = None  # the --model the served names stand for
    max_logprobs: int = 20  # --max-logprobs (the engine checks it too, naming its own fields)
    vocab_size: int = 0  # what a logprobs field's -1 stands for (vLLM's: the whole vocabulary)
    response_role: str = "assistant"  # --response-role
    reasoning_parser: str | None = None  # --reasoning-parser
    # sampling for the fields a request leaves unset (the model's generation_config.json)
    default_sampling: dict[str, Any] = field(default_factory=dict)
    # --override-generation-config's max_new_tokens: as in vLLM, every request's max_tokens
    # is at most it (and it is the default where a request leaves max_tokens unset)
    max_tokens_cap: int | None = None
    force_include_usage: bool = False  # --enable-force-include-usage
    log_requests: bool = False  # --enable-log-requests: a line as each request arrives
    max_log_len: int | None = None  # --max-log-len: prompt characters and ids such a line shows
    # compiles and checks structured outputs on its worker, never on the event loop
    grammars: StructuredOutputManager | None = None


class EngineFailure(Exception):
    """The engine failed this request (see `RequestFailed`); 503 when the server is shutting
    down, 500 otherwise."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Job:
    """One HTTP request: its prompts and one `ChoiceState` per engine request."""

    id: str
    prompts: list[list[int]]
    choices: list[ChoiceState]
    params: list[SamplingParams]
    arrival_time: float = field(default_factory=time.monotonic)
    queue: OutputQueue = field(default_factory=asyncio.Queue)
    # Rewrites each engine output before the response sees it (None: as it is).
    view: Callable[[RequestOutput], RequestOutput] | None = None
    group: str | None = None  # its engine requests' group: the prefix of their ids

    @property
    def with_logprobs(self) -> bool:
        """Whether the response carries logprobs (of its tokens or its prompt)."""
        p = self.params[0]
        return p.logprobs is not None or p.prompt_logprobs is not None

    @property
    def predicted(self) -> bool:
        """Whether the request came with a prediction (its usage then counts its drafts)."""
        return self.params[0].prediction is not None

    def usage(self) -> UsageInfo:
        return usage(self.prompts, self.choices, self.predicted)

    @property
    def unfinished(self) -> list[ChoiceState]:
        return [c for c in self.choices if c.final is None]

    def choice(self, request_id: str) -> ChoiceState:
        return next(c for c in self.choices if c.request_id == request_id)


def check_model(ctx: ServerContext, name: str | None) -> str:
    """The served model a request names; none (absent, null or "", as vLLM takes it) is the
    first served name."""
    if name and name not in ctx.model_names:
        # 404 as vLLM answers it (OpenAI too); the code names the case for clients
        raise APIError(404, f"The model `{name}` does not exist; this server serves "
                       f"{', '.join(map(repr, ctx.model_names))}", "model", "model_not_found")
    return name or ctx.model_names[0]


def build_params(rename: dict[str, str] | None = None, **kwargs: object) -> SamplingParams:
    """SamplingParams, with its ValueError (message starts with the field) as a 400."""
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        name = field_of(str(e))
        raise bad_request(str(e), (rename or {}).get(name, name)) from None


_SHARED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                  "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                  "include_stop_str_in_output", "allowed_token_ids", "bad_words")


def force_usage(ctx: ServerContext, body: SamplingRequest) -> None:
    """--enable-force-include-usage, as vLLM's: a stream carries usage in every chunk and a
    last usage chunk, whatever its stream_options say."""
    if ctx.force_include_usage and body.stream:
        body.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)


def whole_vocabulary(ctx: ServerContext, body: SamplingRequest, *names: str) -> None:
    """Logprobs fields of -1 become the vocabulary's size, as vLLM reads them (400 where
    --max-logprobs allows fewer, naming the -1 the client sent)."""
    for name in names:
        if getattr(body, name) == -1:
            if ctx.vocab_size > ctx.max_logprobs:
                raise bad_request(f"{name} -1 asks for the whole vocabulary ({ctx.vocab_size} "
                                  f"tokens), more than --max-logprobs ({ctx.max_logprobs}) "
                                  "allows; start the server with --max-logprobs -1", name)
            setattr(body, name, ctx.vocab_size)


def request_params(body: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                   rename: dict[str, str] | None = None,
                   prompt_logprobs: int | None = None,
                   constraint: StructuredOutputsParams | None = None,
                   defaults: dict[str, Any] | None = None) -> SamplingParams:
    """SamplingParams from the fields completions and chat requests share (same names); 400
    for a field braid does not implement. `constraint`: a tool choice's grammar, which the
    request's own structured output may not contradict. `defaults` stand for the fields the
    request left unset (absent or null)."""
    unsupported = body.unsupported_field()
    if unsupported is not None:
        name, why = unsupported
        raise bad_request(f"{name}: {why}", name)
    try:
        bias = body.token_bias()
    except ValueError as e:
        raise bad_request(str(e), "logit_bias") from None
    shared = {name: getattr(body, name) for name in _SHARED_FIELDS}
    defaults = dict(defaults or {})
    fallback = defaults.pop("max_tokens", None)  # a generation config's max_new_tokens
    if max_tokens is None:
        max_tokens = fallback
    shared.update({name: value for name, value in defaults.items()
                   if name not in body.model_fields_set})
    if prompt_logprobs is None:
        prompt_logprobs = body.prompt_logprobs
    found = structured(body)
    own = None if found is None else found[1]
    if own is not None and constraint is not None:
        raise bad_request("tool_choice: a required or named tool choice sets the output's "
                          "format; leave response_format and structured_outputs out",
                          "tool_choice")
    prediction = None if body.prediction is None else body.prediction.text
    return build_params(rename, max_tokens=max_tokens, logprobs=logprobs, logit_bias=bias,
                        prompt_logprobs=prompt_logprobs, structured_outputs=own or constraint,
                        prediction=prediction, **shared)


def structured(body: SamplingRequest) -> tuple[str, StructuredOutputsParams] | None:
    """The request's structured output constraint and the field it came from (400 naming
    the field where it is malformed; the grammar itself is checked by `check_structured`)."""
    try:
        found = body.structured()
    except ValueError as e:
        raise bad_request(str(e), field_of(str(e))) from None
    if found is None:
        return None
    where, fields = found
    try:
        return where, StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_request(f"{where}: {e}", where) from None


async def check_structured(ctx: ServerContext, body: SamplingRequest) -> None:
    """400 naming the field whose grammar the grammar engine refuses (invalid, too large,
    too complex), compiled on its worker while the event loop goes on."""
    found = structured(body)
    if found is None:
        return
    where, params = found
    try:
        await check_grammar(ctx, params)
    except ValueError as e:
        raise bad_request(f"{where}: {e}", where) from None


async def check_grammar(ctx: ServerContext, params: StructuredOutputsParams) -> None:
    """ValueError (naming the spec's kind) where the grammar engine refuses `params`; the
    compiled grammar is kept for the request that follows."""
    if ctx.grammars is None:
        raise ValueError("structured output needs a tokenizer: this server has none")
    await asyncio.wrap_future(ctx.grammars.validate(params))


def capped(ctx: ServerContext, max_tokens: int | None) -> int | None:
    """A request's max_tokens within --override-generation-config's max_new_tokens."""
    if max_tokens is None or ctx.max_tokens_cap is None:
        return max_tokens
    return min(max_tokens, ctx.max_tokens_cap)


def check_room(ctx: ServerContext, prompts: list[list[int]], max_tokens: int | None,
               param: str, prompt_param: str) -> None:
    """400 naming `prompt_param` where the longest prompt leaves no room for a token, else
    naming `param` where the tokens it asks for cannot follow it within max_model_len, as
    vLLM answers (instead of silently generating fewer)."""
    longest = max(len(p) for p in prompts)
    if longest >= ctx.max_model_len:  # token ids, or a prompt truncate_prompt_tokens kept
        raise prompt_too_long(f"prompt is {longest} tokens, the maximum is "
                              f"{ctx.max_model_len - 1}", ctx.max_model_len, prompt_param)
    if max_tokens is not None and longest + max_tokens > ctx.max_model_len:
        raise bad_request(
            f"{param} is too large: {max_tokens}. The model's maximum context length is "
            f"{ctx.max_model_len} tokens and the request has {longest} input tokens "
            f"({max_tokens} > {ctx.max_model_len} - {longest})", param)


def kept_prompt_tokens(ctx: ServerContext, truncate_prompt_tokens: int | None) -> int | None:
    """How many of a prompt's last tokens to keep (vLLM's truncate_prompt_tokens; -1: up to
    max_model_len), None to keep all; 400 naming the field for a value it cannot take."""
    k = truncate_prompt_tokens
    if k is None:
        return None
    if k == 0 or k < -1 or k > ctx.max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, {ctx.max_model_len}] "
                          f"(max_model_len), got {k}", "truncate_prompt_tokens")
    return ctx.max_model_len if k == -1 else k


async def prepared(ctx: ServerContext, params: SamplingParams) -> SamplingParams:
    """`params` with what is costly to derive from them done here, in a worker thread, not
    on the engine's: bad_words and the prediction as token ids."""
    if params.bad_words:
        params = await asyncio.to_thread(with_bad_words, params, ctx.tokenizer)
    if params.prediction:
        params = await asyncio.to_thread(with_prediction, params, ctx.tokenizer,
                                         ctx.max_model_len)
    return params


def make_job(prefix: str, prompts: list[list[int]], params: SamplingParams, n: int,
             request_id: str | None = None) -> Job:
    """The job of one request; `request_id` (the client's, as vLLM takes it) names the
    response. The engine requests' ids start with the response's, so log lines
    (--enable-log-requests) can be found by it, and are unique even where a client reuses
    its id: "cmpl-ID-UNIQUE-CHOICE" (the client's ID cut to 64 characters, those that could
    forge or break a log line replaced by "_")."""
    unique = f"{time.time_ns():x}{next(_counter):x}"
    public = f"{prefix}-{unique}" if request_id is None else f"{prefix}-{request_id}"
    engine_prefix = (public if request_id is None
                     else f"{prefix}-{_UNSAFE_IN_LOGS.sub('_', request_id[:64])}-{unique}")
    choices, per_choice = [], []
    for index, (p, j) in enumerate(itertools.product(range(len(prompts)), range(n))):
        choices.append(ChoiceState(index, f"{engine_prefix}-{index}", p))
        per_choice.append(dataclasses.replace(params, seed=choice_seed(params.seed, j)))
    return Job(public, prompts, choices, per_choice, group=engine_prefix)


_counter = itertools.count()
_UNSAFE_IN_LOGS = re.compile(r"[^\w.:/-]")
_HEADER_SAFE = re.compile(r"[ -~]+")
MAX_REQUEST_ID = 256  # characters of a client's request id (the field, or the header)


def request_id(body: SamplingRequest, raw: Request) -> str | None:
    """The client's id for the response, as vLLM takes it: `request_id`, else the
    X-Request-Id header. It goes back in the X-Request-Id header, so `request_id` must be
    printable ASCII (a line break ended the connection without a response) and at most
    MAX_REQUEST_ID characters (the response would carry a header of any size). A header that
    could not be the field is not used: braid names the response itself (a proxy may set the
    header, and the client cannot change it)."""
    if body.request_id and not _is_request_id(body.request_id):
        raise bad_request(f"request_id must be 1 to {MAX_REQUEST_ID} printable ASCII "
                          "characters: it names the response and its X-Request-Id header",
                          "request_id")
    header = raw.headers.get("x-request-id")
    return body.request_id or (header if header and _is_request_id(header) else None)


def _is_request_id(text: str) -> bool:
    return len(text) <= MAX_REQUEST_ID and _HEADER_SAFE.fullmatch(text) is not None


def check_fan_out(ctx: ServerContext, num_prompts: int, n: int,
                  prompt_field: str = "prompt") -> None:
    """400 for a request of more engine requests (prompts x n) than may wait at once: asked
    before anything is done per prompt or per choice (tens of microseconds each: a 4 MB body
    holds 700,000 prompts)."""
    size, limit = num_prompts * n, ctx.max_waiting_requests
    if size > limit:
        name = "n" if num_prompts == 1 else prompt_field
        raise bad_request(f"{name}: this request makes {size} engine requests "
                          f"({num_prompts} prompt(s) x n), more than the server lets "
                          f"wait at once ({limit}); split it", name)


async def submit(ctx: ServerContext, job: Job, prompt_field: str = "prompt",
                 priority: int = 0) -> None:
    """Admit every choice, or none: 400 for a request larger than the waiting limit, 503 when
    too many wait, 400 for a prompt the engine refuses (the field is renamed to
    `prompt_field`), 500 for anything else. The check and the reservation of the waiting
    slots happen with no await between them, so concurrent handlers cannot overrun it."""
    check_fan_out(ctx, len(job.prompts), len(job.choices) // len(job.prompts), prompt_field)
    if not ctx.engine.is_alive:  # its process died: /health says 503 too
        retry = ctx.engine.retry_after_s
        raise APIError(503, ctx.engine.down_message,
                       headers=None if retry is None else {"Retry-After": str(retry)})
    size, limit = len(job.choices), ctx.max_waiting_requests
    waiting = ctx.engine.num_waiting
    if waiting + size > limit:
        raise APIError(503, f"server overloaded: {waiting} requests waiting (limit "
                       f"{limit}); retry later",
                       headers={"Retry-After": str(ctx.retry_after_s)})
    results = await ctx.engine.add_all(
        [(c.request_id, job.prompts[c.prompt_index], p)
         for c, p in zip(job.choices, job.params, strict=True)], job.queue, job.arrival_time,
        priority, job.group)
    errors = [r for r in results if r is not None]
    if errors:
        abort_unfinished(ctx, job)
        raise _admission_error(errors[0], prompt_field)
    ctx.engine.record_admitted(len(job.prompts), len(job.choices) // len(job.prompts), [
        ctx.max_model_len - len(job.prompts[c.prompt_index]) if p.max_tokens is None
        else p.max_tokens for c, p in zip(job.choices, job.params, strict=True)])
    if ctx.log_requests:
        _log_received(ctx, job)


def _log_received(ctx: ServerContext, job: Job) -> None:
    """--enable-log-requests' line per engine request, as vLLM's: its prompt (text and ids,
    each cut at --max-log-len) and sampling parameters."""
    cut = ctx.max_log_len
    for c, params in zip(job.choices, job.params, strict=True):
        ids = job.prompts[c.prompt_index]
        text = ctx.tokenizer.decode(ids[:cut], skip_special_tokens=False)  # [:None]: all
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                    c.request_id, text[:cut], params, ids[:cut])


def _admission_error(error: BaseException, prompt_field: str) -> BaseException:
    if isinstance(error, RequestError | ValueError):
        name = field_of(str(error))
        return bad_request(str(error), prompt_field if name == "prompt" else name)
    if isinstance(error, Exception):
        logger.error("adding a request failed", exc_info=error)
        return APIError(500, f"internal error adding the request: {type(error).__name__}")
    return error


def abort_unfinished(ctx: ServerContext, job: Job) -> None:
    for choice in job.unfinished:
        ctx.engine.abort(choice.request_id)


async def outputs(job: Job) -> AsyncIterator[tuple[ChoiceState, RequestOutput]]:
    """Each output of each choice, as the engine produces them, until all have finished."""
    while job.unfinished:
        item = await job.queue.get()
        if isinstance(item, RequestFailed):
            # the server going down, or the replica's engine that ran it: the client may retry
            status = 503 if isinstance(item.error, ShuttingDown | EngineDied) else 500
            raise EngineFailure(f"{type(item.error).__name__}: {item.error}", status)
        yield job.choice(item.request_id), item if job.view is None else job.view(item)


async def collect(ctx: ServerContext, job: Job, raw: Request) -> list[RequestOutput]:
    """Wait for every choice's final output; give up (raising) if the client goes away."""

    async def drain() -> None:
        async for choice, out in outputs(job):
            choice.advance(out)

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await raw.is_disconnected():
                raise ClientGone
        task.result()
    except EngineFailure as e:
        raise APIError(e.status, f"the engine failed this request: {e}") from None
    finally:
        task.cancel()
        abort_unfinished(ctx, job)
    return [c.final for c in job.choices if c.final is not None]


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


async def respond(ctx: ServerContext, job: Job, raw: Request, stream: bool,
                  events: Callable[[], AsyncIterator[str]],
                  build: Callable[[list[RequestOutput]], BaseModel]) -> Response:
    """SSE stream of `events()`, or one JSON body built from every choice's final output."""
    if stream:
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"X-Request-Id": job.id})
    try:
        finals = await collect(ctx, job, raw)
    except ClientGone:
        return Response(status_code=499)
    # built and written in a thread: with logprobs a response can take seconds to build
    body = await asyncio.to_thread(build, finals)
    return json_response(body, {"X-Request-Id": job.id}, streamed=job.with_logprobs)


def sse(body: BaseModel) -> str:
    """One server-sent event; optional top-level fields are left out while unset."""
    skip = {k for k in ("usage", "braid") if getattr(body, k, None) is None}
    return f"data: {body.model_dump_json(exclude=skip)}\n\n"


def sse_chunk(chunk: BaseModel, body: SamplingRequest, job: Job) -> str:
    """A streamed chunk as an event, with the usage so far where the request asked for it in
    every chunk (stream_options.continuous_usage_stats): as vLLM, the chunk's own choice's
    (its prompt and its tokens so far)."""
    if body.continuous_usage:
        indexes = {c.index for c in chunk.choices}  # type: ignore[attr-defined]
        mine = [c for c in job.choices if c.index in indexes] or job.choices
        chunk.usage = usage(  # type: ignore[attr-defined]
            [job.prompts[i] for i in sorted({c.prompt_index for c in mine})], mine,
            job.predicted)
    return sse(chunk)


SSE_DONE = "data: [DONE]\n\n"

ChunkRenderer = Callable[[ChoiceState, Delta, RequestOutput], list[str]]


async def event_stream(ctx: ServerContext, job: Job, head: list[str], render: ChunkRenderer,
                       tail: Callable[[], list[str]]) -> AsyncIterator[str]:
    """SSE body: `head`, one render per output, `tail` (usage), then [DONE]. A failure
    becomes an error event; a client that leaves (the task is cancelled) aborts the job."""
    try:
        for chunk in head:
            yield chunk
        async for choice, out in outputs(job):
            # a chunk with the prompt's logprobs is large: rendered in a thread
            weight = 0 if out.prompt_logprobs is None else INLINE_BYTES + 1
            for chunk in await off_loop(weight, _rendered, render, choice, out):
                yield chunk
        for chunk in tail():
            yield chunk
    except Exception as e:
        if isinstance(e, EngineFailure) and e.status == 503:
            logger.warning("streaming request %s ended: %s", job.id, e)
        else:
            logger.exception("streaming request %s failed", job.id)
        yield _error_event(e)
    finally:
        abort_unfinished(ctx, job)
    yield SSE_DONE


def _rendered(render: ChunkRenderer, choice: ChoiceState, out: RequestOutput) -> list[str]:
    return render(choice, choice.advance(out), out)


def _error_event(error: Exception) -> str:
    status = error.status if isinstance(error, EngineFailure) else 500
    api = error if isinstance(error, APIError) else APIError(
        status, f"the request failed: {error}")
    return f"data: {api.body().model_dump_json()}\n\n"
