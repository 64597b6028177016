"""The scheduler's step as the executor's records (braid/worker/step_io.py): each scheduled
request's query span, its fixed parts the first time the worker meets it, the outputs the
worker has not seen, its grammar's masks, and the ids of requests that ended since."""

from __future__ import annotations

from braid.core.block_manager import BlockManager
from braid.core.request import Request
from braid.core.scheduler import ScheduledRequest, SchedulerOutput
from braid.structured.grammar import window_bitmask
from braid.worker.runner import QuerySpan
from braid.worker.step_io import NewRequest, ScheduledSpan, StepInput


def prompt_logprob_rows(req: Request, num_new_tokens: int) -> range:
    """Offsets in this step's span of `req` whose logits score a prompt token that has no
    logprob yet: position p scores prompt token p + 1. Positions scored before a preemption
    are not scored again; output and draft positions never are."""
    if not req.scores_prompt:
        return range(0)
    start = req.num_computed_tokens
    first = max(start, len(req.prompt_logprobs) - 1)
    end = min(start + num_new_tokens, req.num_prompt_tokens - 1)
    return range(first - start, max(end - start, first - start))


class StepInputs:
    def __init__(self, blocks: BlockManager, vocab_size: int) -> None:
        self.blocks = blocks
        self.vocab_size = vocab_size
        self.known: dict[str, int] = {}  # request id -> the output tokens the worker has
        self.finished: list[str] = []  # known requests that ended since the last step

    def unsent(self, req: Request) -> list[int]:
        """`req`'s output tokens the worker has not been sent yet (those of its last step:
        the next step it is scheduled in brings them)."""
        return req.output_token_ids[self.known.get(req.request_id, 0) :]

    def forget(self, request_id: str) -> None:
        """The request ended: the worker drops it with the next step."""
        if self.known.pop(request_id, None) is not None:
            self.finished.append(request_id)

    def build(self, sched: SchedulerOutput) -> StepInput:
        """The step's records. A grammar whose masks fail raises here, before the worker
        learned anything of the step (isolation.py finds that request)."""
        spans = [self._span(s) for s in sched.scheduled]
        new = [NewRequest(r.request_id, r.prompt_token_ids, r.sampling_params, r.seed)
               for s in sched.scheduled if (r := s.request).request_id not in self.known]
        for s in sched.scheduled:
            self.known[s.request.request_id] = s.request.num_output_tokens
        finished, self.finished = self.finished, []
        return StepInput(spans, new, finished)

    def _span(self, s: ScheduledRequest) -> ScheduledSpan:
        req, start = s.request, s.request.num_computed_tokens
        samples = s.needs_logits
        drafts = req.spec_token_ids[: s.num_spec_tokens]
        grammar = req.grammar if samples else None
        tables = self.blocks.block_tables(req.request_id)
        return ScheduledSpan(
            req.request_id,
            QuerySpan(req.token_ids(start, start + s.num_new_tokens), start, tables[0],
                      1 + s.num_spec_tokens if samples else 0,
                      prompt_logprob_rows(req, s.num_new_tokens), tuple(tables[1:])),
            s.num_spec_tokens,
            req.output_token_ids[self.known.get(req.request_id, 0) :],
            None if grammar is None else window_bitmask(grammar, drafts, self.vocab_size),
        )
