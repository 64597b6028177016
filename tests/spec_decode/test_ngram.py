from __future__ import annotations

import time

import numpy as np
import pytest

from braid.core.request import Request
from braid.sampling_params import SamplingParams
from braid.spec_decode.ngram import NgramMatcher, TokenHistory


def ref_propose(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Plain Python: longest suffix first, most recent earlier occurrence."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_longest_match_wins_over_more_recent_shorter_one() -> None:
    # suffix [1, 2, 3] occurs at 0 (followed by 7); [2, 3] alone recurs later (followed by 8)
    tokens = [1, 2, 3, 7, 7, 9, 2, 3, 8, 5, 1, 2, 3]
    assert NgramMatcher(1, 3).match_graded(tokens, 2) == ([7, 7], 3)  # graded by its length
    assert NgramMatcher(1, 2).match_graded(tokens, 2) == ([8, 5], 2)


def test_most_recent_occurrence() -> None:
    tokens = [4, 5, 1, 4, 5, 2, 4, 5, 3, 0, 4, 5]
    assert NgramMatcher(2, 2).match_graded(tokens, 1) == ([3], 2)
    assert NgramMatcher(2, 2).match_graded(np.array(tokens), 3) == ([3, 0, 4], 2)


def test_no_match_and_min_length() -> None:
    assert NgramMatcher(1, 3).match_graded([1, 2, 3, 4], 3) == ([], 0)
    # only a 1-token suffix recurs: too short for min 2
    assert NgramMatcher(2, 3).match_graded([5, 1, 2, 5], 3) == ([], 0)
    assert NgramMatcher(1, 3).match_graded([5, 1, 2, 5], 3) == ([1, 2, 5], 1)
    assert NgramMatcher(1, 3).match_graded([], 3) == ([], 0)
    assert NgramMatcher(1, 3).match_graded([7], 3)[0] == []


def test_k_cap_and_zero() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramMatcher(1, 2).match_graded(tokens, 3)[0] == [3, 4, 5]
    assert NgramMatcher(1, 2).match_graded(tokens, 0)[0] == []


def test_match_near_end_is_truncated() -> None:
    # the most recent occurrence of [9, 9] overlaps the suffix: only one token follows it
    assert NgramMatcher(2, 2).match_graded([9, 9, 9], 4)[0] == [9]
    assert NgramMatcher(1, 4).match_graded([3, 1, 2, 3, 1, 2], 5)[0] == [3, 1, 2]


def test_invalid_config() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramMatcher(3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramMatcher(0, 2)


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_matches_reference_on_random_sequences(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    for _ in range(300):
        length = int(rng.integers(0, 40))
        tokens = rng.integers(0, vocab, size=length).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(0, 6))
        got = NgramMatcher(lo, hi).match_graded(np.array(tokens, dtype=np.int64), k)[0]
        assert got == ref_propose(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_token_history_follows_each_request_as_it_grows() -> None:
    rng = np.random.default_rng(1)
    history = TokenHistory()
    requests = [Request(str(i), rng.integers(0, 100, size=n).tolist(), SamplingParams())
                for i, n in enumerate((3, 40, 200))]
    for _ in range(150):  # past the first buffer's capacity of each
        for req in requests:
            if rng.random() < 0.7:
                req.output_token_ids.extend(rng.integers(0, 100, size=rng.integers(1, 5)).tolist())
            req.spec_token_ids = [7, 7]  # pending drafts are not part of the history
            assert history.tokens(req).tolist() == req.prompt_token_ids + req.output_token_ids
    history.forget("1")
    again = Request("2", [5, 6], SamplingParams())  # an id used again, shorter than before
    assert history.tokens(again).tolist() == [5, 6]
    assert history.tokens(requests[1]).tolist() == (requests[1].prompt_token_ids
                                                    + requests[1].output_token_ids)


def test_timing_4k_context() -> None:
    rng = np.random.default_rng(0)
    # code-like: a random 4k context whose last 40 tokens repeat an earlier span
    tokens = rng.integers(0, 32000, size=4096)
    tokens[-40:] = tokens[1000:1040]
    proposer = NgramMatcher(1, 4)
    assert proposer.match_graded(tokens, 4)[0] == tokens[1040:1044].tolist()
    repetitive = np.tile(np.arange(7), 600)[:4096]  # every position is a candidate
    cases = (("ndarray", tokens), ("list", tokens.tolist()), ("repetitive ndarray", repetitive))
    for name, arg in cases:
        for _ in range(20):
            proposer.match_graded(arg, 4)
        runs = 500
        start = time.perf_counter()
        for _ in range(runs):
            proposer.match_graded(arg, 4)
        micros = (time.perf_counter() - start) / runs * 1e6
        print(f"ngram propose, 4096-token context ({name} input): {micros:.1f} us")
