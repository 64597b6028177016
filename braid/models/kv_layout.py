"""Which KV-cache rows and which block tables a model's decoder layers use.

A model whose layers all attend alike (all globally, or all in one window) keeps one block
table per request and a cache row per layer. A model that mixes global and sliding-window
layers (Gemma 3, OLMo 3, Ministral) is split into *layer groups* of equal size, as vLLM's
hybrid allocator does: group 0 (and any further global group) attends to every position,
the others in their window. Each group has its own block table per request, all drawn from
one pool of blocks, and a block holds `rows` layers' KV: layer j of whichever group owns the
block lives in cache row j. A windowed group's blocks that fall behind every query's window
go back to the pool, so its KV stays within the window while the global groups' grows with
the context. With g global layers among n, a block holds min(g, n - g) layers instead of n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from braid.config import EngineConfig
from braid.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVLayout:
    windows: tuple[int | None, ...]  # per layer group: its window (None: every position)
    layer_group: tuple[int, ...]  # per decoder layer: its group
    layer_row: tuple[int, ...]  # per decoder layer: its row of the cache
    rows: int  # cache rows (layers' KV a block holds)

    @classmethod
    def flat(cls, num_layers: int) -> KVLayout:
        """One group, a row per layer (a model whose layers all attend alike)."""
        return cls((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> KVLayout:
        """The layout for layers attending in these windows (None: globally)."""
        n = len(layer_windows)
        kinds = list(dict.fromkeys(layer_windows))  # in first-seen order
        if len(kinds) <= 1:
            return cls((kinds[0] if kinds else None,), (0,) * n, tuple(range(n)), n)
        if None in kinds:  # group 0 is a global one (the draft model and prefix hits use it)
            kinds.remove(None)
            kinds.insert(0, None)
        members = [[i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds]
        rows = min(len(m) for m in members)
        windows: list[int | None] = []
        group, row = [0] * n, [0] * n
        for kind, layers in zip(kinds, members, strict=True):
            for start in range(0, len(layers), rows):
                for j, layer in enumerate(layers[start : start + rows]):
                    group[layer], row[layer] = len(windows), j
                windows.append(kind)
        return cls(tuple(windows), tuple(group), tuple(row), rows)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether its layers keep more than one block table."""
        return len(self.windows) > 1


def kv_layout(cfg: ModelConfig, engine: EngineConfig | None = None) -> KVLayout:
    """The layout of this model's KV cache (its layers' windows); one table for all layers
    where the engine's config says --disable-hybrid-kv-cache-manager."""
    if engine is not None and engine.disable_hybrid_kv_cache_manager:
        return KVLayout.flat(cfg.num_hidden_layers)
    return KVLayout.of([cfg.layer_window(i) for i in range(cfg.num_hidden_layers)])
