"""Builds one flat, unpadded batch per step and runs the model over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from braid.kernels import kernel_isa
from braid.models.attention import AttentionMetadata, build_attention_metadata
from braid.models.config import ModelConfig
from braid.models.interface import CausalLM
from braid.models.kv_layout import KVLayout
from braid.models.quant import huge_page_zeros


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [R] rows of the flat batch whose logits are needed
    num_prompt_rows: int = 0  # the first logits rows are prompt-logprob rows, then sampling


@dataclass(slots=True)
class QuerySpan:
    """One request's query tokens in a flat batch."""

    token_ids: list[int]
    start: int  # position of the first token (= tokens already cached)
    block_table: list[int]  # (layer group 0's: KVLayout)
    num_logits: int  # logits rows wanted for the span's last tokens (0: none)
    prompt_rows: range = range(0)  # span offsets whose logits score the next prompt token
    more_tables: tuple[list[int], ...] = ()  # a hybrid model's groups 1.. (GroupedBlocks)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, layout: KVLayout) -> int:
    """KV bytes a block slot holds (a row per layer, or per layer of a group: KVLayout)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * layout.rows * cfg.num_key_value_heads * cfg.head_dim * itemsize


class ModelRunner:
    """Owns a model and its paged KV cache ([rows, 2, slots, KVH, D]: a row per layer, or
    per layer of a layer group, KVLayout)."""

    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device,
        kv_dtype: torch.dtype | None = None, layers: range | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        """kv_dtype: the cache's element type (None: the model's activation dtype); layers:
        the decoder layers it runs and caches (a pipeline stage's; default all); layout:
        their rows and block tables (default a row each, one table: a draft model's)."""
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.layers = range(cfg.num_hidden_layers) if layers is None else layers
        self.layout = layout or KVLayout.flat(cfg.num_hidden_layers)
        self.logit_ids: int | None = None  # score only token ids below this (None: all)
        dtype = kv_dtype or model.dtype
        held = sorted({self.layout.layer_row[i] for i in self.layers})
        shape = (len(held), 2, num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_cache = (huge_page_zeros(shape, dtype) if torch.device(device).type == "cpu"
                         else torch.zeros(shape, dtype=dtype, device=device))
        model.bind_kv_cache(self.kv_cache, self.layers,
                            {i: held.index(self.layout.layer_row[i]) for i in self.layers},
                            self.layout.layer_group)
        kernel_isa()  # build or load the kernels now, not in the first request's step

    @property
    def weight_and_kv_bytes(self) -> tuple[int, int]:
        """Its model's weights and its KV cache, in bytes."""
        return self.model.weight_bytes(), self.kv_cache.nbytes

    def build_input(self, spans: list[QuerySpan]) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        prompt_indices: list[int] = []
        logits_indices: list[int] = []
        for span in spans:
            prompt_indices += (len(ids) + offset for offset in span.prompt_rows)
            ids += span.token_ids
            positions += range(span.start, span.start + len(span.token_ids))
            logits_indices += range(len(ids) - span.num_logits, len(ids))
        meta = build_attention_metadata(
            query_lens=[len(span.token_ids) for span in spans],
            context_lens=[span.start for span in spans],
            block_tables=[span.block_table for span in spans],
            block_size=self.block_size,
            device=self.device,
        )
        if self.layout.hybrid:
            bs = self.block_size
            assert all(len(t) * bs >= s.start + len(s.token_ids) for s in spans
                       for t in s.more_tables), "a layer group's block table is short"
            meta.kv_groups = meta.over_tables(
                [[span.more_tables[g - 1] for span in spans]
                 for g in range(1, self.layout.num_groups)], self.block_size)
        return ModelInput(
            input_ids=torch.tensor(ids, device=self.device),
            positions=torch.tensor(positions, device=self.device),
            attn_metadata=meta,
            logits_indices=torch.tensor(prompt_indices + logits_indices, dtype=torch.long,
                                        device=self.device),
            num_prompt_rows=len(prompt_indices),
        )

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """-> logits [R, vocab] float32 at inp.logits_indices only."""
        return self.model.compute_logits(self.hidden_rows(inp), self.logit_ids)

    @torch.inference_mode()
    def execute_greedy(self, inp: ModelInput) -> torch.Tensor:
        """-> the argmax token id [R] at inp.logits_indices (CausalLM.greedy_tokens:
        through the coarse LM head where the model has one)."""
        return self.model.greedy_tokens(self.hidden_rows(inp), self.logit_ids)

    def hidden_rows(self, inp: ModelInput) -> torch.Tensor:
        """The last layer's hidden states at inp.logits_indices [R, hidden] (a pipeline's
        runner gets them from its last stage)."""
        hidden = self.model.forward(inp.input_ids, inp.positions, inp.attn_metadata)
        return hidden[inp.logits_indices]
