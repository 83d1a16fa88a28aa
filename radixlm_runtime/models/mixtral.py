"""Mixtral: a Mistral whose MLP is top-2 of 8 routed SwiGLU experts (renormalized router weights)."""

from __future__ import annotations

import torch

from radixlm_runtime.layers.moe import MoE
from radixlm_runtime.models.base import Attention, DecoderForCausalLM, DecoderLayer, load_moe_tensor
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.registry import register


@register("MixtralForCausalLM", model_types=("mixtral",))
class MixtralForCausalLM(DecoderForCausalLM):
    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        attn = Attention(config, layer_id, qkv_bias=False, o_bias=False)
        raw = config.raw
        moe = MoE(
            config.hidden_size,
            config.intermediate_size,
            int(raw["num_local_experts"]),
            int(raw["num_experts_per_tok"]),
            renormalize=True,
        )
        return DecoderLayer(config, attn, moe)

    def load_extra(self, name: str, tensor: torch.Tensor) -> str | None:
        return load_moe_tensor(
            self.layers, name, tensor, "block_sparse_moe", {"w1": "gate", "w3": "up", "w2": "down"}
        )
