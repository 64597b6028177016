"""Online model of step cost: how long a target forward (and a draft forward) will take.

One forward costs t = a + b*q + sum_j c_j*max(0, q - knee_j) + d*attn + e*rows, fitted by
non-negative least squares over a sliding window of measured forwards (q query tokens, attn the
attention work sum_i q_i * kv_i of its windows, rows the positions that need logits: the LM
head over a 150k vocabulary is a large matmul of its own, paid by every verified position but
only once per prefill chunk). The hinges make the token curve piecewise linear and
convex: up to a few dozen tokens a forward streams the weights once and costs about the same,
past that it becomes compute-bound and each token costs more. Attention is a feature of its
own so that long contexts do not bend the token curve (a fit over total context instead
charged every decode of a long conversation as if it were a prefill chunk).

There is no per-request term on purpose: under a steady policy the query tokens are nearly
proportional to the number of requests, and a fit free to split the cost between the two would
extrapolate the cost of k = 0 from the cost of the k it happened to run (drafts look free).
Warm-up measurements stay in the fit as anchors, so a window of identical steady-state steps
cannot make the model blind to other sizes.

Small forwards are not smooth in q: on a CPU the matmul library switches kernels with the
number of rows (a 6-token target forward can cost what a 1-token one does and a 7-token one
clearly more). Those few-token steps are where the policy decides between k = 1 and k = 2, so
the fit is corrected at q <= EXACT_UP_TO by the median residual of the forwards measured at
each size (interpolated between measured sizes; where a smaller size looks dearer than a
larger one, the older measurement gives way). The fit minimizes relative error: in absolute
seconds the long prefill steps would outweigh the decode steps the policy compares.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from braid.core.scheduler import SchedulerOutput

EXACT_UP_TO = 64  # query tokens up to which measured sizes correct the fit
# A fit waits until the forwards observed since the last one are this share of its samples
# (every one while there are few; every ~9 with a full window and the warm-up anchors). A
# fit costs ~1 ms of Python and numpy: refitting after every step made a speculating
# engine's steps ~1 ms dearer than plain decoding's even at k = 0.
REFIT_SHARE = 1 / 32
KNEES = (4, 8, 16, 32, 64, 128, 256)
ATTENTION_UNIT = 1e6  # attention work is fitted per million query-key pairs


def attention_work(query_len: int, context_len: int) -> int:
    """Query-key pairs of one window of `query_len` tokens after `context_len` cached ones."""
    return query_len * (context_len + query_len)


def step_work(sched: SchedulerOutput) -> tuple[int, int]:
    """A step's attention work and logits rows, as the cost model prices them."""
    attention = sum(attention_work(s.num_new_tokens, s.request.num_computed_tokens)
                    for s in sched.scheduled)
    rows = sum(1 + s.num_spec_tokens for s in sched.scheduled if s.needs_logits)
    return attention, rows


@dataclass
class ForwardCost:
    """Seconds of one forward of a model from its query tokens, attention work and logits
    rows."""

    window: int = 256
    anchors: list[tuple[np.ndarray, float]] = field(default_factory=list)
    recent: deque[tuple[np.ndarray, float]] = field(default_factory=deque)
    error_ema: float = 0.0  # relative |predicted - measured| / measured, online samples
    _coef: list[float] | None = None
    _sizes: list[int] = field(default_factory=list)  # measured sizes <= EXACT_UP_TO, sorted
    _residuals: list[float] = field(default_factory=list)  # median residual at each size
    _num_observed: int = 0
    _unfitted: int = 0  # forwards observed since the last fit

    @staticmethod
    def features(tokens: float | np.ndarray, attention: float | np.ndarray,
                 rows: float | np.ndarray) -> np.ndarray:
        """[F] for one forward, or [N, F] for arrays of N."""
        t = np.asarray(tokens, dtype=float)
        hinges = [np.maximum(t - knee, 0.0) for knee in KNEES]
        return np.stack(np.broadcast_arrays(np.ones_like(t), t, *hinges,
                                            np.asarray(attention) / ATTENTION_UNIT,
                                            np.asarray(rows, dtype=float)), axis=-1)

    def observe(self, tokens: float, attention: float, rows: float, seconds: float,
                anchor: bool = False) -> None:
        x = self.features(tokens, attention, rows)
        if not anchor and self._num_observed + len(self.anchors) >= 2:
            error = abs(self(tokens, attention, rows) - seconds) / max(seconds, 1e-9)
            self.error_ema = (error if self._num_observed == 0
                              else 0.9 * self.error_ema + 0.1 * error)
        if not anchor:
            self._num_observed += 1
        (self.anchors if anchor else self.recent).append((x, seconds))
        if len(self.recent) > self.window:
            self.recent.popleft()
        self._unfitted += 1
        if self._unfitted >= REFIT_SHARE * (len(self.anchors) + len(self.recent)):
            self._coef = None

    def __call__(self, tokens: float, attention: float = 0.0, rows: float | None = None
                 ) -> float:
        """Predicted seconds; `rows` defaults to every token (decode and verification).
        Plain Python (the policy asks hundreds of times per step; numpy's per-call overhead
        was most of its cost)."""
        return (self.without_attention(tokens, tokens if rows is None else rows)
                + self.seconds_per_attention * attention)

    def without_attention(self, tokens: float, rows: float) -> float:
        """Predicted seconds of the forward before its attention work, which is priced
        linearly on top (seconds_per_attention): the policy's candidate steps share this part
        and differ in attention, so it memoizes it."""
        c = self._coefficients()
        seconds = c[0] + c[1] * tokens + c[-1] * rows
        for j, knee in enumerate(KNEES):
            if tokens <= knee:
                break
            seconds += c[2 + j] * (tokens - knee)
        return seconds + self.correction(tokens)

    @property
    def seconds_per_attention(self) -> float:
        return self._coefficients()[-2] / ATTENTION_UNIT

    def correction(self, tokens: float) -> float:
        """What forwards measured at (or around) this size took beyond the fit."""
        sizes, residuals = self._sizes, self._residuals
        if not sizes or tokens > sizes[-1]:
            return 0.0
        j = bisect.bisect_left(sizes, tokens)
        if sizes[j] == tokens or j == 0:
            return residuals[j]
        w = (tokens - sizes[j - 1]) / (sizes[j] - sizes[j - 1])
        return (1 - w) * residuals[j - 1] + w * residuals[j]

    def _coefficients(self) -> list[float]:
        if self._coef is None:
            self._fit()
        assert self._coef is not None
        return self._coef

    def _fit(self) -> None:
        self._unfitted = 0
        samples = self.anchors + list(self.recent)
        self._sizes, self._residuals = [], []
        if not samples:
            self._coef = [0.0] * (len(KNEES) + 4)
            return
        x = np.array([s[0] for s in samples])
        y = np.array([s[1] for s in samples])
        weight = 1.0 / np.maximum(y, 1e-6)  # relative error
        coef = nnls(x * weight[:, None], y * weight)
        self._coef = coef.tolist()
        # The median residual at each measured size <= EXACT_UP_TO, and the index of the
        # newest forward of that size (-1: anchors only), without a Python loop over samples
        small = np.flatnonzero(x[:, 1] <= EXACT_UP_TO)
        if not small.size:
            return
        sizes, group = np.unique(x[small, 1].astype(int), return_inverse=True)
        residual = (y - x @ coef)[small]
        ordered = residual[np.lexsort((residual, group))]  # by size, then residual
        counts = np.bincount(group)
        first = np.cumsum(counts) - counts
        medians = (ordered[first + (counts - 1) // 2] + ordered[first + counts // 2]) / 2
        newest = np.full(len(sizes), -1)
        np.maximum.at(newest, group, small - len(self.anchors))
        self._sizes = sizes.tolist()
        fitted = (self.features(sizes, 0.0, sizes) @ coef).tolist()
        times = [f + m for f, m in zip(fitted, medians.tolist(), strict=True)]
        # More query tokens never make a forward cheaper. Where two neighbouring sizes say
        # otherwise, the older evidence gives way: a size measured while the machine was
        # slower and not visited since (the policy avoids what looks slow) would otherwise
        # stay dear and push the policy to a larger size that is truly dearer.
        age = newest.tolist()
        for j in reversed(range(len(times) - 1)):
            if times[j] > times[j + 1] and age[j] < age[j + 1]:
                times[j] = times[j + 1]
        for j in range(1, len(times)):
            if times[j] < times[j - 1] and age[j] < age[j - 1]:
                times[j] = times[j - 1]
        self._residuals = [t - f for t, f in zip(times, fitted, strict=True)]


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """min |a x - b| subject to x >= 0 (Lawson-Hanson active set). Every coefficient is a
    cost, so none may be negative: more tokens or attention never make a step cheaper.
    Clipping an unconstrained fit would be wrong: one negative slope bends all the others."""
    scale = np.maximum(np.abs(a).max(axis=0), 1e-12)  # columns of comparable size
    a = a / scale
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    w = a.T @ (b - a @ x)
    for _ in range(3 * n):
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            blocked = passive & (z <= tol)
            step = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + step * (z - x)
            passive &= x > tol
        x = z
        w = a.T @ (b - a @ x)
    return x / scale


class StepCostModel:
    """The target forward and the draft forward, each a ForwardCost."""

    def __init__(self, window: int = 256) -> None:
        self.target = ForwardCost(window)
        self.draft = ForwardCost(window)

    @property
    def error_ema(self) -> float:
        return self.target.error_ema

    def observe_target(self, tokens: int, attention: int, rows: int, seconds: float,
                       anchor: bool = False) -> None:
        self.target.observe(tokens, attention, rows, seconds, anchor)

    def observe_draft(self, tokens: int, rows: int, seconds: float, anchor: bool = False
                      ) -> None:
        self.draft.observe(tokens, 0, rows, seconds, anchor)

    def target_time(self, tokens: float, attention: float = 0.0, rows: float | None = None
                    ) -> float:
        """Predicted seconds of one target forward (`rows` logits rows, default all)."""
        return self.target(tokens, attention, rows)

    def target_time_without_attention(self, tokens: float, rows: float | None = None
                                      ) -> float:
        """target_time(tokens, 0, rows): target_time(tokens, a, rows) is this plus
        target_seconds_per_attention * a."""
        return self.target.without_attention(tokens, tokens if rows is None else rows)

    @property
    def target_seconds_per_attention(self) -> float:
        return self.target.seconds_per_attention

    def draft_time(self, tokens: float, rows: float | None = None) -> float:
        """Predicted seconds of one draft forward over `tokens` query tokens."""
        return self.draft(tokens, 0.0, rows) if tokens else 0.0
