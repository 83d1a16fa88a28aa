"""The one-call C++ decoder stack (models/llama_cpu.py): bit-identical to the Python layer loop it
replaces, on a workload that reaches every kernel path it chains (prefill chunks, cached prefixes,
decode batches below and above the quantized GEMM's panel threshold), float32 and quantized, with each
layer's own attention parameters (sliding windows, soft-caps), on every family that declares it
(Llama, Qwen2, Qwen3's q/k norms, Gemma 2/3's sandwich norms, GeGLU and per-layer rotary tables),
greedy-equal to transformers, and used only where it can serve. On the CPU whatever the test device:
it runs the C++ CPU kernels."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from family_models import build_family_dir

import radixlm_runtime as rt
from radixlm_runtime.attention.base import AttentionLayer
from radixlm_runtime.layers.linear_kernels import PANEL_GEMM_MIN_ROWS, bf16_available
from radixlm_runtime.models import llama_cpu
from radixlm_runtime.models.llama import LlamaForCausalLM
from radixlm_runtime.models.llama_cpu import LlamaCpuDecoder
from radixlm_runtime.models.qwen3_moe import Qwen3MoeForCausalLM
from radixlm_runtime.utils import cpu

# Shared prefixes (radix-cache hits), a prompt longer than a prefill chunk, and more requests than the
# panel GEMM threshold so decode runs both the row-dot (few rows) and panel kernels.
PREFIX = "The council of the harbour town met every spring to discuss the fishing season. "
PROMPTS = [PREFIX * 6 + f"Question {i}: what did they decide?" for i in range(PANEL_GEMM_MIN_ROWS + 2)]
PROMPTS += ["short", "hello world " * 40]


# Families beyond the Llama-shaped fixtures of conftest, built from family_models' configs: Gemma 3 with
# windows of 16 keys on two of its three layers (the prompts are hundreds of tokens) and two rotary
# tables, Gemma 2 with attention and final soft-caps.
BUILT_FAMILIES = ("gemma2", "gemma3")


@pytest.fixture(scope="module")
def model_dirs(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Path]]:
    dirs = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "qwen3": tiny_qwen3_dir}
    for family in BUILT_FAMILIES:
        dirs[family] = build_family_dir(tmp_path_factory.mktemp(family), family)
    yield dirs


def _outputs(
    model_dir: Path,
    quantization: str,
    native: bool,
    attention_backend: str = "auto",
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
) -> list[tuple[list[int], list[float]]]:
    engine = rt.Engine(
        str(model_dir),
        device="cpu",
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        quantization=quantization,
        max_total_tokens=8192,
        chunked_prefill_size=64,
        # Steps of a fixed size: a budget sized by measured step times would batch differently from
        # run to run, and quantized GEMMs are not batch-invariant (that is --deterministic's job).
        prefill_step_target_ms=0,
        log_level="warning",
        attention_backend=attention_backend,
    )
    try:
        # Kernel linears on the cpu backend; --dtype bfloat16 (bf16 arithmetic) keeps its KV in bf16,
        # --kv-cache-dtype int8 in int8.
        assert (engine.runner.model.cpu_decoder is not None) == (attention_backend == "auto")
        kv_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        kv_dtype = torch.int8 if kv_cache_dtype == "int8" else kv_dtype
        assert engine.runner.kv_pool.dtype == kv_dtype
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
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_matches_the_python_layers_bit_for_bit(
    arch: str, quantization: str, model_dirs: dict[str, Path]
) -> None:
    """Same tokens and the same prompt and output logprobs to the last bit (qwen2: with q/k/v biases;
    qwen3: per-head q/k norms; gemma: four norms a layer, GeGLU, scaled embeddings, windowed and global
    layers on their own rotary tables); `none`: float32 panels."""
    model_dir = model_dirs[arch]
    native = _outputs(model_dir, quantization, native=True)
    python = _outputs(model_dir, quantization, native=False)
    assert len(native) == 3 + len(PROMPTS)
    assert native == python


@pytest.mark.skipif(not bf16_available(), reason="this CPU has no bf16 dot products (AVX512-BF16)")
@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bf16_matches_the_python_layers_bit_for_bit(
    arch: str, quantization: str, model_dirs: dict[str, Path]
) -> None:
    """--dtype bfloat16 (bf16 pair panels, or int4 weights multiplied in bf16 from the panel threshold
    on, and a bf16 KV pool, which `_outputs` checks): the C++ loop chains the same kernels as the Python
    layers, to the bit."""
    model_dir = model_dirs[arch]
    native = _outputs(model_dir, quantization, native=True, dtype="bfloat16")
    assert native == _outputs(model_dir, quantization, native=False, dtype="bfloat16")
    # bf16 arithmetic, not float32 under another name: the logprobs move, a little.
    fp32 = _outputs(model_dir, quantization, native=True)
    assert [lps for _, lps in native] != [lps for _, lps in fp32]
    drift = max(abs(a - b) for (_, x), (_, y) in zip(native, fp32) for a, b in zip(x, y))
    assert drift < 0.5


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_kv_matches_the_python_layers_bit_for_bit(
    arch: str, quantization: str, model_dirs: dict[str, Path]
) -> None:
    """--kv-cache-dtype int8 (an int8 pool with per-token, per-head scales, which `_outputs` checks): the
    C++ loop stores and reads it with the kernels the Python layers call, to the bit (gemma3: windowed
    layers)."""
    model_dir = model_dirs[arch]
    native = _outputs(model_dir, quantization, native=True, kv_cache_dtype="int8")
    assert native == _outputs(model_dir, quantization, native=False, kv_cache_dtype="int8")
    # Quantized, not float32 under another name: the logprobs move, a little.
    fp32 = _outputs(model_dir, quantization, native=True)
    assert [lps for _, lps in native] != [lps for _, lps in fp32]
    drift = max(abs(a - b) for (_, x), (_, y) in zip(native, fp32) for a, b in zip(x, y))
    assert drift < 0.5


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


@torch.inference_mode()
def _hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """transformers' argmax over n steps, each a full forward over the sequence."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3"])
def test_greedy_matches_transformers(arch: str, model_dirs: dict[str, Path]) -> None:
    """The families with ops beyond Llama's, served by the one-call decoder: greedy tokens equal
    transformers' on prompts several windows long (and cached prefixes: the second call)."""
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engine = rt.Engine(
        str(model_dir), device="cpu", dtype="float32", max_total_tokens=8192, log_level="warning"
    )
    try:
        assert engine.runner.model.cpu_decoder is not None
        prompts = [engine.tokenizer.encode(p)[:80] for p in PROMPTS[:3] + PROMPTS[-1:]]
        params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        outs += engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        engine.shutdown()
    want = [_hf_greedy(hf, ids, 8) for ids in prompts]
    assert [o["output_ids"] for o in outs] == want + want


def _logged(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """llama_cpu's info lines, recorded at its logger: the runtime's loggers do not propagate to
    pytest's handler once an engine in an earlier test has configured logging."""
    lines: list[str] = []
    monkeypatch.setattr(llama_cpu.logger, "info", lambda msg, *args: lines.append(msg % args))
    return lines


def test_refuses_a_layer_whose_ops_it_lacks(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k normalized over the whole projection (OLMoE's) is not the C++ loop's per-head norm: `build`
    refuses the model, saying why, so the Python path runs it unchanged."""
    engine = rt.Engine(str(model_dirs["gemma3"]), device="cpu", dtype="float32", max_total_tokens=512)
    try:
        model, attn = engine.runner.model, engine.runner.attn_backend
        assert LlamaCpuDecoder.build(model, attn) is not None
        model.layers[1].self_attn.qk_norm = "full"
        lines = _logged(monkeypatch)
        assert LlamaCpuDecoder.build(model, attn) is None
        assert any("layer 1 normalizes q/k over 'full'" in line for line in lines)
    finally:
        engine.shutdown()


def test_refuses_a_family_whose_mlp_it_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A family that declared the decoder but routes its MLP through experts (Qwen3-MoE) keeps the Python
    layer loop, with the reason logged, and still generates."""
    monkeypatch.setattr(Qwen3MoeForCausalLM, "supports_cpu_decoder", True)
    lines = _logged(monkeypatch)
    engine = rt.Engine(
        str(build_family_dir(tmp_path, "qwen3_moe")), device="cpu", dtype="float32", max_total_tokens=512
    )
    try:
        assert engine.runner.model.cpu_decoder is None
        assert any("MLP is not a gated MLP" in line for line in lines)
        out = engine.generate("hello", {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
        assert len(out["output_ids"]) == 3
    finally:
        engine.shutdown()
