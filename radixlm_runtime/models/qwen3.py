"""Qwen3: a Llama-shaped decoder with an RMSNorm over each head of q and k before the rotary."""

from __future__ import annotations

from radixlm_runtime.models.base import Attention, DecoderForCausalLM, DecoderLayer, GatedMLP
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.registry import register


@register("Qwen3ForCausalLM", model_types=("qwen3",))
class Qwen3ForCausalLM(DecoderForCausalLM):
    supports_cpu_decoder = True

    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        bias = config.attention_bias
        attn = Attention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm="head")
        return DecoderLayer(
            config, attn, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        )
