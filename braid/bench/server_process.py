"""A `braid serve` subprocess on 127.0.0.1 (a free port), its log in a file, stopped with
SIGTERM: what the sweep benchmarks and what the server tests run against. The server also
exits when the process that started it dies (a test run killed for memory left servers
running)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from braid.cli import PARENT_ENV

START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_serve_flags(flags: Sequence[str], option: str, model: str | None = None) -> None:
    """Raise ValueError, naming `option` (the benchmark's flag that carried them), if `braid
    serve` would refuse these flags: parsed by its own parser, checked as its EngineConfig and
    against the models' config.json files as the engine checks them before loading weights
    (`check_before_loading`: e.g. a --max-model-len beyond the model's), with `--model
    model` where given (not quoted in the message). A benchmark checks them before it starts
    anything, instead of reporting a server that exited after its start."""
    from braid.cli import build_parser
    from braid.config import config_from_args
    from braid.engine.bootstrap import check_before_loading, sampling_defaults

    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            model_flags = [] if model is None else ["--model", model]
            args = build_parser().parse_args(["serve", *model_flags, *flags])
        config = config_from_args(args)
        sampling_defaults(config, check_before_loading(config).folder)
    except SystemExit:
        message = usage.getvalue().strip().splitlines()[-1:] or ["not accepted"]
        raise ValueError(f"{option}{_quoted(flags)}: {message[0]}") from None
    except ValueError as e:
        raise ValueError(f"{option}{_quoted(flags)}: {e}") from None


def _quoted(flags: Sequence[str]) -> str:
    return f" {' '.join(flags)!r}" if flags else ''


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; elsewhere none)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # stat's ppid
                found.append(int(stat.parent.name))
    return found


class ServerProcess:
    """`python -m braid.cli serve ...` with its log in a file; stopped with SIGTERM."""

    def __init__(self, model: Path | str, log_dir: Path, *extra: str,
                 timeout_s: float = START_TIMEOUT_S) -> None:
        self.model = str(model)
        self.port = free_port()
        # with --ssl-certfile: https, that certificate trusted (a self-signed one is its CA)
        flags = list(extra)
        cert = flags[flags.index("--ssl-certfile") + 1] if "--ssl-certfile" in flags else None
        self.verify: ssl.SSLContext | bool = \
            True if cert is None else ssl.create_default_context(cafile=cert)
        self.url = f"{'http' if cert is None else 'https'}://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "braid.cli", "serve", "--model", self.model,
               "--port", str(self.port), "--log-stats-interval", "0", *extra]
        # The server exits when this process dies, however it dies (braid.cli.follow_parent).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy(timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0,
                             verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
