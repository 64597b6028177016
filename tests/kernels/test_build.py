"""The compiled kernels build here: a broken build must fail loudly, not fall back quietly."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from braid.kernels import quant_ops


@pytest.mark.skipif(shutil.which("c++") is None or os.environ.get("BRAID_NO_KERNELS") == "1",
                    reason="no C++ compiler (the float fallback is the expected path)")
def test_kernels_build_where_a_compiler_exists() -> None:
    ops = quant_ops()
    assert ops is not None, "the C++ kernels failed to build; see the warning in the log"
    assert ops.isa() in ("avx2", "scalar")
    flags = Path("/proc/cpuinfo").read_text().split()
    if {"avx2", "fma", "f16c"} <= set(flags):
        assert ops.isa() == "avx2"


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
