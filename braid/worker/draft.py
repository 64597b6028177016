"""The draft model's forwards, in the worker: a smaller model with the same vocabulary and its
own paged KV cache, drafting for the requests the engine names (spec_decode/draft.py decides
which, from where, and how many).

The draft cache uses the target's block tables (same slot layout, its own tensors). A call
takes one `DraftSpan` per request: its catch-up (the tokens from where the draft's KV stops
through the request's last token, run in one flat forward with every other request's, which
yields the first draft) and how many drafts to make; then k - 1 more single-token forwards,
batched over the requests still drafting.

Drafts are the draft's argmax after the request's grammar, penalties, logit_bias and
min_tokens, as the target's greedy token is ("greedy"), or for requests that sample a draw
from the draft's own distribution after the request's penalties and filters: with the keyed
number the target's draw at that output position uses ("coupled"), or with a stream of its
own ("independent"); `SpecConfig.draft_sampling_for` picks per request. The q rows of
requests verified by rejection sampling stay here, by request id, until the executor hands
them to its sampler for the window that verifies them (`take_probs`: only those of the
drafts this model drew in its last call), as vLLM keeps them in its worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from braid.config import SpecConfig
from braid.models.interface import CausalLM
from braid.sampling_params import SamplingParams
from braid.structured.grammar import bitmask_after
from braid.worker.constraints import RequestConstraints
from braid.worker.runner import ModelRunner, QuerySpan
from braid.worker.sampler import DRAFT, SAMPLE, SamplingMetadata, apply_penalties, sample_rows
from braid.worker.step import SamplingRow, WorkerRequest, allowed_rows, rows_metadata


@dataclass(slots=True)
class DraftForward:
    """One forward a proposer ran: what the speculation cost model learns from."""

    num_tokens: int  # query tokens
    num_rows: int  # logits rows (requests drafting in it)
    seconds: float


@dataclass(slots=True)
class DraftSpan:
    """One request's part of a draft call (a plain record)."""

    request_id: str
    query: QuerySpan  # its catch-up: tokens, first position, block table, 1 logits row
    k: int  # drafts to make (>= 1)
    new_output_ids: list[int] = field(default_factory=list)  # outputs the worker lacks


@dataclass(slots=True)
class DraftResult:
    drafts: list[list[int]]  # per span
    forwards: list[DraftForward]


@dataclass(slots=True)
class _Row:
    """A drafting request as its sampling rows read it (a SamplingRow): the worker's record
    with the outputs it has not been sent yet, and how its drafts are drawn."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int
    constraints: RequestConstraints
    draws: str  # "greedy", "coupled" or "independent" (SpecConfig.draft_sampling_for)
    keeps_q: bool  # verified by rejection sampling: its q rows are kept
    shaped: bool  # its greedy token may not be the model's plain argmax (grammar, penalties)


class DraftWorker:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 device: torch.device, spec: SpecConfig | None = None,
                 kv_dtype: torch.dtype | None = None,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.runner = ModelRunner(model, num_blocks, block_size, device, kv_dtype)
        self.runner.logit_ids = None if spec is None else spec.draft_vocab_size
        # greedy forwards through the two-stage head where the model can have one
        self.coarse_head = (spec is None or spec.draft_coarse_head) and model.add_coarse_head()
        # the target's: min_tokens suppresses them, and a row its constraints leave no token
        # takes the first, in draft rows as in the target's
        self.eos_token_ids = eos_token_ids
        self.spec = spec  # how each request's drafts are drawn and verified (None: greedy)
        # The last call's drafts and the q [k, V] they were drawn from, by request id, until
        # the executor hands them on (`take_probs`)
        self.pending: dict[str, tuple[list[int], torch.Tensor]] = {}

    def propose(self, spans: list[DraftSpan], requests: Mapping[str, WorkerRequest],
                grammar_of: Callable[[str], Any]) -> DraftResult:
        """Each span's drafts; the q rows of those that keep them replace `pending`.
        `grammar_of`: a request's live grammar by id (None: none)."""
        self.pending = {}
        result = DraftResult([[] for _ in spans], [])
        if not spans:
            return result
        rows = [self._row(requests[s.request_id], s, grammar_of) for s in spans]
        q_rows: list[list[torch.Tensor]] = [[] for _ in spans]
        active = list(range(len(spans)))
        queries = [s.query for s in spans]
        for j in range(max(s.k for s in spans)):
            if j:
                active = [i for i in active if spans[i].k > j]
                queries = [QuerySpan([result.drafts[i][-1]],
                                     spans[i].query.start + len(spans[i].query.token_ids) + j - 1,
                                     spans[i].query.block_table, 1) for i in active]
            tokens, probs = self._run(queries, [spans[i] for i in active],
                                      [rows[i] for i in active],
                                      [result.drafts[i] for i in active], grammar_of, result)
            for row, (i, token) in enumerate(zip(active, tokens, strict=True)):
                result.drafts[i].append(token)
                if (q := probs[row]) is not None and rows[i].keeps_q:
                    q_rows[i].append(q)
        self.pending = {s.request_id: (list(d), torch.stack(q))
                        for s, d, q in zip(spans, result.drafts, q_rows, strict=True) if q}
        return result

    def _row(self, req: WorkerRequest, span: DraftSpan, grammar_of: Callable[[str], Any]
             ) -> _Row:
        params = req.sampling_params
        outputs = (req.output_token_ids + span.new_output_ids if span.new_output_ids
                   else req.output_token_ids)
        spec = self.spec
        return _Row(params, req.prompt_token_ids, outputs, req.seed, req.constraints,
                    "greedy" if spec is None else spec.draft_sampling_for(params),
                    spec is not None and spec.verification_for(params) == "rejection",
                    (grammar_of(span.request_id) is not None or params.shapes_logits
                     or len(outputs) < params.min_tokens))  # (its ends still suppressed)

    def take_probs(self, drafts: Mapping[str, list[int]]) -> dict[str, torch.Tensor]:
        """The q rows of the drafts the next step verifies: those of the last call, for each
        request whose drafts are the ones this model drew (all or the first of them, where a
        grammar cut them); none twice. A request drafting from another source (a prompt
        lookup, its grammar's forced tokens), or in a round that did not call the draft
        model, gets none: its drafts are one-hot."""
        pending, self.pending = self.pending, {}
        return {rid: q for rid, (drawn, q) in pending.items()
                if (final := drafts.get(rid)) and drawn[: len(final)] == list(final)}

    def _run(self, queries: list[QuerySpan], spans: list[DraftSpan], rows: list[_Row],
             drafted: list[list[int]], grammar_of: Callable[[str], Any], result: DraftResult
             ) -> tuple[list[int], list[torch.Tensor | None]]:
        """The next draft token of each query's request (after its `drafted` tokens) and the
        q row it was drawn from (None for an argmax); the forward's size and time go to
        `result.forwards`."""
        start = time.perf_counter()
        probs: list[torch.Tensor | None] = [None] * len(spans)
        inp = self.runner.build_input(queries)
        if self.coarse_head and all(r.draws == "greedy" and not r.shaped for r in rows):
            tokens = self.runner.execute_greedy(inp)
        else:
            tokens = self._pick(self.runner.execute(inp), spans, rows, drafted, grammar_of,
                                probs)
        result.forwards.append(DraftForward(inp.input_ids.numel(), len(queries),
                                            time.perf_counter() - start))
        return tokens.tolist(), probs

    def _pick(self, logits: torch.Tensor, spans: list[DraftSpan], rows: list[_Row],
              drafted: list[list[int]], grammar_of: Callable[[str], Any],
              probs: list[torch.Tensor | None]) -> torch.Tensor:
        """Each row's draft token from the draft's logits [R, V], as its span's draws say; the
        q rows sampled tokens were drawn from go into `probs`."""
        tokens = logits.argmax(dim=-1)
        shaped = [i for i, r in enumerate(rows) if r.draws == "greedy" and r.shaped]
        if shaped:  # the target's argmax sees the grammar, penalties and bias: so does ours
            meta = self._metadata(shaped, spans, rows, drafted, grammar_of, logits)
            tokens[shaped] = apply_penalties(logits[shaped], meta).argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if r.draws != "greedy"]
        if sampled:
            # the target's sampling rows at these positions: keyed in the target's stream for
            # coupled draws, in the draft's own for independent ones
            meta = self._metadata(sampled, spans, rows, drafted, grammar_of, logits,
                                  [SAMPLE if rows[i].draws == "coupled" else DRAFT
                                   for i in sampled])
            picked, q = sample_rows(logits[sampled], meta)
            assert q is not None  # every sampled row is a random one
            tokens[sampled] = picked
            for row, i in enumerate(sampled):
                probs[i] = q[row]
        return tokens

    def _metadata(self, picked: list[int], spans: list[DraftSpan], rows: list[_Row],
                  drafted: list[list[int]], grammar_of: Callable[[str], Any],
                  logits: torch.Tensor,
                  stream: int | list[int] = SAMPLE) -> SamplingMetadata:
        """The target's sampling rows for rows `picked` of this forward (after their
        drafts)."""
        vocab = logits.shape[-1]
        masks = [None if (g := grammar_of(spans[i].request_id)) is None
                 else bitmask_after(g, drafted[i], vocab) for i in picked]
        pairs: list[tuple[SamplingRow, list[int]]] = [(rows[i], drafted[i]) for i in picked]
        return rows_metadata(pairs, vocab, logits.device, self.eos_token_ids, stream,
                             allowed_rows(masks, vocab, logits.device),
                             [rows[i].constraints for i in picked])

