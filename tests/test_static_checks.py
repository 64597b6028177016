"""ruff and mypy stay clean (pyproject.toml configures both), checked with the suite; the
command line starts without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_is_clean() -> None:
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = run("mypy", "braid")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_command_line_starts_without_torch() -> None:
    """`braid --help` and the flag checks answer at once, and Ctrl+C while torch loads (in a
    subcommand, under braid.cli.main) ends quietly with 130."""
    code = "import sys, braid.cli; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_no_function_is_longer_than_a_screen() -> None:
    """At most 60 lines a function (it reads on one screen); flat tables
    of command-line flags (`add_*_args`) are the exception."""
    import ast

    long = []
    for path in (ROOT / "braid").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                flags = node.name.startswith("add_") and node.name.endswith("_args")
                if lines > 60 and not flags:
                    long.append(f"{path.relative_to(ROOT)}: {node.name} ({lines} lines)")
    assert not long, "\n".join(long)
