"""Compiled CPU kernels: C++ built with torch.utils.cpp_extension on first use, cached per
source, torch version, CPU kind and Python environment; None (with one warning) where no
compiler works, and the callers fall back to plain torch."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from braid.files import cache_root

logger = logging.getLogger("braid")

SOURCES = [Path(__file__).with_name(name)
           for name in ("quant.cpp", "panels.cpp", "attention.cpp", "norm.cpp", "layer.cpp")]
HEADERS = [Path(__file__).with_name(name)
           for name in ("formats.h", "ops.h", "vexp.h", "isa.h")]
ISAS = ("avx512-vnni", "avx512", "avx2", "scalar")


def _build_dir(digest: str) -> Path:
    """Where this source's build lives: $BRAID_KERNEL_DIR, else the cache's kernels folder."""
    root = os.environ.get("BRAID_KERNEL_DIR") or cache_root() / "kernels"
    return Path(root).expanduser() / f"quant-{digest}"


def _find_ninja() -> None:
    """torch runs `ninja` from PATH; the `ninja` package installs it beside this Python, which
    is not on PATH when the venv is not activated."""
    here = Path(sys.executable).parent
    if shutil.which("ninja") is None and (here / "ninja").is_file():
        os.environ["PATH"] = os.pathsep.join([str(here), os.environ.get("PATH", "")])


@functools.cache
def quant_ops() -> ModuleType | None:
    """The extension (quantized matmuls in quant.cpp, batch-invariant attention in
    attention.cpp, RMSNorm and rotary in norm.cpp, a whole quantized decoder layer in
    layer.cpp), or None if it cannot be built here.
    BRAID_NO_KERNELS=1 turns it off (the plain-torch fallback)."""
    if os.environ.get("BRAID_NO_KERNELS") == "1":
        logger.info("quantized kernels off (BRAID_NO_KERNELS=1)")
        return None
    from torch.utils import cpp_extension

    _find_ninja()

    key = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    # the environment too: ninja records the compile command, and another venv's include
    # paths in it would make two environments sharing one build rebuild it in turn
    key += torch.__version__.encode() + platform.machine().encode() + sys.prefix.encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    build = _build_dir(digest)
    try:  # a folder that cannot be made or written falls back too (a read-only home)
        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            logger.info("building the CPU kernels (once, ~1 min) in %s", build)
        with build_lock(build):
            module = cpp_extension.load(
                name=f"braid_kernels_{digest}", sources=_copied_sources(build),
                build_directory=str(build),
                extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build: fall back, loudly
        module = _finished_build(build, digest, e)
        if module is None:
            logger.warning("quantized CPU kernels unavailable (%s: %s); GGUF weights are "
                           "dequantized to float instead", type(e).__name__, str(e)[:300])
            return None
    return module


def _finished_build(build: Path, digest: str, error: Exception) -> ModuleType | None:
    """The extension a finished build left in `build`, imported as it is (no lock, no ninja),
    or None: a kernel folder that cannot be written (a read-only image or mount that ships
    the built kernels) still serves them. `error`: why the usual build-and-load failed."""
    name = f"braid_kernels_{digest}"
    built = build / f"{name}.so"
    if not built.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, built)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:
        return None
    logger.info("CPU kernels loaded as built from %s (building there failed: %s: %s)", build,
                type(error).__name__, str(error)[:200])
    return module


@contextlib.contextmanager
def build_lock(build: Path) -> Iterator[None]:
    """Hold the build folder for one process at a time, by a kernel lock (flock) that dies
    with its process. torch's own `lock` file does not: a process killed while building (a
    server stopped during its first start) leaves it behind, and every later start would wait
    on it forever. Inside this lock no other process can be building, so a `lock` file found
    here was left by a dead one and is removed."""
    with open(build / "flock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is building the CPU kernels in %s",
                        build)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a process that stopped while building", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _copied_sources(build: Path) -> list[str]:
    """The sources, as copies in the build folder, which is keyed by their content: ninja
    records the paths it compiled, so two checkouts of the same source (a CI clone beside a
    working tree) compiling from their own paths would rebuild (~1 min) each time the other
    had built. Copies are written once, atomically, so their mtimes never move."""
    folder = build / "src"
    folder.mkdir(exist_ok=True)
    for path in SOURCES + HEADERS:
        copy = folder / path.name
        if not copy.is_file():
            tmp = copy.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(path.read_bytes())
            os.replace(tmp, copy)
    return [str(folder / p.name) for p in SOURCES]


@functools.cache
def kernel_isa() -> Any:
    """The instruction sets every op is given (an `ops.Isa`), chosen once: all this CPU has,
    or those BRAID_KERNEL_ISA names: avx512-vnni (weights in panels of 16 interleaved rows),
    avx512 (rows on AVX2, AVX512 activations and attention), avx2 (row by row), scalar
    (portable). None without the kernels."""
    wanted = os.environ.get("BRAID_KERNEL_ISA", "auto")
    if wanted not in ("auto", *ISAS):
        raise ValueError(f"BRAID_KERNEL_ISA={wanted!r}: expected auto or one of {ISAS}")
    ops = quant_ops()
    if ops is None:
        return None
    isa = ops.Isa(wanted)
    if wanted not in ("auto", isa.name):
        logger.warning("BRAID_KERNEL_ISA=%s: this CPU lacks it, using %s", wanted, isa.name)
    logger.info("quantized CPU kernels: %s, int8-quantized activations", isa.name)
    return isa
