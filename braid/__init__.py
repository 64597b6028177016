"""braid: an LLM serving engine braiding chunked prefill with dynamic speculative decoding."""

from __future__ import annotations

__version__ = "0.1.0"
