"""Prompt-lookup (n-gram) proposer, vLLM's `ngram` method, vectorized with numpy.

The matcher finds the longest suffix of the sequence, of length n in
[prompt_lookup_min, prompt_lookup_max], that also occurs earlier in the sequence, and proposes
the tokens that followed that earlier occurrence. Among several earlier occurrences of the
longest suffix it takes the most recent one (as vLLM V1 does): recent context is the best
predictor of what comes next (an edit of the code block just quoted, the current loop body).
Occurrences may overlap the suffix; the proposal stops at the end of the sequence, so it can
be shorter than k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from braid.core.request import Request
from braid.spec_decode.proposer import Proposal, Proposer


class NgramProposer(Proposer):
    """Prompt lookup: no model, proposes what followed the last matching n-gram."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.matcher = NgramMatcher(prompt_lookup_min, prompt_lookup_max)
        self.history = TokenHistory()

    def propose(self, requests: list[Request], ks: list[int]) -> Proposal:
        graded = [self.matcher.match_graded(self.history.tokens(r), k) if k else ([], 0)
                  for r, k in zip(requests, ks, strict=True)]
        return Proposal([drafts for drafts, _ in graded], levels=[n for _, n in graded])

    def draft_after(self, req: Request, after: list[int], k: int) -> tuple[list[int], int]:
        tokens = self.history.tokens(req)
        return self.matcher.match_graded(
            np.concatenate([tokens, np.asarray(after, dtype=tokens.dtype)]), k)

    def forget(self, request_id: str) -> None:
        self.history.forget(request_id)


class TokenHistory:
    """Each request's tokens (prompt and output) as one numpy array that grows by the tokens
    emitted since the last call: rebuilding it from the request's lists every step cost
    ~50 us a request, about what the match itself costs. A request's tokens only grow, and
    its owner forgets it when it finishes (the engine forgets every finished request)."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # id -> (buffer, tokens in it)

    def tokens(self, req: Request) -> np.ndarray:
        """req's tokens [num_tokens] (a view of the buffer, valid until the next call)."""
        buffer, known = self._arrays.get(req.request_id, (None, 0))
        end = req.num_tokens
        if buffer is None or known > end:  # a new request (or a shorter one, same id)
            buffer, known = np.empty(max(2 * end, 64), dtype=np.int64), 0
        elif end > buffer.shape[0]:
            grown = np.empty(2 * end, dtype=np.int64)
            grown[:known] = buffer[:known]
            buffer = grown
        if end > known:
            buffer[known:end] = req.token_ids(known, end)
        self._arrays[req.request_id] = (buffer, end)
        return buffer[:end]

    def forget(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)


class NgramMatcher:
    """Cost per call: one O(L) comparison of the last token against the context, then at most
    prompt_lookup_max - 1 comparisons over the shrinking set of candidate occurrences."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def match_graded(self, token_ids: np.ndarray | Sequence[int], k: int
                     ) -> tuple[list[int], int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest
        matching suffix ([] when no suffix of at least prompt_lookup_min tokens recurs),
        and that suffix's length (0 where nothing matched): the drafts' confidence level,
        since a longer match is followed more often."""
        tokens = np.asarray(token_ids)  # [L]
        if k <= 0 or tokens.shape[0] <= self.prompt_lookup_min:
            return [], 0
        ends, matched = longest_match_ends(tokens[:-1], tokens, self.prompt_lookup_max)
        if not ends.size or matched < self.prompt_lookup_min:
            return [], 0
        start = int(ends[-1]) + 1  # the most recent occurrence; ends are ascending
        return [int(t) for t in tokens[start : start + k]], matched


def longest_match_ends(haystack: np.ndarray, pattern: np.ndarray, longest: int
                       ) -> tuple[np.ndarray, int]:
    """Where the longest suffix of `pattern` (at most `longest` tokens, fewer than pattern
    has) occurs in `haystack`: its ascending end positions p, haystack[p - n + 1 : p + 1] ==
    pattern[-n:], and its length n (no positions where not even pattern's last token
    occurs). One O(len(haystack)) comparison, then a shrinking set of candidates."""
    ends = np.flatnonzero(haystack == pattern[-1])  # [C] suffix of length 1 matches
    matched = 1
    while matched < longest and ends.size:
        # extend each candidate one token to the left; candidates at p < matched cannot
        ends_left = ends[ends >= matched]
        longer = ends_left[haystack[ends_left - matched] == pattern[-1 - matched]]
        if not longer.size:
            break
        ends, matched = longer, matched + 1
    return ends, matched
