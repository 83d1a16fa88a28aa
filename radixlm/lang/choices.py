"""How `select` turns per-token logprobs of each choice into a decision (SGLang's three methods).

A method gets, for each choice, the logprobs of the choice's tokens given the prompt, and (when it
asks for them) the logprobs of the same tokens with no prompt at all.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from radixlm.lang.ir import ChoiceDecision

Logprobs = list[list[float]]


class ChoicesMethod(Protocol):
    requires_unconditional_logprobs: bool

    def scores(
        self, token_logprobs: list[list[float]], unconditional: list[list[float]] | None
    ) -> list[float]: ...


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class TokenLengthNormalized:
    """Highest mean token logprob: long choices are not penalised for their length."""

    requires_unconditional_logprobs: bool = False

    def scores(
        self, token_logprobs: list[list[float]], unconditional: list[list[float]] | None
    ) -> list[float]:
        return [_mean(lps) for lps in token_logprobs]


@dataclass(frozen=True)
class GreedyTokenSelection:
    """Decides token by token, like greedy decoding would: the best first token wins; ties go to the
    next token. A choice that is a prefix of a longer one is extended with its own mean logprob."""

    requires_unconditional_logprobs: bool = False

    def scores(
        self, token_logprobs: list[list[float]], unconditional: list[list[float]] | None
    ) -> list[float]:
        width = max(len(lps) for lps in token_logprobs)
        padded = [lps + [_mean(lps)] * (width - len(lps)) for lps in token_logprobs]
        alive = list(range(len(padded)))
        for pos in range(width):
            best = max(padded[i][pos] for i in alive)
            alive = [i for i in alive if padded[i][pos] == best]
            if len(alive) == 1:
                break
        return [0.0 if i in alive else -math.inf for i in range(len(padded))]


@dataclass(frozen=True)
class UnconditionalLikelihoodNormalized:
    """Mean logprob given the prompt minus mean logprob with no prompt: favours the choice the prompt
    makes likelier, not the one that is common anyway."""

    requires_unconditional_logprobs: bool = True

    def scores(
        self, token_logprobs: list[list[float]], unconditional: list[list[float]] | None
    ) -> list[float]:
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        return [_mean(c) - _mean(u) for c, u in zip(token_logprobs, unconditional)]


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def decide(
    method: ChoicesMethod,
    choices: list[str],
    token_logprobs: list[list[float]],
    unconditional: list[list[float]] | None,
    temperature: float,
    rng: random.Random,
) -> ChoiceDecision:
    """Argmax of the method's scores, or a softmax sample over them when temperature > 0."""
    scores = method.scores(token_logprobs, unconditional)
    if temperature > 0 and all(math.isfinite(s) for s in scores):
        top = max(scores)
        weights = [math.exp((s - top) / temperature) for s in scores]
        index = rng.choices(range(len(choices)), weights=weights)[0]
    else:
        index = max(range(len(choices)), key=lambda i: scores[i])
    meta = {
        "scores": scores,
        "normalized_prompt_logprobs": [_mean(lps) for lps in token_logprobs],
        "token_logprobs": token_logprobs,
        "unconditional_token_logprobs": unconditional,
    }
    return ChoiceDecision(choices[index], meta)
