"""The runtime's own model code against transformers on the same weights (tiny random-init models)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import radixlm_runtime as rt

PROMPTS = [
    "the theater then",
    "an interesting answer to the question",
    "abc abc abc abc abc",
    "<|im_start|>user\nhello there<|im_end|>\n",
]


def _hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_logits_match_transformers(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path, prompt_logprobs: Callable[..., dict]
) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    if fixture == "tiny_qwen2_dir":
        model_dir = _with_random_biases(model_dir, tmp_path)
    engine = rt.Engine(str(model_dir), dtype="float32", max_total_tokens=2048, log_level="warning")
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        ref = _hf_logprobs(model_dir, ids)
        meta = prompt_logprobs(engine, ids, start=0, top=8)
        ours = meta["input_token_logprobs"]
        assert ours[0][0] is None and len(ours) == len(ids)
        for pos in range(1, len(ids)):
            assert abs(ours[pos][0] - ref[pos - 1, ids[pos]].item()) < 1e-4
            top_vals = torch.tensor([lp for lp, _, _ in meta["input_top_logprobs"][pos]])
            torch.testing.assert_close(top_vals, ref[pos - 1].topk(8).values, atol=1e-4, rtol=0)


def test_cached_prefill_matches_fresh_prefill(
    tiny_llama_dir: Path, prompt_logprobs: Callable[..., dict]
) -> None:
    engine = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=2048, log_level="warning")
    ids = engine.tokenizer.encode("the theater then an interesting answer to the question abc abc")
    start = len(ids) - 5
    fresh = prompt_logprobs(engine, ids, start=start, top=5)
    assert fresh["cached_tokens"] == 0
    # Warm a longer prefix, then ask again: the first start-1 tokens now come from the cache.
    engine.flush_cache()
    engine.generate(input_ids=ids[:start], sampling_params={"max_new_tokens": 0})
    cached = prompt_logprobs(engine, ids, start=start, top=5)
    assert cached["cached_tokens"] == start - 1
    for a, b in zip(fresh["input_token_logprobs"], cached["input_token_logprobs"], strict=True):
        assert a[1] == b[1] and abs(a[0] - b[0]) < 1e-4
    for a, b in zip(fresh["input_top_logprobs"], cached["input_top_logprobs"], strict=True):
        assert [t for _, t, _ in a] == [t for _, t, _ in b]
        assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) < 1e-4


def test_greedy_generation_matches_transformers(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=4096, log_level="warning")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = engine.tokenizer.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        assert out["output_ids"] == ref[0, len(ids) :].tolist()


def _with_random_biases(model_dir: Path, tmp_path: Path) -> Path:
    """Qwen2 checkpoints carry q/k/v biases; random-init ones are zero, which would not test them."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "qwen2_biased"
    shutil.copytree(model_dir, out)
    path = next(out.glob("*.safetensors"))
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith("_proj.bias"):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.5
    save_file(tensors, path, metadata={"format": "pt"})
    return out
