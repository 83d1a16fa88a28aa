"""The one-call C++ decoder stack (models/llama_cpu.py): bit-identical to the Python layer loop it
replaces, on a workload that reaches every kernel path it chains (prefill chunks, cached prefixes,
decode batches below and above the quantized GEMM's panel threshold), float32 and quantized, with each
layer's own attention parameters (sliding windows, soft-caps), and used only where it can serve. On
the CPU whatever the test device: it runs the C++ CPU kernels."""

from __future__ import annotations

from pathlib import Path

import pytest

import radixlm_runtime as rt
from radixlm_runtime.attention.base import AttentionLayer
from radixlm_runtime.layers.linear_kernels import PANEL_GEMM_MIN_ROWS
from radixlm_runtime.models.llama import LlamaForCausalLM
from radixlm_runtime.utils import cpu

# Shared prefixes (radix-cache hits), a prompt longer than a prefill chunk, and more requests than the
# panel GEMM threshold so decode runs both the row-dot (few rows) and panel kernels.
PREFIX = "The council of the harbour town met every spring to discuss the fishing season. "
PROMPTS = [PREFIX * 6 + f"Question {i}: what did they decide?" for i in range(PANEL_GEMM_MIN_ROWS + 2)]
PROMPTS += ["short", "hello world " * 40]


def _outputs(
    model_dir: Path, quantization: str, native: bool, attention_backend: str = "auto"
) -> list[tuple[list[int], list[float]]]:
    engine = rt.Engine(
        str(model_dir),
        device="cpu",
        dtype="float32",
        quantization=quantization,
        max_total_tokens=8192,
        chunked_prefill_size=64,
        log_level="warning",
        attention_backend=attention_backend,
    )
    try:
        # Kernel linears on the cpu backend.
        assert (engine.runner.model.cpu_decoder is not None) == (attention_backend == "auto")
        if not native:
            engine.runner.model.cpu_decoder = None
        params = [
            {"temperature": 0, "max_new_tokens": 6 + i % 5, "ignore_eos": True} for i in range(len(PROMPTS))
        ]
        # Two calls: the second finds the first's prefixes in the cache.
        outs = engine.generate(PROMPTS[:3], params[:3], return_logprob=True, logprob_start_len=0)
        outs += engine.generate(PROMPTS, params, return_logprob=True, logprob_start_len=0)
    finally:
        engine.shutdown()
    return [
        (
            o["output_ids"],
            [
                lp[0]
                for lp in o["meta_info"]["input_token_logprobs"][1:] + o["meta_info"]["output_token_logprobs"]
            ],
        )
        for o in outs
    ]


@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_matches_the_python_layers_bit_for_bit(
    arch: str, quantization: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path
) -> None:
    """Same tokens and the same prompt and output logprobs to the last bit (qwen2: with q/k/v biases);
    `none`: float32 panels."""
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    native = _outputs(model_dir, quantization, native=True)
    python = _outputs(model_dir, quantization, native=False)
    assert len(native) == 3 + len(PROMPTS)
    assert native == python


def _windowed_layers(self: LlamaForCausalLM) -> tuple[AttentionLayer, ...]:
    """Layer 0 sees its last 24 keys only (the prompts are hundreds of tokens, and prefill chunks of 64),
    layer 1 soft-caps its scores: a window that bites, and parameters that differ by layer."""
    scale = self.config.head_dim**-0.5
    return (AttentionLayer(scale, 24), AttentionLayer(scale, None, 5.0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_windowed_layers_match_the_python_layers_bit_for_bit(
    arch: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral's and Qwen2's sliding windows (and a soft-cap) on the one-call decoder: each layer
    attends with its own parameters, as the Python layer loop does, bit for bit; and like the torch
    backend's reference path within float error."""
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    monkeypatch.setattr(LlamaForCausalLM, "attention_layers", _windowed_layers)
    native = _outputs(model_dir, "none", native=True)
    assert native == _outputs(model_dir, "none", native=False)
    reference = _outputs(model_dir, "none", native=False, attention_backend="torch")
    assert [ids for ids, _ in native] == [ids for ids, _ in reference]
    for (_, lp), (_, ref_lp) in zip(native, reference):
        assert len(lp) == len(ref_lp) and max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-4
    monkeypatch.undo()
    assert native != _outputs(model_dir, "none", native=True)  # the window and soft-cap are not ignored


@pytest.mark.parametrize(
    "flags",
    [
        {"quantization": "none", "cpu_flags": "sse4_2"},
        {"quantization": "int4", "attention_backend": "torch"},
        {"quantization": "int4", "deterministic": True},
    ],
    ids=["onednn-fallback", "torch-attention", "deterministic"],
)
def test_serves_only_kernel_layers_on_the_cpu_attention(
    tiny_llama_dir: Path, flags: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float weights on oneDNN (a CPU the panel kernels have no SIMD path for), another attention
    backend or the batch-invariant mode's attention keep the Python layer loop."""
    if "cpu_flags" in flags:
        fake = cpu.CpuInfo("fake CPU", frozenset(flags.pop("cpu_flags").split()), 2)
        monkeypatch.setattr(cpu, "detect", lambda: fake)
    engine = rt.Engine(str(tiny_llama_dir), device="cpu", dtype="float32", max_total_tokens=512, **flags)
    try:
        assert engine.runner.model.cpu_decoder is None
        out = engine.generate("hello", {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
        assert len(out["output_ids"]) == 3
    finally:
        engine.shutdown()
