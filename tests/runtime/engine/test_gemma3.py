"""End to end on a second real model: Gemma 3 270M (Q4_K_M GGUF from the `radixlm[gemma3]` extra),
served by its short name. Gemma 3 has what SmolLM2 lacks: sliding-window layers interleaved with global
ones, each with its own rotary base, per-head q/k norms, four norms a layer, GeGLU, scaled embeddings,
a 262k vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import radixlm_runtime as rt
from radixlm_runtime.models.loader import resolve_model_path

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Explain gravity in simple terms:",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "import numpy as np\n",
    "Q: Who wrote Hamlet?\nA:",
    "List three primary colors:",
    "The best way to learn a language is",
    "SELECT name FROM users WHERE",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "In 1969, astronauts",
    "Water boils at",
    "A recipe for pancakes:\n1.",
    "The mitochondria is",
    "Translate to French: Good morning ->",
    "for i in range(10):",
    "Dear hiring manager,",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def reference(gemma3_dir: Path) -> list[list[int]]:
    """transformers' greedy tokens on the same GGUF (dequantized by transformers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(gemma3_dir))
    refs = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        refs.append(out[0, len(ids) :].tolist())
    return refs


def _greedy(engine: rt.Engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": NEW_TOKENS})
    return [o["output_ids"] for o in outs]


def test_float_path_matches_transformers_on_20_of_20(reference: list[list[int]]) -> None:
    engine = rt.Engine(MODEL, dtype="float32", quantization="none", log_level="warning")
    try:
        assert engine.tokenizer.encode(PROMPTS[0])[0] == 2  # <bos>, as the Gemma tokenizer adds it
        ours = _greedy(engine)
    finally:
        engine.shutdown()
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) == 20


def test_quantized_path_keeps_transformers_tokens(reference: list[list[int]]) -> None:
    """The default serves the GGUF's own K-quant blocks on the int4/int8 kernels: the same weights,
    summed in another order, so at most one prompt may drift by a rounding-level tie."""
    engine = rt.Engine(MODEL, dtype="float32", log_level="warning")
    try:
        ours = _greedy(engine)
        cached = _greedy(engine)
    finally:
        engine.shutdown()
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= 19
    assert cached == ours
