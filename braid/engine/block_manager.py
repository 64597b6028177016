"""Paged KV-cache block manager: a free list and one block table per request.

Block ``b`` holds the KV of cache slots ``[b * block_size, (b + 1) * block_size)``; token
position ``pos`` of a request lives in slot
``table[pos // block_size] * block_size + pos % block_size``.

No prefix caching yet. Each used block carries a ref count (always 1 today) so that sharing
blocks between requests can be added later without changing the public API.
"""

from __future__ import annotations

from collections import deque

import numpy as np


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids in position order (empty if unknown)."""
        return list(self._tables.get(request_id, ()))

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's table covers."""
        return len(self._tables.get(request_id, ())) * self.block_size

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks needed so the request's table covers ``num_tokens`` slots."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """Whether ``allocate`` would succeed and still leave ``reserve`` blocks free."""
        return self.blocks_needed(request_id, num_tokens) + reserve <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the table to cover ``num_tokens`` slots; all-or-nothing.

        Returns False and changes nothing when too few blocks are free. Never shrinks.
        """
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(needed):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)
        return True

    def free(self, request_id: str) -> None:
        """Release all blocks of the request; a no-op for an unknown request."""
        for block in self._tables.pop(request_id, []):
            self._release(block)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Release trailing blocks not needed to cover ``num_tokens`` slots.

        For rolling back rejected drafts that spilled into new blocks. Returns the number of
        blocks released. The table stays registered even when it becomes empty.
        """
        table = self._tables.get(request_id)
        if table is None:
            return 0
        keep = cdiv(max(num_tokens, 0), self.block_size)
        released = 0
        while len(table) > keep:
            self._release(table.pop())
            released += 1
        return released

    def slot_mapping(self, request_id: str, start: int, end: int) -> np.ndarray:
        """Flat cache slot of each token position in ``[start, end)``; int64, ``[end - start]``.

        Raises IndexError when a position lies beyond the request's table.
        """
        if not 0 <= start <= end <= self.num_slots(request_id):
            raise IndexError(
                f"positions [{start}, {end}) outside the {self.num_slots(request_id)} slots "
                f"of request {request_id!r}"
            )
        table = np.asarray(self._tables.get(request_id, ()), dtype=np.int64)
        positions = np.arange(start, end, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        free = list(self._free)
        free_set = set(free)
        assert len(free_set) == len(free), "free list has duplicates"
        assert all(0 <= b < self.num_blocks for b in free), "free block id out of range"
        used: dict[int, str] = {}
        for request_id, table in self._tables.items():
            for block in table:
                assert 0 <= block < self.num_blocks, f"block {block} of {request_id!r} out of range"
                assert block not in used, (
                    f"block {block} in tables of {used[block]!r} and {request_id!r}"
                )
                assert block not in free_set, f"block {block} of {request_id!r} is also free"
                used[block] = request_id
        assert len(free) + len(used) == self.num_blocks, (
            f"free {len(free)} + used {len(used)} != total {self.num_blocks}"
        )
        for block in range(self.num_blocks):
            expected = 1 if block in used else 0
            assert self._ref_counts[block] == expected, (
                f"block {block} ref count {self._ref_counts[block]}, expected {expected}"
            )

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)
