"""Request and response bodies, kept off the event loop where they are large.

The event loop serves every connection: parsing and validating a body costs ~0.1 s a MB, and
a response with logprobs of every prompt token can take seconds to build, stopping /health
and every stream meanwhile. Bodies up to `INLINE_BYTES` are handled on the loop (under ~5 ms);
larger ones in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from braid import heap
from braid.server.errors import bad_request, validation_error

INLINE_BYTES = 64 * 1024
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, in a worker thread where `size` (bytes of input or output) is large."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def read_json(raw: Request) -> tuple[Any, int]:
    """The request's JSON value and the body's size; 400 for a body that is not JSON."""
    body = await raw.body()
    return await off_loop(len(body), _loads, body), len(body)


def _loads(body: bytes) -> Any:
    if not body:
        raise bad_request("request body: a JSON object is required", "body")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise bad_request(f"malformed JSON body: {e}", "body") from None


async def parse_body(raw: Request, model: type[M]) -> M:
    """The request's body validated as `model`; 400 naming the field otherwise."""
    data, size = await read_json(raw)
    return await off_loop(size, validate, model, data)


def validate(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise bad_request("request body: nested too deeply", "body") from None


def json_response(body: BaseModel, headers: dict[str, str] | None = None,
                  streamed: bool = False) -> Response:
    """`body` as JSON. `streamed`: written one choice at a time (a response with logprobs
    can hold tens of MB: it is never one string in memory), each piece in a worker thread."""
    if not streamed or not getattr(body, "choices", None):
        return JSONResponse(body.model_dump(), headers=headers)
    return StreamingResponse(_pieces(body), media_type="application/json", headers=headers)


class RawJSON(bytes):
    """JSON text already written: a field of a response that holds it is spliced in as it
    is (`_pieces`), not serialized by pydantic."""


def _pieces(body: BaseModel) -> Iterator[bytes]:
    """The JSON text of `body` in pieces: its fields around the choices, then each choice
    (a choice's prompt logprobs, which can be most of it, as RawJSON already written)."""
    choices: list[BaseModel] = body.choices  # type: ignore[attr-defined]
    empty = body.model_copy(update={"choices": []}).model_dump_json()
    head, tail = empty.split('"choices":[]', 1)
    yield f'{head}"choices":['.encode()
    for i, choice in enumerate(choices):
        raw = getattr(choice, "prompt_logprobs", None)
        if not isinstance(raw, RawJSON):
            yield (b"," if i else b"") + choice.model_dump_json().encode()
            continue
        rest = choice.model_dump_json(exclude={"prompt_logprobs"}).encode()
        yield (b"," if i else b"") + rest[:-1] + b',"prompt_logprobs":' + raw + b"}"
    yield f"]{tail}".encode()
    heap.trim()  # such a response took tens of MB while it was built (heap.py)


def json_lists(head: dict[str, Any], items: list[Any],
               lists: dict[str, Callable[[list[Any]], list[Any]]]) -> bytes:
    """A JSON object of `head`'s fields, then one list per entry of `lists`: its function of
    `items`, applied and written a slice at a time. No single call then holds the GIL for
    long (pydantic and json.dumps hold it ~0.1 s per million items, and the engine thread
    waits that long)."""
    parts = [json.dumps(head)[:-1]]
    for name, of in lists.items():
        parts.append(f', "{name}": [')
        for start in range(0, len(items), _SLICE):
            text = json.dumps(of(items[start:start + _SLICE]))[1:-1]
            parts.append(("," if start else "") + text)
        parts.append("]")
    parts.append("}")
    return "".join(parts).encode()


_SLICE = 16384  # list items per json.dumps call (json_lists)
