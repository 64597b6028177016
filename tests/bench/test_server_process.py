"""ServerProcess: a real `braid serve` that does not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server.conftest import ENGINE_FLAGS

PARENT = """
import sys, time
from pathlib import Path
from braid.bench.server_process import ServerProcess
server = ServerProcess(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) counts as gone.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_server_exits_when_its_starter_is_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model_dir), str(tmp_path),
                               *ENGINE_FLAGS], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        server_pid = int(parent.stdout.readline())
        assert alive(server_pid)
    finally:
        parent.send_signal(signal.SIGKILL)  # no cleanup code of its own runs
        parent.wait()
    deadline = time.monotonic() + 30
    while alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(server_pid), "the server outlived the process that started it"
