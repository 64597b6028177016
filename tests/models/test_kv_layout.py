from __future__ import annotations

import pytest

from braid.models.config import gemma3_layer_types
from braid.models.kv_layout import KVLayout, kv_layout
from tests.tiny import tiny_config


def windows(types: list[str], window: int = 512) -> list[int | None]:
    return [window if t == "sliding_attention" else None for t in types]


def test_layers_that_attend_alike_keep_one_table_and_a_row_each() -> None:
    for layer_windows in ([None] * 4, [8] * 4, []):
        layout = KVLayout.of(layer_windows)
        assert not layout.hybrid and layout.rows == len(layer_windows)
        assert layout.layer_row == tuple(range(len(layer_windows)))
        assert set(layout.layer_group) <= {0}
    assert kv_layout(tiny_config("qwen2")) == KVLayout.flat(2)


@pytest.mark.parametrize("num_layers, rows, groups", [
    (18, 3, 6),  # Gemma 3 270M: 3 global, 15 windowed
    (26, 4, 7),  # Gemma 3 1B: 4 global, 22 windowed (the last group half full)
    (34, 5, 7),  # Gemma 3 4B: 5 global, 29 windowed
])
def test_mixed_layers_split_into_groups_of_equal_rows(num_layers: int, rows: int,
                                                      groups: int) -> None:
    """Global layers fill group 0 (and the next global groups), windowed layers the rest; a
    block holds `rows` layers, each layer of a group on its own row."""
    types = gemma3_layer_types(num_layers)
    layout = KVLayout.of(windows(types))
    assert layout.hybrid and (layout.rows, layout.num_groups) == (rows, groups)
    assert layout.windows[0] is None and set(layout.windows[1:]) == {512}
    places = list(zip(layout.layer_group, layout.layer_row, strict=True))
    assert len(set(places)) == num_layers and max(layout.layer_row) < rows
    for layer, t in enumerate(types):
        assert (layout.windows[layout.layer_group[layer]] is None) == (t == "full_attention")
    # the smaller kind fills whole groups: a block holds `rows` layers instead of all
    assert rows == min(types.count("full_attention"), types.count("sliding_attention"))


def test_a_model_s_layout_follows_its_layer_windows() -> None:
    cfg = tiny_config("gemma3", num_hidden_layers=6, layer_types=gemma3_layer_types(6, 3))
    layout = kv_layout(cfg)
    assert layout.windows == (None, 8, 8) and layout.rows == 2
    assert layout.layer_group == (1, 1, 0, 2, 2, 0)  # layers 2 and 5 global


def test_a_step_over_another_group_s_tables_is_the_step_built_on_them() -> None:
    """A hybrid model's further layer groups get the step's metadata by looking their slots
    up (AttentionMetadata.over_tables): the same as building it from their tables, for
    decodes, a verification window and a prefill chunk together, released entries included."""
    import torch

    from braid.models.attention import build_attention_metadata

    query_lens, context_lens, bs = [1, 4, 30, 1], [9, 21, 6, 0], 4
    group0 = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], list(range(20, 29)), [40]]
    other = [[-1, -1, 50], [-1, -1, -1, 51, 52, 53, 54], [60 + i for i in range(9)], [70]]
    meta = build_attention_metadata(query_lens, context_lens, group0, bs)
    derived, again = meta.over_tables([other, group0], bs)
    assert torch.equal(again.kv_slots, meta.kv_slots)
    built = build_attention_metadata(query_lens, context_lens, other, bs)
    assert torch.equal(derived.slot_mapping, built.slot_mapping)
    assert torch.equal(derived.kv_slots, built.kv_slots)
    assert len(derived.groups) == len(built.groups) == 2
    for d, b in zip(derived.groups, built.groups, strict=True):
        assert torch.equal(d.kv_slots, b.kv_slots) and torch.equal(d.query_index, b.query_index)
    window = derived.windowed(8)
    assert torch.equal(window.kv_slots, built.kv_slots) and window.row_start is not None
