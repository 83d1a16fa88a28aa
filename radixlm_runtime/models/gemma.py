"""Gemma 2 and Gemma 3 (text): GeGLU, four norms a layer, embeddings scaled by sqrt(hidden), an
attention scale of query_pre_attn_scalar^-1/2, local sliding-window layers interleaved with global
ones. Gemma 2 soft-caps attention scores and final logits; Gemma 3 instead normalizes q and k per head
and gives its local layers their own rotary base.

Gemma's RMSNorm multiplies by (1 + weight): the 1 is folded into the weights at load, so the norms run
on the shared (fused) RMSNorm kernels."""

from __future__ import annotations

import torch

from radixlm_runtime.models.base import Attention, DecoderForCausalLM, DecoderLayer, GatedMLP
from radixlm_runtime.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from radixlm_runtime.models.registry import register


class _Gemma(DecoderForCausalLM):
    # Sandwich norms, GeGLU and per-layer rotary tables are in the one-call C++ decoder's loop; the
    # embedding scale and final soft-cap stay in Python around it.
    supports_cpu_decoder = True
    qk_norm: str | None = None
    # Every how many layers a global one comes, for configs that list no layer_types.
    global_every = 2

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5
        self.final_logit_softcap = config.raw.get("final_logit_softcapping")

    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        bias = config.attention_bias
        attn = Attention(config, layer_id, qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return DecoderLayer(config, attn, mlp, sandwich=True)

    @classmethod
    def resolve_layer_types(cls, config: ModelConfig) -> tuple[str, ...]:
        if config.layer_types is not None:
            return super().resolve_layer_types(config)
        every = int(config.raw.get("sliding_window_pattern") or cls.global_every)
        return tuple(
            FULL_ATTENTION if (i + 1) % every == 0 else SLIDING_ATTENTION for i in range(config.num_layers)
        )

    def attention_scale(self) -> float:
        return float(self.config.raw.get("query_pre_attn_scalar") or self.config.head_dim) ** -0.5

    def attention_softcap(self) -> float | None:
        return self.config.raw.get("attn_logit_softcapping")

    def transform_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1.0 if name.endswith("norm.weight") else tensor


@register("Gemma2ForCausalLM", model_types=("gemma2",))
class Gemma2ForCausalLM(_Gemma):
    pass


@register("Gemma3ForCausalLM", model_types=("gemma3_text",))
class Gemma3ForCausalLM(_Gemma):
    qk_norm = "head"
    global_every = 6
