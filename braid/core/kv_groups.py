"""Block tables per layer group for models that mix global and sliding-window layers
(braid/models/kv_layout.py): one pool of blocks, a table per request and group.

Group 0 attends to every position: its table is the request's `block_table` (the draft
model's KV and the scheduler's slot counts use it). A windowed group's table covers the same
positions, but its blocks behind every query's window go back after each step
(`release_windows`), and it is only ever allocated as far as the next step can reach: one
step's tokens past its window. So a long prompt, a long generation or many of them hold
global KV for every position and windowed KV for about a window each.

A prefix hit must hold in every group (their blocks chain their hashes from roots of their
own): the global groups need every block of the prefix, a windowed group only those the
first computed query's window reaches (vLLM's sliding-window hit); the blocks before them are
RELEASED entries from the start.
"""

from __future__ import annotations

from collections.abc import Sequence

from braid.core.block_manager import RELEASED, BlockManager, TableKey, Tokens


class PrefixHit(list[int]):
    """A cached prefix: group 0's blocks (what the scheduler counts), with every group's
    table for `allocate` (`tables`)."""

    def __init__(self, tables: list[list[int]]) -> None:
        super().__init__(tables[0])
        self.tables = tables


class GroupedBlocks(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 windows: Sequence[int | None], max_span: int) -> None:
        """windows: each layer group's (group 0's None); max_span: the most tokens of one
        request a step computes (the token budget)."""
        super().__init__(num_blocks, block_size, enable_caching)
        assert windows and windows[0] is None, "group 0 must attend to every position"
        self.windows = tuple(windows)
        self.max_span = max_span

    @property
    def num_tables(self) -> int:
        return len(self.windows)

    def _keys(self, request_id: TableKey) -> list[TableKey]:
        assert isinstance(request_id, str)
        return [request_id] + [(request_id, g) for g in range(1, len(self.windows))]

    def block_tables(self, request_id: str) -> list[list[int]]:
        return [self.block_table(key) for key in self._keys(request_id)]

    def _reach(self, g: int, key: TableKey, num_tokens: int, cached: Sequence[int],
               whole: bool) -> int:
        """Slots group g's table is allocated for when `num_tokens` are asked: all of them
        for a global group (or a `whole` forward); a windowed one's reach ends a window and
        a step past its first block still held."""
        window = self.windows[g]
        if window is None or whole:
            return num_tokens
        table = cached or self._tables.get(key, ())
        return min(num_tokens, _first_held(table) * self.block_size
                   + window_reach(window, self.block_size, self.max_span))

    def _plan(self, request_id: TableKey, num_tokens: int, cached: Sequence[int],
              whole: bool = False) -> list[tuple[TableKey, int, Sequence[int]]]:
        if cached and not isinstance(cached, PrefixHit):
            raise ValueError("a hybrid model's cached blocks come from its find_cached")
        tables = cached.tables if isinstance(cached, PrefixHit) else [[]] * len(self.windows)
        return [(key, self._reach(g, key, num_tokens, tables[g], whole), tables[g])
                for g, key in enumerate(self._keys(request_id))]

    def _fits(self, plan: list[tuple[TableKey, int, Sequence[int]]], reserve: int) -> bool:
        return sum(self.cost(key, n, c) for key, n, c in plan) + reserve <= len(self._free)

    def can_allocate(self, request_id: TableKey, num_tokens: int, cached: Sequence[int] = (),
                     reserve: int = 0, whole: bool = False) -> bool:
        return self._fits(self._plan(request_id, num_tokens, cached, whole), reserve)

    def allocate(self, request_id: TableKey, num_tokens: int, cached: Sequence[int] = (),
                 reserve: int = 0, whole: bool = False) -> bool:
        """Every group's table as far as it needs (all-or-nothing; see BlockManager)."""
        plan = self._plan(request_id, num_tokens, cached, whole)
        if not self._fits(plan, reserve):
            return False
        # every group's shared blocks first: fresh ones come off the free queue, where a
        # later group's shared blocks may wait
        for key, _, c in plan:
            if c:
                claimed = super().allocate(key, len(c) * self.block_size, c)
                assert claimed
        for key, n, _ in plan:
            grown = super().allocate(key, n)
            assert grown
        return True

    def free(self, request_id: TableKey) -> None:
        for key in reversed(self._keys(request_id)):  # windowed groups' blocks go first
            super().free(key)

    def release_windows(self, request_id: str, first_query: int, window: int | None) -> None:
        super().release_windows(request_id, first_query, window)
        for key, w in zip(self._keys(request_id)[1:], self.windows[1:], strict=True):
            if w is not None:
                self.release_before(key, first_query - w + 1)

    def publish(self, request_id: TableKey, tokens: Tokens, num_final_tokens: int
                ) -> list[int]:
        published = []
        for key in self._keys(request_id):
            published += super().publish(key, tokens, num_final_tokens)
        return published

    def find_cached(self, request_id: TableKey, tokens: Tokens, max_tokens: int) -> list[int]:
        """The longest prefix every group holds (a PrefixHit; [] for none): one look-up per
        block and group."""
        group0 = super().find_cached(request_id, tokens, max_tokens)  # from position 0
        n = len(group0)
        found = [[self._cached.get(h) for h in self._chain(key, tokens, n)]
                 for key in self._keys(request_id)[1:]]
        holes = [_last_holes(blocks) for blocks in found]
        for i in range(n, 0, -1):
            firsts = [self._first_needed(g, i) for g in range(1, len(self.windows))]
            if all(hole[i] < first for hole, first in zip(holes, firsts, strict=True)):
                return PrefixHit([group0[:i]] + [
                    [RELEASED] * first + [b for b in blocks[first:i] if b is not None]
                    for blocks, first in zip(found, firsts, strict=True)])
        return []

    def _first_needed(self, g: int, num_blocks: int) -> int:
        """The first of a prefix's `num_blocks` blocks group g must hold: the first query
        after the prefix reads positions from (prefix - window + 1) in a windowed group."""
        window = self.windows[g]
        if window is None:
            return 0
        return max(0, num_blocks * self.block_size - window + 1) // self.block_size


def window_reach(window: int, block_size: int, max_span: int) -> int:
    """Slots a windowed group's table covers past its first held block: that block, the
    window and one step's tokens (the memory check sizes one sequence by it too)."""
    return block_size + window + max_span


def _first_held(table: Sequence[int]) -> int:
    """The index of a table's first block still held: RELEASED entries only ever lead a
    table (release_before gives blocks back from the front), so a binary search finds it."""
    lo, hi = 0, len(table)
    while lo < hi:
        mid = (lo + hi) // 2
        if table[mid] == RELEASED:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _last_holes(blocks: list[int | None]) -> list[int]:
    """For each prefix length i (0..len): the last index before i whose block is missing
    (None), -1 where none is."""
    holes, last = [], -1
    for j, block in enumerate(blocks):
        holes.append(last)
        if block is None:
            last = j
    return holes + [last]
