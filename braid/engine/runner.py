"""Builds one flat, unpadded batch per step and runs the model over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from braid.engine.block_manager import BlockManager
from braid.engine.scheduler import SchedulerOutput
from braid.models.attention import AttentionMetadata, build_attention_metadata
from braid.models.qwen2 import Qwen2ForCausalLM


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [R] rows of the flat batch whose logits are needed
    # For each scheduled request: (first logits row, number of rows); rows == 0 if not sampled.
    logits_rows: list[tuple[int, int]]


def kv_bytes_per_token(model: Qwen2ForCausalLM, dtype: torch.dtype) -> int:
    cfg = model.config
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


class ModelRunner:
    """Owns a model and its paged KV cache ([layers, 2, slots, KVH, D])."""

    def __init__(
        self, model: Qwen2ForCausalLM, num_blocks: int, block_size: int, device: torch.device
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        dtype = model.embed_tokens.weight.dtype
        self.kv_cache = torch.zeros(
            cfg.num_hidden_layers, 2, num_blocks * block_size, cfg.num_key_value_heads,
            cfg.head_dim, dtype=dtype, device=device,
        )
        model.bind_kv_cache(self.kv_cache)

    def prepare(self, sched: SchedulerOutput, blocks: BlockManager) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        logits_rows: list[tuple[int, int]] = []
        for s in sched.scheduled:
            req, c, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            ids += req.token_ids(c, c + n)
            positions += range(c, c + n)
            rows = 1 + s.num_spec_tokens if s.samples else 0
            logits_rows.append((len(logits_indices), rows))
            logits_indices += range(len(ids) - rows, len(ids))
        meta = build_attention_metadata(
            query_lens=[s.num_new_tokens for s in sched.scheduled],
            context_lens=[s.request.num_computed_tokens for s in sched.scheduled],
            block_tables=[blocks.block_table(s.request.request_id) for s in sched.scheduled],
            block_size=self.block_size,
            device=self.device,
        )
        return ModelInput(
            input_ids=torch.tensor(ids, device=self.device),
            positions=torch.tensor(positions, device=self.device),
            attn_metadata=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            logits_rows=logits_rows,
        )

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """-> logits [R, vocab] float32 at inp.logits_indices only."""
        hidden = self.model(inp.input_ids, inp.positions, inp.attn_metadata)
        return self.model.compute_logits(hidden[inp.logits_indices])
