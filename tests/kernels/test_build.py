"""The compiled kernels build here: a broken build must fail loudly, not fall back quietly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from braid.kernels import build_lock, quant_ops


@pytest.mark.skipif(shutil.which("c++") is None or os.environ.get("BRAID_NO_KERNELS") == "1",
                    reason="no C++ compiler (the float fallback is the expected path)")
def test_kernels_build_where_a_compiler_exists() -> None:
    ops = quant_ops()
    assert ops is not None, "the C++ kernels failed to build; see the warning in the log"
    assert ops.Isa().name in ("avx512-vnni", "avx512", "avx2", "scalar")
    flags = Path("/proc/cpuinfo").read_text().split()
    if {"avx2", "fma", "f16c"} <= set(flags):
        assert ops.Isa().avx2


def test_kernels_compile_from_copies_in_their_build_folder() -> None:
    """ninja records the paths it compiled: copies in the content-keyed build folder keep
    them the same for every checkout of the same source, so a second checkout (a CI clone)
    reuses the build instead of rebuilding it for its own paths, and back."""
    import braid.kernels

    ops = quant_ops()
    if ops is None:
        pytest.skip("no compiled kernels here")
    assert ops.__file__ is not None
    build = Path(ops.__file__).parent
    ninja = (build / "build.ninja").read_text()
    for source in braid.kernels.SOURCES:
        assert str(build / "src" / source.name) in ninja
        assert (build / "src" / source.name).read_bytes() == source.read_bytes()
    assert str(Path(braid.kernels.__file__).parent) not in ninja


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start() -> None:
    """torch's `lock` file outlives a process killed while building; the next start used to
    wait on it forever. It is found under braid's own kernel lock, so it is stale: removed."""
    ops = quant_ops()
    if ops is None:
        pytest.skip("no compiled kernels here")
    assert ops.__file__ is not None
    stale = Path(ops.__file__).parent / "lock"
    stale.touch()
    try:
        start = subprocess.run(
            [sys.executable, "-c", "from braid.kernels import quant_ops; assert quant_ops()"],
            capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a start waited on the stale build lock")
    finally:
        stale.unlink(missing_ok=True)
    assert start.returncode == 0, start.stderr[-2000:]
    assert "left by a process that stopped while building" in start.stderr


def test_the_kernel_lock_waits_for_a_live_builder_and_not_for_a_dead_one(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\n"
         f"f = open({str(tmp_path / 'flock')!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
         "print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    entered = threading.Event()

    def enter() -> None:
        with build_lock(tmp_path):
            entered.set()

    waiter = threading.Thread(target=enter, daemon=True)
    waiter.start()
    try:
        assert not entered.wait(1.0), "entered while another process held the kernel lock"
    finally:
        holder.kill()  # as a killed build: its kernel lock goes with it
        holder.wait()
    assert entered.wait(10.0), "still waiting after the holder died"
    waiter.join()
