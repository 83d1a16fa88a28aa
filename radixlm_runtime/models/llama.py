"""Llama-shaped decoders: Llama (SmolLM2), Mistral, Qwen2. GQA, RoPE, RMSNorm, SwiGLU; Mistral's and
Qwen2's sliding windows come from their configs (`sliding_window`, `layer_types`)."""

from __future__ import annotations

from radixlm_runtime.models.base import Attention, DecoderForCausalLM, DecoderLayer, GatedMLP
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.registry import register


@register("LlamaForCausalLM", "MistralForCausalLM", model_types=("llama", "mistral"))
class LlamaForCausalLM(DecoderForCausalLM):
    supports_cpu_decoder = True
    # Qwen2 biases q/k/v whatever its config says.
    qkv_bias: bool | None = None

    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        qkv_bias = config.attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = config.attention_bias and self.qkv_bias is None
        attn = Attention(config, layer_id, qkv_bias=qkv_bias, o_bias=o_bias)
        return DecoderLayer(
            config, attn, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        )


@register("Qwen2ForCausalLM", model_types=("qwen2",))
class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
