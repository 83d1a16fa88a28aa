"""Phi-3: a Llama-shaped decoder whose checkpoints store q/k/v and gate/up already fused (under the
names the shared blocks use), with LongRoPE scaling and a sliding window on every layer where its
config sets one."""

from __future__ import annotations

from radixlm_runtime.models.base import Attention, DecoderForCausalLM, DecoderLayer, GatedMLP
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.registry import register


@register("Phi3ForCausalLM", model_types=("phi3",))
class Phi3ForCausalLM(DecoderForCausalLM):
    fused_checkpoint = True

    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        attn = Attention(config, layer_id, qkv_bias=False, o_bias=False)
        return DecoderLayer(
            config, attn, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        )
