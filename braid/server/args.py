"""`braid serve` flags beyond the engine's (kept free of heavy imports: the CLI loads it)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from braid.config import positive_int
from braid.engine.router import ROUTER_POLICIES, RouterConfig
from braid.server.reasoning import PARSERS as REASONING_PARSERS


def _port(text: str) -> int:
    """argparse type: a TCP port (0: any free one)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _one(text: str) -> int:
    """argparse type: 1 (vLLM's parallel sizes; braid runs one model on one machine)."""
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(f"braid runs one model on one machine: must be 1, "
                                         f"got {text}")
    return 1


def _seconds(text: str) -> float:
    """argparse type: a duration in seconds, >= 0."""
    value = float(text)
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


_port.__name__, _one.__name__, _seconds.__name__ = "port", "integer", "number"  # as argparse
# names them in "invalid <name> value: 'x'"


def _not_blank(text: str) -> str:
    """argparse type: a name clients see or send (a model name, a role), not blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be blank")
    return text


def _chat_template(text: str) -> str:
    """argparse type, as vLLM's --chat-template: a Jinja file, or the template itself."""
    import jinja2

    from braid.tokenizer import compile_chat_template

    path = Path(text)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text} is not UTF-8 text ({e.reason} at byte "
                                             f"{e.start})") from None
    elif not any(c in text for c in "{}\n"):
        raise argparse.ArgumentTypeError(f"no such file, nor a Jinja template: {text!r}")
    try:
        compile_chat_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise argparse.ArgumentTypeError(f"not a valid Jinja template (line {e.lineno}: "
                                         f"{e.message})") from None
    return text


def _root_path(text: str) -> str:
    """argparse type: a URL path prefix ("" or "/a/b"; a trailing slash is dropped)."""
    if text and not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"must start with /, got {text!r}")
    return text.rstrip("/")


def _string_list(text: str) -> list[str]:
    """argparse type, as vLLM's CORS flags: a JSON list of strings."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. "
                                         f"'[\"a\", \"b\"]', got {text!r}")
    return value


def _add_replica_args(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    group = parser.add_argument_group("replicas (docs/scaling.md)")
    group.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                       help="engine replicas behind the one endpoint (vLLM's), each with its "
                            "own model and KV cache and its share of the cores")
    group.add_argument("--router-policy", choices=list(ROUTER_POLICIES), default=d.policy,
                       help="how a request picks its replica: the one holding most of its "
                            "prompt's prefix unless the loads are imbalanced (prefix_aware), "
                            "the least loaded, or in turn")
    group.add_argument("--router-cache-threshold", type=float, default=d.cache_threshold,
                       help="prefix_aware: the share of a prompt's blocks a replica must hold "
                            "to be chosen for its cache (else the least loaded)")
    group.add_argument("--router-balance-abs-threshold", type=int,
                       default=d.balance_abs_threshold,
                       help="prefix_aware: loads count as imbalanced when the busiest "
                            "replica has more than this many requests over the idlest ...")
    group.add_argument("--router-balance-rel-threshold", type=float,
                       default=d.balance_rel_threshold,
                       help="... and more than this many times as many")


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig of the flags (a ValueError naming the flag where one is invalid)."""
    return RouterConfig(args.router_policy, args.router_cache_threshold,
                        args.router_balance_abs_threshold, args.router_balance_rel_threshold)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=_port, default=8000)
    group.add_argument("--served-model-name", action="extend", nargs="+", default=None,
                       type=_not_blank,
                       help="name(s) clients use in `model`, as vLLM takes them (`--served-"
                       "model-name a b`, or the flag repeated; default: --model)")
    group.add_argument("--max-waiting-requests", type=positive_int, default=256,
                       help="engine requests allowed to wait; beyond it new requests get 503")
    group.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                       help="seconds SIGTERM waits for in-flight requests; then streams end with "
                            "an error event and other requests get 503")
    group.add_argument("--max-request-bytes", type=positive_int, default=4 * 2**20,
                       help="largest request body accepted; larger ones get 413 (default 4 MiB)")
    group.add_argument("--api-key", default=os.environ.get("BRAID_API_KEY"),
                       help="require `Authorization: Bearer KEY` on the /v1 routes, /tokenize, "
                            "/detokenize and /invocations "
                            "(default: $BRAID_API_KEY; none: open)")
    # TLS, as vLLM's flags (uvicorn's): https with the key and certificate given
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key file (PEM)")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate chain file (PEM)")
    group.add_argument("--ssl-keyfile-password",
                       default=os.environ.get("BRAID_SSL_KEYFILE_PASSWORD"),
                       help="passphrase of an encrypted --ssl-keyfile (default: "
                            "$BRAID_SSL_KEYFILE_PASSWORD)")
    group.add_argument("--ssl-ca-certs", default=None,
                       help="CA certificates file, to verify client certificates")
    group.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=0,
                       help="client certificates: 0 not asked for, 1 optional, 2 required "
                            "(Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED)")
    # CORS, as vLLM's flags and defaults: browsers on any origin may call the API
    group.add_argument("--allowed-origins", type=_string_list, default=["*"],
                       help="origins browsers may call the API from, a JSON list (default "
                            "[\"*\"]: any)")
    group.add_argument("--allowed-methods", type=_string_list, default=["*"],
                       help="HTTP methods allowed across origins, a JSON list (default any)")
    group.add_argument("--allowed-headers", type=_string_list, default=["*"],
                       help="request headers allowed across origins, a JSON list (default any)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="let cross-origin requests carry credentials (cookies, auth)")
    group.add_argument("--root-path", type=_root_path, default="",
                       help="the path prefix a path-based proxy serves braid under, e.g. "
                            "/llm (vLLM's: FastAPI's root_path); routes answer with it and "
                            "without it")
    group.add_argument("--enable-docs", action="store_true",
                       help="serve the OpenAPI schema and /docs (off by default)")
    group.add_argument("--chat-template", type=_chat_template, default=None,
                       help="chat template for /v1/chat/completions instead of the model's: "
                            "a Jinja file, or the template itself")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name tokens as \"token_id:<id>\" (vLLM's; a request's "
                            "return_tokens_as_token_ids asks for it alone)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a request's own `chat_template` (refused by default, as in "
                            "vLLM)")
    group.add_argument("--response-role", default="assistant", type=_not_blank,
                       help="the role chat replies carry after a generation prompt (vLLM's)")
    # vLLM needs these two for tool_choice "auto"; braid always parses tool calls, with the
    # parser Qwen2.5 needs, so a vLLM command line runs unchanged
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM command lines: tool_choice \"auto\" is always on")
    group.add_argument("--tool-call-parser",
                       choices=["hermes", "llama3_json", "mistral", "phi4_mini_json",
                                "pythonic"],
                       default="hermes",
                       help="accepted for vLLM command lines: braid reads these formats "
                            "whatever it says: hermes (Qwen's <tool_call> blocks), "
                            "llama3_json (Llama 3's bare JSON calls, after <|python_tag|>), "
                            "mistral ([TOOL_CALLS] and a list of calls), phi4_mini_json "
                            "(Phi-4-mini's functools[...]) and pythonic "
                            "(Llama 3.2/4's [f(a=1), g(b=\"x\")])")
    group.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                       help="split a reasoning model's <think> block from its answer into "
                            "reasoning_content (vLLM's): qwen3 (a reply that opens with "
                            "<think>) or deepseek_r1 (the template opens it in the prompt)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream carries usage, in each chunk and a last one, "
                            "whatever its stream_options (vLLM's)")
    # vLLM flags that change nothing here, accepted so vLLM command lines run unchanged
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM command lines: braid runs its own model code, "
                            "never a checkpoint's")
    group.add_argument("--enforce-eager", action="store_true",
                       help="accepted for vLLM command lines: braid captures no graphs")
    group.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="accepted for vLLM command lines and ignored: braid runs on the "
                            "CPU, and --kv-cache-gib sizes the KV cache")
    group.add_argument("--tensor-parallel-size", type=_one, default=1,
                       help="accepted for vLLM command lines: 1 (no tensor parallelism)")
    _add_replica_args(parser)
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it arrives (its prompt and sampling "
                            "parameters) and as it ends (vLLM's)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="accepted for vLLM command lines: requests are not logged unless "
                            "--enable-log-requests")
    group.add_argument("--max-log-len", type=positive_int, default=None,
                       help="with --enable-log-requests, the prompt characters and token ids "
                            "a line shows (default all)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no line per HTTP request in the log (vLLM's; on by default)")
    group.add_argument("--log-level", "--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="the server's log level (--uvicorn-log-level: vLLM's name)")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic stats lines (vLLM's; as --log-stats-interval 0)")
