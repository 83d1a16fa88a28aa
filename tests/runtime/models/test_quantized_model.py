"""The embedded model served with int8 and int4 weights: sane greedy output, and greedy tokens that mostly
agree with transformers' fp32 reference on the same (dequantized) weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import radixlm_runtime as rt

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Q: Who wrote Hamlet?\nA:",
    "The quick brown fox",
    "Water boils at",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["int8", "int4"])
def engine(request: pytest.FixtureRequest) -> rt.Engine:
    # On the CPU whatever the test device: int8/int4 weights are served by the C++ CPU kernels only.
    eng = rt.Engine(device="cpu", quantization=request.param, max_total_tokens=4096, log_level="warning")
    yield eng
    eng.shutdown()


def _reference(model_dir: Path, tokenizer, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        outs.append(out[0, len(ids) :].tolist())
    return outs


def test_layers_are_served_quantized(engine: rt.Engine) -> None:
    model = engine.runner.model
    bits = 8 if engine.server_args.engine.quantization == "int8" else 4
    layer = model.layers[0]
    for linear in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert linear.quantized is not None and linear.quantized.bits == bits
    assert model.lm_head.quantized is not None and model.lm_head.quantized.bits == 8


def test_greedy_output_is_sane(engine: rt.Engine) -> None:
    capital, count = engine.generate(
        ["The capital of France is", "1, 2, 3, 4, 5,"], {"temperature": 0, "max_new_tokens": 8}
    )
    assert "Paris" in capital["text"]
    assert count["text"].lstrip().startswith("6")


def test_greedy_tokens_mostly_agree_with_fp32_transformers(
    engine: rt.Engine, default_model_dir: Path, prompt_logprobs: Callable[..., dict]
) -> None:
    """Teacher-forced: at each position of transformers' fp32 greedy continuation, is the quantized
    model's top-1 token the same? (One differing token does not derail the positions after it.)"""
    ref = _reference(default_model_dir, engine.tokenizer, PROMPTS)
    same = total = 0
    for prompt, cont in zip(PROMPTS, ref, strict=True):
        ids = engine.tokenizer.encode(prompt)
        tops = prompt_logprobs(engine, ids + cont, start=len(ids), top=1)["input_top_logprobs"]
        top1 = [entry[0][1] for entry in tops]
        same += sum(a == b for a, b in zip(top1, cont, strict=True))
        total += len(cont)
    # Measured: int4 (the GGUF's own Q4_1 blocks, the reference's very weights) and int8 (requantized
    # per channel from them): see benchmarks/README.md.
    assert same / total >= 0.9, f"{same}/{total} greedy tokens agree with fp32"
