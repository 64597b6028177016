"""The compiled kernels, for every test of this folder (skipped where they cannot build)."""

from __future__ import annotations

from types import ModuleType

import pytest

from braid.kernels import quant_ops


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    module = quant_ops()
    if module is None:
        pytest.skip("quantized kernels unavailable (no compiler, or BRAID_NO_KERNELS=1)")
    return module


@pytest.fixture(scope="module")
def isa(ops: ModuleType) -> object:
    """Everything this CPU has (what the engine's ops get unless BRAID_KERNEL_ISA says less)."""
    return ops.Isa()
