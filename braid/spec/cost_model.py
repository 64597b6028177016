"""Online model of step cost: how long the target forward (and a draft forward) will take.

Target: t = a + b*q + c*max(0, q - knee) + d*ctx, fitted by least squares over a sliding
window of measured steps (q query tokens, ctx cached tokens attended). There is no
per-request term on purpose: under a steady policy the query tokens are nearly proportional
to the number of requests, and a fit free to split the cost between the two would
extrapolate the cost of k = 0 from the cost of the k it happened to run (drafts look free).
The hinge captures the roofline: up to a few dozen tokens a forward streams the weights once
and costs about the same, past that it becomes compute-bound. The knee is the one of a few
candidates that fits best. Warm-up measurements stay in the fit as anchors, so a window of
identical steady-state steps cannot make the model blind to other sizes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

KNEES = (8, 16, 32, 64, 128)


@dataclass
class LinearFit:
    """Least squares with non-negative slopes over (features, seconds) samples."""

    window: int = 256
    anchors: list[tuple[tuple[float, ...], float]] = field(default_factory=list)
    recent: deque[tuple[tuple[float, ...], float]] = field(default_factory=deque)
    coef: np.ndarray | None = None

    def add(self, x: tuple[float, ...], seconds: float, anchor: bool = False) -> None:
        (self.anchors if anchor else self.recent).append((x, seconds))
        if len(self.recent) > self.window:
            self.recent.popleft()
        self.coef = None

    def fit(self) -> np.ndarray | None:
        samples = self.anchors + list(self.recent)
        if len(samples) < 2:
            return None
        xs = np.array([(1.0, *x) for x, _ in samples])
        ys = np.array([y for _, y in samples])
        return _nonnegative_lstsq(xs, ys)

    def predict(self, x: tuple[float, ...]) -> float:
        if self.coef is None:
            self.coef = self.fit()
        if self.coef is None:
            return 0.0
        return float(self.coef @ np.array((1.0, *x)))

    def residual(self) -> float:
        samples = self.anchors + list(self.recent)
        return float(sum((self.predict(x) - y) ** 2 for x, y in samples))


def _nonnegative_lstsq(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (more tokens, context or requests never
    make a step cheaper): refit without the most negative coefficient until none is left
    (an active-set approximation of NNLS; exact for the few features used here in practice).
    Clipping after an unconstrained fit would be wrong: a negative slope on one feature would
    have bent all the others."""
    active = list(range(xs.shape[1]))
    coef = np.zeros(xs.shape[1])
    while active:
        fit = np.linalg.lstsq(xs[:, active], ys, rcond=None)[0]  # minimum-norm if alike
        worst = int(np.argmin(fit))
        if fit[worst] >= 0:
            coef[active] = fit
            return coef
        active.pop(worst)
    return coef


class StepCostModel:
    def __init__(self, window: int = 256) -> None:
        self._target = {knee: LinearFit(window) for knee in KNEES}
        self._knee = KNEES[1]
        self._draft = LinearFit(window)
        self._num_target = 0
        self.error_ema = 0.0  # relative |predicted - measured| / measured of target steps

    @staticmethod
    def _features(knee: int, tokens: int, requests: int, context: int) -> tuple[float, ...]:
        return (tokens, max(0, tokens - knee), context / 1000.0)

    def observe_target(self, tokens: int, requests: int, context: int, seconds: float,
                       anchor: bool = False) -> None:
        predicted = self.target_time(tokens, requests, context)
        if predicted > 0 and not anchor:
            error = abs(predicted - seconds) / seconds
            self.error_ema = error if self._num_target == 0 else 0.9 * self.error_ema + 0.1 * error
            self._num_target += 1
        for knee, fit in self._target.items():
            fit.add(self._features(knee, tokens, requests, context), seconds, anchor)
        if anchor or self._num_target % 32 == 0:
            self._knee = min(self._target, key=lambda k: self._target[k].residual())

    def observe_draft(self, tokens: int, seconds: float, anchor: bool = False) -> None:
        self._draft.add((tokens,), seconds, anchor)

    def target_time(self, tokens: int, requests: int, context: int) -> float:
        """Predicted seconds of one target forward."""
        return self._target[self._knee].predict(
            self._features(self._knee, tokens, requests, context))

    def draft_time(self, tokens: int) -> float:
        """Predicted seconds of one draft forward over `tokens` query tokens."""
        return self._draft.predict((tokens,))
