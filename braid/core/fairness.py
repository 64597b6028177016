"""Fair shares between API requests: the scheduler's rules for who decodes in a step and who
gives up a seat, as pure functions of the requests.

An engine request belongs to a group: the API request it came from (its prompts x n
choices; alone, a request is its own group). On a CPU a step's cost grows with its rows, so a
group of many choices would slow every other client's tokens in proportion, and holding every
seat, keep later requests from starting at all. While other groups decode, a group runs at
most as many decodes as all the others together, plus
FAIR_SLACK (its members take turns, longest waiting first), and a request whose grammar masks
are dear rests the steps the engine gave it (`Request.rest_steps`). Alone, a group is never
held back.
"""

from __future__ import annotations

from collections.abc import Sequence

from braid.core.request import Request

FAIR_SLACK = 2  # decodes a group may run beyond those of every other group together


def fair_decodes(decoding: list[Request]) -> tuple[list[Request], list[Request]]:
    """(the decodes that run this step, those held back), each in `decoding`'s order."""
    ready = [r for r in decoding if r.rest_steps == 0] or list(decoding)
    groups: dict[str, list[Request]] = {}
    for r in ready:
        groups.setdefault(r.group, []).append(r)
    chosen = {id(r) for r in ready}
    if len(groups) > 1:
        for members in groups.values():
            allowed = len(ready) - len(members) + FAIR_SLACK
            waited = sorted(members, key=lambda r: r.last_scheduled_step)
            chosen.difference_update(map(id, waited[allowed:]))
    if len(chosen) == len(decoding):
        return decoding, []
    return ([r for r in decoding if id(r) in chosen],
            [r for r in decoding if id(r) not in chosen])


def seat_giver(running: Sequence[Request], newcomer: Request) -> Request | None:
    """The running request that gives its seat to `newcomer` when every seat is taken: the
    newest of the group holding the most, if `newcomer`'s group holds none and that group
    holds more than one."""
    if any(r.group == newcomer.group for r in running):
        return None
    held: dict[str, int] = {}
    for r in running:
        held[r.group] = held.get(r.group, 0) + 1
    group = max(held, key=lambda g: held[g], default=None)
    if group is None or held[group] < 2:
        return None
    return next(r for r in reversed(running) if r.group == group)
