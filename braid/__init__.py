"""braid: an LLM serving engine braiding chunked prefill with dynamic speculative decoding."""

from __future__ import annotations

from braid.llm import LLM
from braid.outputs import CompletionOutput, Logprob, RequestOutput
from braid.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
