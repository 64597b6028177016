"""The goodput policy's choice of k, played back on recorded acceptance.

A greedy request's window of drafts is accepted up to the first draft that differs from the
target's own next token. So record once, for every output position, how many drafts in a row
a window starting there would have accepted (`accepted_runs`: the draft model's argmax along
the target's output, or a prompt lookup at each prefix), and any rule that picks k each step
can be played back exactly and without the machine's noise: a window of k drafts at a
position emits min(run, k) + 1 tokens (`replay`). Steps are priced in target decodes
(`Costs`), so a rule's speedup over no speculation is tokens over decodes' worth of time.
Results: docs/benchmarks.md, The acceptance estimate on replayed windows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams
from braid.spec_decode.ngram import NgramMatcher
from braid.spec_decode.policy import DRAFT_MODEL_AGE_FLOOR, AcceptanceEstimator, expected_tokens
from braid.spec_decode.speculator import Speculator
from braid.worker.runner import QuerySpan


@dataclass(frozen=True)
class Costs:
    """A step's time in target decodes: a window of t query tokens costs windows[t - 1]
    (windows[0] = 1), and each of its k drafts one draft forward (`draft`; 0 for drafts
    that cost no forward)."""

    windows: tuple[float, ...]
    draft: float

    def step(self, k: int) -> float:
        return self.windows[k] + k * self.draft

    @classmethod
    def parse(cls, text: str) -> Costs:
        """'draft=0.42,1.15,1.3,1.47': a draft forward, then windows of 2, 3, 4 ... tokens."""
        draft, windows = 0.0, [1.0]
        try:
            for part in filter(None, text.split(",")):
                if part.startswith("draft="):
                    draft = float(part.removeprefix("draft="))
                else:
                    windows.append(float(part))
        except ValueError:
            windows = []
        if len(windows) < 2 or not all(0 < w < math.inf for w in windows) or not (
                0 <= draft < math.inf):
            raise ValueError(f"{text!r}: give draft=D (>= 0) and the costs of windows of "
                             "2, 3, ... tokens (> 0), in decodes")
        return cls(tuple(windows), draft)


def accepted_runs(guesses: Sequence[int], tokens: Sequence[int], first: int, longest: int
                  ) -> list[int]:
    """For each position p from `first` to the sequence's last, the drafts in a row a window
    starting at p accepts (at most `longest`): the positions q >= p where guesses[q] (the
    proposer's token for position q, from tokens[:q]) equals tokens[q]."""
    hit = np.asarray(guesses[first:]) == np.asarray(tokens[first:])
    runs = np.zeros(hit.shape[0] + 1, dtype=np.int64)
    for i in range(hit.shape[0] - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if hit[i] else 0
    return np.minimum(runs[:-1], longest).tolist()


def lookup_runs(tokens: Sequence[int], first: int, longest: int, matcher: NgramMatcher
                ) -> tuple[list[int], list[int], list[int]]:
    """`accepted_runs` of prompt lookup (the drafts it proposes from each prefix, matched
    against what the target wrote), at each position how many drafts it has at all (0
    where nothing matches: the step is a plain decode), and their confidence level (the
    matched length)."""
    seq = np.asarray(tokens)
    runs, lengths, levels = [], [], []
    for p in range(first, len(tokens)):
        drafts, level = matcher.match_graded(seq[:p], longest)
        n = 0
        while n < len(drafts) and p + n < len(tokens) and drafts[n] == tokens[p + n]:
            n += 1
        runs.append(n)
        lengths.append(len(drafts))
        levels.append(level)
    return runs, lengths, levels


@dataclass
class Replay:
    """What a rule did over the requests: tokens emitted, their cost in decodes, the ks."""

    tokens: int = 0
    cost: float = 0.0
    ks: Counter[int] = field(default_factory=Counter)

    @property
    def speedup(self) -> float:
        """Tokens per decode's worth of time (no speculation: 1.0; no tokens: 0.0)."""
        return self.tokens / self.cost if self.cost else 0.0


Rule = Callable[[str, int], int]  # (request id, the most drafts it may take) -> k


def best_k(alpha: float, cap: int, costs: Costs) -> int:
    """The k that maximises expected tokens per cost at one request (choose_ks's objective
    without its margins and catch-ups)."""
    return max(range(cap + 1), key=lambda k: expected_tokens(alpha, k) / costs.step(k))


def replay(requests: Sequence[Sequence[int]], estimator: AcceptanceEstimator | None,
           costs: Costs, longest: int, rule: Rule | None = None,
           lengths: Sequence[Sequence[int]] | None = None,
           levels: Sequence[Sequence[int]] | None = None) -> Replay:
    """Play requests one after another (one at a time, as at concurrency 1), each step a
    window of k drafts: k from `rule`, or (rule None) best_k at the estimator's alpha, at
    most the drafts the proposer has there (`lengths`, per request and position; None: as
    many as asked), of the confidence `levels` the proposer gave them (None: ungraded).
    The estimator learns from every window as the speculator's does (update, rest and age
    at k = 0 where there were drafts to take, forget at the end)."""
    assert len(costs.windows) > longest, f"price windows of up to {longest + 1} tokens"
    out = Replay()
    for i, runs in enumerate(requests):
        rid = str(i)
        p = 0
        while p < len(runs):
            # drafts past the last token are waste
            cap = min(longest, len(runs) - p - 1,
                      longest if lengths is None else lengths[i][p])
            if not cap:
                k = 0
            elif rule is not None:
                k = min(rule(rid, cap), cap)
            else:
                assert estimator is not None, "give an estimator or a rule"
                level = None if levels is None else levels[i][p]
                k = best_k(estimator.alpha(rid, level=level), cap, costs)
            accepted = min(runs[p], k)
            if estimator is not None and cap:
                if k:
                    estimator.update(rid, k, accepted, None if levels is None else levels[i][p])
                else:
                    estimator.rest(rid)
                    estimator.age()
            out.tokens += accepted + 1
            out.cost += costs.step(k)
            out.ks[k] += 1
            p += accepted + 1
        if estimator is not None:
            estimator.forget(rid)
    return out


def hindsight_alpha(runs: Sequence[int], longest: int,
                    lengths: Sequence[int] | None = None) -> float:
    """The request's acceptance as windows of `longest` drafts (or as many as there are:
    `lengths`) measure it over its whole output (the rule 'each request's true alpha, known
    in advance' plays with it)."""
    accepted = trials = 0
    p = 0
    while p < len(runs):
        k = min(longest, len(runs) - p - 1, longest if lengths is None else lengths[p])
        a = min(runs[p], k)
        accepted, trials = accepted + a, trials + a + (a < k)
        p += a + 1
    return accepted / trials if trials else 0.0


PLAYED_WEIGHTS = (1.0, 4.0, 16.0, 64.0, 256.0)


def play_rules(requests: Sequence[Sequence[int]], costs: Costs, longest: int, prior: float,
               lengths: Sequence[Sequence[int]] | None = None,
               age_floor: float = DRAFT_MODEL_AGE_FLOOR,
               levels: Sequence[Sequence[int]] | None = None
               ) -> tuple[dict[str, Replay], float]:
    """Every rule played back on `requests`: each fixed k up to `longest`, each request's
    hindsight alpha (known in advance: a bound for any estimate), the acceptance estimate
    with prior weights fixed at PLAYED_WEIGHTS and with its
    fitted weight (`prior`: the estimate's prior acceptance; `age_floor`: as the
    speculator sets it for the source), and with the drafts' confidence `levels` where the
    proposer grades them. Also the weight the fit ended at."""
    rules = {f"fixed k={k}": replay(requests, None, costs, longest, _fixed(k), lengths)
             for k in range(1, longest + 1)}
    alphas = {str(i): hindsight_alpha(r, longest, None if lengths is None else lengths[i])
              for i, r in enumerate(requests)}
    rules["hindsight alpha"] = replay(
        requests, None, costs, longest, lambda rid, cap: best_k(alphas[rid], cap, costs),
        lengths)
    for weight in PLAYED_WEIGHTS:
        rules[f"prior weight {weight:g}"] = replay(
            requests, AcceptanceEstimator(prior=prior, fixed_weight=weight, age_floor=age_floor),
            costs, longest, lengths=lengths)
    fitted = AcceptanceEstimator(prior=prior, age_floor=age_floor)
    rules["fitted prior weight"] = replay(requests, fitted, costs, longest, lengths=lengths)
    if levels is not None:
        rules["fitted prior weight, confidence levels"] = replay(
            requests, AcceptanceEstimator(prior=prior, age_floor=age_floor), costs, longest,
            lengths=lengths, levels=levels)
    return rules, fitted.prior_weight


def _fixed(k: int) -> Rule:
    return lambda rid, cap: k


def lookup_record(sequences: Sequence[dict[str, Any]], longest: int, matcher: NgramMatcher
                  ) -> dict[str, list[list[int]]]:
    """`lookup_runs` of each recorded sequence ({"tokens", "first"}), as `record_runs` of
    benchmarks/bench_spec.py keeps them: "ngram", "ngram_lengths", "ngram_levels"."""
    out: dict[str, list[list[int]]] = {"ngram": [], "ngram_lengths": [], "ngram_levels": []}
    for seq in sequences:
        for key, values in zip(out, lookup_runs(seq["tokens"], seq["first"], longest, matcher),
                               strict=True):
            out[key].append(values)
    return out


def record_runs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, longest: int
                ) -> dict[str, Any]:
    """The draft model's `accepted_runs` along the target's greedy output of each prompt
    (`engine` drafts with a draft model; "draft_model") and the sequences themselves
    ("sequences": prompt and output, and where the output's second token is), from which
    `lookup_record` derives prompt lookup's."""
    assert isinstance(engine.speculator, Speculator), "needs a draft model"
    draft = engine.speculator.draft_runner
    assert draft is not None, "needs a draft model"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    runs: dict[str, Any] = {"draft_model": [], "sequences": []}
    for i, prompt in enumerate(tqdm(prompts, desc="recording acceptance", leave=False)):
        engine.add_request(f"replay-{i}", prompt, params)
        out = [o for o in engine.run_until_done() if o.finished][-1].outputs[0]
        seq, first = [*prompt, *out.token_ids], len(prompt) + 1
        if len(seq) <= first:
            continue
        with engine.scheduler.scratch_blocks(len(seq)) as tables:
            assert tables is not None, "the KV cache is too small for a whole sequence"
            inp = draft.build_input([QuerySpan(seq, 0, tables[0], len(seq) - first + 1)])
            ids = (draft.execute_greedy(inp) if engine.speculator.proposer.coarse_head
                   else draft.execute(inp).argmax(-1))
        guesses = [-1] * first + ids[:-1].tolist()  # guesses[q]: the draft's, from seq[:q]
        runs["draft_model"].append(accepted_runs(guesses, seq, first, longest))
        runs["sequences"].append({"tokens": seq, "first": first})
    return runs
