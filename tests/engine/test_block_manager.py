from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from braid.engine.block_manager import BlockManager


def test_fresh_manager_is_empty() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage) == (8, 0, 0.0)
    assert bm.block_table("x") == []
    bm.check_invariants()


def test_allocate_grows_across_block_boundaries() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 1)
    assert len(bm.block_table("a")) == 1
    assert bm.allocate("a", 4)
    assert len(bm.block_table("a")) == 1
    assert bm.allocate("a", 5)
    assert len(bm.block_table("a")) == 2
    assert bm.allocate("a", 3)  # never shrinks
    assert len(bm.block_table("a")) == 2
    assert bm.num_used_blocks == 2 and bm.usage == pytest.approx(0.25)
    bm.check_invariants()


def test_blocks_needed_and_can_allocate() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.blocks_needed("a", 0) == 0
    assert bm.blocks_needed("a", 9) == 3
    bm.allocate("a", 6)
    assert bm.blocks_needed("a", 8) == 0
    assert bm.blocks_needed("a", 9) == 1
    assert bm.can_allocate("a", 16)
    assert not bm.can_allocate("a", 17)


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate("a", 8)
    table = bm.block_table("a")
    assert not bm.allocate("b", 8)
    assert not bm.allocate("a", 16)
    assert bm.block_table("a") == table
    assert bm.block_table("b") == []
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_free_returns_blocks_and_ignores_unknown_ids() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    bm.allocate("b", 4)
    bm.free("a")
    bm.free("a")
    bm.free("never-seen")
    assert bm.num_free_blocks == 2 and bm.block_table("a") == []
    assert len(bm.block_table("b")) == 2
    assert bm.allocate("c", 4)
    bm.check_invariants()


def test_tables_never_share_blocks() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    for rid in "abc":
        bm.allocate(rid, 4)
    blocks = [b for rid in "abc" for b in bm.block_table(rid)]
    assert sorted(blocks) == list(range(6))


def test_block_table_is_a_copy() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 2)
    bm.block_table("a").append(3)
    assert len(bm.block_table("a")) == 1
    bm.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    bm._tables["b"].append(bm._tables["a"][0])
    with pytest.raises(AssertionError, match="tables of"):
        bm.check_invariants()

    bm = BlockManager(num_blocks=4, block_size=4)
    bm._free.append(0)
    with pytest.raises(AssertionError, match="duplicates"):
        bm.check_invariants()


def test_invalid_construction() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=-1, block_size=4)


REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(6)])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / free sequences against a model of tokens per request."""

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 4
        self.bm = BlockManager(num_blocks=16, block_size=self.block_size)
        self.covered: dict[str, int] = {}  # request -> slots its table must cover

    def _model_blocks(self, rid: str) -> int:
        return math.ceil(self.covered.get(rid, 0) / self.block_size)

    @rule(rid=REQUEST_IDS, num_tokens=st.integers(0, 80))
    def allocate(self, rid: str, num_tokens: int) -> None:
        before = self.bm.block_table(rid)
        enough = self.bm.can_allocate(rid, num_tokens)
        assert self.bm.allocate(rid, num_tokens) == enough
        if enough:
            self.covered[rid] = max(self.covered.get(rid, 0), num_tokens)
            assert self.bm.block_table(rid)[: len(before)] == before
        else:
            assert self.bm.block_table(rid) == before

    @rule(rid=REQUEST_IDS, extra=st.integers(1, 10))
    def grow(self, rid: str, extra: int) -> None:
        self.allocate(rid, self.covered.get(rid, 0) + extra)

    @rule(rid=REQUEST_IDS)
    def free(self, rid: str) -> None:
        self.bm.free(rid)
        self.covered.pop(rid, None)

    @invariant()
    def matches_model(self) -> None:
        self.bm.check_invariants()
        for rid in self.covered:
            assert len(self.bm.block_table(rid)) == self._model_blocks(rid)
        used = sum(self._model_blocks(rid) for rid in self.covered)
        assert self.bm.num_used_blocks == used
        assert self.bm.num_free_blocks == self.bm.num_blocks - used


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
