"""What the layers above need of a model, whatever its family: the runner calls `forward` over
one flat paged batch and scores rows with `compute_logits` / `greedy_tokens`; the loader
hands it weights by their Hugging Face names. Qwen2 and Llama (qwen2.py) are the first
implementation; each family added ([M14]) implements the same calls."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import torch
from gguf import GGMLQuantizationType

from braid.models.attention import AttentionMetadata
from braid.models.config import ModelConfig
from braid.models.quant import QuantWeight


class CausalLM(Protocol):
    config: ModelConfig
    quant_type: GGMLQuantizationType | None  # its decoder layers' format (None: float)

    @property
    def dtype(self) -> torch.dtype:
        """Activations' (and the KV cache's) dtype."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (before the final norm);
        every layer writes the batch's KV into the bound cache before attention reads it."""

    def compute_logits(self, hidden: torch.Tensor, num_ids: int | None = None) -> torch.Tensor:
        """Rows of hidden states -> logits [R, V] (only the first `num_ids` token ids)."""

    def greedy_tokens(self, hidden: torch.Tensor, num_ids: int | None = None) -> torch.Tensor:
        """Rows of hidden states -> their argmax token ids [R]."""

    def add_coarse_head(self) -> bool:
        """Set up a cheaper two-stage LM head for greedy_tokens; False where it has none."""

    def bind_kv_cache(self, kv_cache: torch.Tensor, layers: range | None = None,
                      rows: Mapping[int, int] | None = None,
                      kv_groups: Sequence[int] | None = None) -> None:
        """Attend over this paged cache [rows, 2, slots, KV heads, head dim] (`layers`: the
        decoder layers it holds, a pipeline stage's, default all; `rows`: each one's row,
        default its place; `kv_groups`: each layer's group of block tables, KVLayout)."""

    def forward_layers(self, x: torch.Tensor, positions: torch.Tensor,
                       attn_metadata: AttentionMetadata, layers: range) -> torch.Tensor:
        """Hidden states [T, hidden] through the decoder layers `layers`."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the first layer's input [T, hidden]."""

    def keep_layers(self, layers: range, ends: bool = True) -> None:
        """Free the decoder layers outside `layers` (a pipeline stage's), and without `ends`
        the embedding and LM head (a later stage's)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
        """Weights by their Hugging Face names; a missing or unknown one is an error."""

    def weight_bytes(self) -> int:
        """Bytes its weights hold (the memory check)."""
