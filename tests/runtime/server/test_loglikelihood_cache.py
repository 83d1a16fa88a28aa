"""Loglikelihood scoring the way lm-eval's `local-completions` sends it: tokenized prompts to
/v1/completions with `echo` and `logprobs`, no new tokens. Every prompt token's logprob is asked
for, so before the radix tree kept logprobs none of the 5-shot prefix could come from the cache;
now the second and later questions reuse it."""

from __future__ import annotations

import math

import openai
import pytest
from server_harness import Server, assert_no_leak, wait_idle

from radixlm.eval.data import load_mmlu
from radixlm.eval.tasks import MMLU_CHOICES, mmlu_block, mmlu_fewshot_prefix
from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.models.loader import default_model_path, resolve_model_path

pytestmark = pytest.mark.slow

SUBJECT = "high_school_geography"
NUM_QUESTIONS = 3


def _requests() -> list[list[int]]:
    """lm-eval's loglikelihood requests: context + continuation, tokenized, per choice."""
    tokenizer = load_tokenizer(resolve_model_path(str(default_model_path())))
    prefix = mmlu_fewshot_prefix(SUBJECT, 5)
    prompts = []
    for item in load_mmlu(SUBJECT, "test", NUM_QUESTIONS):
        context = tokenizer.encode(prefix + mmlu_block(item.question, item.choices))
        prompts += [context + tokenizer.encode(choice, add_special_tokens=False) for choice in MMLU_CHOICES]
    return prompts


def _score(client: openai.OpenAI, model: str, ids: list[int]) -> openai.types.Completion:
    return client.completions.create(
        model=model, prompt=[ids], max_tokens=0, echo=True, logprobs=1, temperature=0
    )


def test_echo_logprobs_hit_the_prefix_cache(server: Server, client: openai.OpenAI, model: str) -> None:
    """lm-eval sends the served name (its `model=` argument), as any OpenAI client must."""
    prompts = _requests()
    _score(client, model, prompts[0])
    start = wait_idle(server)["cached_tokens"]
    prompt_tokens = 0
    for ids in prompts[1:]:
        out = _score(client, model, ids)
        assert out.usage is not None and out.usage.prompt_tokens == len(ids)
        lps = out.choices[0].logprobs
        assert lps is not None and len(lps.token_logprobs) == len(ids) and lps.token_logprobs[0] is None
        assert all(lp is not None and math.isfinite(lp) and lp <= 0 for lp in lps.token_logprobs[1:])
        prompt_tokens += len(ids)
    info = wait_idle(server)
    cached = info["cached_tokens"] - start
    # Every later request recomputes only its own question, choice and one prefix token.
    assert cached / prompt_tokens >= 0.9, (cached, prompt_tokens)
    assert_no_leak(info)
