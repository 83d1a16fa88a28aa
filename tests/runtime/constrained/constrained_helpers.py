"""Helpers shared by the constrained-decoding tests: reading a bitmask and walking a guide as any
sampler could."""

from __future__ import annotations

import random

import numpy as np

from radixlm_runtime.constrained.backend import Guide


def allowed_ids(guide: Guide, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in the guide's mask."""
    bits = guide.allowed_mask(vocab_size)
    assert bits.dtype == np.int32 and bits.shape == ((vocab_size + 31) // 32,)
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab_size])


def random_walk(
    guide: Guide, vocab_size: int, eos: int, rng: random.Random, budget: int = 60
) -> list[int] | None:
    """Samples allowed tokens uniformly, taking EOS with probability 1/3 where allowed; returns the
    ids without the EOS, or None when the walk did not end within `budget` tokens."""
    ids: list[int] = []
    for _ in range(budget):
        allowed = allowed_ids(guide, vocab_size)
        assert len(allowed) > 0, "a guide that is not finished allows some token"
        others = allowed[allowed != eos]
        if len(others) == 0 or (eos in allowed and rng.random() < 1 / 3):
            assert eos in allowed and guide.is_accepting()
            return ids
        token = int(others[rng.randrange(len(others))])
        guide.advance(token)
        ids.append(token)
    return None
