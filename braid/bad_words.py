"""Bad words' token ids, indexed by their prefixes in flat arrays.

A request may carry 100,000 bad words. The sampler asks, for each row, which tokens would
complete a word after the row's output: a lookup of the output's tail once per prefix length
the words have, so its cost is the number of distinct lengths, not of words. The index is
built where the words are tokenized (the server's worker thread, or the engine's input
processing offline), and is a handful of arrays: it crosses to the engine's process as their
bytes, where 200,000 lists of ids took seconds to pickle and index on the engine's side.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence


class _Table:
    """The words of one prefix length n: distinct prefixes sorted by (hash, prefix), their
    tokens flat (n per prefix), and each prefix's last tokens (`starts` bound them)."""

    __slots__ = ("n", "hashes", "prefixes", "starts", "lasts")

    def __init__(self, n: int, words: dict[tuple[int, ...], set[int]]) -> None:
        self.n = n
        order = sorted(words, key=lambda prefix: (hash(prefix), prefix))
        self.hashes = array("q", [hash(prefix) for prefix in order])
        self.prefixes = array("q", [t for prefix in order for t in prefix])
        self.starts, self.lasts = array("q", [0]), array("q")
        for prefix in order:
            self.lasts.extend(sorted(words[prefix]))
            self.starts.append(len(self.lasts))

    def find(self, tail: tuple[int, ...]) -> int | None:
        """The index of prefix `tail` (n tokens), or None."""
        h, n = hash(tail), self.n
        i = bisect_left(self.hashes, h)
        while i < len(self.hashes) and self.hashes[i] == h:
            if tuple(self.prefixes[i * n:(i + 1) * n]) == tail:
                return i
            i += 1
        return None

    def words(self) -> Iterator[list[int]]:
        n = self.n
        for i in range(len(self.hashes)):
            prefix = self.prefixes[i * n:(i + 1) * n].tolist()
            for last in self.lasts[self.starts[i]:self.starts[i + 1]]:
                yield [*prefix, last]

    def __getstate__(self) -> tuple:
        return self.n, self.hashes, self.prefixes, self.starts, self.lasts

    def __setstate__(self, state: tuple) -> None:
        self.n, self.hashes, self.prefixes, self.starts, self.lasts = state


class BadWordIndex:
    """Token id sequences (words; empty ones ignored) by prefix: `completing(output)` is the
    last tokens that would complete a word after `output`. Iterating gives the words (each
    once, in index order)."""

    __slots__ = ("_tables", "_size")

    def __init__(self, words: Iterable[Sequence[int]]) -> None:
        by_length: dict[int, dict[tuple[int, ...], set[int]]] = {}
        for word in words:
            if word:
                prefix = tuple(word[:-1])
                by_length.setdefault(len(prefix), {}).setdefault(prefix, set()).add(word[-1])
        self._tables = [_Table(n, by_length[n]) for n in sorted(by_length)]
        self._size = sum(len(t.lasts) for t in self._tables)

    def completing(self, output: Sequence[int]) -> list[tuple[int, int]]:
        """Keys (table, prefix index) of the prefixes `output` ends with; `lasts` reads
        each one's tokens."""
        found = []
        for k, table in enumerate(self._tables):
            n = table.n
            if n > len(output):
                break
            i = table.find(tuple(output[len(output) - n:]))
            if i is not None:
                found.append((k, i))
        return found

    def lasts(self, key: tuple[int, int]) -> array:
        k, i = key
        table = self._tables[k]
        return table.lasts[table.starts[i]:table.starts[i + 1]]

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[list[int]]:
        for table in self._tables:
            yield from table.words()

    def __getstate__(self) -> tuple:
        return self._tables, self._size

    def __setstate__(self, state: tuple) -> None:
        self._tables, self._size = state
