"""ASGI middleware in front of the routes: the request body size limit (and the shutdown
deadline for bodies still arriving) and API key auth."""

from __future__ import annotations

import asyncio
import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from braid.server.errors import APIError

# Routes that need the API key (when one is set); /health, /metrics and /version stay open.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/invocations")


class BodyReads:
    """The requests waiting for more of their body. At the shutdown deadline each is answered
    503 (uvicorn would cancel it a little later: a plain-text 500 and a traceback each)."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Task[object]] = set()
        self._failed: str | None = None

    def fail_all(self, message: str) -> None:
        self._failed = message
        for task in self._waiting:
            task.cancel()

    async def receive(self, receive: Receive) -> Message:
        """`receive()`, or a 503 HTTPException once `fail_all` was called."""
        if self._failed is not None:
            raise HTTPException(503, self._failed)
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            return await receive()
        except asyncio.CancelledError:
            if self._failed is None:
                raise
            task.uncancel()  # this cancellation ends here, as the 503
            raise HTTPException(503, self._failed) from None
        finally:
            self._waiting.discard(task)


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once from Content-Length, else while it arrives
    (the route never sees more than the limit). Body reads go through `reads`."""

    def __init__(self, app: ASGIApp, max_bytes: int, reads: BodyReads) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.reads = reads

    def _error(self) -> APIError:
        return APIError(413, f"request body is larger than the server accepts "
                        f"(--max-request-bytes {self.max_bytes})", "body")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._error().response()(scope, receive, send)
            return
        received, done = 0, False

        async def limited() -> Message:
            nonlocal received, done
            if done:  # e.g. a streaming response listening for the client's disconnect
                return await receive()
            message = await self.reads.receive(receive)
            done = message["type"] != "http.request" or not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # answered by the app's HTTPException handler
                raise HTTPException(413, self._error().message)
            return message

        await self.app(scope, limited, send)


def route_path(scope: Scope) -> str:
    """The path the routes see: without --root-path where the request carries it (as
    Starlette's routing strips it), so the prefix cannot walk around a check."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):]
    return path


class ApiKeyAuth:
    """`Authorization: Bearer KEY` on the protected routes: the scheme in any case (RFC
    7235), the key compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, key = header.partition(b" ")
        key_ok = hmac.compare_digest(key.lstrip(b" "), self.key)  # whatever the scheme
        return key_ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope).startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not self._authorized(given):
                error = APIError(401, "invalid or missing API key (send Authorization: "
                                 "Bearer KEY)", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
