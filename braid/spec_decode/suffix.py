"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025; vLLM's method "suffix"):
drafts what followed the current context's recurring suffixes in text seen before: the
request's own prompt and output, and the outputs of other requests, running and recently
finished. At each draft position it takes the most frequent continuation and stops once the
continuation's estimated probability (the fraction of matching occurrences that went on
that way, multiplied along the draft) falls below `suffix_decoding_min_token_prob`. Longer
matches may draft more: at most `suffix_decoding_max_spec_factor` tokens per matched token.

SuffixDecoding stores suffix trees; `SuffixCorpus` keeps the text itself with an index of
its token pairs, which answers the same questions (how often each continuation of a context
occurred) from the occurrences of the context's last two tokens, at a few numpy passes per
draft, and costs an index entry per token instead of a tree path per suffix. Lossless like
every proposer: the target verifies each draft."""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from braid.config import SpecConfig
from braid.core.request import Request
from braid.spec_decode.ngram import TokenHistory
from braid.spec_decode.proposer import Proposal, Proposer

GAP = -1  # fills the arena between and after sequences: never a token, so matches stop there
MAX_CANDIDATES = 256  # most recent occurrences of a token pair a draft is taken from


def _pair(a: Any, b: Any) -> Any:
    """The index key of token pair (a, b): ints, or numpy arrays of them."""
    return (a << 32) | b


@dataclass(slots=True)
class Span:
    """Where one sequence lives in the arena: tokens [start, start + length), room to
    start + capacity."""

    start: int
    length: int
    capacity: int


class SuffixCorpus:
    """Sequences of token ids in one arena (a numpy buffer, GAP between them) and an index
    from each adjacent token pair to the arena positions of its second token. Sequences
    grow at their end; one outgrowing its room moves to the arena's end (its old place is
    filled with GAP, and index entries that point there fail the content check), and the
    arena is compacted once most of it is dead."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self._spans: dict[str, Span] = {}
        self._tokens = np.full(1024, GAP, dtype=np.int64)
        self._end = 1  # arena position 0 stays GAP: a match never runs past the start
        # pair key -> positions: those indexed at the last compaction (sorted keys, each
        # key's positions a slice of one array), and those added since
        self._base = PairIndex.build(np.full(1, GAP, dtype=np.int64))
        self._index: dict[int, array] = {}
        self._live = 0  # tokens in live sequences

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._spans

    def __len__(self) -> int:
        return len(self._spans)

    def length(self, seq_id: str) -> int:
        span = self._spans.get(seq_id)
        return 0 if span is None else span.length

    def extend(self, seq_id: str, tokens: np.ndarray | list[int]) -> None:
        """Append `tokens` to sequence `seq_id` (created empty if new)."""
        new = np.asarray(tokens, dtype=np.int64)
        if not new.size:
            return
        span = self._spans.get(seq_id) or self._place(seq_id, 0, new.size)
        if span.length + new.size > span.capacity:
            span = self._move(seq_id, span, span.length + new.size)
        at = span.start + span.length
        self._tokens[at:at + new.size] = new
        self._add_pairs(max(at - 1, span.start), at + new.size)
        span.length += new.size
        self._live += new.size

    def remove(self, seq_id: str) -> None:
        span = self._spans.pop(seq_id, None)
        if span is None:
            return
        self._tokens[span.start:span.start + span.length] = GAP
        self._live -= span.length
        if self._end > 4 * max(self._live, 1024):
            self._compact()

    def speculate(self, context: np.ndarray, k: int, spec_factor: float, min_prob: float,
                  own: str | None = None) -> tuple[list[int], float]:
        """Up to k drafts continuing `context` [n], and their score (the sum of each draft's
        probability, as SuffixDecoding ranks candidates). `own`: a sequence of this corpus
        that `context` is the end of; its last position is the context itself, not an
        earlier occurrence."""
        positions = self._occurrences(context, own)
        if not positions.size or k <= 0:
            return [], 0.0
        matched = self._match_lengths(context, positions).tolist()
        following = self._tokens[positions[:, None] + np.arange(1, k + 1)].tolist()  # [C, k]
        best: tuple[list[int], float] = ([], 0.0)
        for length in sorted(set(matched), reverse=True):  # longest match first
            max_tokens = min(k, int(length * spec_factor + 1e-6))
            if max_tokens <= best[1]:  # a score is at most its draft count
                break
            rows = [f for f, m in zip(following, matched, strict=True) if m >= length]
            drafts, score = _walk(rows, max_tokens, min_prob)
            if score > best[1]:
                best = (drafts, score)
        return best

    def _occurrences(self, context: np.ndarray, own: str | None) -> np.ndarray:
        """Arena positions p where the context's last two tokens occur as t[p-1], t[p]
        (the most recent MAX_CANDIDATES)."""
        if context.shape[0] < 2:
            return np.empty(0, dtype=np.int64)
        a, b = int(context[-2]), int(context[-1])
        key = _pair(a, b)
        entries = self._index.get(key)
        recent = (np.empty(0, dtype=np.int64) if entries is None
                  else np.frombuffer(entries, dtype=np.int64)[-MAX_CANDIDATES:])
        positions = recent
        if recent.shape[0] < MAX_CANDIDATES:
            older = self._base.positions(key)[-(MAX_CANDIDATES - recent.shape[0]):]
            positions = np.concatenate([older, recent]) if older.size else recent
        if not positions.size:
            return positions
        t = self._tokens
        positions = positions[(t[positions] == b) & (t[positions - 1] == a)]  # moved: stale
        span = self._spans.get(own) if own is not None else None
        if span is not None:
            positions = positions[positions != span.start + span.length - 1]
        return positions

    def _match_lengths(self, context: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """How many of the context's last tokens (2 to max_depth) each occurrence matches.
        A GAP precedes every sequence, so a match ends inside the arena (positions clipped
        at 0 lie past a GAP already)."""
        depth = min(self.max_depth, context.shape[0])
        back = np.maximum(positions[:, None] - np.arange(depth), 0)  # [C, depth]
        equal = self._tokens[back] == context[::-1][:depth]
        return np.where(equal.all(axis=1), depth, equal.argmin(axis=1))

    def _place(self, seq_id: str, length: int, capacity: int) -> Span:
        """Room for a sequence at the arena's end (one GAP after the previous one)."""
        capacity = max(capacity, 64)
        start = self._end
        self._end = start + capacity + 1
        needed = self._end + 64  # a walk reads up to MAX draft positions past a sequence
        if needed > self._tokens.shape[0]:
            grown = np.full(max(2 * self._tokens.shape[0], needed), GAP, dtype=np.int64)
            grown[:start] = self._tokens[:start]
            self._tokens = grown
        span = self._spans[seq_id] = Span(start, length, capacity)
        return span

    def _move(self, seq_id: str, span: Span, needed: int) -> Span:
        old = self._tokens[span.start:span.start + span.length].copy()
        self._tokens[span.start:span.start + span.length] = GAP
        moved = self._place(seq_id, span.length, 2 * needed)
        self._tokens[moved.start:moved.start + moved.length] = old
        self._add_pairs(moved.start, moved.start + moved.length)
        return moved

    def _add_pairs(self, begin: int, end: int) -> None:
        """Index the pairs (t[p-1], t[p]) for p in (begin, end)."""
        t = self._tokens[begin:end].tolist()
        index = self._index
        for i in range(1, len(t)):
            key = _pair(t[i - 1], t[i])
            entries = index.get(key)
            if entries is None:
                entries = index[key] = array("q")
            entries.append(begin + i)

    def _compact(self) -> None:
        """Rebuild the arena and the index from the live sequences (the index with numpy
        ops and a Python step per distinct pair, not per token)."""
        live = [(sid, self._tokens[s.start:s.start + s.length].copy())
                for sid, s in self._spans.items()]
        self._spans, self._live, self._end = {}, 0, 1
        self._tokens = np.full(1024, GAP, dtype=np.int64)
        for sid, tokens in live:
            span = self._place(sid, tokens.shape[0], tokens.shape[0])
            self._tokens[span.start:span.start + span.length] = tokens
            self._live += span.length
        self._base, self._index = PairIndex.build(self._tokens[:self._end]), {}


@dataclass(slots=True)
class PairIndex:
    """The positions p of every pair (t[p-1], t[p]) of an arena (GAP in neither), grouped
    by pair key in three arrays: built with numpy ops alone, so compacting a large corpus
    costs no Python step per token or per pair."""

    keys: np.ndarray  # [K] sorted distinct pair keys
    starts: np.ndarray  # [K + 1] where each key's positions begin in `at`
    at: np.ndarray  # [N] positions, ascending within each key

    @classmethod
    def build(cls, tokens: np.ndarray) -> PairIndex:
        left, right = tokens[:-1], tokens[1:]
        real = (left >= 0) & (right >= 0)
        keys = _pair(left, right)[real]
        positions = np.arange(1, tokens.shape[0], dtype=np.int64)[real]
        order = np.argsort(keys, kind="stable")
        keys, positions = keys[order], positions[order]
        first = np.flatnonzero(np.concatenate([[True], keys[1:] != keys[:-1]])) \
            if keys.size else np.empty(0, dtype=np.int64)
        return cls(keys[first], np.append(first, keys.shape[0]), positions)

    def positions(self, key: int) -> np.ndarray:
        i = int(np.searchsorted(self.keys, key))
        if i == self.keys.shape[0] or self.keys[i] != key:
            return self.at[:0]
        return self.at[self.starts[i]:self.starts[i + 1]]


def _walk(rows: list[list[int]], max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation of the occurrences whose following tokens are `rows`,
    token by token, while its probability (the fraction of occurrences still on it) stays
    >= min_prob. Ties go to the most recent occurrence's token."""
    drafts: list[int] = []
    prob, score = 1.0, 0.0
    for step in range(max_tokens):
        counts = Counter(row[step] for row in reversed(rows))
        token, count = counts.most_common(1)[0]
        prob *= count / len(rows)
        if token == GAP or prob < min_prob:
            break
        drafts.append(token)
        score += prob
        rows = [row for row in rows if row[step] == token]
    return drafts, score



@dataclass(slots=True)
class SuffixSettings:
    """vLLM's suffix_decoding_* settings."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1

    @classmethod
    def of(cls, spec: SpecConfig) -> SuffixSettings:
        return cls(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                   spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)


class SuffixProposer(Proposer):
    """Drafts from two corpora, the better score of the two: the request's own prompt and
    output, and the outputs of every running request and of the last `max_cached_requests`
    finished ones (least recently finished dropped first)."""

    def __init__(self, settings: SuffixSettings) -> None:
        self.settings = settings
        self.history = TokenHistory()
        self.outputs = SuffixCorpus(settings.max_tree_depth)  # running and cached outputs
        self.cached: OrderedDict[str, None] = OrderedDict()  # finished ones, oldest first
        self.own: dict[str, SuffixCorpus] = {}  # each running request's prompt and output

    def propose(self, requests: list[Request], ks: list[int]) -> Proposal:
        graded = [self.draft_graded(r, k) if k else ([], 0)
                  for r, k in zip(requests, ks, strict=True)]
        return Proposal([drafts for drafts, _ in graded], levels=[n for _, n in graded])

    def draft_graded(self, req: Request, k: int, after: Sequence[int] = ()
                     ) -> tuple[list[int], int]:
        """Up to k drafts for `req` (following its tokens and then `after`), and their
        confidence level: their mean estimated probability in quarters (0: below 0.25 ...
        3: 0.75 or more)."""
        tokens = self._sync(req)
        if len(after):
            tokens = np.concatenate([tokens, np.asarray(after, dtype=tokens.dtype)])
        s = self.settings
        rid = req.request_id
        mine = self.own[rid].speculate(tokens, k, s.max_spec_factor, s.min_token_prob, rid)
        others = self.outputs.speculate(tokens, k, s.max_spec_factor, s.min_token_prob, rid)
        drafts, score = mine if mine[1] >= others[1] else others
        return drafts, min(int(4 * score / len(drafts)), 3) if drafts else 0

    def draft_after(self, req: Request, after: list[int], k: int) -> tuple[list[int], int]:
        return self.draft_graded(req, k, after)

    def _sync(self, req: Request) -> np.ndarray:
        """The request's tokens, with those not yet in its corpora added to them."""
        rid = req.request_id
        tokens = self.history.tokens(req)
        own = self.own.get(rid)
        if own is None or own.length(rid) > tokens.shape[0]:
            if rid in self.cached:  # an id used again: the finished request's output stays
                del self.cached[rid]
                self.outputs.remove(rid)
            own = self.own[rid] = SuffixCorpus(self.settings.max_tree_depth)
        own.extend(rid, tokens[own.length(rid):])
        prompt = req.num_prompt_tokens
        self.outputs.extend(rid, tokens[prompt + self.outputs.length(rid):])
        return tokens

    def finish(self, req: Request) -> None:
        """A finished request's output stays in the shared corpus (bounded, LRU)."""
        rid = req.request_id
        if rid in self.cached and rid not in self.own:  # a finished request's, same id
            del self.cached[rid]
            self.outputs.remove(rid)
        self.outputs.extend(rid, req.output_token_ids[self.outputs.length(rid):])
        if rid in self.outputs:
            self.cached[rid] = None
            while len(self.cached) > self.settings.max_cached_requests:
                self.outputs.remove(self.cached.popitem(last=False)[0])
        self.forget(rid)

    def forget(self, request_id: str) -> None:
        self.history.forget(request_id)
        self.own.pop(request_id, None)
        if request_id not in self.cached:
            self.outputs.remove(request_id)  # preempted: added again when it drafts
