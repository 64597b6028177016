"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from braid.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("braid.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error a handler answers with; `param` names the request field at fault, `code`
    (OpenAI's: a string or null) the case where a client may act on it. A message quoting
    the client's text keeps what cannot be UTF-8 (a lone surrogate) as an escape, so the
    answer can always be sent."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=_TYPES.get(self.status, "api_error"), param=self.param,
            code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status,
                            headers=self.headers)


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param)


def prompt_too_long(message: str, max_model_len: int, param: str) -> APIError:
    """400 for a prompt the model cannot take, in the engine's words."""
    return bad_request(f"{message} (max_model_len {max_model_len} includes at least one "
                       "generated token)", param)


def field_of(message: str) -> str:
    """Engine and SamplingParams messages start with the field name ("max_tokens must ...")."""
    return message.split(" ", 1)[0].strip(":")


def validation_error(exc: RequestValidationError | ValidationError) -> APIError:
    """Pydantic's complaint as a 400 naming the top-level body field. Of several, where a
    field takes one of several shapes (a string or a list of parts), the complaint of the
    shape the client meant: one a validator raised (the shape fitted, a value did not),
    else the one deepest in the body (that shape got furthest)."""
    errors: list[dict[str, Any]] = [dict(e) for e in exc.errors()]
    first = max(errors, key=lambda e: (e.get("type") == "value_error", len(e.get("loc", ()))),
                default={})
    loc = _path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('msg', 'invalid JSON')}", "body")
    if not loc:
        return bad_request(f"request body: {first.get('msg', 'invalid')}", "body")
    where = ".".join(loc)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = re.sub(r" or instance of \w+$", "", message)  # a class name means nothing to them
    if str(first.get("type", "")).endswith("_type"):  # strict types: say what came instead
        message += f", got {_JSON_TYPES.get(type(first.get('input')), 'another type')}"
    return bad_request(f"{where}: {message}", loc[0])


_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object", type(None): "null"}


def _path(loc: Sequence[object]) -> list[str]:
    """Pydantic's error location as the client's field path: without "body" and without
    the labels it gives the shapes a field may take ("list[TextPart]", "NamedToolChoice",
    "function-after[_utf8(), str]"). A last part is kept (it is the field or key complained
    about, which may be a key the client made up) unless it is a validator's label; a dict
    key's own label ("[key]") goes, the key stays."""
    parts = [str(part) for part in loc if part not in ("body", "[key]")]
    if len(parts) > 1 and parts[-1].startswith("function-"):
        parts.pop()
    return [p for p in parts[:-1] if "[" not in p and not p[:1].isupper()] + parts[-1:]


def _routes(app: FastAPI) -> dict[str, str]:
    """The app's API routes: path -> its methods ("GET|POST"), for errors that say what
    there is."""
    return {r.path: "|".join(sorted((r.methods or set()) - {"HEAD"})) for r in app.routes
            if isinstance(r, APIRoute)}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = (f"Not Found: braid serves no {request.method} {request.url.path} (it "
                       f"serves {', '.join(f'{m} {p}' for p, m in _routes(app).items())})")
        elif exc.status_code == 405 and request.url.path in (routes := _routes(app)):
            message = (f"Method Not Allowed: {request.url.path} takes "
                       f"{routes[request.url.path]}, not {request.method}")
        return APIError(exc.status_code, message,
                        "body" if exc.status_code == 413 else None).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
