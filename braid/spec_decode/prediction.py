"""Predicted outputs (OpenAI's `prediction` field): drafts from the text the client expects
the reply to be, e.g. the file it asked to have edited. The output is followed along the
prediction token by token; where it departs (the edit), the next drafts wait until the
output's last few tokens are found in the prediction again, and go on from there. Lossless
like every draft source: the target verifies each token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from braid.core.request import Request
from braid.spec_decode.ngram import longest_match_ends

# Output tokens that must match the prediction to pick it up again after a departure: the
# longest match first, at least REJOIN_MIN (one token recurs too often to mean much).
REJOIN_MAX = 8
REJOIN_MIN = 2


@dataclass(slots=True)
class Alignment:
    """Where one request's output stands in its prediction."""

    prediction: np.ndarray  # [P] the predicted token ids
    position: int | None = 0  # the prediction's token the next output token should be
    seen: int = 0  # output tokens followed so far
    # the furthest position reached (past a departure): an output rejoins there or later
    # where it can
    last: int = 0


class PredictedOutputs:
    """Each request's prediction and its alignment with the output."""

    def __init__(self) -> None:
        self._alignments: dict[str, Alignment] = {}

    def drafts(self, req: Request, k: int) -> list[int]:
        """Up to k predicted tokens that would follow the output so far ([] where the output
        has left the prediction and not rejoined it, or at its end)."""
        predicted = req.sampling_params.prediction_token_ids
        if not predicted or k <= 0:
            return []
        a = self._alignments.get(req.request_id)
        if a is None:
            a = self._alignments[req.request_id] = Alignment(np.asarray(predicted))
        output = req.output_token_ids
        for token in output[a.seen:]:
            p = a.position
            if p is not None and p < len(a.prediction) and a.prediction[p] == token:
                a.position = p + 1
            elif p is not None:  # departed at p: rejoining there would depart again
                a.position, a.last = None, max(a.last, p + 1)
        a.seen = len(output)
        if a.position is None:
            a.position = rejoin(a.prediction, output, a.last)
        if a.position is None:
            return []
        a.last = max(a.last, a.position)
        return a.prediction[a.position:a.position + k].tolist()

    def forget(self, request_id: str) -> None:
        self._alignments.pop(request_id, None)


def rejoin(prediction: np.ndarray, output: list[int], after: int = 0) -> int | None:
    """The prediction's position after an occurrence of the output's longest tail
    (REJOIN_MAX down to REJOIN_MIN tokens): the first one ending at or after `after`, else
    the first one; None where the tail occurs nowhere."""
    longest = min(REJOIN_MAX, len(output), len(prediction))
    if longest < REJOIN_MIN:
        return None
    ends, matched = longest_match_ends(prediction, np.asarray(output[-longest:]), longest)
    if not ends.size or matched < REJOIN_MIN:
        return None
    positions = ends + 1
    later = positions[positions >= after]
    return int(later[0] if later.size else positions[0])
