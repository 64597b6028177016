"""Suffix decoding: the corpus's drafts and counts, its bounds, and the proposer in the engine
(lossless, and drafting from other requests' outputs)."""

from __future__ import annotations

import numpy as np
import pytest

from braid.config import ConfigError, EngineConfig
from braid.sampling_params import SamplingParams
from braid.spec_decode.suffix import SuffixCorpus
from tests.engine.test_engine import STAGGERED, make_engine, prompts, run
from tests.spec_decode.test_spec_engine import GREEDY, spec_engine


def speculate(corpus: SuffixCorpus, context: list[int], k: int = 8, factor: float = 4.0,
              min_prob: float = 0.1, own: str | None = None) -> tuple[list[int], float]:
    return corpus.speculate(np.array(context), k, factor, min_prob, own)


def test_drafts_the_most_frequent_continuation_while_it_is_likely() -> None:
    corpus = SuffixCorpus(max_depth=24)
    corpus.extend("a", [1, 2, 3, 4, 5, 6])
    corpus.extend("b", [1, 2, 3, 4, 7, 8])
    corpus.extend("c", [9, 2, 3, 4, 7, 9])
    # after (2, 3): 4 always (1.0), then 7 in 2 of 3 (0.67), then 8 or 9 (0.33 each)
    drafts, score = speculate(corpus, [0, 2, 3])
    assert drafts[:2] == [4, 7] and score == pytest.approx(1 + 2 / 3 + 1 / 3)
    assert speculate(corpus, [0, 2, 3], min_prob=0.5) == ([4, 7], pytest.approx(1 + 2 / 3))
    # a longer match narrows the occurrences to the one that matches it: c's
    assert speculate(corpus, [9, 2, 3])[0] == [4, 7, 9]
    assert speculate(corpus, [5, 5]) == ([], 0.0)  # never seen


def test_a_match_drafts_at_most_its_length_times_the_factor() -> None:
    corpus = SuffixCorpus(max_depth=24)
    corpus.extend("a", list(range(1, 30)))
    assert speculate(corpus, [0, 3, 4], factor=1.0)[0] == [5, 6]  # matched (3, 4)
    assert speculate(corpus, [2, 3, 4], factor=1.0)[0] == [5, 6, 7]  # matched (2, 3, 4)
    assert speculate(corpus, [2, 3, 4], k=2, factor=1.0)[0] == [5, 6]
    assert len(speculate(SuffixCorpus(max_depth=4), list(range(1, 10)) + [1, 2, 3, 4, 5],
                         k=16, factor=1.0)[0]) == 0  # the context is a corpus of its own


def test_the_context_itself_is_not_an_occurrence_of_itself() -> None:
    corpus = SuffixCorpus(max_depth=24)
    corpus.extend("a", [5, 6, 7, 5, 6])
    assert speculate(corpus, [5, 6, 7, 5, 6], own="a")[0] == [7, 5, 6]
    corpus.extend("a", [7])
    # (6, 7) occurred once before the end: what followed it
    assert speculate(corpus, [5, 6, 7, 5, 6, 7], own="a")[0] == [5, 6, 7]
    corpus.extend("b", [1, 2])
    assert speculate(corpus, [1, 2], own="b") == ([], 0.0)


def test_sequences_grow_move_and_are_removed_and_compacted() -> None:
    corpus = SuffixCorpus(max_depth=24)
    rng = np.random.default_rng(0)
    text = {str(i): rng.integers(0, 50, 300).tolist() for i in range(20)}
    for piece in range(0, 300, 7):  # interleaved growth: every sequence moves several times
        for sid, tokens in text.items():
            corpus.extend(sid, tokens[piece:piece + 7])
    for sid, tokens in text.items():
        assert corpus.length(sid) == len(tokens)
        context = tokens[100:130]
        assert speculate(corpus, context, k=4, min_prob=0.0)[0] == tokens[130:134]
    for sid in list(text)[:19]:
        corpus.remove(sid)
    assert len(corpus) == 1 and corpus._end < 4 * 1024 + 1  # compacted
    last = text["19"]
    assert speculate(corpus, last[:50], k=3, min_prob=0.0)[0] == last[50:53]
    assert speculate(corpus, text["0"][:50], min_prob=0.0)[1] <= 1  # gone (a chance pair)


@pytest.mark.parametrize("k", [3, 7])
@pytest.mark.parametrize("budget", [8, 32])
def test_suffix_is_lossless(k: int, budget: int) -> None:
    reference = run(make_engine(max_num_batched_tokens=256), STAGGERED, GREEDY)
    engine = spec_engine("suffix", k, max_num_batched_tokens=budget)
    assert run(engine, STAGGERED, GREEDY) == reference
    assert engine.stats.spec_stats.num_drafts > 0


def test_suffix_is_lossless_under_preemption() -> None:
    reference = run(make_engine(max_num_batched_tokens=256), STAGGERED, GREEDY)
    engine = spec_engine("suffix", 3, num_kv_blocks=64, max_num_batched_tokens=32)
    assert run(engine, STAGGERED, GREEDY) == reference
    assert engine.stats.num_preemptions > 0


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_a_repeated_task_drafts_from_the_earlier_outputs(policy: str) -> None:
    """The same prompts again under new ids, in a second batch after the engine went idle:
    the finished requests' outputs draft nearly all of the new ones, losslessly."""
    engine = spec_engine("suffix", 8, policy=policy, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = run(engine, {0: [0, 1, 2]}, params)
    stats = engine.stats.spec_stats
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    ps = prompts()
    for i in (0, 1, 2):
        engine.add_request(f"again{i}", ps[i], params)
    again = {o.request_id[5:]: o.outputs[0].token_ids for o in engine.run_until_done()
             if o.finished}
    assert first == again == run(make_engine(max_num_batched_tokens=256), {0: [0, 1, 2]}, params)
    drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
    # each output drafts from its twin's (a few drafts from its own looping text miss)
    assert accepted >= 0.75 * 3 * 40 and accepted >= 0.9 * drafted


@pytest.mark.parametrize("policy", ["fixed", "goodput"])
def test_suffix_decoding_beside_a_draft_model_takes_the_recurring_windows(policy: str) -> None:
    """draft_suffix_decoding: the repeated task's windows come from the suffix corpora, no
    draft forward, losslessly; without it the draft model drafts them."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = run(make_engine(max_num_batched_tokens=256), {0: [0, 1, 2]}, params)
    for beside in (True, False):
        engine = spec_engine("draft_model", 4, policy=policy, max_num_batched_tokens=64,
                             draft_suffix_decoding=beside)
        assert run(engine, {0: [0, 1, 2]}, params) == reference
        ps = prompts()
        for i in (0, 1, 2):
            engine.add_request(f"again{i}", ps[i], params)
        again = {o.request_id[5:]: o.outputs[0].token_ids for o in engine.run_until_done()
                 if o.finished}
        assert again == reference
        windows = engine.speculator.windows_by_source
        if beside:
            assert windows["suffix"] > windows["draft_model"]
        else:
            assert windows["suffix"] == 0 and windows["draft_model"] > 0


def test_cached_outputs_are_bounded_by_max_cached_requests() -> None:
    engine = spec_engine("suffix", 3, max_num_batched_tokens=64)
    engine.speculator.proposer.settings.max_cached_requests = 2
    run(engine, STAGGERED, GREEDY)
    proposer = engine.speculator.proposer
    assert len(proposer.cached) == 2 and len(proposer.outputs) == 2 and not proposer.own


@pytest.mark.parametrize(("key", "value", "message"), [
    ("suffix_decoding_max_tree_depth", 1, "suffix_decoding_max_tree_depth must be"),
    ("suffix_decoding_max_tree_depth", True, "suffix_decoding_max_tree_depth must be"),
    ("suffix_decoding_max_cached_requests", -1, "suffix_decoding_max_cached_requests must"),
    ("suffix_decoding_max_spec_factor", 0, "suffix_decoding_max_spec_factor must be"),
    ("suffix_decoding_min_token_prob", 1.5, "suffix_decoding_min_token_prob must be"),
])
def test_bad_suffix_settings_are_config_errors(key: str, value: object, message: str) -> None:
    spec = {"method": "suffix", "num_speculative_tokens": 4, key: value}
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model="tiny", speculative_config=spec)


def test_suffix_settings_belong_to_suffix_decoding() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8}
    with pytest.raises(ConfigError, match="only for method suffix or draft_suffix_decoding"):
        EngineConfig(model="tiny", speculative_config=spec)
    with pytest.raises(ConfigError, match="'draft_suffix_decoding' is only for method draft"):
        EngineConfig(model="tiny", speculative_config={
            "method": "suffix", "num_speculative_tokens": 4, "draft_suffix_decoding": True})
    EngineConfig(model="tiny", speculative_config={
        "method": "draft_model", "num_speculative_tokens": 4, "draft_suffix_decoding": True,
        "suffix_decoding_min_token_prob": 0.3})


def test_compaction_rebuilds_the_same_index() -> None:
    """The index compaction builds with numpy holds what indexing token by token did, and
    drafts come from it and from what is added after it alike."""
    rng = np.random.default_rng(1)
    corpus = SuffixCorpus(max_depth=24)
    text = {str(i): rng.integers(0, 20, 200).tolist() for i in range(30)}
    for sid, tokens in text.items():
        corpus.extend(sid, tokens)
    for i in range(0, 30, 2):
        corpus.remove(str(i))
    corpus._compact()
    again = SuffixCorpus(max_depth=24)
    again._tokens, again._end = corpus._tokens.copy(), corpus._end
    for span in corpus._spans.values():  # in arena order
        again._add_pairs(span.start, span.start + span.length)
    base = corpus._base
    rebuilt = {int(k): base.at[base.starts[i]:base.starts[i + 1]].tolist()
               for i, k in enumerate(base.keys)}
    assert rebuilt == {key: list(v) for key, v in again._index.items()}
    assert not corpus._index
    corpus.extend("new", [7, 7, 3, 4, 5])
    assert speculate(corpus, [3, 4], k=1, min_prob=0.0)[0]  # from both parts
    tokens = text["1"]
    assert speculate(corpus, tokens[:60], k=3, min_prob=0.0)[0] == tokens[60:63]
    empty = SuffixCorpus(max_depth=24)
    empty.extend("a", [1, 2, 3])
    empty.remove("a")
    empty._compact()
    assert not empty._base.keys.size and speculate(empty, [1, 2]) == ([], 0.0)


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_free_drafts_are_graded_and_each_grade_learned(method: str) -> None:
    """Suffix decoding grades its drafts by their estimated probability, prompt lookup by
    the matched n-gram's length; the goodput policy's estimate learns each grade's
    acceptance from the windows the engine verifies (losslessly either way)."""
    engine = spec_engine(method, 4, policy="goodput", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = run(engine, {0: [0, 1, 2]}, params)
    assert outputs == run(make_engine(max_num_batched_tokens=256), {0: [0, 1, 2]}, params)
    estimator = engine.speculator.acceptance
    assert estimator.levels and all(trials > 0 for _, trials in estimator.levels.values())
