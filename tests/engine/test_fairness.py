"""Fair shares between API requests (braid/core/fairness.py): a group of many
choices decodes at most as many rows as every other group together (plus FAIR_SLACK), its
members taking turns; a request whose grammar masks are dear rests steps in proportion. No
output changes: a request's tokens do not depend on which step computes them."""

from __future__ import annotations

from dataclasses import replace

import torch

from braid.core.fairness import FAIR_SLACK
from braid.core.scheduler import ScheduledRequest, SchedulerOutput
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams, StructuredOutputsParams
from braid.structured.grammar import bitmask_width
from braid.tokenizer import Tokenizer
from tests.engine.test_engine import make_engine
from tests.tiny import VOCAB, byte_tokenizer

TOKENIZER = Tokenizer(byte_tokenizer(), {"eos_token": "<|endoftext|>"})
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)


def add_group(engine: LLMEngine, name: str, n: int, prompt: list[int]) -> None:
    for j in range(n):
        engine.add_request(f"{name}-{j}", prompt, replace(SAMPLED, seed=j), group=name)


def outputs(engine: LLMEngine) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """Tokens by request, and per step (rows of group "big", rows of others) of decodes."""
    done: dict[str, list[int]] = {}
    rows = []
    while engine.has_unfinished_requests():
        decoding = {r.request_id for r in engine.scheduler.running if not r.is_prefilling}
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        ran = [r for r in decoding if r not in engine.requests
               or engine.requests[r].last_scheduled_step == engine.scheduler.num_steps]
        rows.append((sum(r.startswith("big") for r in ran),
                     sum(not r.startswith("big") for r in ran)))
    return done, rows


def test_a_group_of_many_choices_takes_turns_beside_others() -> None:
    engine = make_engine()
    add_group(engine, "big", 12, list(b"a long shared prompt"))
    engine.add_request("small", list(b"hello"), GREEDY)
    done, rows = outputs(engine)
    assert all(big <= small + FAIR_SLACK for big, small in rows if small)
    alone = make_engine()
    add_group(alone, "big", 12, list(b"a long shared prompt"))
    alone_done, alone_rows = outputs(alone)
    assert max(big for big, _ in alone_rows) == 12  # alone, a group is not held back
    small = make_engine()
    small.add_request("small", list(b"hello"), GREEDY)
    assert done == {**alone_done, **outputs(small)[0]}


def test_every_member_of_a_held_group_progresses() -> None:
    engine = make_engine()
    add_group(engine, "big", 8, list(b"shared"))
    for i in range(2):
        engine.add_request(f"other{i}", list(b"x") * (i + 1), replace(GREEDY, max_tokens=40))
    done, rows = outputs(engine)
    assert len(done) == 10 and all(len(t) == 10 for r, t in done.items() if r.startswith("big"))
    assert any(0 < big < 8 for big, small in rows if small)  # turns were taken


def test_a_request_with_dear_masks_rests_while_others_decode() -> None:
    """Masks that took most of a step (here: a mask computed just before a step of nearly no
    other work) make the request sit out steps while another decodes; then it goes on."""
    engine = make_engine(tokenizer=TOKENIZER)
    literal = "ab" * 4000
    heavy = SamplingParams(temperature=0, max_tokens=6,
                           structured_outputs=StructuredOutputsParams(regex=literal))
    engine.add_request("heavy", list(b"go"), heavy)
    engine.add_request("light", list(b"hello"), replace(GREEDY, max_tokens=30))
    while (req := engine.requests["heavy"]).is_prefilling or req.grammar is None:
        engine.step()
    assert req.grammar is not None
    req.grammar.fill_mask([], torch.zeros(bitmask_width(VOCAB), dtype=torch.int32))
    engine.grammars.share_time(SchedulerOutput([ScheduledRequest(req, 1, 0)]), 1e-6)
    rest = req.rest_steps
    assert rest > 0
    for _ in range(rest):
        out = engine.scheduler.schedule()
        assert [s.request.request_id for s in out.scheduled] == ["light"]
        assert [r.request_id for r in out.held] == ["heavy"]
        engine.scheduler.discard_published(out)
    done = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done() if o.finished}
    assert bytes(done["heavy"]) == literal[:6].encode()


def test_a_request_gets_a_seat_from_a_group_that_took_them_all() -> None:
    """Every seat taken by one group: a request of another group waits one step at most (the
    group's newest member gives its seat up and waits behind it); no output changes."""
    engine = make_engine(max_num_seqs=6)
    add_group(engine, "big", 6, list(b"shared"))
    engine.step()
    assert len(engine.scheduler.running) == 6
    engine.add_request("late", list(b"hello"), GREEDY)
    engine.step()
    assert "late" in {r.request_id for r in engine.scheduler.running}
    assert engine.requests["big-5"].num_preemptions == 1
    done, _ = outputs(engine)
    alone = make_engine()
    add_group(alone, "big", 6, list(b"shared"))
    alone.add_request("late", list(b"hello"), GREEDY)
    assert done == outputs(alone)[0]
