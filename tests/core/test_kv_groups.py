from __future__ import annotations

from braid.core.block_manager import RELEASED
from braid.core.kv_groups import GroupedBlocks, PrefixHit


def tokens(ids: list[int]):
    return lambda start, end: ids[start:end]


def live(table: list[int]) -> int:
    return sum(b != RELEASED for b in table)


def test_a_windowed_group_holds_a_window_and_a_step_while_group_0_holds_everything() -> None:
    """Blocks of 4, a window of 8, steps of at most 4 tokens: a 40-token prompt admitted whole
    takes 10 blocks in group 0 and 4 in the windowed group; computed 4 tokens a step, the
    windowed group never holds more than a window and a step's blocks (5), group 0 all."""
    bm = GroupedBlocks(64, 4, False, (None, 8), max_span=4)
    assert bm.allocate("a", 40)
    group0, windowed = bm.block_tables("a")
    assert (len(group0), len(windowed)) == (10, 4) and bm.num_used_blocks == 14
    most = 0
    for computed in range(0, 80, 4):
        assert bm.allocate("a", computed + 4)  # this step's tokens [computed, computed + 4)
        bm.release_windows("a", computed + 4, None)  # the next query is at computed + 4
        group0, windowed = bm.block_tables("a")
        assert len(group0) == max(10, (computed + 4) // 4) and live(group0) == len(group0)
        assert len(windowed) >= (computed + 4) // 4
        most = max(most, live(windowed))
        bm.check_invariants()
    assert most <= 5
    bm.free("a")
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_an_allocation_needs_room_in_every_group_or_takes_nothing() -> None:
    bm = GroupedBlocks(12, 4, False, (None, 8, 8), max_span=4)
    assert not bm.can_allocate("a", 40)  # 10 + 4 + 4 blocks
    assert not bm.allocate("a", 40)
    assert bm.num_used_blocks == 0 and bm.block_tables("a") == [[], [], []]
    assert bm.allocate("a", 16)  # 4 + 4 + 4
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_groups_publish_the_same_tokens_under_hashes_of_their_own() -> None:
    bm = GroupedBlocks(64, 4, True, (None, 8), max_span=64)
    ids = list(range(20))
    assert bm.allocate("a", 20)
    published = bm.publish("a", tokens(ids), 20)
    assert sorted(published) == sorted(bm.block_table("a") + bm.block_tables("a")[1])
    assert bm.num_cached_blocks == 10
    bm.check_invariants()


def test_a_prefix_hit_takes_only_the_windowed_blocks_the_next_query_reads() -> None:
    """After "a" (40 tokens, window 8, blocks of 4) is gone, "b" with the same prompt shares
    9 blocks of group 0 and only the windowed blocks from position 36 - 8 + 1 on (blocks 7
    and 8); earlier ones, evicted or not, are RELEASED entries. A needed windowed block that
    is gone shortens the hit to where the window's blocks are all there."""
    bm = GroupedBlocks(64, 4, True, (None, 8), max_span=64)
    ids = list(range(40))
    assert bm.allocate("a", 40)
    bm.publish("a", tokens(ids), 40)
    bm.release_windows("a", 40, None)
    windowed_a = bm.block_tables("a")[1]
    bm.free("a")
    hit = bm.find_cached("b", tokens(ids), 39)
    assert isinstance(hit, PrefixHit) and len(hit) == 9
    group0, windowed = hit.tables
    assert group0 == list(hit) and windowed[:7] == [RELEASED] * 7 and RELEASED not in windowed[7:]
    assert bm.allocate("b", 40, hit)
    assert bm.block_tables("b")[1][:9] == windowed and live(bm.block_tables("b")[1]) == 3
    bm.check_invariants()
    bm.free("b")
    assert windowed_a[:7] == [RELEASED] * 7  # released while "a" ran: cached all the same
    hit = bm.find_cached("c", tokens(ids), 39)
    windowed_blocks = hit.tables[1]
    bm.unpublish([windowed_blocks[8]])  # block 8 of the windowed group is gone
    shorter = bm.find_cached("c", tokens(ids), 39)
    assert len(shorter) == 8 and shorter.tables[1][:6] == [RELEASED] * 6
    bm.check_invariants()


def test_freeing_a_request_frees_every_group_and_drops_its_hashes() -> None:
    bm = GroupedBlocks(64, 4, True, (None, 8, None), max_span=8)
    ids = list(range(30))
    assert bm.find_cached("a", tokens(ids), 29) == []
    assert bm.allocate("a", 30)
    bm.publish("a", tokens(ids), 30)
    assert bm.find_cached("b", tokens(ids), 29) != []  # every group holds the prefix
    bm.free("a")
    assert bm.num_used_blocks == 0 and not [k for k in bm._hashes if k[0] == "a"]
    bm.check_invariants()


def test_fresh_blocks_never_come_from_another_group_s_shared_ones() -> None:
    """Group 0 needs fresh blocks and the windowed group shares cached blocks that sit at
    the front of the free queue: the shared ones are claimed first, so no block ends up in
    two tables (each group's KV in it would overwrite the other's)."""
    bm = GroupedBlocks(8, 4, True, (None, 8), max_span=4)
    ids = list(range(20))
    assert bm.allocate("a", 16)
    bm.publish("a", tokens(ids), 16)
    bm.free("a")  # windowed blocks freed first: the free queue's front
    hit = bm.find_cached("b", tokens(ids), 19)
    assert isinstance(hit, PrefixHit) and len(hit) == 4
    assert bm.allocate("b", 20, hit)  # every block of the pool
    group0, windowed = bm.block_tables("b")
    assert not set(group0) & {b for b in windowed if b != RELEASED}
    bm.check_invariants()


def test_a_second_global_group_needs_every_block_of_the_prefix() -> None:
    bm = GroupedBlocks(64, 4, True, (None, 8, None), max_span=8)
    ids = list(range(40))
    assert bm.allocate("a", 40)
    bm.publish("a", tokens(ids), 40)
    windowed = bm.block_tables("a")[1]
    bm.release_windows("a", 40, None)  # (released blocks stay cached)
    bm.unpublish([bm.block_tables("a")[2][3]])  # the second global group's fourth block
    hit = bm.find_cached("b", tokens(ids), 39)
    assert isinstance(hit, PrefixHit) and len(hit) == 3 and len(hit.tables[2]) == 3
    assert hit.tables[1] == [RELEASED] + windowed[1:3]  # positions 4-11: the window of 12
    bm.check_invariants()
