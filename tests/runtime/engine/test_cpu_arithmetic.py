"""The CPU arithmetic switches end to end on a tiny model: --dtype bfloat16 (bf16 dot products) and
--cpu-act-quant int8 (int8 activations into quantized weights). Under each, the one-call C++ decoder
matches the Python layers to the bit and the outputs stay close to float32's; where every linear is
batch-invariant (bf16 panels, int8 activations), a prompt served from the radix cache gives the same
tokens and logprobs as served fresh, in these batches (default-mode attention sums shared-prefix groups
in another order where requests share steps otherwise, e.g. under overlap scheduling: --deterministic
makes it per-token). Quantized weights on float32 arithmetic run on quantized panels, one kernel's bits
at every row count, so they are batch-invariant too; in bf16 they switch from the row-dot kernels to a
panel GEMM at PANEL_GEMM_MIN_ROWS rows, so their bits depend on the batch (--deterministic pads them
to one shape)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import radixlm_runtime as rt
from radixlm_runtime.layers.linear_kernels import act8_available, bf16_available

PREFIX = "The council of the harbour town met every spring to discuss the fishing season. " * 3
PROMPTS = [PREFIX + f"Question {i}: what did they decide?" for i in range(14)] + ["hello world " * 30]

needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="no bf16 dot products (AVX512-BF16)")
needs_act8 = pytest.mark.skipif(not act8_available(), reason="no SIMD path for int8 activations")
ARITHMETIC = [
    pytest.param({"dtype": "bfloat16", "quantization": "none"}, marks=needs_bf16, id="bf16-float-weights"),
    pytest.param(
        {"dtype": "bfloat16", "quantization": "int4"}, marks=needs_bf16, id="bf16-int4-not-invariant"
    ),
    pytest.param({"cpu_act_quant": "int8", "quantization": "int4"}, marks=needs_act8, id="act8-int4"),
    pytest.param({"cpu_act_quant": "int8", "quantization": "int8"}, marks=needs_act8, id="act8-int8"),
]


def _run(model_dir: Path, native: bool, **arithmetic: Any) -> tuple[list, list]:
    """(outputs served fresh, the same prompts again served from the cache): tokens and logprobs."""
    engine = rt.Engine(
        str(model_dir),
        device="cpu",
        max_total_tokens=8192,
        chunked_prefill_size=64,
        prefill_step_target_ms=0,  # fixed step sizes: the batches must not depend on measured times
        log_level="warning",
        **{"dtype": "float32", **arithmetic},
    )
    try:
        if not native:
            engine.runner.model.cpu_decoder = None
        params = [
            {"temperature": 0, "max_new_tokens": 5 + i % 4, "ignore_eos": True} for i in range(len(PROMPTS))
        ]
        runs = []
        for _ in range(2):
            outs = engine.generate(PROMPTS, params, return_logprob=True, logprob_start_len=0)
            runs.append(
                [
                    (
                        o["output_ids"],
                        [lp[0] for lp in o["meta_info"]["input_token_logprobs"][1:]]
                        + [lp[0] for lp in o["meta_info"]["output_token_logprobs"]],
                        o["meta_info"]["cached_tokens"],
                    )
                    for o in outs
                ]
            )
    finally:
        engine.shutdown()
    return runs[0], runs[1]


@pytest.mark.parametrize("arithmetic", ARITHMETIC)
def test_cached_equals_fresh_and_the_decoder_equals_python(tiny_llama_dir: Path, arithmetic: dict) -> None:
    fresh, cached = _run(tiny_llama_dir, native=True, **arithmetic)
    assert all(c > 0 for _, _, c in cached)
    invariant = arithmetic.get("cpu_act_quant") == "int8" or arithmetic["quantization"] == "none"
    assert invariant == ([(ids, lps) for ids, lps, _ in fresh] == [(ids, lps) for ids, lps, _ in cached])
    python, _ = _run(tiny_llama_dir, native=False, **arithmetic)
    assert [(ids, lps) for ids, lps, _ in python] == [(ids, lps) for ids, lps, _ in fresh]
    # Another arithmetic, not float32 under another name: the logprobs move, a little.
    reference, _ = _run(tiny_llama_dir, native=True, quantization=arithmetic["quantization"])
    ours = [lp for _, lps, _ in fresh for lp in lps[: len(PREFIX)]]
    theirs = [lp for _, lps, _ in reference for lp in lps[: len(PREFIX)]]
    assert ours != theirs
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 0.5


def test_quantized_weights_on_float32_arithmetic_give_cached_the_bits_of_fresh(tiny_llama_dir: Path) -> None:
    """int4 weights on float32 arithmetic (quantized panels, the default model's serving path): a prompt
    served from the radix cache, whose uncached suffix is a few rows, gets the tokens and logprobs it
    got fresh in longer chunks; the one-call decoder equals the Python layers."""
    fresh, cached = _run(tiny_llama_dir, native=True, quantization="int4")
    assert all(c > 0 for _, _, c in cached)
    assert [(ids, lps) for ids, lps, _ in fresh] == [(ids, lps) for ids, lps, _ in cached]
    python, _ = _run(tiny_llama_dir, native=False, quantization="int4")
    assert [(ids, lps) for ids, lps, _ in python] == [(ids, lps) for ids, lps, _ in fresh]
