"""The prefill budget of the next step, sized by time on this device.

A step that carries prefill puts a gap into every running stream, and every request that arrives
meanwhile waits behind it. How long a step takes depends on the device, the model and what else the
machine runs, so it is measured while serving, per component:

- the decode step alone: steps without prefill, their time fitted as a cost per step, per decode
  token and per key the decode tokens attend to (their requests' contexts, summed: a decode at
  context 3,900 reads 180 MB of float32 K/V on the default model, 1.5x the step of one at 400);
- prefill: what a step with prefill took beyond that decode prediction, fitted as a cost per step
  that carries prefill (on CPU the quantized linears change kernels as rows grow, from row dots to
  dequantized panels), a cost per prefill token, a cost per (token x context) pair, the attention
  work, and a cost per key before each chunk (its prefix's K/V read once, whatever the chunk's
  size: 4 tokens at context 3,900 cost 3x a decode there). A chunk at context 3,500 costs several
  times one at context 200, and a line in tokens alone always lags the chunk it sizes.

Older steps weigh less (about the last 20 count). The step's target time is:

- while requests decode and one of them is streamed, `decode_ratio` times their decode step alone
  at no context, so a stream's slowest gaps stay within that factor of a short-context stream's
  usual one, on a fast device or a slow one (a long-context request's own steps are longer: paced to
  those, every stream beside it would see gaps past the ratio). Requests nobody streams (a batch
  through the offline Engine, a non-streamed response) see only their end, which pacing would delay:
  the few-shot GSM8K batch ran 1.3-1.8x longer paced;
- while nothing decodes (nobody to stall), `target_s`, which bounds the wait of arrivals.

Every cost is fitted by exponentially weighted least squares, each >= 0 (`_Fit`). Admission spends
what is left after the decode prediction chunk by chunk, each at its own context (`PrefillBudget`).
Without a target (`target_s` 0) the budget is `max_tokens` tokens a step. The budget grows at most
twofold past the largest step measured so far, so it never extrapolates far from what was seen.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

# A step carries at least this many prompt tokens, however slow the device looks: MIN_STEP_TOKENS
# while nothing decodes, MIN_CHUNK beside decodes (whose gaps a floor stretches past the decode ratio:
# 16 tokens at context 3,000 cost 7 decode steps of the default model on 2 cores).
MIN_STEP_TOKENS = 16
MIN_CHUNK = 4
# Before any step was measured: a step this size is cheap on any device, and its time starts the fit.
FIRST_STEP_TOKENS = 64
# Weight of a measured step after the next one: about the last 1 / (1 - DECAY) = 20 steps count.
DECAY = 0.95


def attention_work(context: int, tokens: int) -> float:
    """(token x context) pairs of `tokens` new tokens after `context` computed ones: each attends to
    the prefix and to the new tokens before it."""
    return tokens * (context + tokens / 2)


class _Chunk(Protocol):
    prefix_len: int
    extend_len: int
    is_prefill: bool


@dataclass(frozen=True)
class StepShape:
    """What a step computed, as the cost model sees it."""

    decode: int  # tokens of running requests (their sampled tokens, drafts)
    prefill: int  # prompt tokens
    attention: float  # the prompt tokens' attention work (attention_work summed over chunks)
    context: int = 0  # keys before each prompt chunk, summed (each chunk reads its prefix's K/V once)
    decode_context: int = 0  # keys before the running requests' tokens, summed

    @classmethod
    def of(cls, items: Iterable[_Chunk]) -> StepShape:
        decode = prefill = context = decode_context = 0
        attention = 0.0
        for it in items:
            if it.is_prefill:
                prefill += it.extend_len
                attention += attention_work(it.prefix_len, it.extend_len)
                context += it.prefix_len
            else:
                decode += it.extend_len
                decode_context += it.prefix_len
        return cls(decode, prefill, attention, context, decode_context)

    @property
    def tokens(self) -> int:
        return self.decode + self.prefill


class _Fit:
    """Exponentially weighted least squares of y = sum of c_i * x_i over a step's features (x_0 = 1,
    a cost per step), every c_i >= 0: the subset of terms with non-negative costs that fits best, among
    the subsets that hold the terms in `required`. The decode fit requires the cost per step: where its
    steps all had one batch size they cannot show what a token adds, and the fit is then their mean (a
    decode step is mostly reading the weights; charging it per token would make a batch of 8 look 8
    times slower, its decode-ratio target and its streams' gaps 8 times longer)."""

    def __init__(self, features: int, required: tuple[int, ...] = ()) -> None:
        self.xx = [[0.0] * features for _ in range(features)]
        self.xy = [0.0] * features
        self.yy = 0.0
        self._subsets = [
            terms
            for size in range(features, 0, -1)
            for terms in itertools.combinations(range(features), size)
            if set(required) <= set(terms)
        ]
        self._costs: tuple[float, ...] | None = None

    def add(self, x: Sequence[float], y: float) -> None:
        for i, xi in enumerate(x):
            self.xy[i] = self.xy[i] * DECAY + xi * y
            for j, xj in enumerate(x):
                self.xx[i][j] = self.xx[i][j] * DECAY + xi * xj
        self.yy = self.yy * DECAY + y * y
        self._costs = None

    @property
    def measured(self) -> bool:
        return self.xx[0][0] > 0.0

    def costs(self) -> tuple[float, ...]:
        """Each feature's cost (0 for all before anything was measured)."""
        if self._costs is None:
            self._costs = self._fit()
        return self._costs

    def predict(self, x: Sequence[float]) -> float:
        return sum(c * xi for c, xi in zip(self.costs(), x))

    def _fit(self) -> tuple[float, ...]:
        n = len(self.xy)
        best: tuple[float, list[float]] | None = None
        for terms in self._subsets:
            coef = _solve([[self.xx[i][j] for j in terms] for i in terms], [self.xy[i] for i in terms])
            if coef is None or min(coef) < 0.0:
                continue
            full = [0.0] * n
            for i, c in zip(terms, coef):
                full[i] = c
            # Weighted squared error: yy - 2 c.xy + c.XX.c.
            sse = self.yy - 2 * sum(c * self.xy[i] for i, c in enumerate(full))
            sse += sum(full[i] * full[j] * self.xx[i][j] for i in range(n) for j in range(n))
            if best is None or sse < best[0] - 1e-12:
                best = (sse, full)
        return tuple(best[1]) if best is not None else (0.0,) * n


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b for a symmetric positive semi-definite a (normal equations), by Gaussian elimination on
    a scaled to a unit diagonal (tokens and attention work differ by orders of magnitude); None where
    it is (near) singular."""
    n = len(b)
    d = [math.sqrt(a[i][i]) for i in range(n)]
    if min(d) <= 0.0:
        return None
    m = [[a[i][j] / (d[i] * d[j]) for j in range(n)] + [b[i] / d[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    y = [0.0] * n
    for r in range(n - 1, -1, -1):
        y[r] = (m[r][n] - sum(m[r][c] * y[c] for c in range(r + 1, n))) / m[r][r]
    return [y[i] / d[i] for i in range(n)]


@dataclass
class PrefillBudget:
    """What one step may still spend on prefill: `seconds` at `per_context` per key before a chunk,
    `per_token` + `per_pair` x context per token, and at most `tokens` tokens. Without a time target,
    seconds are unbounded and `tokens` is the budget. The step's first `floor` tokens fit whatever
    their time (at any context), so a slow model never stalls prefill: the floor shrinks as tokens are
    taken."""

    seconds: float
    tokens: int
    per_token: float = 0.0
    per_pair: float = 0.0
    per_context: float = 0.0
    floor: int = 0

    def cost(self, context: int, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return (
            self.per_context * context
            + self.per_token * tokens
            + self.per_pair * attention_work(context, tokens)
        )

    def fit(self, context: int, want: int, share: float = 1.0) -> int:
        """How many of `want` tokens after `context` computed ones fit `share` of what is left."""
        cap = min(want, int(self.tokens * share))
        if cap <= 0:
            return 0
        floor = min(cap, self.floor)
        left = self.seconds * share - self.per_context * context
        if math.isinf(left):
            return cap
        if left <= 0.0:
            return floor
        # Largest n with per_pair / 2 * n^2 + (per_token + per_pair * context) * n <= left: the root
        # written without the difference of near-equal terms (a per_pair fitted at 1e-20 for a device
        # with none lost two tokens of 16 to that cancellation).
        lin = self.per_token + self.per_pair * context
        root = lin + math.sqrt(lin * lin + 2.0 * self.per_pair * left)
        n = 2.0 * left / root if root > 0.0 else float(cap)
        return max(floor, min(cap, int(n)))

    def take(self, context: int, tokens: int) -> None:
        self.seconds -= self.cost(context, tokens)
        self.tokens -= tokens
        self.floor -= tokens

    def give_back(self, context: int, tokens: int) -> None:
        self.seconds += self.cost(context, tokens)
        self.tokens += tokens
        self.floor += tokens

    @property
    def spent(self) -> bool:
        return self.tokens <= 0 or (self.seconds <= 0.0 and self.floor <= 0)


class StepBudget:
    """The measured step costs and, from them, each step's `PrefillBudget`."""

    def __init__(self, max_tokens: int, target_s: float, decode_ratio: float = 0.0) -> None:
        self.max_tokens = max_tokens
        self.target_s = target_s
        self.decode_ratio = decode_ratio
        # Per step, per decode token, per key they attend to.
        self._decode = _Fit(3, required=(0,))
        # Per step, per prompt token, per (token x context) pair, per key before a chunk.
        self._prefill = _Fit(4)
        self._largest = 0

    def _decode_seconds(self, tokens: int, context: int) -> float:
        return self._decode.predict((1.0, tokens, context))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Records one step: what it computed and its wall time."""
        if shape.tokens <= 0 or seconds <= 0.0:
            return
        if shape.prefill:
            rest = seconds - self._decode_seconds(shape.decode, shape.decode_context)
            self._prefill.add((1.0, shape.prefill, shape.attention, shape.context), rest)
        else:
            self._decode.add((1.0, shape.decode, shape.decode_context), seconds)
        self._largest = max(self._largest, shape.tokens)

    def predict(self, shape: StepShape) -> float:
        """The model's time for a step of this shape (0 before it measured any)."""
        decode = self._decode_seconds(shape.decode, shape.decode_context)
        if not shape.prefill or not self._prefill.measured:
            return decode
        return decode + self._prefill.predict((1.0, shape.prefill, shape.attention, shape.context))

    def start(self, decode_tokens: int, streamed: bool = True, decode_context: int = 0) -> PrefillBudget:
        """The prefill budget of a step whose running requests compute `decode_tokens` after
        `decode_context` keys in all (`streamed`: one of them streams its tokens): never less than the
        floor, in tokens (whatever the bounds below say) and in time."""
        least = MIN_CHUNK if decode_tokens else MIN_STEP_TOKENS
        if self.target_s <= 0.0:
            bound = self.max_tokens
        elif self._largest == 0:
            bound = min(self.max_tokens, FIRST_STEP_TOKENS)
        else:
            bound = min(self.max_tokens, 2 * self._largest)
        tokens = max(bound - decode_tokens, least)
        if self.target_s <= 0.0 or not self._prefill.measured:
            return PrefillBudget(math.inf, tokens)
        per_step, per_token, per_pair, per_context = self._prefill.costs()
        if per_token == 0.0 and per_pair == 0.0 and per_context == 0.0:
            # Prefill steps measured no faster than decode-only ones (noise, a slow first decode
            # step): the times say nothing about prompt tokens yet, and the token bound alone holds.
            return PrefillBudget(math.inf, tokens)
        decode = self._decode_seconds(decode_tokens, decode_context)
        target = self.target_s
        if decode_tokens and streamed and self.decode_ratio > 0.0 and self._decode.measured:
            target = self.decode_ratio * self._decode_seconds(decode_tokens, 0)
        return PrefillBudget(
            target - decode - per_step, tokens, per_token, per_pair, per_context, floor=least
        )
