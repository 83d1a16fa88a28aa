"""Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral): GQA, RoPE, RMSNorm, SwiGLU.

Projections that read the same input are fused (q/k/v, gate/up) so each layer runs a few large
matmuls; checkpoints are loaded by their Hugging Face names and packed into the fused weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixlm_runtime.attention.base import AttentionBackend, AttentionLayer
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.layers.activation import SiluAndMul
from radixlm_runtime.layers.linear import Linear
from radixlm_runtime.layers.norm import RMSNorm
from radixlm_runtime.layers.quantization import LinearShards
from radixlm_runtime.layers.rotary import CosSin, RotaryEmbedding
from radixlm_runtime.models.config import ModelConfig

if TYPE_CHECKING:
    from radixlm_runtime.models.llama_cpu import LlamaCpuDecoder

# HF parameter name fragment -> (fused parameter fragment, shard id)
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = RotaryEmbedding.split_qkv(rope, qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        o = attn.forward(q, k, v.contiguous(), self.layer_id, batch)
        return self.o_proj(o.reshape(-1, self.q_size))

    def load_shard(self, shard: str, weight: torch.Tensor, bias: bool) -> None:
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        target = self.qkv_proj.bias if bias else self.qkv_proj.weight
        target.data[offset : offset + weight.shape[0]].copy_(weight)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def load_shard(self, shard: int, weight: torch.Tensor) -> None:
        offset = shard * self.intermediate_size
        self.gate_up_proj.weight.data[offset : offset + self.intermediate_size].copy_(weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, batch, attn)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = rotary
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Runs the decoder layers in one C++ call where the executor found it can (CPU kernel linears).
        self.cpu_decoder: LlamaCpuDecoder | None = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Returns float32 logits for the rows in batch.logits_indices only: projecting every prefill
        token onto a 49k vocabulary would cost more than the rest of a small model."""
        hidden = self.embed_tokens(batch.input_ids)
        rope = self.rotary.cos_sin(batch.positions)
        if self.cpu_decoder is not None:
            hidden, residual = self.cpu_decoder.forward(hidden, rope, batch)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(rope, hidden, residual, batch, attn)
        if batch.logits_indices.numel() != batch.num_tokens:
            hidden = hidden.index_select(0, batch.logits_indices)
            residual = residual.index_select(0, batch.logits_indices)
        hidden, _ = self.norm(hidden, residual)
        return self.lm_head(hidden).float()

    def attention_layers(self) -> tuple[AttentionLayer, ...]:
        """Every layer's attention parameters, for the attention backend."""
        return AttentionLayer.uniform(self.config.num_layers, self.config.head_dim**-0.5)

    def linear_shards(self) -> list[LinearShards]:
        """Every linear layer with the checkpoint weights fused into it, for quantization."""
        config = self.config
        attn = self.layers[0].self_attn
        targets = []
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            qkv = [("q_proj", attn.q_size), ("k_proj", attn.kv_size), ("v_proj", attn.kv_size)]
            mlp = [("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)]
            for name, linear, shards in (
                ("self_attn.qkv_proj", layer.self_attn.qkv_proj, [(f"self_attn.{n}", r) for n, r in qkv]),
                ("self_attn.o_proj", layer.self_attn.o_proj, [("self_attn.o_proj", config.hidden_size)]),
                ("mlp.gate_up_proj", layer.mlp.gate_up_proj, [(f"mlp.{n}", r) for n, r in mlp]),
                ("mlp.down_proj", layer.mlp.down_proj, [("mlp.down_proj", config.hidden_size)]),
            ):
                weights = [(f"{prefix}.{shard}.weight", rows) for shard, rows in shards]
                targets.append(LinearShards(f"{prefix}.{name}", linear, weights))
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        targets.append(LinearShards("lm_head", self.lm_head, [(head, config.vocab_size)], is_lm_head=True))
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.config.tie_word_embeddings:
            # Tied here rather than in __init__: materialising meta-device modules unties them.
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.keep_weight = True
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            packed = next((frag for frag in _PACKED if f".{frag}." in name), None)
            if packed is not None:
                fused, shard = _PACKED[packed]
                layer = self.layers[int(name.split(".")[1])]
                module = layer.self_attn if fused == "qkv_proj" else layer.mlp
                if fused == "qkv_proj":
                    module.load_shard(shard, tensor, bias=name.endswith(".bias"))
                else:
                    module.load_shard(shard, tensor)
                loaded.add(name.replace(packed, fused))
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in the model")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            )
