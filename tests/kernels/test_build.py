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
