"""The attention backends behind one interface give the same results through the whole engine.
On CPU the Triton kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import radixlm_runtime as rt

PROMPTS = [
    [(5 * i) % 250 + 3 for i in range(30)] + [7, 8, 9],
    [(5 * i) % 250 + 3 for i in range(30)] + [11, 12],
    [40, 41, 42, 43, 44, 45],
]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _run(model_dir: Path, backend: str) -> tuple[list[list[int]], list[float]]:
    engine = rt.Engine(str(model_dir), max_total_tokens=1024, attention_backend=backend, log_level="warning")
    outs = engine.generate(
        input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
    )
    logprobs = [lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]
    logprobs += [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    return [o["output_ids"] for o in outs], logprobs


@pytest.mark.parametrize("backend", ["triton"])
def test_backend_matches_torch(tiny_llama_dir: Path, backend: str) -> None:
    ref_ids, ref_lp = _run(tiny_llama_dir, "torch")
    ids, lp = _run(tiny_llama_dir, backend)
    assert ids == ref_ids
    assert len(lp) == len(ref_lp)
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-4


@pytest.mark.parametrize("with_outsider", [False, True])
def test_torch_decode_shared_prefix_groups_match_ungrouped(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, with_outsider: bool
) -> None:
    """Decode attention over a shared cached prefix (read once per group, merged by log-sum-exp)
    equals attending to each request's whole sequence; with an outsider in the batch the group
    is a subset of the decode requests."""
    from radixlm_runtime.attention import torch_backend

    prompts = [[(3 * i) % 250 + 3 for i in range(48)] + [100 + j] for j in range(4)]
    if with_outsider:
        prompts.append([200, 201, 202, 203])
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}

    def run() -> list[list[float]]:
        engine = rt.Engine(str(tiny_llama_dir), max_total_tokens=2048, log_level="warning")
        engine.generate(input_ids=prompts[0][:48], sampling_params={"max_new_tokens": 0})
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        return [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]

    calls = []
    original = torch_backend.TorchAttentionBackend._merge_shared_prefix

    def spy(self, *args, **kwargs):
        calls.append(args[3].members is None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch_backend.TorchAttentionBackend, "_merge_shared_prefix", spy)
    grouped = run()
    # Without the outsider every group spans the whole batch; with it, some steps group a subset.
    assert calls and (False in calls) == with_outsider
    calls.clear()
    monkeypatch.setattr(torch_backend, "MIN_SHARED_PREFIX", 10**9)
    ungrouped = run()
    assert not calls
    for a, b in zip(grouped, ungrouped, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_torch_short_extends_batched_like_decodes_match_per_request(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Extends up to MAX_BATCHED_EXTEND tokens (16-token prefill chunks here, the tokens a
    jump-forward appends) run as decode-style query rows; that equals one attention call per
    request over its whole sequence."""
    from radixlm_runtime.attention import torch_backend

    def run() -> list[float]:
        engine = rt.Engine(
            str(tiny_llama_dir), max_total_tokens=1024, chunked_prefill_size=16, log_level="warning"
        )
        outs = engine.generate(
            input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
        )
        lps = [lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]
        return lps + [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]

    batched = run()
    monkeypatch.setattr(torch_backend, "MAX_BATCHED_EXTEND", 0)
    per_request = run()
    assert len(batched) == len(per_request)
    assert max(abs(a - b) for a, b in zip(batched, per_request)) < 1e-5
