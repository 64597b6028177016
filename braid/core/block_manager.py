"""Paged KV-cache block manager with automatic prefix caching.

Block ``b`` holds the KV of cache slots ``[b * block_size, (b + 1) * block_size)``; token
position ``pos`` of a request lives in slot
``table[pos // block_size] * block_size + pos % block_size``.

Prefix caching (vLLM V1's scheme): a full block whose KV is final is *published* under a hash
that chains its tokens to its parent block's hash, so equal hashes mean equal token prefixes.
A request admitted later looks its prompt's full blocks up and shares the published ones
(reference counts). Freed blocks stay published in a least-recently-freed queue and are
evicted (unpublished) only when a new block is needed; a request frees its blocks tail first,
so a prefix outlives its continuations. Only the scheduler publishes, and only blocks whose
tokens are final (no drafts, nothing past the request's computed tokens).

The draft model keeps its KV on the same block tables (spec_decode/draft.py). A published
block also records whether the draft's KV in it is valid (`mark_draft_computed`), so a
request that shares it skips the draft's catch-up over that prefix too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

# (start, end) -> a request's token ids at positions [start, end) (Request.token_ids)
Tokens = Callable[[int, int], Sequence[int]]
# A block table's key: a request id, or (request id, layer group) for a hybrid model's
# further groups (kv_groups.py), whose hashes chain from a root of their own
TableKey = str | tuple[str, int]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: its tokens chained to its parent's hash (a cryptographic
    hash, so no request can craft a collision with another's prefix)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


RELEASED = -1  # a table entry whose block was given back (release_before): never read again


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Blocks no table holds, least recently freed first: new blocks come from the front.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks  # tables holding each block
        self._hash: list[bytes | None] = [None] * num_blocks  # a published block's hash
        self._draft_valid = [False] * num_blocks  # the draft's KV in a published block is valid
        self._cached: dict[bytes, int] = {}  # published hash -> block
        self._tables: dict[TableKey, list[int]] = {}
        # Per table: chained hashes of its full final blocks so far, and how many of its
        # blocks the scheduler has published (or found already published).
        self._hashes: dict[TableKey, list[bytes]] = {}
        self._num_published: dict[TableKey, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (published blocks no table holds included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def block_table(self, request_id: TableKey) -> list[int]:
        """A copy of the request's block ids in position order (empty if unknown)."""
        return list(self._tables.get(request_id, ()))

    @property
    def num_tables(self) -> int:
        """Block tables per request (one here; a table per layer group in GroupedBlocks)."""
        return 1

    def block_tables(self, request_id: str) -> list[list[int]]:
        """The request's table of each layer group (here one: GroupedBlocks keeps more)."""
        return [self.block_table(request_id)]

    def num_slots(self, request_id: TableKey) -> int:
        """Token slots the request's table covers."""
        return len(self._tables.get(request_id, ())) * self.block_size

    def blocks_needed(self, request_id: TableKey, num_tokens: int) -> int:
        """Extra blocks needed so the request's table covers ``num_tokens`` slots."""
        have = len(self._tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def can_allocate(self, request_id: TableKey, num_tokens: int, cached: Sequence[int] = (),
                     reserve: int = 0) -> bool:
        """Whether ``allocate`` would succeed."""
        return self.cost(request_id, num_tokens, cached) + reserve <= len(self._free)

    def cost(self, key: TableKey, num_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free blocks an allocation takes: new ones, and shared ones no table holds yet."""
        have = len(self._tables.get(key, ())) + len(cached)
        fresh = max(0, cdiv(num_tokens, self.block_size) - have)
        return fresh + sum(1 for b in cached if b != RELEASED and self._ref[b] == 0)

    def allocate(self, request_id: TableKey, num_tokens: int, cached: Sequence[int] = (),
                 reserve: int = 0, whole: bool = False) -> bool:
        """Grow the table to cover ``num_tokens`` slots, starting with the shared blocks
        ``cached`` (from `find_cached`, RELEASED where a windowed table needs none; only for
        a table that holds no blocks yet), then fresh ones; all-or-nothing. Returns False
        and changes nothing when fewer than `reserve` blocks would stay free. Never
        shrinks. `whole`: one forward computes all of them (a warm-up's; GroupedBlocks
        gives its windowed groups as much then)."""
        if cached and self._tables.get(request_id):
            raise ValueError("cached blocks can only start a table")
        if self.cost(request_id, num_tokens, cached) + reserve > len(self._free):
            return False
        table = self._tables.setdefault(request_id, [])
        for block in cached:
            if block != RELEASED:
                if self._ref[block] == 0:
                    del self._free[block]
                self._ref[block] += 1
            table.append(block)
        if cached:
            self._num_published[request_id] = len(cached)
        for _ in range(self.blocks_needed(request_id, num_tokens)):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            table.append(block)
        return True

    def _evict(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._cached[h]
            self._hash[block] = None
            self._draft_valid[block] = False

    def free(self, request_id: TableKey) -> None:
        """Release all blocks of the request (tail first, so its prefix is evicted last);
        published ones stay cached. A no-op for an unknown request."""
        for block in reversed(self._tables.pop(request_id, [])):
            self._unref(block)
        self._hashes.pop(request_id, None)
        self._num_published.pop(request_id, None)

    def _unref(self, block: int) -> None:
        if block == RELEASED:
            return
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None
            if self._hash[block] is None:
                self._free.move_to_end(block, last=False)  # unpublished: reuse first

    def release_windows(self, request_id: str, first_query: int, window: int | None) -> None:
        """After a step: give back the request's blocks that no query from `first_query` on
        reads, where every layer attends in `window` (None: all are read)."""
        if window is not None:
            self.release_before(request_id, first_query - window + 1)

    def release_before(self, request_id: TableKey, position: int) -> int:
        """Give back the request's blocks that hold only positions before `position` (a
        sliding-window model's KV that no later query attends to); their table entries
        become RELEASED, so the table still covers the same positions. Returns how many.
        Released entries are always a table's leading ones, so only the blocks released since
        the last call are visited (from the new edge back to the old one)."""
        table = self._tables.get(request_id, [])
        released = 0
        for i in reversed(range(min(max(0, position) // self.block_size, len(table)))):
            if table[i] == RELEASED:
                break
            self._unref(table[i])
            table[i] = RELEASED
            released += 1
        return released

    # ---- prefix caching ------------------------------------------------------------------

    def _chain(self, request_id: TableKey, tokens: Tokens, num_blocks: int) -> list[bytes]:
        """The request's first `num_blocks` block hashes (computed once, then extended)."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        root = None if isinstance(request_id, str) else b"kv group %d" % request_id[1]
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else root,
                                     tokens(i * bs, (i + 1) * bs)))
        return hashes[:num_blocks]

    def find_cached(self, request_id: TableKey, tokens: Tokens, max_tokens: int) -> list[int]:
        """Published blocks holding the longest cached prefix of the request's tokens that
        ends at or before `max_tokens` (whole blocks only), for `allocate(cached=...)`."""
        if not self.enable_caching:
            return []
        hashes = self._chain(request_id, tokens, max(0, max_tokens) // self.block_size)
        hits = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def publish(self, request_id: TableKey, tokens: Tokens, num_final_tokens: int) -> list[int]:
        """Publish the request's full blocks that lie within its first `num_final_tokens`
        tokens (KV computed, or being computed this step, from final tokens); a block whose
        hash is already published elsewhere stays private. Returns the blocks published."""
        if not self.enable_caching:
            return []
        table = self._tables.get(request_id, [])
        full = min(num_final_tokens // self.block_size, len(table))
        start = self._num_published.get(request_id, 0)
        if full <= start:
            return []
        hashes = self._chain(request_id, tokens, full)
        published = []
        for i in range(start, full):
            block, h = table[i], hashes[i]
            if block != RELEASED and self._hash[block] is None and h not in self._cached:
                self._hash[block] = h
                self._cached[h] = block
                published.append(block)
        self._num_published[request_id] = full
        return published

    def unpublish(self, blocks: Sequence[int]) -> None:
        """Withdraw blocks whose KV was never written (their step failed)."""
        for block in blocks:
            self._evict(block)
        for rid, table in self._tables.items():
            n = self._num_published.get(rid, 0)
            first_bad = next((i for i, b in enumerate(table[:n]) if b in blocks), n)
            self._num_published[rid] = first_bad

    def num_published_tokens(self, request_id: TableKey) -> int:
        """Tokens of the request's leading blocks that are published (or were found so)."""
        return self._num_published.get(request_id, 0) * self.block_size

    def mark_draft_computed(self, request_id: TableKey, num_tokens: int) -> None:
        """The draft model's KV of the request is valid for its first `num_tokens` tokens:
        its published blocks within them serve the draft too."""
        table = self._tables.get(request_id, [])
        for block in table[: min(num_tokens // self.block_size, len(table))]:
            if block != RELEASED and self._hash[block] is not None:
                self._draft_valid[block] = True

    def num_draft_cached_tokens(self, request_id: TableKey) -> int:
        """Tokens of the request's leading blocks whose draft KV is valid."""
        n = 0
        for block in self._tables.get(request_id, []):
            # (a released block counts: it was given back only behind the draft's progress)
            if block != RELEASED and not self._draft_valid[block]:
                break
            n += 1
        return n * self.block_size

    def reset_prefix_cache(self) -> int:
        """Unpublish every block no table holds (vLLM's reset_prefix_cache); returns how
        many. Blocks in use stay published: their requests' KV is still valid."""
        dropped = [b for b in self._free if self._hash[b] is not None]
        for block in dropped:
            self._evict(block)
        return len(dropped)

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        refs = [0] * self.num_blocks
        for request_id, table in self._tables.items():
            held = [b for b in table if b != RELEASED]
            assert len(set(held)) == len(held), f"{request_id!r} holds a block twice"
            for block in held:
                assert 0 <= block < self.num_blocks, f"block {block} of {request_id!r} out of range"
                assert block not in self._free, f"block {block} of {request_id!r} is also free"
                refs[block] += 1
        assert refs == self._ref, "reference counts differ from the tables"
        assert all(0 <= b < self.num_blocks for b in self._free), "free block id out of range"
        assert all(self._ref[b] == 0 for b in self._free), "a free block is referenced"
        assert len(self._free) + sum(1 for r in refs if r) == self.num_blocks, (
            f"free {len(self._free)} + used {sum(1 for r in refs if r)} != {self.num_blocks}")
        for h, block in self._cached.items():
            assert self._hash[block] == h, f"cache entry of block {block} out of step"
        assert sum(h is not None for h in self._hash) == len(self._cached), "stray block hash"
        assert all(self._hash[b] is not None for b, v in enumerate(self._draft_valid) if v), (
            "draft-valid flag on an unpublished block")
        for request_id, n in self._num_published.items():
            table = self._tables.get(request_id, [])
            assert n <= len(table), f"{request_id!r}: more blocks published than it holds"
