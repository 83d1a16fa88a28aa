"""Rotary position embeddings with the config's scaling.

The inverse frequencies of scaled variants (linear, llama3, yarn, ...) come from transformers'
own RoPE initialisers, so they match the reference implementation by construction.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D]."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        q = _rotate(q.float(), cos, sin).to(q.dtype)
        k = _rotate(k.float(), cos, sin).to(k.dtype)
        return q, k


def build_rotary(
    hf_config: object | None,
    head_dim: int,
    rope_theta: float,
    max_positions: int,
    device: torch.device | str = "cpu",
) -> RotaryEmbedding:
    """hf_config (a transformers config) is needed only for scaled RoPE variants."""
    rope_type = _rope_type(hf_config)
    if rope_type == "default":
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return RotaryEmbedding(inv_freq, max_positions, device=device)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return RotaryEmbedding(inv_freq, max_positions, float(scaling), device)


def _rope_type(hf_config: object | None) -> str:
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, attr, None)
        if isinstance(params, dict):
            return params.get("rope_type") or params.get("type") or "default"
    return "default"
