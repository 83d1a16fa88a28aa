"""The token budget of the next step, sized by time on this device.

A step that carries prefill tokens puts a gap into every running stream, and every request that
arrives meanwhile waits behind it. How many tokens fit a given time depends on the device, the model
and what else the machine runs, so it is measured while serving: each step's wall time is fitted
against its token count (least squares over the recent steps, older ones weighing less), and the
budget is what the fit says fits the step's target time:

- while requests decode, `decode_ratio` times what the fit predicts for their decode step alone, so
  a stream's slowest gaps stay within that factor of its usual one, on a fast device or a slow one;
- while nothing decodes (nobody to stall), `target_s`, which bounds the wait of arrivals.

The budget grows at most twofold past the largest step measured so far, so it never extrapolates
far from what was seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A step always carries at least this many tokens, however slow the device looks.
MIN_STEP_TOKENS = 16
# Before any step was measured: a step this size is cheap on any device, and its time starts the fit.
FIRST_STEP_TOKENS = 64
# Weight of a measured step after the next one: about the last 1 / (1 - DECAY) = 20 steps count.
DECAY = 0.95


@dataclass
class _Fit:
    """Exponentially weighted least squares of a step's seconds over its tokens and its attention
    work (the keys its new tokens attend to: a prefill token at context 3,000 costs more than one at
    context 100). M holds the weighted sums of products of (1, tokens, work, seconds)."""

    m: list[list[float]] = field(default_factory=lambda: [[0.0] * 4 for _ in range(4)])

    def add(self, tokens: float, work: float, seconds: float) -> None:
        f = (1.0, tokens, work, seconds)
        for i in range(4):
            for j in range(4):
                self.m[i][j] = self.m[i][j] * DECAY + f[i] * f[j]

    def line(self) -> tuple[float, float]:
        """(seconds per step, seconds per token), ignoring the work. Where the steps measured are
        all of one size (or the fit slopes down, as noise can make it), every second is charged to
        the tokens: an overestimate per token, so the budget errs small."""
        m = self.m
        n, x, xx, y, xy = m[0][0], m[0][1], m[1][1], m[0][3], m[1][3]
        var = n * xx - x * x
        slope = (n * xy - x * y) / var if var > 1e-9 * n * xx else 0.0
        if slope <= 0.0:
            return 0.0, y / x
        return max(0.0, (y - slope * x) / n), slope

    def plane(self) -> tuple[float, float, float]:
        """(seconds per step, per token, per unit of work). The line (no work term) where the steps
        seen cannot separate the work from the tokens, or the fit gives a negative coefficient."""
        m = self.m
        a = [[m[i][j] for j in range(3)] for i in range(3)]
        rhs = [m[i][3] for i in range(3)]
        det = _det3(a)
        if abs(det) > 1e-9 * a[0][0] * a[1][1] * a[2][2] > 0.0:
            coef = []
            for k in range(3):
                swapped = [[rhs[i] if j == k else a[i][j] for j in range(3)] for i in range(3)]
                coef.append(_det3(swapped) / det)
            if min(coef) >= 0.0:
                return coef[0], coef[1], coef[2]
        per_step, per_token = self.line()
        return per_step, per_token, 0.0


def _det3(a: list[list[float]]) -> float:
    return (
        a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
        - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
        + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
    )


class StepBudget:
    """Tokens the next step may carry: `max_tokens` when no target is set (`target_s` 0), else as
    many as the measured step times say fit the step's target (between MIN_STEP_TOKENS and
    max_tokens)."""

    def __init__(self, max_tokens: int, target_s: float, decode_ratio: float = 0.0) -> None:
        self.max_tokens = max_tokens
        self.target_s = target_s
        self.decode_ratio = decode_ratio
        self._fit = _Fit()
        self._largest = 0

    def observe(self, tokens: int, seconds: float, work: float = 0.0) -> None:
        """Records one step: the tokens it computed, its attention work (see step_work) and its wall
        time."""
        if tokens <= 0 or seconds <= 0.0:
            return
        self._fit.add(float(tokens), work, seconds)
        self._largest = max(self._largest, tokens)

    def tokens(self, decode_tokens: int, decode_work: float = 0.0, context: int = 0) -> int:
        """The budget of a step whose running requests compute `decode_tokens` (included in it) with
        `decode_work`, the prefill tokens going to a prompt `context` tokens in."""
        if self.target_s <= 0.0:
            return self.max_tokens
        if self._largest == 0:
            return min(self.max_tokens, FIRST_STEP_TOKENS)
        per_step, per_token, per_work = self._fit.plane()
        decode_alone = per_step + per_token * decode_tokens + per_work * decode_work
        target = self.target_s
        if decode_tokens and self.decode_ratio > 0.0:
            target = self.decode_ratio * decode_alone
        # n prefill tokens at `context` add per_token * n + per_work * (n * context + n * n / 2).
        room, linear = target - decode_alone, per_token + per_work * context
        if room <= 0.0:
            extra = 0.0
        elif per_work > 0.0:
            extra = (math.sqrt(linear * linear + 2.0 * per_work * room) - linear) / per_work
        else:
            extra = room / linear
        fits = decode_tokens + int(extra)
        return max(MIN_STEP_TOKENS, min(fits, 2 * self._largest, self.max_tokens))


def step_work(extends: list[tuple[int, int]]) -> float:
    """The attention work of a step's (prefix_len, extend_len) chunks: the keys their new tokens
    attend to (a decode token at context c: c + 1)."""
    return sum(n * (p + (n + 1) / 2) for p, n in extends)
