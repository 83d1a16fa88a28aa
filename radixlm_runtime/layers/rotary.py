"""Rotary position embeddings with the config's scaling.

The inverse frequencies of scaled variants (linear, llama3, yarn, ...) come from transformers'
own RoPE initialisers, so they match the reference implementation by construction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from radixlm_runtime.layers import fused_cpu, fused_triton

# A step's cos and sin rows, [T, 1, D/2] each.
CosSin = tuple[torch.Tensor, torch.Tensor]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in float32 into a new tensor of x's dtype. Each half is written in place
    (a multiply, then a fused multiply-add) rather than built from products and concatenated: on a CPU
    these passes over the activations, not the arithmetic, are what rotary costs."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.empty_like(xf)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out.to(x.dtype)


class RotaryEmbedding:
    """Neox-style (half-split) rotation, which is what Hugging Face Llama-family checkpoints use.
    The cos/sin tables are plain float32 tensors, not module buffers, so building the model on the
    meta device and casting its weights to bf16 leave them intact."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        attention_scaling: float = 1.0,
        device: torch.device | str = "cpu",
    ) -> None:
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        self.cos_cache = (freqs.cos() * attention_scaling).to(device)
        self.sin_cache = (freqs.sin() * attention_scaling).to(device)

    def cos_sin(self, positions: torch.Tensor) -> CosSin:
        """The tables' rows for a step's positions, [T, 1, D/2] each: gathered once per forward and
        shared by every layer."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    @staticmethod
    def apply(cos_sin: CosSin, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] rotated by the positions `cos_sin` was gathered for."""
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    @staticmethod
    def split_qkv(
        cos_sin: CosSin, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] rotated, and v, from a fused projection's output
        [T, (Hq + 2 Hkv) D]. On CUDA and on float32 CPU rows q and k are rotated inside qkv by one fused
        pass (the results are views of it); elsewhere by `apply`."""
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, num_heads, head_dim)
        k = k.view(-1, num_kv_heads, head_dim)
        v = v.view(-1, num_kv_heads, head_dim)
        if qkv.dim() == 2 and fused_triton.supports(qkv):
            cos, sin = cos_sin
            fused_triton.rope_(qkv, cos.squeeze(1), sin.squeeze(1), num_heads + num_kv_heads, head_dim)
            return q, k, v
        if qkv.dim() == 2 and fused_cpu.supports(qkv):
            cos, sin = cos_sin
            fused_cpu.rope_(qkv, cos.squeeze(1), sin.squeeze(1), num_heads + num_kv_heads, head_dim)
            return q, k, v
        q, k = RotaryEmbedding.apply(cos_sin, q, k)
        return q, k, v


def build_rotary(
    hf_config: Callable[[], Any] | None,
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_positions: int,
    device: torch.device | str = "cpu",
    layer_type: str | None = None,
) -> RotaryEmbedding:
    """The table of one rotary base and scaling (None: plain RoPE). Scaled variants take their
    inverse frequencies from transformers' initialisers, fed the transformers config that `hf_config`
    loads (and the layer type where that config nests its rope parameters per layer type).
    LongRoPE: positions before the original context rotate with the short factors, later ones with
    the long factors (transformers switches every position to the long factors once a sequence
    passes the original context; per position, cached KV never changes meaning)."""
    if scaling is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return RotaryEmbedding(inv_freq, max_positions, device=device)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = scaling["rope_type"]
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported")
    assert hf_config is not None, "scaled RoPE needs the transformers config"
    config = hf_config()
    params = getattr(config, "rope_parameters", None) or {}
    nested = bool(params) and all(isinstance(v, dict) for v in params.values())
    init = functools.partial(ROPE_INIT_FUNCTIONS[rope_type], config, torch.device("cpu"))
    kind = layer_type if nested else None
    if rope_type != "longrope":
        inv_freq, attention_scaling = init(layer_type=kind)
        return RotaryEmbedding(inv_freq, max_positions, float(attention_scaling), device)
    original = int(scaling["original_max_position_embeddings"])
    short, attention_scaling = init(layer_type=kind)
    long, _ = init(seq_len=original + 1, layer_type=kind)
    table = RotaryEmbedding(short, max_positions, float(attention_scaling), device)
    if max_positions > original:
        beyond = RotaryEmbedding(long, max_positions, float(attention_scaling), device)
        table.cos_cache[original:] = beyond.cos_cache[original:]
        table.sin_cache[original:] = beyond.sin_cache[original:]
    return table
