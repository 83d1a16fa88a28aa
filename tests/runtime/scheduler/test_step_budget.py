"""The step budget on its own: a simulated device whose step time is known exactly (a per-step cost,
a cost per decode token and per key the decode tokens attend to, per prefill token, per (prefill token
x context) pair and per key before a chunk), fed to the budget as the scheduler feeds measured steps;
the budgets it hands out must fit the step's target."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from radixlm_runtime.scheduler.step_budget import (
    FIRST_STEP_TOKENS,
    MIN_CHUNK,
    MIN_STEP_TOKENS,
    StepBudget,
    StepShape,
    attention_work,
)


@dataclass(frozen=True)
class Device:
    step: float  # seconds a step
    decode: float  # seconds a decode token
    token: float  # seconds a prefill token
    pair: float = 0.0  # seconds a (prefill token x context) pair
    prefill_step: float = 0.0  # seconds a step pays when it carries prefill (its own code path)
    key: float = 0.0  # seconds a key before a prefill chunk (its prefix read once)
    decode_key: float = 0.0  # seconds a key the decode tokens attend to

    def seconds(self, decode: int, chunks: list[tuple[int, int]], decode_context: int = 0) -> float:
        """A step of `decode` decode tokens after `decode_context` keys in all and prefill chunks of
        (context, tokens)."""
        prefill = sum(n for _, n in chunks)
        work = sum(attention_work(c, n) for c, n in chunks)
        keys = sum(c for c, _ in chunks)
        path = self.prefill_step if prefill else 0.0
        decoding = self.decode * decode + self.decode_key * decode_context
        return self.step + path + decoding + self.token * prefill + self.pair * work + self.key * keys

    def run(
        self, budget: StepBudget, decode: int, chunks: list[tuple[int, int]], decode_context: int = 0
    ) -> float:
        prefill = sum(n for _, n in chunks)
        work = sum(attention_work(c, n) for c, n in chunks)
        shape = StepShape(decode, prefill, work, sum(c for c, _ in chunks), decode_context)
        seconds = self.seconds(decode, chunks, decode_context)
        budget.observe(shape, seconds)
        return seconds


def _warm(budget: StepBudget, device: Device) -> None:
    """Decode steps of several batch sizes, prefill chunks at several sizes and contexts."""
    for _ in range(3):
        for d in (1, 4, 8):
            device.run(budget, d, [])
        for context, n in ((0, 50), (300, 200), (2000, 60), (3500, 100)):
            device.run(budget, 0, [(context, n)])


def test_budget_is_what_fits_the_target() -> None:
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    device = Device(step=0.010, decode=0.001, token=0.001)
    _warm(budget, device)
    # 10 ms a step plus 1 ms a token: 240 tokens fit 250 ms.
    assert abs(budget.start(0).fit(0, 10**6) - 240) <= 1
    # A slower device (or a busier machine) shrinks it as its steps come in.
    _warm(budget, Device(step=0.010, decode=0.001, token=0.004))
    for _ in range(10):
        _warm(budget, Device(step=0.010, decode=0.001, token=0.004))
    assert abs(budget.start(0).fit(0, 10**6) - 60) <= 1
    # A faster one grows it, never past the fixed budget.
    fast = Device(step=0.001, decode=0.00001, token=0.00001)
    for _ in range(20):
        _warm(budget, fast)
    fast.run(budget, 0, [(0, 1024)])
    assert budget.start(0).fit(0, 10**6) == 1024


def test_a_chunk_is_sized_at_its_own_context() -> None:
    """Attention makes a token at context 3,500 dearer than one at context 0: the budget gives the
    deep chunk fewer tokens, and each chunk's step lands on the target."""
    device = Device(step=0.010, decode=0.001, token=0.001, pair=1e-6)
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    _warm(budget, device)
    shallow = budget.start(0).fit(0, 10**6)
    deep = budget.start(0).fit(3500, 10**6)
    assert deep < shallow / 2
    for context, n in ((0, shallow), (3500, deep)):
        assert device.seconds(0, [(context, n)]) == pytest.approx(0.25, rel=0.02)


def test_a_long_prompt_chunked_beside_decodes_keeps_every_step_within_the_ratio() -> None:
    """The case a line in tokens alone got wrong: a 4,000-token prompt chunked while 8 requests
    decode, on a device where attention dominates deep chunks. Every step stays within the decode
    ratio of the decode step alone (a small margin for the fit catching up), first chunk to last."""
    device = Device(step=0.008, decode=0.0005, token=0.0012, pair=3.5e-7)
    budget = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    _warm(budget, device)
    alone = device.seconds(8, [])
    done, steps = 0, 0
    while done < 4000:
        share = budget.start(8)
        n = min(4000 - done, max(share.fit(done, 4000 - done), 1))
        seconds = device.run(budget, 8, [(done, n)])
        assert seconds <= 2.5 * alone * 1.05, (done, n, seconds / alone)
        done += n
        steps += 1
    # ... and it does not crawl: the last chunks still carry a handful of tokens each.
    assert steps < 4000 / 5


def test_decodes_nobody_streams_are_not_paced() -> None:
    """The decode ratio protects the gaps a client sees: beside decodes that nobody streams (a batch)
    the step is sized to the target, as when nothing decodes."""
    device = Device(step=0.008, decode=0.0005, token=0.0012)
    budget = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    _warm(budget, device)
    paced = budget.start(8).fit(0, 10**6)
    batch = budget.start(8, streamed=False).fit(0, 10**6)
    assert device.seconds(8, [(0, paced)]) <= 2.5 * device.seconds(8, []) * 1.05
    assert device.seconds(8, [(0, batch)]) == pytest.approx(0.25, rel=0.05)
    assert batch > 5 * paced


def test_budget_starts_small_and_at_most_doubles() -> None:
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    assert budget.start(0).tokens == FIRST_STEP_TOKENS
    device = Device(step=0.0, decode=0.0001, token=0.0001)
    device.run(budget, 0, [(0, FIRST_STEP_TOKENS)])
    assert budget.start(0).fit(0, 10**6) == 2 * FIRST_STEP_TOKENS
    device.run(budget, 0, [(0, 2 * FIRST_STEP_TOKENS)])
    assert budget.start(0).fit(0, 10**6) == 4 * FIRST_STEP_TOKENS


def test_chunks_at_one_context_charge_everything_per_token() -> None:
    """Chunks all at one context cannot separate the per-token cost from the attention one: all of
    it is charged per token, exact at that context."""
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    device = Device(step=0.0, decode=0.0, token=0.001, pair=1e-6)
    for n in (100, 50, 100, 80) * 3:
        device.run(budget, 0, [(1000, n)])
    n = budget.start(0).fit(1000, 10**6)
    assert device.seconds(0, [(1000, n)]) == pytest.approx(0.25, rel=0.05)


def test_a_slow_device_still_carries_the_minimum() -> None:
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    _warm(budget, Device(step=5.0, decode=0.1, token=0.1))
    assert budget.start(0).fit(0, 10**6) == MIN_STEP_TOKENS
    assert budget.start(4).fit(0, 10**6) == MIN_CHUNK  # beside decodes, a smaller floor


def test_budget_while_decoding_is_a_multiple_of_the_decode_step() -> None:
    """While requests decode, a step carrying prefill is sized to 2.5 of their decode steps alone,
    whatever the target: on a machine so slow (or busy) that a decode step of 8 requests takes
    0.5 s, over a 0.1 s target, most of such a step is still prefill rather than 16 tokens; on a fast
    one, the 250 ms target would put 13 decode steps' worth into one gap of the streams."""
    slow = StepBudget(max_tokens=1024, target_s=0.1, decode_ratio=2.5)
    _warm(slow, Device(step=0.4, decode=0.01, token=0.01))
    assert slow.start(8).fit(0, 10**6) in (71, 72)  # (2.5 * 0.48 - 0.48) / 0.01
    assert slow.start(0).fit(0, 10**6) == MIN_STEP_TOKENS  # nothing decodes: the target alone
    fast = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    _warm(fast, Device(step=0.010, decode=0.001, token=0.001))
    assert fast.start(8).fit(0, 10**6) in (26, 27)  # (2.5 * 0.018 - 0.018) / 0.001
    assert abs(fast.start(0).fit(0, 10**6) - 240) <= 1
    target_alone = StepBudget(max_tokens=1024, target_s=0.1)
    _warm(target_alone, Device(step=0.4, decode=0.01, token=0.01))
    assert target_alone.start(8).fit(0, 10**6) == MIN_CHUNK


def test_shares_and_refunds() -> None:
    """Admission holds back the first partial prefill's share while others are admitted, then gives
    it back: the budget ends where it started."""
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    _warm(budget, Device(step=0.010, decode=0.001, token=0.001, pair=1e-6))
    share = budget.start(0)
    before = (share.seconds, share.tokens)
    quarter = share.fit(2000, 10**6, 0.25)
    assert 0 < quarter < share.fit(2000, 10**6)
    share.take(2000, quarter)
    share.give_back(2000, quarter)
    assert (share.seconds, share.tokens) == pytest.approx(before)


def test_no_target_is_the_fixed_budget() -> None:
    budget = StepBudget(max_tokens=1024, target_s=0.0)
    Device(step=5.0, decode=0.1, token=0.1).run(budget, 0, [(0, 200)])
    assert budget.start(0).fit(3000, 10**6) == 1024
    assert budget.start(8).fit(0, 10**6) == 1016


def test_the_model_predicts_each_component() -> None:
    """After decode steps of several sizes and chunks at several contexts, the model's time for a
    step it never saw (decoding and a deep chunk together) is the device's."""
    device = Device(step=0.010, decode=0.001, token=0.001, pair=1e-6)
    budget = StepBudget(max_tokens=1024, target_s=0.25)
    _warm(budget, device)
    shape = StepShape(6, 40, attention_work(3000, 40))
    assert budget.predict(shape) == pytest.approx(device.seconds(6, [(3000, 40)]), rel=0.02)


def test_a_prefill_step_pays_its_own_path() -> None:
    """Decode-only steps take a faster path than steps with prefill (the one-call decoder on CPU):
    the model learns the prefill path's cost per step apart from its cost per token, so small
    chunks beside decodes land on the target instead of over it."""
    device = Device(step=0.008, decode=0.0005, token=0.001, pair=3e-7, prefill_step=0.012)
    budget = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=3.0)
    _warm(budget, device)
    for context in (0, 500, 1000):
        n = budget.start(2).fit(context, 10**6)
        target = 3.0 * device.seconds(2, [])
        # On the target, less at most one token's cost (whole tokens only).
        one_token = device.token + device.pair * (context + n + 1)
        assert target - one_token <= device.seconds(2, [(context, n)]) <= target


def test_a_small_chunk_pays_its_prefix_once() -> None:
    """A chunk reads its prefix's K/V once whatever its size: the model learns that cost per key apart
    from the per-token and per-pair ones, so a few tokens at context 3,900 beside a decode land on the
    decode-ratio target rather than past it (4 tokens there cost 3x a decode step on a Zen 5, where a
    model in tokens and pairs alone sized them for half that)."""
    device = Device(step=0.006, decode=0.0005, token=0.0006, pair=2e-8, key=2e-6)
    budget = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    for _ in range(3):
        for d in (1, 2, 4):
            device.run(budget, d, [])
        for context, n in ((0, 50), (300, 200), (2000, 60), (3500, 100), (3900, 4), (2500, 8), (1000, 30)):
            device.run(budget, 1, [(context, n)])
    target = 2.5 * device.seconds(1, [])
    for context in (100, 1000, 2500):
        n = budget.start(1).fit(context, 10**6)
        one_token = device.token + device.pair * (context + n + 1)
        assert n > MIN_CHUNK
        assert target - one_token <= device.seconds(1, [(context, n)]) <= target * (1 + 1e-9)
    # Where the prefix alone takes what the target leaves (9.6 of 9.75 ms at context 4,800): the floor.
    assert budget.start(1).fit(4800, 10**6) == MIN_CHUNK


def test_a_long_context_decode_paces_as_a_short_one() -> None:
    """A decode step reads its requests' K/V, so at long context it is slower: the model learns that per
    key. The target stays the ratio times the batch's decode step at no context (a long-context stream
    must not stretch the gaps of the streams beside it), and the budget is what is left after the
    decode's own time at its context."""
    device = Device(step=0.006, decode=0.0005, token=0.0006, decode_key=1.5e-6)
    budget = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    for _ in range(3):
        for d, keys in ((1, 100), (1, 4000), (2, 600), (4, 2000), (2, 5000)):
            device.run(budget, d, [], keys)
    for _ in range(3):
        for context, n in ((0, 50), (300, 200), (100, 20)):
            device.run(budget, 1, [(context, n)], 500)
    assert budget.predict(StepShape(1, 0, 0.0, 0, 3000)) == pytest.approx(device.seconds(1, [], 3000))
    target = 2.5 * device.seconds(1, [])
    for keys in (0, 2000, 4000):
        n = budget.start(1, decode_context=keys).fit(100, 10**6)
        assert target - device.token <= device.seconds(1, [(100, n)], keys) <= target * (1 + 1e-9)


def test_decode_steps_of_one_size_predict_their_mean() -> None:
    """Decode steps all of one batch size cannot show what a token adds: the model takes their mean
    (a decode step is mostly reading the weights) rather than charging it per token, which would make
    a batch of 8 look 8 times slower and stretch its streams' gaps by as much."""
    budget = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    device = Device(step=0.009, decode=0.0002, token=0.001)
    for _ in range(10):
        device.run(budget, 1, [])
    assert budget.predict(StepShape(8, 0, 0.0)) == pytest.approx(device.seconds(1, []))


def test_prefill_faster_than_decode_steps_still_admits() -> None:
    """Regression: a slow first decode step made 4-token prefill steps look cheaper than a decode step,
    every prefill cost fitted to 0, and the floor then set the budget to 0 seconds (spent): a prompt
    waiting with nothing running was never admitted and the server spun forever."""
    budget = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    for seconds in (0.030, 0.011, 0.010):
        budget.observe(StepShape(1, 0, 0.0), seconds)
    for context in range(0, 40, 4):
        budget.observe(StepShape(0, 4, attention_work(context, 4)), 0.008)
    alone = budget.start(0)
    assert not alone.spent
    assert alone.fit(0, 10**6) >= MIN_STEP_TOKENS
    beside = budget.start(1)
    assert not beside.spent
    assert beside.fit(0, 10**6) >= MIN_CHUNK


@pytest.mark.parametrize("decode", [0, 3])
def test_floor_holds_when_the_largest_step_was_tiny(decode: int) -> None:
    """The twofold growth bound can sit below the floor (only 2-token steps measured so far): the floor
    wins, in tokens and in seconds."""
    budget = StepBudget(max_tokens=1024, target_s=0.25, decode_ratio=2.5)
    device = Device(step=0.010, decode=0.001, token=0.002)
    for _ in range(3):
        device.run(budget, 1, [])
        device.run(budget, 0, [(0, 2)])
        device.run(budget, 0, [(5, 1)])
    least = MIN_CHUNK if decode else MIN_STEP_TOKENS
    step = budget.start(decode)
    assert not step.spent
    assert step.fit(0, 10**6) >= least


@pytest.mark.parametrize("decode", [0, 3])
def test_floor_holds_at_any_context(decode: int) -> None:
    """The floor is tokens, not their time at context 0: a prompt whose first uncached token sits after
    an 8,000-token cached prefix still gets the floor when the target leaves no time (a slow device)."""
    budget = StepBudget(max_tokens=1024, target_s=0.05, decode_ratio=1.0)
    _warm(budget, Device(step=0.040, decode=0.002, token=0.002, pair=2e-6, prefill_step=0.03))
    least = MIN_CHUNK if decode else MIN_STEP_TOKENS
    step = budget.start(decode)
    assert not step.spent
    assert step.fit(8000, 10**6) == least
    step.take(8000, least)
    assert step.fit(8000, 10**6) == 0 and step.spent


@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 64),  # decode tokens
            st.lists(st.tuples(st.integers(0, 8000), st.integers(1, 2048)), max_size=3),  # chunks
            st.floats(1e-5, 5.0),  # seconds, however unrelated to the shape
            st.integers(0, 64 * 8192),  # keys the decode tokens attend to
        ),
        max_size=40,
    ),
    decode=st.integers(0, 64),
    decode_context=st.integers(0, 64 * 8192),
    context=st.integers(0, 8192),
    target_ms=st.sampled_from([0.0, 1.0, 50.0, 250.0]),
    ratio=st.sampled_from([0.0, 1.0, 2.5]),
)
# Found by CI: only a decode step measured, the twofold bound (2 tokens) below the decode tokens.
@example(steps=[(1, [], 1.0, 0)], decode=2, decode_context=0, context=0, target_ms=1.0, ratio=0.0)
@example(steps=[(1, [], 1.0, 0)], decode=0, decode_context=0, context=0, target_ms=1.0, ratio=0.0)
@settings(max_examples=1000, deadline=None)
def test_every_step_admits_its_floor(
    steps: list[tuple[int, list[tuple[int, int]], float, int]],
    decode: int,
    decode_context: int,
    context: int,
    target_ms: float,
    ratio: float,
) -> None:
    """Whatever the measured times (noise, a slow first step, times unrelated to the work), a step's
    budget is never spent before its floor and fits the floor at any context, its own and its decodes'
    (the model's per-key costs included): admission relies on it to make progress when nothing else
    runs (the stall of CI stop 40)."""
    budget = StepBudget(max_tokens=1024, target_s=target_ms / 1000, decode_ratio=ratio)
    for d, chunks, seconds, keys in steps:
        prefill = sum(n for _, n in chunks)
        work = sum(attention_work(c, n) for c, n in chunks)
        budget.observe(StepShape(d, prefill, work, sum(c for c, _ in chunks), keys), seconds)
    least = MIN_CHUNK if decode else MIN_STEP_TOKENS
    step = budget.start(decode, decode_context=decode_context)
    assert not step.spent
    assert step.fit(context, 10**6) >= least
    assert step.fit(context, 3) == 3
