"""The FastAPI app, its routes, and `run_server` behind `braid serve`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from braid import __version__, heap
from braid.config import ConfigError, EngineConfig, config_from_args
from braid.core.stats import GrammarStats
from braid.engine.bootstrap import check_before_loading
from braid.engine.process import EngineInfo, EngineProcess
from braid.engine.router import RouterConfig, make_router
from braid.sampling_params import is_int
from braid.server.args import router_config
from braid.server.bodies import (
    json_lists,
    json_response,
    off_loop,
    parse_body,
    read_json,
    validate,
)
from braid.server.engine_loop import AsyncEngine, ShuttingDown
from braid.server.errors import bad_request, install_error_handlers, validation_error
from braid.server.metrics import ServerMetrics
from braid.server.middleware import ApiKeyAuth, BodyReads, BodySizeLimit
from braid.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from braid.server.replicas import Replicas, StartEngine, engine_starter, start_engines
from braid.server.serving import ServerContext, check_fan_out, check_model
from braid.server.serving_chat import (
    check_template_fields,
    create_chat_completion,
    render_chat,
)
from braid.server.serving_completion import create_completion, num_prompts
from braid.structured.manager import StructuredOutputManager
from braid.tokenizer import Tokenizer

logger = logging.getLogger("braid.server")
GIL_SWITCH_S = 0.0005


@dataclass(frozen=True)
class AppOptions:
    max_request_bytes: int = 4 * 2**20
    api_key: str | None = None
    enable_docs: bool = False
    # CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # --root-path


def create_app(ctx: ServerContext, metrics: ServerMetrics,
               options: AppOptions = AppOptions()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        yield
        # uvicorn has drained the in-flight requests (bounded by its graceful timeout).
        await asyncio.to_thread(ctx.engine.stop)

    on = options.enable_docs
    app = FastAPI(title="braid", version=__version__, lifespan=lifespan,
                  docs_url="/docs" if on else None, redoc_url="/redoc" if on else None,
                  openapi_url="/openapi.json" if on else None, root_path=options.root_path)
    install_error_handlers(app)
    _add_routes(app, ctx, metrics)
    _add_token_routes(app, ctx)
    if options.api_key:
        app.add_middleware(ApiKeyAuth, api_key=options.api_key)
    app.state.body_reads = BodyReads()
    app.add_middleware(BodySizeLimit, max_bytes=options.max_request_bytes,
                       reads=app.state.body_reads)
    # outermost: preflights are answered before the key is asked for, and every answer,
    # errors included, carries the headers a browser needs to read it
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods),
                       allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)
    return app


def _add_routes(app: FastAPI, ctx: ServerContext, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health() -> Response:
        ok = ctx.engine.is_alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"},
                            status_code=200 if ok else 503)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=ctx.root, max_model_len=ctx.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in ctx.model_names])

    # OpenAI's client.models.retrieve; a served name may hold slashes (a model's path)
    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> ModelCard:
        return card(check_model(ctx, name))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # Bodies are read by hand (bodies.py): a large one is parsed off the event loop.
    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        data, size = await read_json(raw)
        if isinstance(data, dict):  # counted before validation, which grows with them
            check_fan_out(ctx, num_prompts(data.get("prompt", "")),
                          data["n"] if is_int(data.get("n")) else 1)
        body = await off_loop(size, validate, CompletionRequest, data)
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        body = await parse_body(raw, ChatCompletionRequest)
        return await create_chat_completion(ctx, body, raw)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    # SageMaker's routes, as vLLM serves them: /ping is /health, /invocations a chat
    # completion where the body has messages and a completion where it has a prompt
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.post("/invocations")
    async def invocations(raw: Request) -> Response:
        fields, size = await read_json(raw)
        if not isinstance(fields, dict) or ("messages" not in fields and "prompt" not in fields):
            raise bad_request("body: expected a chat completion request (with messages) or a "
                              "completion request (with prompt)", "body")
        body = await off_loop(size, _by_messages, fields, ChatCompletionRequest,
                              CompletionRequest)
        if isinstance(body, ChatCompletionRequest):
            return await create_chat_completion(ctx, body, raw)
        return await create_completion(ctx, body, raw)


def _by_messages(fields: dict[str, Any], chat: type[BaseModel], other: type[BaseModel]
                 ) -> Any:
    """`fields` validated as the chat form where they have messages, else as `other` (a
    union body would name the model class in its errors); a 400 naming the field."""
    try:
        return (chat if "messages" in fields else other).model_validate(fields)
    except ValidationError as e:
        raise validation_error(e) from None


def _add_token_routes(app: FastAPI, ctx: ServerContext) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize."""

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        fields, size = await read_json(raw)
        if not isinstance(fields, dict):
            raise bad_request("request body: a JSON object is required", "body")
        body = await off_loop(size, _by_messages, fields, TokenizeChatRequest,
                              TokenizeCompletionRequest)
        check_model(ctx, body.model)
        if isinstance(body, TokenizeChatRequest):
            check_template_fields(body, ctx.trust_request_chat_template)
        # tokenized, and the answer written, in a thread: both grow with the text
        return await asyncio.to_thread(_tokenized, ctx, body)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        body = await parse_body(raw, DetokenizeRequest)
        check_model(ctx, body.model)
        return await asyncio.to_thread(_detokenized, ctx, body)


def _tokenized(ctx: ServerContext, body: TokenizeChatRequest | TokenizeCompletionRequest
               ) -> Response:
    """vLLM's TokenizeResponse, written in slices (json_lists): the answer to a 4 MB text
    is millions of ids and strings."""
    if isinstance(body, TokenizeChatRequest):
        tokens = render_chat(ctx.tokenizer, body)
    else:
        tokens = ctx.tokenizer.encode(body.prompt, body.add_special_tokens)
    head: dict[str, Any] = {"count": len(tokens), "max_model_len": ctx.max_model_len}
    lists: dict[str, Callable[[list[int]], list[Any]]] = {"tokens": lambda ids: ids}
    if body.return_token_strs:
        lists["token_strs"] = ctx.tokenizer.convert_ids_to_tokens
    else:
        head["token_strs"] = None
    return Response(json_lists(head, tokens, lists), media_type="application/json")


def _detokenized(ctx: ServerContext, body: DetokenizeRequest) -> Response:
    vocab = ctx.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"tokens must be token ids in [0, {vocab})", "tokens")
    # special tokens kept, as vLLM's (and transformers' decode) do: the text is the prompt
    return json_response(DetokenizeResponse(prompt=ctx.tokenizer.decode(
        body.tokens, skip_special_tokens=False)))


def run_server(args: argparse.Namespace) -> int:
    _set_up_process()
    config = config_from_args(args)
    _check_tls(args)
    if args.enable_log_requests and args.disable_log_requests:
        raise ConfigError("--enable-log-requests and --disable-log-requests contradict each "
                          "other; give one")
    sock = _bind(args.host, args.port)  # before the load: a busy port fails in a second
    tokenizer = _served_tokenizer(config, args.chat_template)
    routing = router_config(args)
    start = engine_starter(config, args.data_parallel_size)
    engines = start_engines(start, args.data_parallel_size)  # each loads the models
    try:
        return _serve(args, sock, engines, _Replicating(start, routing), tokenizer)
    finally:
        for engine in engines:
            engine.shutdown()


@dataclass(frozen=True)
class _Replicating:
    """How replicas are started again and requests routed among them."""

    start: StartEngine
    routing: RouterConfig


def _serve(args: argparse.Namespace, sock: socket.socket, engines: list[EngineProcess],
           replicating: _Replicating, tokenizer: Tokenizer) -> int:
    info = engines[0].info
    config = info.config
    names = list(dict.fromkeys(args.served_model_name or [config.model]))  # each name once
    metrics = ServerMetrics(names[0], cache_config={
        "block_size": config.block_size,
        "cache_dtype": info.kv_cache_dtype,
        "num_gpu_blocks": info.num_kv_blocks,  # vLLM's name for the cache's blocks
        "enable_prefix_caching": config.enable_prefix_caching,
        "kv_cache_gib": f"{info.kv_cache_bytes / 2**30:.4g}"},  # the target's, as allocated
        replica=None if _one_engine(engines) else 0)
    ctx = _context(args, _front(args, engines, replicating, metrics), info, tokenizer, names)
    app = create_app(ctx, metrics, AppOptions(
        args.max_request_bytes, args.api_key, args.enable_docs, tuple(args.allowed_origins),
        tuple(args.allowed_methods), tuple(args.allowed_headers), args.allow_credentials,
        args.root_path))
    server = _Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE_S,
        access_log=not args.disable_uvicorn_access_log, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, ssl_keyfile_password=args.ssl_keyfile_password,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs),
        ctx.engine, app.state.body_reads, args.shutdown_timeout)
    # After a graceful stop uvicorn re-raises the signal it caught; a no-op handler turns
    # that into a clean exit 0 instead of death by SIGTERM.
    signal.signal(signal.SIGTERM, _ignore)
    # uvicorn names the address only for sockets it binds itself
    host, port = sock.getsockname()[:2]
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)",
        "https" if args.ssl_certfile else "http", f"[{host}]" if ":" in host else host, port)
    try:
        server.run(sockets=[sock])
    finally:
        if isinstance(ctx.engine, Replicas):
            ctx.engine.shutdown()  # the replicas' engines now, restarted ones included
        if config.distributed_executor_backend == "ray":
            from braid.worker.cluster import leave_cluster

            leave_cluster()
    return 0 if server.started else 1


def _one_engine(engines: list[EngineProcess]) -> bool:
    """One local engine, served as it always was (no replicas' routing, restarts, labels)."""
    return len(engines) == 1 and engines[0].info.config.distributed_executor_backend == "mp"


def _front(args: argparse.Namespace, engines: list[EngineProcess], replicating: _Replicating,
           metrics: ServerMetrics) -> AsyncEngine | Replicas:
    """What the server sends requests to: the one engine's loop, or the replicas'."""
    if _one_engine(engines):
        return AsyncEngine(engines[0], metrics, args.enable_log_requests)
    info = engines[0].info
    router = make_router(replicating.routing, len(engines), info.config.block_size,
                         info.num_kv_blocks)
    return Replicas(engines, router, metrics, replicating.start, args.enable_log_requests)


def _set_up_process() -> None:
    """Process-wide settings, before any thread starts."""
    heap.limit_arenas()  # heap.py
    # The engine thread shares the GIL with the event loop and the worker threads that
    # parse, validate and write large requests: asked for it, it waits at most this long
    # for pure-Python work to let go (the default, 5 ms, is a decode step of a small model)
    sys.setswitchinterval(GIL_SWITCH_S)


def _served_tokenizer(config: EngineConfig, chat_template: str | None) -> Tokenizer:
    """The tokenizer and chat template requests are read with (the model's, --tokenizer's,
    --chat-template's), after the checks that need only config.json files."""
    checked = check_before_loading(config)
    tokenizer = checked.tokenizer
    if tokenizer is None and (checked.folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(checked.folder)
    if tokenizer is None:
        raise ConfigError(f"--model {config.model}: the server needs a model with a tokenizer "
                          "(tokenizer.json), or one given with --tokenizer")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    elif tokenizer.chat_template:
        warn_of_a_broken_chat_template(tokenizer.chat_template, config.model)
    return tokenizer


def _context(args: argparse.Namespace, engine: AsyncEngine | Replicas, info: EngineInfo,
             tokenizer: Tokenizer, names: list[str]) -> ServerContext:
    config = info.config
    assert config.max_model_len is not None
    # the server's own grammar engine: requests' grammars are checked here, off the engine
    grammars = StructuredOutputManager(tokenizer, info.vocab_size, info.eos_token_ids,
                                       GrammarStats())
    grammars.warm_up()  # its tokenizer view, before any request
    return ServerContext(engine, tokenizer, names,
                         config.max_model_len, args.max_waiting_requests,
                         trust_request_chat_template=args.trust_request_chat_template,
                         default_sampling=info.default_sampling,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         root=config.model, max_logprobs=info.max_logprobs,
                         vocab_size=info.vocab_size,
                         response_role=args.response_role,
                         reasoning_parser=args.reasoning_parser,
                         max_tokens_cap=info.max_tokens_cap,
                         force_include_usage=args.enable_force_include_usage,
                         log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                         grammars=grammars)


def _check_tls(args: argparse.Namespace) -> None:
    """The TLS flags as uvicorn will use them, before the load: a ConfigError naming the
    flags where the files cannot be read or do not match."""
    if not (args.ssl_keyfile or args.ssl_certfile or args.ssl_ca_certs):
        if args.ssl_cert_reqs:
            raise ConfigError(f"--ssl-cert-reqs {args.ssl_cert_reqs} asks clients for "
                              "certificates, which needs TLS: --ssl-keyfile, --ssl-certfile "
                              "and --ssl-ca-certs")
        return
    if not (args.ssl_keyfile and args.ssl_certfile):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together (--ssl-ca-certs needs "
                          "them too)")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ConfigError(f"--ssl-cert-reqs {args.ssl_cert_reqs} needs --ssl-ca-certs (the "
                          "CAs that sign the client certificates): without it no client "
                          "certificate can be verified")

    asked = []  # whether the key is encrypted (its passphrase was asked for)

    def password() -> str:  # never a prompt here: uvicorn would prompt a second time
        asked.append(True)
        if args.ssl_keyfile_password is None:
            raise ConfigError(f"--ssl-keyfile {args.ssl_keyfile} is encrypted: give its "
                              "passphrase with --ssl-keyfile-password or "
                              "$BRAID_SSL_KEYFILE_PASSWORD")
        return str(args.ssl_keyfile_password)

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password)
    except ConfigError:
        raise
    except ValueError as e:  # Python's own limit on a passphrase
        raise ConfigError(f"--ssl-keyfile-password: {e}") from None
    except (OSError, ssl.SSLError) as e:
        if asked and isinstance(e, ssl.SSLError) and "mismatch" not in str(e):
            # the certificate loaded and the key was encrypted: OpenSSL says "PEM lib" or
            # "bad decrypt" for a wrong passphrase (a key that does not match: "mismatch")
            raise ConfigError(f"--ssl-keyfile {args.ssl_keyfile}: cannot decrypt it with "
                              "--ssl-keyfile-password (wrong passphrase?)") from None
        raise ConfigError(f"--ssl-certfile {args.ssl_certfile} --ssl-keyfile "
                          f"{args.ssl_keyfile}: {e.strerror or e}") from None
    if args.ssl_ca_certs:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"--ssl-ca-certs {args.ssl_ca_certs}: {e.strerror or e}") from None
        if not args.ssl_cert_reqs:
            logger.warning("--ssl-ca-certs without --ssl-cert-reqs 1 or 2: client "
                           "certificates are not asked for")


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to the address the server will listen on, as uvicorn binds it (IPv6
    for a host with a colon, else IPv4); it listens once started, so a client that comes
    earlier is refused, not kept waiting. A ConfigError naming the flags where the host does
    not resolve or the port is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:  # socket.gaierror included
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there "
                          f"({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


def _ignore(signum: int, frame: Any) -> None:
    pass


SHUTDOWN_GRACE_S = 3.0  # after failing the stragglers, time for their last bytes to go out
TLS_GOODBYE_S = 0.5  # how long a closed TLS connection may wait for the client's goodbye
FORCE_QUIT_S = 1.0  # how long a force quit lets the failed requests send their last words


class _Server(uvicorn.Server):
    """uvicorn's graceful shutdown, plus a deadline: requests still in flight after
    `--shutdown-timeout` are failed by the engine loop (streams end with an error event and
    [DONE], other requests get 503) instead of being cut mid-response, and requests whose
    body is still arriving get 503. A force quit (Ctrl+C during the drain) fails them the
    same way at once and gives them a moment to say so, where uvicorn alone cancels them
    mid-response with a traceback each."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine | Replicas, reads: BodyReads,
                 deadline_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.reads = reads
        self.deadline_s = deadline_s
        self._loop: asyncio.AbstractEventLoop | None = None

    def _fail_all(self, message: str) -> None:
        self.engine.fail_all(ShuttingDown(message))
        self.reads.fail_all(message)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = self._loop = asyncio.get_running_loop()
        timer = loop.call_later(
            self.deadline_s, self._fail_all,
            f"server shutting down (--shutdown-timeout {self.deadline_s:g} s)")
        goodbyes = loop.create_task(self._end_tls_goodbyes()) if self.config.is_ssl else None
        try:
            await super().shutdown(sockets)
            if self.force_exit:
                await self._last_words()
        finally:
            timer.cancel()
            if goodbyes is not None:
                goodbyes.cancel()

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit:  # a second signal, during shutdown
            self.engine.fail_all(ShuttingDown("server force quit"))  # thread-safe
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.reads.fail_all, "server force quit")

    async def _last_words(self) -> None:
        """The requests failed by a force quit finish their responses, then the engine stops
        (each up to FORCE_QUIT_S); what is left is cancelled by uvicorn."""
        loop = asyncio.get_running_loop()
        end = loop.time() + FORCE_QUIT_S
        while self.server_state.tasks and loop.time() < end:
            await asyncio.sleep(0.05)
        with contextlib.suppress(TimeoutError):  # uvicorn skips the lifespan's end
            await asyncio.wait_for(self.lifespan.shutdown(), FORCE_QUIT_S)

    async def _end_tls_goodbyes(self) -> None:
        """A TLS connection the shutdown closed waits for the client's close_notify (asyncio:
        up to 30 s), which an idle keep-alive client never sends, and the shutdown waits for
        the connection: once such a connection has nothing left to send, it is dropped."""
        while True:
            await asyncio.sleep(TLS_GOODBYE_S)
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                if (transport is not None and transport.is_closing()
                        and transport.get_write_buffer_size() == 0):
                    transport.abort()


def warn_of_a_broken_chat_template(template: str, model: str) -> None:
    """The model's own chat template, checked at start: a broken one is a warning (the
    completions API still works), and each chat request a 500 that says so."""
    import jinja2

    from braid.tokenizer import compile_chat_template

    try:
        compile_chat_template(template)
    except jinja2.TemplateSyntaxError as e:
        logger.warning("%s: its chat template does not compile (line %s: %s); chat requests "
                       "will fail: give one with --chat-template", model, e.lineno, e.message)
