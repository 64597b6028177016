"""Speculation as the engine sees it: after every step, pick k per request (policy), get that
many drafts (proposer), and learn from what verification accepted and what steps cost.

It reads the scheduler (its requests and its view of the next step) and hands drafts back;
the scheduler writes them (`update_draft_token_ids`) and reserves their KV slots."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from braid.config import SpecConfig
from braid.core.request import Request
from braid.core.scheduler import RequestUpdate, Scheduler
from braid.models.config import ModelConfig
from braid.spec_decode.goodput import FixedPolicy, GoodputPolicy, Window, usual_lag
from braid.spec_decode.ngram import NgramProposer
from braid.spec_decode.policy import AcceptanceEstimator, age_floor, expected_tokens
from braid.spec_decode.prediction import PredictedOutputs
from braid.spec_decode.proposer import Proposal, Proposer
from braid.spec_decode.suffix import SuffixProposer, SuffixSettings
from braid.worker.runner import ModelRunner

logger = logging.getLogger("braid")

# Prior of suffix-decoding drafts (method suffix, or beside a draft model): they are cut
# where their estimated probability falls below suffix_decoding_min_token_prob, so what is
# drafted is likely (docs/benchmarks.md, Agentic sessions and suffix decoding).
SUFFIX_PRIOR_ALPHA = 0.6
# Prior acceptance before any verification (roughly what each method gets on code).
PRIOR_ALPHA = {"draft_model": 0.7, "ngram": 0.3, "suffix": SUFFIX_PRIOR_ALPHA}
# Prior of lookups beside a draft model: about what n-grams of 2-5 accept on the target's
# own outputs, code and chat alike (docs/benchmarks.md, What the policy's rules rest on).
LOOKUP_PRIOR_ALPHA = 0.5
# Prior of a client's predicted output: it is what the client expects the reply to be
# (an edited file is mostly its original), so most of it is taken where it is followed.
PREDICTION_PRIOR_ALPHA = 0.8
# Prior of the tokens a request's grammar forces: the mask allows nothing else there (a
# model may still write the same text in other tokens, which rejects the draft).
FORCED_PRIOR_ALPHA = 0.95
LOG_EVERY = 100  # steps between cost-model log lines

@dataclass(slots=True)
class SpeculatorFigures:
    """What the speculator tells the outside world (logs, /metrics, benchmarks)."""

    chosen_k: dict[int, int]  # how often each k was chosen for a decoding request
    predicted_step_time: float  # seconds, of the step the last proposal was made for
    cost_model_error: float  # moving mean of the target step's relative prediction error
    acceptance_estimate: float  # global per-draft acceptance (the proposer's own drafts)
    lookup_windows: int  # windows whose drafts came from a prompt lookup instead
    lookup_acceptance_estimate: float | None  # the lookups' own (None: no lookups beside)


class Speculation:
    """What the engine asks of speculation, once per step. This base is speculation off (no
    drafts, nothing to learn, no prefill cap), so the engine runs one path either way;
    `Speculator` below is speculation on."""

    def prefill_cap(self, scheduler: Scheduler) -> int | None:
        """Prefill tokens the next step may carry (None: no cap)."""
        return None

    def propose(self, scheduler: Scheduler) -> dict[str, list[int]]:
        """Drafts for the next step by request id (the q rows of sampled ones stay in the
        worker: Executor.set_drafts)."""
        return {}

    def next_drafts(self, scheduler: Scheduler) -> dict[str, list[int]]:
        """`propose`, where a proposer that raises costs this step's drafts only: the draft
        model's progress is forgotten (it catches up later), and a request at fault fails
        alone in the next target step, which meets the same fault."""
        try:
            return self.propose(scheduler)
        except Exception:
            logger.exception("proposing drafts failed; this step goes without")
            for req in scheduler.running:
                self.forget(req.request_id)
            return {}

    def observe_step(self, tokens: int, attention: int, rows: int, seconds: float) -> None:
        """A target step's size and duration (the cost model's evidence)."""

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """A window of `req`'s drafts was verified."""

    def on_update(self, u: RequestUpdate) -> None:
        """A request's step: its window's figures, and what the policy learns from the drafts
        it proposed (those a grammar cut count as rejected)."""
        if u.num_drafts:
            u.request.spec_stats.record(u.num_drafts, u.num_accepted)
        if u.num_drafts or u.num_grammar_rejected:
            self.on_verified(u.request, u.num_drafts + u.num_grammar_rejected, u.num_accepted)

    def forget(self, request_id: str) -> None:
        """The request finished or lost its KV blocks (preempted)."""

    def finish(self, req: Request) -> None:
        """The request finished: `forget`, but a proposer may keep what it wrote."""
        self.forget(req.request_id)

    def request_figures(self, req: Request) -> dict[str, float | str]:
        return {}

    def figures(self) -> SpeculatorFigures | None:
        return None

    @property
    def draft_runner(self) -> ModelRunner | None:
        """The draft model's runner (its weights and KV cache), if it has one."""
        return None

    def release_windows(self, scheduler: Scheduler, target: ModelConfig) -> None:
        """Where every layer of the target, and of the draft model if one runs, attends in a
        window, have the scheduler give back each request's blocks before the largest one,
        counted from what both models still compute (a draft model catches up on its own KV:
        from where its progress stops)."""
        draft = self.draft_config
        windows = [target.kv_window] + ([] if draft is None else [draft.kv_window])
        if None in windows:
            return
        scheduler.sliding_window = max(w for w in windows if w is not None)
        if draft is not None:
            lag = self.proposer_lag
            scheduler.kv_floor = lambda req: min(req.num_computed_tokens,
                                                 req.num_tokens - lag(req))

    def proposer_lag(self, req: Request) -> int:
        """Tokens of `req` the proposer has yet to process (its draft model's catch-up)."""
        return 0

    @property
    def draft_config(self) -> ModelConfig | None:
        """The draft model's config, where one drafts."""
        return None


class Candidate(NamedTuple):
    """A free source's drafts for one window (Window's source, lookup, level, forced)."""

    source: str
    drafts: list[int]
    level: int | None = None  # their confidence level (None: ungraded)
    forced: int = 0  # leading drafts a grammar forces, where `source` continues them


def _graded(proposal: Proposal, i: int) -> tuple[list[int], int | None]:
    """Request i's drafts in `proposal`, and their confidence level (None: ungraded)."""
    return proposal.drafts[i], None if proposal.levels is None else proposal.levels[i]


class Speculator(Speculation):
    def __init__(self, spec: SpecConfig, proposer: Proposer, max_model_len: int,
                 target_itl: float | None = None) -> None:
        self.config = spec
        self.proposer = proposer
        self.max_model_len = max_model_len
        # A proposer without a model (ngram, suffix) drafts before the policy chooses, as the
        # free sources do, so the policy plans the drafts there are (a request with none
        # plans as a decode); its acceptance is the speculator's own.
        self.free_main = proposer.runner is None
        self.acceptance = AcceptanceEstimator(
            prior=PRIOR_ALPHA[spec.method],
            age_floor=age_floor(self.free_main))
        # Prompt lookup beside a draft model (SpecConfig.draft_prompt_lookup): its drafts'
        # acceptance is learned apart from the model's (lookups accept markedly less).
        self.lookup = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                       if spec.method == "draft_model" and spec.draft_prompt_lookup else None)
        # Suffix decoding beside a draft model (SpecConfig.draft_suffix_decoding)
        self.suffix = (SuffixProposer(SuffixSettings.of(spec))
                       if spec.method == "draft_model" and spec.draft_suffix_decoding else None)
        self.predicted = PredictedOutputs()  # drafts from a request's `prediction`
        # the free sources' acceptance, learned apart from the proposer's, by Window.source
        self.free_acceptance = {
            source: AcceptanceEstimator(prior=prior, age_floor=age_floor(free=True))
            for source, prior in (("lookup", LOOKUP_PRIOR_ALPHA),
                                  ("prediction", PREDICTION_PRIOR_ALPHA),
                                  ("grammar", FORCED_PRIOR_ALPHA),
                                  ("suffix", SUFFIX_PRIOR_ALPHA))}
        if self.free_main:
            self.free_acceptance[spec.method] = self.acceptance
        self.policy: FixedPolicy = (
            FixedPolicy() if spec.policy == "fixed" else
            GoodputPolicy(spec, proposer, max_model_len, self.acceptance,
                          self.free_acceptance, target_itl))
        # requests whose pending drafts came from a free source: which, and their level
        self._looked_up: dict[str, tuple[str, int | None, int]] = {}
        self.lookup_windows = 0  # verified windows whose drafts came from a lookup
        self.chosen_k: Counter[int] = Counter()  # how often each k was chosen for a request
        self.windows_by_source: Counter[str] = Counter()  # verified windows by draft source
        self._steps = 0

    # ---- per step -----------------------------------------------------------------------

    def propose(self, scheduler: Scheduler) -> dict[str, list[int]]:
        """Drafts for the next step of every running request, by request id."""
        windows = [Window(r, 0 if r.is_prefilling else self._cap(r))
                   for r in scheduler.running]
        found = self._free_drafts(windows)
        self.policy.choose(windows, scheduler.next_step())
        if self.proposer.needs_kv_slots:
            for w in windows:
                w.k = scheduler.reserve_draft_slots(w.req, w.k)
        # the proposer drafts for the requests without a lookup; it leaves the others behind
        for w in windows:
            w.started = w.model_k > 0 and self.proposer.lag(w.req) > usual_lag(self.config)
        proposal = self.proposer.propose([w.req for w in windows],
                                         [w.model_k for w in windows])
        for f in proposal.forwards:
            self.policy.observe_draft(f.num_tokens, f.num_rows, f.seconds)
        for w, d in zip(windows, proposal.drafts, strict=True):
            w.drafts = w.lookup[: w.k] if w.lookup else d
            if w.forced and len(w.drafts) <= w.forced:  # cut to its forced run
                w.source, w.level, w.forced = "grammar", None, 0
        for w in windows:
            if not w.req.is_prefilling:
                self._account(w)
        if any(w.cap and not w.lookup for w in windows) and not any(proposal.drafts):
            self.acceptance.age()
            self.policy.on_idle()
        for source in found - {w.source for w in windows if w.drafts} - {self.config.method}:
            # found, not worth verifying by the estimate: it ages, so the source is tried
            # again in time
            self.free_acceptance[source].age()
        return {w.req.request_id: w.drafts for w in windows}

    def _account(self, w: Window) -> None:
        """What a decoding request's window tells the estimators and the policy."""
        rid = w.req.request_id
        self.chosen_k[len(w.drafts)] += 1
        self._looked_up.pop(rid, None)
        if w.lookup:
            # neither starts nor stops the draft model's drafting; the tokens this window
            # emits are lag the draft catches up on when the model drafts for the request
            # again, priced then like any backlog beyond the usual lag (a start; counting
            # them as usual lag measured no better: docs/benchmarks.md, What the policy's
            # rules rest on)
            if w.drafts:
                self._looked_up[rid] = (w.source, w.level, w.forced)
            if w.source != self.config.method:
                self.acceptance.rest(rid)  # no model drafts: its evidence ages
        elif w.drafts:
            self.policy.on_started(w)
        elif w.cap:
            self.policy.on_stopped(w.req)
            self.acceptance.rest(rid)

    def _cap(self, req: Request) -> int:
        """Drafts beyond what the request can still emit are waste."""
        k = min(self.config.num_speculative_tokens, self.max_model_len - req.num_tokens)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _free_drafts(self, windows: Sequence[Window]) -> set[str]:
        """Each window's drafts from a source that costs no forward, if any: of the tokens
        its grammar forces (at least two, or its cap: SGLang's jump-forward as drafts), its
        predicted output's (where the output follows it), its prompt lookup
        (draft_prompt_lookup: `cap` tokens; a shorter one the draft model would out-draft),
        its suffix decoding's (draft_suffix_decoding: at least two, or its cap) and a
        model-free proposer's (ngram, suffix), the one expected to emit the most tokens at
        its source's acceptance estimate. The sources chosen for some window."""
        requests, caps = [w.req for w in windows], [w.cap for w in windows]
        none = Proposal([[] for _ in windows])
        found = self.lookup.propose(requests, caps) if self.lookup is not None else none
        main = self.proposer.propose(requests, caps) if self.free_main else none
        for i, w in enumerate(windows):
            if not w.cap:
                continue
            candidates = [c for c in [*self._candidates(w, _graded(found, i)),
                                      Candidate(self.config.method, *_graded(main, i))]
                          if c.drafts]
            if candidates:
                best = max(candidates, key=lambda c: self._expected(w.req.request_id, c))
                w.source, w.lookup, w.level, w.forced = best
            elif self.free_main:
                w.cap = 0  # nothing to draft
        return {w.source for w in windows if w.lookup}

    def _expected(self, rid: str, c: Candidate) -> float:
        """Tokens a window of all of candidate `c`'s drafts is expected to emit."""
        head_alpha = self.free_acceptance["grammar"].alpha(rid) if c.forced else 1.0
        return expected_tokens(self.free_acceptance[c.source].alpha(rid, level=c.level),
                               len(c.drafts), c.forced, head_alpha)

    def _candidates(self, w: Window, look: tuple[list[int], int | None]) -> list[Candidate]:
        """Each free source's drafts for window `w` ([] where it has none worth verifying)
        and their confidence level (None: ungraded); `look` is its prompt lookup's. Where
        the request's grammar forces a run shorter than the cap, each model-free source
        also drafts on from the run's end: the forced tokens, then its own."""
        grammar = w.req.grammar
        forced = grammar.forced_tokens(w.cap) if grammar is not None else []
        suffix, level = (self.suffix.draft_graded(w.req, w.cap) if self.suffix is not None
                         else ([], None))
        least = min(2, w.cap)
        predicted = self.predicted.drafts(w.req, w.cap)
        # one forced token is worth a window where no draft model's would be displaced
        return [Candidate("grammar", forced if len(forced) >= (
                    1 if self.free_main else least) else []),
                Candidate("prediction", predicted if len(predicted) >= least else []),
                Candidate("lookup", look[0] if len(look[0]) == w.cap else [], look[1]),
                Candidate("suffix", suffix if len(suffix) >= least else [], level),
                *(self._after_forced(w, forced) if 0 < len(forced) < w.cap else [])]

    def _after_forced(self, w: Window, forced: list[int]) -> list[Candidate]:
        """Window `w`'s grammar-forced run continued by each model-free source (a lookup
        beside a draft model only where it fills the window, as above)."""
        rest = w.cap - len(forced)
        sources: list[tuple[str, Proposer | None]] = [
            ("lookup", self.lookup), ("suffix", self.suffix),
            (self.config.method, self.proposer if self.free_main else None)]
        out = []
        for source, proposer in sources:
            if proposer is None:
                continue
            drafts, level = proposer.draft_after(w.req, forced, rest)
            if drafts and (source != "lookup" or len(drafts) == rest):
                out.append(Candidate(source, forced + drafts, level, len(forced)))
        return out

    def prefill_cap(self, scheduler: Scheduler) -> int | None:
        return self.policy.prefill_cap(list(scheduler.running), scheduler.next_step())

    @property
    def lookup_acceptance(self) -> AcceptanceEstimator:
        return self.free_acceptance["lookup"]

    def on_verified(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        source, level, forced = self._looked_up.pop(req.request_id, ("", None, 0))
        if forced and num_drafted <= forced:  # a short step budget cut it to the forced run
            source, level, forced = "grammar", None, 0
        self.windows_by_source[f"grammar+{source}" if forced else source
                               or self.config.method] += 1
        self.lookup_windows += source == "lookup"
        if source == "prediction":
            req.spec_stats.record_prediction(num_drafted, num_accepted)
        if forced:  # the forced run's drafts are the grammar's evidence, the rest the source's
            self.free_acceptance["grammar"].update(req.request_id, forced,
                                                   min(num_accepted, forced))
            if num_accepted < forced:
                return
            num_drafted, num_accepted = num_drafted - forced, num_accepted - forced
        estimator = self.free_acceptance[source] if source else self.acceptance
        estimator.update(req.request_id, num_drafted, num_accepted, level)

    def observe_step(self, tokens: int, attention: int, rows: int, seconds: float) -> None:
        predicted = self.policy.observe_target(tokens, attention, rows, seconds)
        if predicted is None:
            return
        self._steps += 1
        if self._steps % LOG_EVERY == 0:
            logger.info("cost model: step of %d tokens predicted %.0f ms, took %.0f ms; mean "
                        "relative error %.1f%%; acceptance estimate %.2f; k chosen %s; %d "
                        "windows from prompt lookups",
                        tokens, predicted * 1e3, seconds * 1e3, self.policy.cost_error * 100,
                        self.acceptance.global_alpha, dict(sorted(self.chosen_k.items())),
                        self.lookup_windows)

    def finish(self, req: Request) -> None:
        self.proposer.finish(req)
        if self.suffix is not None:
            self.suffix.finish(req)
        self._forget_state(req.request_id)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        if self.suffix is not None:
            self.suffix.forget(request_id)
        self._forget_state(request_id)

    def _forget_state(self, request_id: str) -> None:
        """Everything but the proposer's state of the request."""
        self.acceptance.forget(request_id)
        for estimator in self.free_acceptance.values():
            estimator.forget(request_id)
        if self.lookup is not None:
            self.lookup.forget(request_id)
        self.predicted.forget(request_id)
        self._looked_up.pop(request_id, None)
        self.policy.forget(request_id)

    def request_figures(self, req: Request) -> dict[str, float | str]:
        """Per-response figures: the acceptance estimates (the model's, and the lookups'
        where they draft beside it), and how this request's drafts were verified and (draft
        model) drawn."""
        figures: dict[str, float | str] = {
            "acceptance_estimate": round(self.acceptance.alpha(req.request_id), 4),
            "verification": self.config.verification_for(req.sampling_params),
        }
        if self.config.method == "draft_model":
            figures["draft_sampling"] = self.config.draft_sampling_for(req.sampling_params)
        if self.lookup is not None:
            figures["lookup_acceptance_estimate"] = round(
                self.lookup_acceptance.alpha(req.request_id), 4)
        return figures

    @property
    def draft_runner(self) -> ModelRunner | None:
        return self.proposer.runner

    @property
    def draft_config(self) -> ModelConfig | None:
        return getattr(self.proposer, "config", None)

    def proposer_lag(self, req: Request) -> int:
        return self.proposer.lag(req)

    def figures(self) -> SpeculatorFigures:
        return SpeculatorFigures(
            dict(self.chosen_k), self.policy.predicted_step_time, self.policy.cost_error,
            self.acceptance.global_alpha, self.lookup_windows,
            None if self.lookup is None else self.lookup_acceptance.global_alpha)

    def warm_up(self, target: ModelRunner, scheduler: Scheduler) -> None:
        """The policy's warm-up forwards (the goodput policy's cost model anchors)."""
        self.policy.warm_up(target, self.proposer.runner, scheduler, self.proposer.coarse_head)
