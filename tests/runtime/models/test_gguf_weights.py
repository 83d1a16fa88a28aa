"""GGUF Q4_0 / Q4_1 / Q8_0 blocks re-packed into the runtime's int4/int8 format: bit-exact against gguf's
own dequantization, through the format and through the kernels, and on the embedded model's file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from radixlm_runtime.layers.linear_kernels import PANEL_GEMM, ROW_DOT, ROW_DOT_512, SCALAR, cpu_linear
from radixlm_runtime.models.gguf_weights import (
    GGUFQuantizedWeights,
    gguf_tensor_name,
    repack_blocks,
    unpermute_rows,
)
from radixlm_runtime.models.loader import default_model_path, load_weights

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _blocks(type_name: str, rows: int = 24, cols: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """gguf's own quantization of random floats, and gguf's own dequantization of it."""
    floats = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(floats, qtype)
    return raw, dequantize(raw, qtype)


@pytest.mark.parametrize("type_name", TYPES)
def test_repacked_blocks_dequantize_bit_exactly_like_gguf(type_name: str) -> None:
    raw, ref = _blocks(type_name)
    weight = repack_blocks(type_name, raw, *ref.shape)
    assert weight.bits == (8 if type_name == "Q8_0" else 4) and weight.group_size == 32
    assert torch.equal(weight.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("mode", [SCALAR, ROW_DOT, PANEL_GEMM, ROW_DOT_512])
@pytest.mark.parametrize("type_name", TYPES)
def test_kernels_read_the_same_weights_as_gguf(type_name: str, mode: int) -> None:
    """x = I reads every weight back through a kernel: scale * q + min is rounded once, as gguf does."""
    raw, ref = _blocks(type_name)
    weight = repack_blocks(type_name, raw, *ref.shape)
    out = cpu_linear(torch.eye(ref.shape[1]), weight, mode=mode)
    assert torch.equal(out.T.contiguous(), torch.from_numpy(ref))


def test_other_tensor_types_are_left_to_the_float_path() -> None:
    assert repack_blocks("F32", np.zeros((2, 32), np.float32), 2, 32) is None
    assert repack_blocks("Q6_K", np.zeros((2, 210), np.uint8), 2, 256) is None


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
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.layers.0.input_layernorm.weight") is None


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
