"""Paged KV-cache block manager: a free list and one block table per request.

Block ``b`` holds the KV of cache slots ``[b * block_size, (b + 1) * block_size)``; token
position ``pos`` of a request lives in slot
``table[pos // block_size] * block_size + pos % block_size``.

Each block belongs to at most one request (no prefix caching yet).
"""

from __future__ import annotations

from collections import deque


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

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether ``allocate`` would succeed."""
        return self.blocks_needed(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the table to cover ``num_tokens`` slots; all-or-nothing.

        Returns False and changes nothing when too few blocks are free. Never shrinks.
        """
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > len(self._free):
            return False
        table = self._tables.setdefault(request_id, [])
        table.extend(self._free.popleft() for _ in range(needed))
        return True

    def free(self, request_id: str) -> None:
        """Release all blocks of the request; a no-op for an unknown request."""
        self._free.extend(self._tables.pop(request_id, []))

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
