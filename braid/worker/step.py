"""The step's sampling: from one forward's logits to each scheduled request's tokens and
logprobs. Every request that samples is a verification window (k = 0 for a plain decode),
verified in one batched call (verify.py); logprobs are taken once, from the raw rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from braid.config import SpecConfig
from braid.outputs import Logprob, PackedLogprobs, SampleLogprobs
from braid.sampling_params import SamplingParams
from braid.structured.grammar import allowed_tokens
from braid.worker.constraints import RequestConstraints
from braid.worker.sampler import SAMPLE, SamplingMetadata, gather_logprobs
from braid.worker.step_io import SampleResult, ScheduledSpan
from braid.worker.verify import verify


@dataclass(slots=True)
class WorkerRequest:
    """A request as the worker knows it: what its sampling reads, sent once, and its output
    so far (StepInput's updates)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    _constraints: RequestConstraints | None = None

    @property
    def constraints(self) -> RequestConstraints:
        """Its lists as tensors, built the first step it samples in (they never change)."""
        if self._constraints is None:
            self._constraints = RequestConstraints.build(self.sampling_params,
                                                         self.prompt_token_ids)
        return self._constraints


class SamplingRow(Protocol):
    """What a sampling row reads of its request (a WorkerRequest; the draft's Request)."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def seed(self) -> int: ...


class StepSampler:
    def __init__(self, device: torch.device, eos_token_ids: frozenset[int],
                 spec: SpecConfig | None = None) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.spec = spec  # its verification mode, when the engine speculates
        # The draft's q [k, V] of each request whose pending drafts it sampled, by request id
        # (rejection sampling reads them; one-hot drafts have none).
        self.draft_probs: dict[str, torch.Tensor] = {}

    def set_draft_probs(self, probs: Mapping[str, torch.Tensor],
                        drafts: Mapping[str, list[int]], cuts: Mapping[str, int]) -> None:
        """The probabilities of the drafts just proposed (every running request's: they
        replace the last proposal's). A grammar may cut a sampled draft only where the draft
        was certain of it (`cuts`: Scheduler.update_draft_token_ids)."""
        for request_id, n in cuts.items():
            q = probs.get(request_id)
            assert q is None or bool(q[n, drafts[request_id][n]] == 1.0), \
                "a sampled draft broke its grammar"
        self.draft_probs = dict(probs)

    def sample(self, spans: list[ScheduledSpan], requests: Mapping[str, WorkerRequest],
               logits: torch.Tensor) -> dict[str, SampleResult]:
        """The result of each span that samples, by request id (`logits` holds their rows
        in span order: 1 + k_i each)."""
        to_sample = [s for s in spans if s.samples]
        if not to_sample:
            return {}
        tokens = self._verify(to_sample, requests, logits)
        logprobs = self._logprobs(to_sample, requests, logits, tokens)
        return {s.request_id: SampleResult(tokens[i], None if logprobs is None else logprobs[i])
                for i, s in enumerate(to_sample)}

    def _verify(self, to_sample: list[ScheduledSpan], requests: Mapping[str, WorkerRequest],
                logits: torch.Tensor) -> list[list[int]]:
        out = verify(
            logits,
            [s.drafts for s in to_sample],
            self.metadata(to_sample, requests, logits.shape[-1]),
            [self._draft_probs(s) for s in to_sample],
            [self.uses_rejection(requests[s.request_id].sampling_params)
             and s.num_spec_tokens > 0 for s in to_sample],
        )
        ids = out.output_token_ids.tolist()
        return [row[: n + 1] for row, n in zip(ids, out.num_accepted.tolist(), strict=True)]

    def _draft_probs(self, s: ScheduledSpan) -> torch.Tensor | None:
        probs = self.draft_probs.get(s.request_id)
        return None if probs is None or not s.num_spec_tokens else probs[: s.num_spec_tokens]

    def uses_rejection(self, params: SamplingParams) -> bool:
        """Seeded requests are always verified coupled, so their tokens never depend on k."""
        return self.spec is not None and self.spec.verification_for(params) == "rejection"

    def metadata(self, to_sample: list[ScheduledSpan], requests: Mapping[str, WorkerRequest],
                 vocab_size: int) -> SamplingMetadata:
        """One row per window position; row j of a window sees its first j drafts as output
        (so penalties, min_tokens and its keyed number apply as if they had been accepted)."""
        rows: list[tuple[SamplingRow, list[int]]] = []
        masks: list[torch.Tensor | None] = []
        constraints = []
        for s in to_sample:
            req, drafts = requests[s.request_id], s.drafts
            rows += ((req, drafts[:j]) for j in range(1 + s.num_spec_tokens))
            masks += (None if s.grammar_bitmask is None else s.grammar_bitmask[j]
                      for j in range(1 + s.num_spec_tokens))
            constraints += [req.constraints] * (1 + s.num_spec_tokens)
        return rows_metadata(rows, vocab_size, self.device, self.eos_token_ids,
                             allowed=allowed_rows(masks, vocab_size, self.device),
                             constraints=constraints)

    def _logprobs(
        self, to_sample: list[ScheduledSpan], requests: Mapping[str, WorkerRequest],
        logits: torch.Tensor, tokens: list[list[int]]
    ) -> list[SampleLogprobs] | None:
        """Each emitted token's entry (raw model logprobs) and the top-n, per request."""
        wanted = [requests[s.request_id].sampling_params.logprobs for s in to_sample]
        if all(n is None for n in wanted):
            return None
        rows: list[int] = []
        starts = [0]
        for s, t in zip(to_sample, tokens, strict=True):
            rows += range(starts[-1], starts[-1] + len(t))
            starts.append(starts[-1] + 1 + s.num_spec_tokens)
        flat = [t for ts in tokens for t in ts]
        entries = _entries(logits[rows].float().log_softmax(dim=-1), torch.tensor(flat),
                           max(n or 0 for n in wanted))
        out, r = [], 0
        for n, t in zip(wanted, tokens, strict=True):
            out.append([_top_n(entries[r + j], n or 0) for j in range(len(t))])
            r += len(t)
        return out


def rows_metadata(
    rows: Sequence[tuple[SamplingRow, list[int]]], vocab_size: int, device: torch.device,
    eos_token_ids: frozenset[int] = frozenset(), stream: int | list[int] = SAMPLE,
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
    constraints: Sequence[RequestConstraints] | None = None,
) -> SamplingMetadata:
    """Sampling rows of (request, drafts before the row): the request's params and seed, its
    output followed by those drafts (the row's output position is their count). `allowed`:
    the rows a grammar restricts and their tokens (`allowed_rows`); `constraints`: each row's
    request's lists as tensors (built here when not given)."""
    return SamplingMetadata.build(
        params=[r.sampling_params for r, _ in rows],
        prompt_token_ids=[r.prompt_token_ids for r, _ in rows],
        output_token_ids=[r.output_token_ids + drafts for r, drafts in rows],
        seeds=[r.seed for r, _ in rows],
        vocab_size=vocab_size,
        device=device,
        eos_token_ids=eos_token_ids,
        stream=stream,
        allowed=allowed,
        constraints=constraints,
    )


def allowed_rows(bitmasks: Sequence[torch.Tensor | None], vocab_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row indices, [R, V] bool allowed tokens) of the rows that have a grammar's bitmask
    ([ceil(V / 32)] int32 each; None: unconstrained)."""
    constrained = [i for i, mask in enumerate(bitmasks) if mask is not None]
    if not constrained:
        return None
    stacked = torch.stack([m for m in bitmasks if m is not None])
    rows_index = torch.tensor(constrained, dtype=torch.int64, device=device)
    return rows_index, allowed_tokens(stacked, vocab_size).to(device)


def _entries(row_logprobs: torch.Tensor, tokens: torch.Tensor, n: int
             ) -> list[dict[int, Logprob]]:
    """Per row of `row_logprobs` [R, V]: its token (`tokens` [R]) with its rank in the
    vocabulary (1 + the tokens more likely), then the row's top-n ranked 1..n (vLLM's ranks;
    the row's token keeps its own where it is among them)."""
    lp = gather_logprobs(row_logprobs, tokens, n)
    ranks = ((row_logprobs > lp.logprobs[:, :1]).sum(dim=-1) + 1).tolist()
    out = []
    for ids, values, rank in zip(lp.token_ids.tolist(), lp.logprobs.tolist(), ranks,
                                 strict=True):
        entry = {ids[0]: Logprob(values[0], rank)}
        for i in range(1, len(ids)):
            entry.setdefault(ids[i], Logprob(values[i], i))
        out.append(entry)
    return out


def _packed_entries(row_logprobs: torch.Tensor, tokens: torch.Tensor, n: int
                    ) -> PackedLogprobs:
    """`_entries` as flat arrays, made with tensor ops (a long prompt's positions at top-20
    were ~30,000 Logprob objects made one by one inside the step)."""
    lp = gather_logprobs(row_logprobs, tokens, n)
    rows, width = lp.token_ids.shape
    ranks = torch.arange(width).expand(rows, width).clone()
    ranks[:, 0] = (row_logprobs > lp.logprobs[:, :1]).sum(dim=-1) + 1
    keep = torch.ones(rows, width, dtype=torch.bool)
    keep[:, 1:] = lp.token_ids[:, 1:] != lp.token_ids[:, :1]  # the token's own entry wins
    return PackedLogprobs.from_rows(lp.token_ids[keep].tolist(), lp.logprobs[keep].tolist(),
                                    ranks[keep].tolist(), keep.sum(dim=1).tolist())


def _top_n(entry: dict[int, Logprob], n: int) -> dict[int, Logprob]:
    """An entry of `_entries` cut to its token and its top n."""
    return {t: lp for i, (t, lp) in enumerate(entry.items())
            if i == 0 or (lp.rank is not None and lp.rank <= n)}


# Prompt positions scored per step beside decodes: their logits cells, at most (a row is a
# vocabulary-wide log-softmax and ranking, ~35 us per 152k-token row on an AVX2 core; 2^22
# cells are ~1 ms, about a tiny model's decode step's third). Scheduler.max_scored_rows.
SCORED_LOGITS = 1 << 22
MIN_SCORED_ROWS = 16


def max_scored_rows(vocab_size: int) -> int:
    """The prompt positions a step beside decodes may score (`SCORED_LOGITS`)."""
    return max(MIN_SCORED_ROWS, SCORED_LOGITS // vocab_size)


def score_prompts(spans: list[ScheduledSpan], requests: Mapping[str, WorkerRequest],
                  logits: torch.Tensor) -> dict[str, PackedLogprobs]:
    """Prompt logprobs from `logits` [P, V]: each span's `prompt_rows`, in span order (raw
    model logprobs, like sampled tokens' logprobs, and vocabulary ranks), by request id."""
    scored: dict[str, PackedLogprobs] = {}
    r = 0
    for s in spans:
        rows = s.query.prompt_rows
        if not rows:
            continue
        req = requests[s.request_id]
        first = s.query.start + rows.start  # position scoring token first + 1
        targets = torch.tensor(req.prompt_token_ids[first + 1 : first + 1 + len(rows)])
        n = req.sampling_params.prompt_logprobs or 0
        row_logprobs = logits[r : r + len(rows)].float().log_softmax(dim=-1)  # [R, V]
        scored[s.request_id] = _packed_entries(row_logprobs, targets, n)
        r += len(rows)
    return scored
