"""The server tests' tiny model and server fixtures, shared with the benchmark tests."""

from __future__ import annotations

from tests.server.conftest import server, tiny_model_dir

__all__ = ["server", "tiny_model_dir"]
