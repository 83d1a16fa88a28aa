"""The three select methods on hand-made logprobs."""

from __future__ import annotations

import math
import random

import pytest

import radixlm as sgl
from radixlm.lang.choices import decide

CHOICES = ["a", "bb", "ccc"]


def test_token_length_normalized_uses_the_mean() -> None:
    # Sum favours the short choice; the mean favours "ccc".
    lps = [[-1.0], [-0.9, -0.9], [-0.5, -0.5, -0.5]]
    out = decide(sgl.token_length_normalized, CHOICES, lps, None, 0.0, random.Random(0))
    assert out.decision == "ccc"
    assert out.meta_info["normalized_prompt_logprobs"] == pytest.approx([-1.0, -0.9, -0.5])


def test_greedy_token_selection_decides_on_the_first_token() -> None:
    lps = [[-0.1, -9.0], [-0.2, -0.1], [-3.0]]
    assert decide(sgl.greedy_token_selection, CHOICES, lps, None, 0.0, random.Random(0)).decision == "a"


def test_greedy_token_selection_breaks_ties_on_later_tokens() -> None:
    # "a" is a prefix case: padded with its own mean (-0.5), beaten by "bb"'s second token.
    lps = [[-0.5], [-0.5, -0.1], [-2.0]]
    assert decide(sgl.greedy_token_selection, CHOICES, lps, None, 0.0, random.Random(0)).decision == "bb"


def test_unconditional_likelihood_normalized_prefers_what_the_prompt_raised() -> None:
    cond = [[-1.0], [-2.0], [-3.0]]
    uncond = [[-0.5], [-5.0], [-3.0]]
    out = decide(sgl.unconditional_likelihood_normalized, CHOICES, cond, uncond, 0.0, random.Random(0))
    assert out.decision == "bb" and out.meta_info["scores"] == pytest.approx([-0.5, 3.0, 0.0])
    with pytest.raises(ValueError, match="needs unconditional logprobs"):
        decide(sgl.unconditional_likelihood_normalized, CHOICES, cond, None, 0.0, random.Random(0))


def test_temperature_samples_in_proportion() -> None:
    lps = [[math.log(0.7)], [math.log(0.2)], [math.log(0.1)]]
    rng = random.Random(1)
    picks = [decide(sgl.token_length_normalized, CHOICES, lps, None, 1.0, rng).decision for _ in range(2000)]
    assert 0.62 < picks.count("a") / 2000 < 0.78 and picks.count("ccc") > 100
