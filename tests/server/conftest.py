"""A real `braid serve` subprocess on 127.0.0.1 (random free port) over a tiny random model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from braid.bench.server_process import START_TIMEOUT_S, ServerProcess, child_pids, free_port
from tests.tiny import save_tiny_model

__all__ = ["ENGINE_FLAGS", "ENGINE_OPTIONS", "START_TIMEOUT_S", "ServerProcess", "free_port"]

ENGINE_FLAGS = ["--num-kv-blocks", "256", "--block-size", "4", "--max-model-len", "256"]
ENGINE_OPTIONS = {"num_kv_blocks": 256, "block_size": 4, "max_model_len": 256}


def tls_flags(folder: Path) -> list[str]:
    """--ssl-keyfile / --ssl-certfile of a self-signed certificate for 127.0.0.1 made in
    `folder` with the openssl command (the test is skipped without one)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("server-log"), *ENGINE_FLAGS)
    yield proc
    assert proc.stop() == 0, proc.log()


def engine_pid(server: ServerProcess) -> int:
    """The engine's process: the server's child that holds the model (the other child is
    multiprocessing's resource tracker)."""
    for pid in child_pids(server.proc.pid):
        if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
            return pid
    raise AssertionError("no engine process")
