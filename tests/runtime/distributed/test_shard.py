"""What each tensor-parallel rank holds: head groups (even, uneven, replicated), checkpoint tensor parts
(float and quantized, the quantized part equal to the float part's quantization), vocabulary padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixlm_runtime.distributed.shard import ShardLayout, TensorShard, split_heads
from radixlm_runtime.layers.quantization import quantize_int4, quantize_int8
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.loader import load_weights


def _config(**overrides: object) -> ModelConfig:
    """SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64), unless overridden."""
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 2,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    return ModelConfig.from_hf_config(hf | overrides)


def test_three_kv_heads_on_two_ranks_split_in_whole_groups() -> None:
    """The default model: rank 0 KV heads 0-1 with their query heads 0-5, rank 1 KV head 2 with 6-8."""
    assert split_heads(9, 3, 2, 0) == (range(0, 6), range(0, 2))
    assert split_heads(9, 3, 2, 1) == (range(6, 9), range(2, 3))
    assert split_heads(9, 3, 3, 2) == (range(6, 9), range(2, 3))


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    # 8 query heads on 2 KV heads, 4 ranks: each KV head on 2 ranks, which split its 4 query heads.
    assert [split_heads(8, 2, 4, r) for r in range(4)] == [
        (range(0, 2), range(0, 1)),
        (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)),
        (range(6, 8), range(1, 2)),
    ]
    with pytest.raises(ValueError, match="tp_size 4"):
        split_heads(9, 3, 4, 0)  # 3 KV heads cannot be replicated evenly on 4 ranks


def test_layout_local_config_and_tensor_parts() -> None:
    layouts = [ShardLayout.of(_config(), r, 2) for r in range(2)]
    local = [layout.local_config() for layout in layouts]
    assert [(c.num_heads, c.num_kv_heads) for c in local] == [(6, 2), (3, 1)]
    assert [c.intermediate_size for c in local] == [768, 768]
    assert [c.vocab_size for c in local] == [24576, 24576]
    q = [layout.tensor_shard("model.layers.3.self_attn.q_proj.weight") for layout in layouts]
    assert [s.pieces for s in q] == [(range(0, 384),), (range(384, 576),)]
    o = layouts[1].tensor_shard("model.layers.0.self_attn.o_proj.weight")
    assert (o.dim, o.pieces) == (1, (range(384, 576),))
    assert layouts[0].tensor_shard("model.layers.0.self_attn.o_proj.bias") is None
    assert layouts[1].tensor_shard("model.layers.0.self_attn.o_proj.bias").zero
    assert layouts[0].tensor_shard("model.layers.0.input_layernorm.weight") is None
    assert layouts[0].tensor_shard("model.layers.0.self_attn.q_norm.weight") is None
    # A fused checkpoint's q/k/v (Phi-3): the rank's q rows, then its k rows and v rows.
    fused = layouts[1].tensor_shard("model.layers.0.self_attn.qkv_proj.weight")
    assert fused.pieces == (range(384, 576), range(576 + 128, 576 + 192), range(768 + 128, 768 + 192))


def test_vocab_rows_padded_to_one_size() -> None:
    layouts = [ShardLayout.of(_config(vocab_size=301), r, 2) for r in range(2)]
    assert [layout.vocab for layout in layouts] == [range(0, 151), range(151, 301)]
    table = torch.randn(301, 8)
    parts = [layout.tensor_shard("model.embed_tokens.weight").take(table) for layout in layouts]
    assert [p.shape[0] for p in parts] == [151, 151]
    torch.testing.assert_close(torch.cat(parts)[:301], table, rtol=0, atol=0)
    assert not parts[1][150].any()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_parts_equal_the_float_parts_quantized(bits: int) -> None:
    """Rows and whole-chunk columns of a quantized weight are the weight of the float part: the codes
    of a row or a group do not depend on the others."""
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    quantize = quantize_int4 if bits == 4 else lambda w: quantize_int8(w, 32)
    full = quantize(weight)
    rows = TensorShard(0, (range(0, 32), range(64, 80)), rows=64)
    part = rows.take_quantized(full)
    expect = rows.take(weight)
    torch.testing.assert_close(part.dequantize()[:48], quantize(expect[:48]).dequantize(), rtol=0, atol=0)
    assert part.out_features == 64 and not part.dequantize()[48:].any()
    cols = TensorShard(1, (range(32, 96),))
    torch.testing.assert_close(
        cols.take_quantized(full).dequantize(), quantize(cols.take(weight)).dequantize(), rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="whole groups of 32"):
        TensorShard(1, (range(16, 48),)).take_quantized(full)


def test_safetensors_read_as_the_ranks_parts(tiny_llama_dir: Path) -> None:
    """load_weights with a rank's shards yields only its parts, equal to the full tensors' slices."""
    config = ModelConfig.from_dir(tiny_llama_dir)
    full = dict(load_weights(tiny_llama_dir))
    layout = ShardLayout.of(config, 1, 2)
    parts = dict(load_weights(tiny_llama_dir, layout.tensor_shard))
    assert parts.keys() == full.keys()
    q = full["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(parts["model.layers.0.self_attn.q_proj.weight"], q[32:])
    down = full["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(parts["model.layers.1.mlp.down_proj.weight"], down[:, 64:])
    assert torch.equal(parts["model.embed_tokens.weight"], full["model.embed_tokens.weight"][150:])
    assert torch.equal(parts["model.norm.weight"], full["model.norm.weight"])
