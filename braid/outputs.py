"""What the engine hands back to callers, shaped like vLLM's RequestOutput."""

from __future__ import annotations

import dataclasses
import itertools
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload


@dataclass(slots=True)
class Logprob:
    """One token's entry in a position's logprobs, as vLLM's: its raw model logprob, its rank
    in the vocabulary (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position {token_id: Logprob}: the position's own token (sampled, or the prompt's) and the
# top-n. Prompt logprobs have None for the first prompt token (nothing precedes it).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With logprobs: per generated token, the sampled token and the top-n.
    logprobs: SampleLogprobs | None = None
    # With logprobs: the sum of the generated tokens' logprobs (vLLM's, e.g. to rank n samples)
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's times (time.monotonic() seconds) and figures, with vLLM's names."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # its first admission: queueing ends
    # Speculation figures of this request (drafts, draft tokens, accepted, ...), once present.
    spec_stats: dict[str, Any] = field(default_factory=dict)
    last_token_time: float | None = None  # when its latest tokens came

    @property
    def finished_time(self) -> float | None:
        return self.finish_time

    def shifted(self, offset: float) -> RequestMetrics:
        """The same times read on a clock `offset` seconds ahead (an engine on another
        machine)."""
        def move(t: float | None) -> float | None:
            return None if t is None else t + offset

        return dataclasses.replace(
            self, arrival_time=self.arrival_time + offset,
            first_token_time=move(self.first_token_time), finish_time=move(self.finish_time),
            first_scheduled_time=move(self.first_scheduled_time),
            last_token_time=move(self.last_token_time))

    @property
    def time_in_queue(self) -> float | None:
        """Arrival to first admission."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With prompt_logprobs: per prompt token (None for the first) the prompt token and the
    # top-n; set once the whole prompt has been scored (from another process: PackedLogprobs).
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None = None
    # Prompt tokens whose KV came from the prefix cache (vLLM's name; 0 before admission).
    num_cached_tokens: int = 0


class PackedLogprobs(Sequence[dict[int, Logprob] | None]):
    """Prompt logprobs in flat arrays: how they cross a process boundary. A long prompt's
    entries are ~40,000 `Logprob` objects per 2,000 tokens at top-20, whose pickling stopped
    the engine's loop for seconds; these arrays pickle as their bytes. Entries are made on
    reading (`[i]`, iteration), so a side that only passes them on never makes them."""

    __slots__ = ("_starts", "_ids", "_values", "_ranks", "_texts")

    def __init__(self, entries: Sequence[dict[int, Logprob] | None] = ()) -> None:
        starts, ids, values, ranks = array("q", [0]), array("q"), array("d"), array("q")
        texts: list[str | None] = []
        for entry in entries:
            if entry is None:  # the first prompt token's: its end stored as -1 - end
                starts.append(-1 - len(ids))
                continue
            for token, lp in entry.items():
                ids.append(token)
                values.append(lp.logprob)
                ranks.append(-1 if lp.rank is None else lp.rank)
                texts.append(lp.decoded_token)
            starts.append(len(ids))
        self._starts, self._ids, self._values, self._ranks = starts, ids, values, ranks
        self._texts = texts

    @classmethod
    def from_rows(cls, ids: Sequence[int], values: Sequence[float], ranks: Sequence[int],
                  counts: Sequence[int], texts: Sequence[str | None] | None = None
                  ) -> PackedLogprobs:
        """Positions of `counts[i]` entries each, their (id, logprob, rank) flat in order
        (rank -1: none), and their texts (None: none)."""
        packed = cls()
        packed._ids.extend(ids)
        packed._values.extend(values)
        packed._ranks.extend(ranks)
        packed._starts.extend(itertools.accumulate(counts))
        packed._texts = list(texts) if texts is not None else [None] * len(packed._ids)
        return packed

    @property
    def token_ids(self) -> array:
        """Every entry's token id, positions in order (what `with_texts` spells)."""
        return self._ids

    def with_texts(self, texts: Sequence[str | None]) -> PackedLogprobs:
        """The entries' texts set (one per entry of `token_ids`); returns self."""
        assert len(texts) == len(self._ids)
        self._texts = list(texts)
        return self

    def extend(self, other: PackedLogprobs) -> None:
        """`other`'s positions after these (a prompt scored chunk by chunk)."""
        offset = len(self._ids)
        self._starts.extend(s + offset if s >= 0 else s - offset for s in other._starts[1:])
        self._ids.extend(other._ids)
        self._values.extend(other._values)
        self._ranks.extend(other._ranks)
        self._texts.extend(other._texts)

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, i: int) -> dict[int, Logprob] | None: ...
    @overload
    def __getitem__(self, i: slice) -> list[dict[int, Logprob] | None]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"position {i} of {len(self)}")
        start, end = self._starts[i], self._starts[i + 1]
        if end < 0:
            return None
        return self._entry(start if start >= 0 else -1 - start, end)

    def __iter__(self) -> Iterator[dict[int, Logprob] | None]:
        start = 0
        for end in self._starts[1:]:
            if end < 0:
                start = -1 - end
                yield None
                continue
            yield self._entry(start, end)
            start = end

    def _entry(self, start: int, end: int) -> dict[int, Logprob]:
        """The position whose entries are [start, end) of the arrays."""
        return {self._ids[j]: Logprob(self._values[j], None if self._ranks[j] < 0
                                      else self._ranks[j], self._texts[j])
                for j in range(start, end)}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> tuple:
        return self._starts, self._ids, self._values, self._ranks, self._texts

    def __setstate__(self, state: tuple) -> None:
        self._starts, self._ids, self._values, self._ranks, self._texts = state
