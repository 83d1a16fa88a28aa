"""Qwen3-MoE and OLMoE: routed SwiGLU experts (`norm_topk_prob` decides renormalization) on a Qwen3
attention (per-head q/k norms) or an OLMoE one (q/k norms over the whole projection). Qwen3-MoE keeps
dense MLPs on its `mlp_only_layers` and off its `decoder_sparse_step`."""

from __future__ import annotations

import torch

from radixlm_runtime.layers.moe import MoE
from radixlm_runtime.models.base import Attention, DecoderForCausalLM, DecoderLayer, GatedMLP, load_moe_tensor
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.registry import register

_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


@register("Qwen3MoeForCausalLM", model_types=("qwen3_moe",))
class Qwen3MoeForCausalLM(DecoderForCausalLM):
    qk_norm = "head"

    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        raw = config.raw
        bias = config.attention_bias
        attn = Attention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm)
        # transformers 5 writes num_local_experts where older configs say num_experts.
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        step = int(raw.get("decoder_sparse_step") or 1)
        sparse = (
            experts > 0 and layer_id not in (raw.get("mlp_only_layers") or []) and (layer_id + 1) % step == 0
        )
        if not sparse:
            return DecoderLayer(config, attn, GatedMLP(config.hidden_size, config.intermediate_size))
        inter = int(raw.get("moe_intermediate_size") or config.intermediate_size)
        moe = MoE(
            config.hidden_size, inter, experts, int(raw["num_experts_per_tok"]), bool(raw["norm_topk_prob"])
        )
        return DecoderLayer(config, attn, moe)

    def load_extra(self, name: str, tensor: torch.Tensor) -> str | None:
        return load_moe_tensor(self.layers, name, tensor, "mlp", _PROJECTIONS)


@register("OlmoeForCausalLM", model_types=("olmoe",))
class OlmoeForCausalLM(Qwen3MoeForCausalLM):
    qk_norm = "full"

    def __init__(self, config: ModelConfig) -> None:
        if config.raw.get("clip_qkv") is not None:
            raise ValueError(f"clip_qkv {config.raw['clip_qkv']} is not supported")
        super().__init__(config)
