"""Speculative decoding on the embedded default model: the same greedy tokens and logprobs as
without it, on a prompt where lookup hits (repeating a document) mixed with ones where it misses."""

from __future__ import annotations

import pytest

import radixlm_runtime as rt

pytestmark = pytest.mark.slow

DOCUMENT = (
    "The radix tree stores the KV cache of every prompt keyed by token ids. Requests that share a "
    "prefix reuse it instead of recomputing it, and the scheduler orders requests to maximise those hits."
)
QUOTE = f"<|im_start|>user\n{DOCUMENT}\nRepeat the text above exactly.<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [QUOTE, "The capital of France is", QUOTE + "Sure: "]
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def test_greedy_tokens_and_logprobs_match_without_speculation() -> None:
    results = []
    for k in (0, 4):
        engine = rt.Engine(
            dtype="float32", speculative_num_draft_tokens=k, max_total_tokens=2048, log_level="warning"
        )
        single = engine.generate(QUOTE, GREEDY, return_logprob=True, top_logprobs_num=2)
        batch = engine.generate(PROMPTS, GREEDY)  # the radix cache now holds QUOTE's prefix
        results.append((single, batch))
        engine.shutdown()
    (plain, plain_batch), (spec, spec_batch) = results
    assert spec["output_ids"] == plain["output_ids"]
    assert [o["output_ids"] for o in spec_batch] == [o["output_ids"] for o in plain_batch]
    meta = spec["meta_info"]
    assert meta["spec_accept_token_num"] > 0 and meta["spec_verify_ct"] < meta["completion_tokens"]
    want = [lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]]
    got = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert got == pytest.approx(want, abs=2e-3)
    for g_top, w_top in zip(
        meta["output_top_logprobs"], plain["meta_info"]["output_top_logprobs"], strict=True
    ):
        assert [t[1] for t in g_top] == [t[1] for t in w_top]
