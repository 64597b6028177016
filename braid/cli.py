"""`braid` command line: generate (stream one completion to the terminal), serve (the
OpenAI-compatible HTTP server) and bench (serving benchmarks: `bench serve`, `bench sweep`)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from typing import Any

from braid.bench.args import add_bench_args
from braid.config import ConfigError, add_config_args, config_from_args
from braid.sampling_params import SamplingParams
from braid.server.args import add_server_args

DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "unset ones take the model's generation config (--generation-config, "
        "--override-generation-config), else 256 tokens, greedy")
    group.add_argument("--max-tokens", type=int, default=None, help="tokens to generate")
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace, defaults: dict[str, Any]) -> SamplingParams:
    """The flags given, over `defaults` (the engine's generation config), over 256 tokens of
    greedy decoding."""
    given = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_p",
                                                     "top_k", "min_p")
             if getattr(args, name) is not None}
    try:
        return SamplingParams(**{"max_tokens": 256, "temperature": 0.0, **defaults, **given},
                              seed=args.sampling_seed, stop=args.stop,
                              ignore_eos=args.ignore_eos)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        flag = "--sampling-seed" if name == "seed" else "--" + name.replace("_", "-")
        raise ConfigError(f"{flag}: {e}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    import jinja2

    from braid.engine.engine import LLMEngine

    if "log_stats_interval" not in vars(args):  # the periodic stats would cut into the text
        args.log_stats_interval = 0.0
    config = config_from_args(args)
    if args.raw and args.system is not None:
        raise ConfigError("--system goes into the chat template, which --raw leaves out")
    _sampling_params(args, {})  # a bad flag fails before the weights load
    # --raw completes the text exactly as given (indentation and newlines included)
    text = args.prompt if args.prompt is not None else _stdin_or(DEMO_PROMPT, strip=not args.raw)
    if not text.strip():
        raise ConfigError("the prompt is empty")
    engine = LLMEngine(config)
    params = _sampling_params(args, engine.default_sampling)
    if engine.tokenizer is None:
        raise ConfigError(f"--model {config.model}: it has no tokenizer.json; give one with "
                          "--tokenizer")
    if args.raw:
        prompt = engine.tokenizer.encode(text)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": text})
        try:
            chat = engine.tokenizer.apply_chat_template(messages)
        except jinja2.TemplateError as e:
            raise ConfigError(f"--model {config.model}: its chat template fails ({e}); "
                              "--raw completes the text without it") from None
        prompt = engine.tokenizer.encode(chat, add_special_tokens=False)
    room = (engine.config.max_model_len or 0) - len(prompt)
    if params.max_tokens is not None and 0 < room < params.max_tokens:
        logging.getLogger("braid").warning(
            "--max-tokens %d: the prompt's %d tokens leave room for %d in --max-model-len %d; "
            "the output stops there", params.max_tokens, len(prompt), room,
            engine.config.max_model_len)
    engine.add_request("cli", prompt, params)
    text = ""
    try:
        for out in engine.run_until_done():
            completion = out.outputs[0]
            new = completion.text[len(text):]
            text = completion.text
            if out.finished and not text.endswith("\n"):  # the answer ends its line
                new, text = new + "\n", text + "\n"
            sys.stdout.write(new)
            sys.stdout.flush()
            if out.finished:
                _report(out)
    finally:  # interrupted: the shell's prompt starts on a line of its own (a reader of
        # the pipe that went, `| head`, raises again here: main ends quietly)
        if text and not text.endswith("\n"):
            sys.stdout.write("\n")
            sys.stdout.flush()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from braid.server.app import run_server

    follow_parent()
    return run_server(args)


# A pid: the server exits when that process dies (set by braid.bench.server_process).
PARENT_ENV = "BRAID_EXIT_WITH_PARENT"


def follow_parent() -> None:
    """Started by braid.bench.server_process (its pid in BRAID_EXIT_WITH_PARENT): get
    SIGTERM when that process (strictly, the thread that started this one) dies, however
    it dies: Linux's PR_SET_PDEATHSIG. Elsewhere, or without the variable, nothing."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _report(out) -> None:  # noqa: ANN001 - RequestOutput
    m, c = out.metrics, out.outputs[0]
    total = (m.finish_time or 0) - m.arrival_time
    decode = (m.finish_time or 0) - (m.first_token_time or 0)
    rate = (len(c.token_ids) - 1) / decode if decode > 0 else float("nan")
    print(
        f"\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
        f"TTFT {(m.first_token_time or 0) - m.arrival_time:.2f} s, {rate:.2f} tok/s decode, "
        f"{total:.1f} s total]",
        file=sys.stderr,
    )


def _stdin_or(default: str, strip: bool = True) -> str:
    """The prompt piped in on stdin (stripped of surrounding whitespace unless not `strip`);
    `default` when stdin is a terminal (or closed)."""
    if sys.stdin is None or sys.stdin.isatty():
        return default
    data = sys.stdin.read()
    if not data.strip():
        raise ConfigError("stdin is empty: give the prompt as an argument or pipe it in")
    return data.strip() if strip else data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="braid", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt", nargs="?", help="prompt text (default: stdin, else a demo)")
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    gen.add_argument("--system", default=None, help="system message for the chat template")
    _add_sampling_args(gen)
    add_config_args(gen)
    gen.set_defaults(func=cmd_generate, command_parser=gen)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (see braid/server)")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model to serve, as `vllm serve MODEL` (same as --model)")
    add_server_args(serve)
    add_config_args(serve)
    serve.set_defaults(func=cmd_serve, command_parser=serve)
    add_bench_args(sub)
    return parser


def _dashed(arg: str) -> str:
    """--max_model_len=8 -> --max-model-len=8: flag names with underscores, as vLLM's parser
    takes them. Only a flag's name changes: a value after "=", and a value that merely starts
    with "--" (--server-args '--speculative-config {"method": "draft_model", ...}'), stay."""
    flag = _FLAG_NAME.match(arg)
    return arg if flag is None else flag[1].replace("_", "-") + arg[flag.end(1):]


_FLAG_NAME = re.compile(r"(--[A-Za-z0-9_-]+)(?:=|$)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    given = sys.argv[1:] if argv is None else argv
    args, unknown = build_parser().parse_known_args([_dashed(a) for a in given])
    if unknown:  # with the subcommand's usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command_line = ["braid", *given]
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ConfigError, ValueError) as e:
        print(f"braid: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if args.command != "generate":
            raise
        return _reader_gone()  # the reader of its pipe went (`| head`)


def _reader_gone() -> int:
    """End quietly, as Unix tools do when the reader of their output goes: nothing left to
    flush at exit (that would raise again), 128 + SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a stream without a descriptor
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
