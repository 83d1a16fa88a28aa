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

from dataclasses import dataclass

# A step always carries at least this many tokens, however slow the device looks.
MIN_STEP_TOKENS = 16
# Before any step was measured: a step this size is cheap on any device, and its time starts the fit.
FIRST_STEP_TOKENS = 64
# Weight of a measured step after the next one: about the last 1 / (1 - DECAY) = 20 steps count.
DECAY = 0.95


@dataclass
class _Fit:
    """Exponentially weighted sums of (tokens, seconds), for a line seconds = a + b * tokens."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        for name in ("n", "x", "y", "xx", "xy"):
            setattr(self, name, getattr(self, name) * DECAY)
        self.n += 1.0
        self.x += x
        self.y += y
        self.xx += x * x
        self.xy += x * y

    def line(self) -> tuple[float, float]:
        """(seconds per step, seconds per token). Where the steps measured are all of one size (or
        the fit slopes down, as noise can make it), every second is charged to the tokens: an
        overestimate per token, so the budget errs small."""
        var = self.n * self.xx - self.x * self.x
        slope = (self.n * self.xy - self.x * self.y) / var if var > 1e-9 * self.n * self.xx else 0.0
        if slope <= 0.0:
            return 0.0, self.y / self.x
        return max(0.0, (self.y - slope * self.x) / self.n), slope


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

    def observe(self, tokens: int, seconds: float) -> None:
        """Records one step: the tokens it computed and its wall time."""
        if tokens <= 0 or seconds <= 0.0:
            return
        self._fit.add(float(tokens), seconds)
        self._largest = max(self._largest, tokens)

    def tokens(self, decode_tokens: int) -> int:
        """The budget of a step whose running requests compute `decode_tokens` (included in it)."""
        if self.target_s <= 0.0:
            return self.max_tokens
        if self._largest == 0:
            return min(self.max_tokens, FIRST_STEP_TOKENS)
        per_step, per_token = self._fit.line()
        target = self.target_s
        if decode_tokens and self.decode_ratio > 0.0:
            target = self.decode_ratio * (per_step + per_token * decode_tokens)
        fits = int((target - per_step) / per_token)
        return max(MIN_STEP_TOKENS, min(fits, 2 * self._largest, self.max_tokens))
