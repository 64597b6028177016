"""The FastAPI app, its routes, and `run_server` behind `braid serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from braid.config import ConfigError, config_from_args
from braid.server.engine_loop import AsyncEngine
from braid.server.errors import install_error_handlers
from braid.server.metrics import ServerMetrics
from braid.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from braid.server.serving import ServerContext
from braid.server.serving_chat import create_chat_completion
from braid.server.serving_completion import create_completion

logger = logging.getLogger("braid.server")


def create_app(ctx: ServerContext, metrics: ServerMetrics) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        yield
        # uvicorn has drained the in-flight requests (bounded by its graceful timeout).
        await asyncio.to_thread(ctx.engine.stop)

    app = FastAPI(title="braid", lifespan=lifespan)
    install_error_handlers(app)
    _add_routes(app, ctx, metrics)
    return app


def _add_routes(app: FastAPI, ctx: ServerContext, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health() -> Response:
        ok = ctx.engine.is_alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=ctx.max_model_len)
                               for name in ctx.model_names])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, body, raw)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from braid.engine.engine import LLMEngine

    if args.max_waiting_requests < 1:
        raise ConfigError("--max-waiting-requests must be >= 1")
    config = config_from_args(args)
    engine = LLMEngine(config)
    if engine.tokenizer is None:
        raise ConfigError(f"--model {config.model}: the server needs a model with a tokenizer")
    names = args.served_model_name or [config.model]
    metrics = ServerMetrics(names[0])
    ctx = ServerContext(AsyncEngine(engine, metrics), engine.tokenizer, names,
                        config.max_model_len, args.max_waiting_requests)
    server = uvicorn.Server(uvicorn.Config(
        create_app(ctx, metrics), host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout, access_log=False))
    # After a graceful stop uvicorn re-raises the signal it caught; a no-op handler turns
    # that into a clean exit 0 instead of death by SIGTERM.
    signal.signal(signal.SIGTERM, _ignore)
    server.run()
    return 0 if server.started else 1


def _ignore(signum: int, frame: Any) -> None:
    pass
