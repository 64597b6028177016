from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from braid.core.block_manager import BlockManager, block_hash


def tokens(ids: list[int]):
    """A request's token getter (Request.token_ids) over a fixed list."""
    return lambda start, end: ids[start:end]


def cached_request(bm: BlockManager, rid: str, ids: list[int], num_final: int) -> list[int]:
    """Admit `rid` the way the scheduler does: share its cached prefix, allocate the rest,
    publish its final blocks. Returns the blocks it shared."""
    hit = bm.find_cached(rid, tokens(ids), len(ids) - 1)
    assert bm.allocate(rid, len(ids), hit)
    bm.publish(rid, tokens(ids), num_final)
    return hit


def test_block_hash_chains_the_prefix() -> None:
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4]) and a != block_hash(None, [1, 2, 3, 5])
    assert block_hash(a, [5, 6]) != block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6])


def test_requests_share_a_published_prefix() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    prompt = list(range(10))
    assert cached_request(bm, "a", prompt, 10) == []  # two full blocks published
    hit = cached_request(bm, "b", prompt[:8] + [77, 78, 79], 11)
    assert hit == bm.block_table("a")[:2] and bm.block_table("b")[:2] == hit
    assert bm.num_used_blocks == 3 + 1  # a's three, b's own third
    bm.check_invariants()
    # the last token is always computed: a prompt of exactly two blocks shares only one
    assert len(bm.find_cached("c", tokens(prompt[:8]), 7)) == 1
    assert bm.find_cached("d", tokens([5] + prompt[1:]), 9) == []  # first block differs
    bm.check_invariants()


def test_only_final_tokens_are_published() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    ids = list(range(12))
    bm.allocate("a", 12)
    assert bm.publish("a", tokens(ids), 7) == bm.block_table("a")[:1]  # 7 final: block 0
    assert bm.num_published_tokens("a") == 4
    assert len(bm.find_cached("b", tokens(ids), 11)) == 1
    bm.publish("a", tokens(ids), 12)
    assert len(bm.find_cached("c", tokens(ids), 12)) == 3


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_freed() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    first, second = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    cached_request(bm, "a", first, 4)  # blocks of a: 2 published, 1 private
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    cached_request(bm, "b", second, 4)  # takes the private block first, then one cached
    bm.free("b")
    bm.check_invariants()
    # a's prefix lost its tail block (freed first), b's is intact
    assert len(bm.find_cached("c", tokens(first), 4)) == 1
    assert len(bm.find_cached("d", tokens(second), 4)) == 2
    assert bm.num_cached_blocks == 3
    bm.check_invariants()


def test_a_shared_block_counts_against_the_pool_only_when_no_table_holds_it() -> None:
    bm = BlockManager(num_blocks=3, block_size=2, enable_caching=True)
    ids = [1, 2, 3, 4, 5]
    cached_request(bm, "a", ids, 4)
    hit = bm.find_cached("b", tokens(ids), 4)
    assert len(hit) == 2 and bm.num_free_blocks == 0
    assert not bm.allocate("b", 5, hit)  # needs one fresh block, none free
    assert bm.allocate("b", 4, hit)  # the shared blocks alone cost nothing
    bm.free("a")
    assert bm.num_free_blocks == 1  # a's private block; the shared ones are b's too
    bm.free("b")
    hit = bm.find_cached("c", tokens(ids), 4)
    assert bm.can_allocate("c", 5, hit) and not bm.can_allocate("c", 7, hit)
    bm.check_invariants()


def test_draft_validity_and_unpublish() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    ids = list(range(13))
    cached_request(bm, "a", ids, 12)
    bm.mark_draft_computed("a", 9)  # the draft computed 9 tokens: block 0 and 1 of 3
    assert bm.num_draft_cached_tokens("a") == 8
    hit = cached_request(bm, "b", ids, 12)
    assert len(hit) == 3 and bm.num_draft_cached_tokens("b") == 8
    bm.unpublish(bm.block_table("a")[1:2])  # as if that step failed
    assert bm.num_published_tokens("a") == 4 and bm.num_draft_cached_tokens("a") == 4
    assert len(bm.find_cached("c", tokens(ids), 12)) == 1
    bm.free("a")
    bm.free("b")
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_caching_off_publishes_nothing() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    ids = list(range(9))
    bm.allocate("a", 9)
    assert bm.publish("a", tokens(ids), 9) == []
    assert bm.find_cached("b", tokens(ids), 8) == []


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
    with pytest.raises(AssertionError, match="reference counts"):
        bm.check_invariants()

    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 4)
    bm._free[bm._tables["a"][0]] = None
    with pytest.raises(AssertionError, match="also free"):
        bm.check_invariants()

    bm = BlockManager(num_blocks=4, block_size=4, enable_caching=True)
    bm.allocate("a", 8)
    bm.publish("a", tokens(list(range(8))), 8)
    bm._hash[bm._tables["a"][0]] = None
    with pytest.raises(AssertionError, match="out of step"):
        bm.check_invariants()


def test_invalid_construction() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=-1, block_size=4)


REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(6)])
# a few prompt families sharing prefixes, so lookups hit, miss and hit partially
PROMPTS = [[1] * 12 + [2] * 8, [1] * 12 + [3] * 8, [1] * 4 + [4] * 16, [5] * 20]


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


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admit (find cached + allocate) / publish / grow / free / evict sequences with
    prefix caching: invariants after every rule, and every lookup returns only blocks whose
    published content equals the prefix asked for (a model of what each block holds)."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=10, block_size=4, enable_caching=True)
        self.ids: dict[str, list[int]] = {}  # admitted request -> its tokens
        self.final: dict[str, int] = {}  # tokens whose KV it computed
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the prefix it ends

    @rule(rid=REQUEST_IDS, prompt=st.sampled_from(range(len(PROMPTS))),
          cut=st.integers(2, 20))
    def admit(self, rid: str, prompt: int, cut: int) -> None:
        if rid in self.ids:
            return
        ids = PROMPTS[prompt][:cut]
        hit = self.bm.find_cached(rid, tokens(ids), len(ids) - 1)
        for i, block in enumerate(hit):
            assert self.content.get(block) == tuple(ids[: (i + 1) * 4]), "stale or foreign hit"
        enough = self.bm.can_allocate(rid, len(ids), hit)
        assert self.bm.allocate(rid, len(ids), hit) == enough
        if enough:
            self.ids[rid], self.final[rid] = ids, len(hit) * 4
            assert self.bm.block_table(rid)[: len(hit)] == hit
            self._fresh(self.bm.block_table(rid)[len(hit):])
        else:
            assert self.bm.block_table(rid) == []
            self.bm.free(rid)  # this id may come back with other tokens: forget its hashes

    def _fresh(self, blocks: list[int]) -> None:
        for block in blocks:  # new content: whatever the block held is gone
            self.content.pop(block, None)

    @rule(rid=REQUEST_IDS, extra=st.integers(1, 12))
    def compute(self, rid: str, extra: int) -> None:
        if rid not in self.ids:
            return
        ids = self.ids[rid]
        self.final[rid] = min(len(ids), self.final[rid] + extra)
        for block in self.bm.publish(rid, tokens(ids), self.final[rid]):
            i = self.bm.block_table(rid).index(block)
            self.content[block] = tuple(ids[: (i + 1) * 4])

    @rule(rid=REQUEST_IDS, extra=st.integers(1, 9))
    def grow(self, rid: str, extra: int) -> None:
        if rid in self.ids:
            before = self.bm.block_table(rid)
            if self.bm.allocate(rid, self.bm.num_slots(rid) + extra):
                assert self.bm.block_table(rid)[: len(before)] == before
                self._fresh(self.bm.block_table(rid)[len(before):])

    @rule(rid=REQUEST_IDS)
    def free(self, rid: str) -> None:
        self.bm.free(rid)
        self.ids.pop(rid, None)
        self.final.pop(rid, None)

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        for rid in self.ids:
            assert self.bm.num_published_tokens(rid) <= self.final[rid]
        held = {b for rid in self.ids for b in self.bm.block_table(rid)}
        assert self.bm.num_used_blocks == len(held)


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase


def test_release_before_gives_back_leading_blocks_once() -> None:
    """A windowed model's blocks before a position go back to the pool and their entries read
    RELEASED: the table still covers the same positions, a second call gives back only what
    the edge passed since, and freeing the request skips the released entries."""
    from braid.core.block_manager import RELEASED

    bm = BlockManager(8, 4)
    assert bm.allocate("a", 20)  # 5 blocks
    blocks = bm.block_table("a")
    assert bm.release_before("a", 9) == 2  # positions 0-7: blocks 0 and 1
    assert bm.block_table("a") == [RELEASED, RELEASED, *blocks[2:]]
    assert bm.num_free_blocks == 5 and bm.num_slots("a") == 20
    assert bm.release_before("a", 11) == 0 and bm.release_before("a", 16) == 2
    bm.check_invariants()
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_invariants()
