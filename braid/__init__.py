"""braid: an LLM serving engine braiding chunked prefill with dynamic speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING

from braid.outputs import CompletionOutput, Logprob, RequestOutput
from braid.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from braid.engine.engine import LLMEngine
    from braid.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "LLMEngine", "Logprob", "RequestOutput",
           "RequestOutputKind", "SamplingParams"]


def __getattr__(name: str) -> object:
    # LLM and LLMEngine import torch (about a second): `braid --help` and the CLI's own
    # checks come first, and Ctrl+C during that import ends quietly in braid.cli.main.
    if name == "LLM":
        from braid.llm import LLM

        return LLM
    if name == "LLMEngine":
        from braid.engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'braid' has no attribute {name!r}")
