"""The blocks every family is built from, and the decoder-only model they make.

A family module (llama.py, qwen3.py, gemma3.py, ...) picks its blocks' options (q/k norms, activation,
sandwich norms, per-layer windows and rotary tables, embedding scale, logit soft-cap) and how its
checkpoint names map onto them; the forward, the fused projections, the quantizer's view of the
linears and the weight loader are written once, here.

Projections that read the same input are fused (q/k/v, gate/up) so each layer runs a few large
matmuls; checkpoints are loaded by their Hugging Face names and packed into the fused weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from radixlm_runtime.attention.base import AttentionBackend, AttentionLayer
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.layers import fused_cpu
from radixlm_runtime.layers.activation import GeluAndMul, SiluAndMul
from radixlm_runtime.layers.embedding import Embedding
from radixlm_runtime.layers.linear import Linear
from radixlm_runtime.layers.norm import RMSNorm
from radixlm_runtime.layers.quantization import LinearShards
from radixlm_runtime.layers.rotary import CosSin, RotaryEmbedding, build_rotary
from radixlm_runtime.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeSpec

if TYPE_CHECKING:
    from radixlm_runtime.models.llama_cpu import LlamaCpuDecoder

# HF parameter name fragment -> (fused parameter fragment, shard id)
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": SiluAndMul,
    "gelu_pytorch_tanh": GeluAndMul,
    "gelu_tanh": GeluAndMul,
}


class Attention(nn.Module):
    """Fused q/k/v projection, optional q/k RMSNorm (per head: Qwen3, Gemma 3; over the whole
    projection: OLMoE), rotary, attention through the backend, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: str | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm is not None:
            q_dim, k_dim = {"head": (self.head_dim,) * 2, "full": (self.q_size, self.kv_size)}[qk_norm]
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps)

    def forward(
        self, rope: CosSin, hidden: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        fused_norm = self.fused_head_norm(qkv)
        if fused_norm:
            # In place in the projection's output, then rotated there as a plain layer's q and k are:
            # the kernels (and order) the one-call C++ decoder runs.
            fused_cpu.head_rms_norm_(
                qkv,
                self.q_norm.weight,
                self.k_norm.weight,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.q_norm.eps,
            )
        if self.qk_norm is None or fused_norm:
            q, k, v = RotaryEmbedding.split_qkv(rope, qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            rows = -1 if self.qk_norm == "head" else q.shape[0]
            q = self.q_norm(q.reshape(rows, self.q_norm.weight.shape[0])).view(
                -1, self.num_heads, self.head_dim
            )
            k = self.k_norm(k.reshape(rows, self.k_norm.weight.shape[0])).view(
                -1, self.num_kv_heads, self.head_dim
            )
            q, k = RotaryEmbedding.apply(rope, q, k)
            v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = attn.forward(q, k, v.contiguous(), self.layer_id, batch)
        return self.o_proj(o.reshape(-1, self.q_size))

    def fused_head_norm(self, qkv: torch.Tensor) -> bool:
        """Whether the per-head q/k norms run on the fused CPU kernel (float32 CPU rows and weights)."""
        return (
            self.qk_norm == "head"
            and qkv.dim() == 2
            and fused_cpu.supports(qkv)
            and self.q_norm.weight.dtype == self.k_norm.weight.dtype == torch.float32
            and self.q_norm.eps == self.k_norm.eps
        )

    def load_shard(self, shard: str, weight: torch.Tensor, bias: bool) -> None:
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        target = self.qkv_proj.bias if bias else self.qkv_proj.weight
        target.data[offset : offset + weight.shape[0]].copy_(weight)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) on a fused gate/up projection (SwiGLU, GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {activation!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = _ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def load_shard(self, shard: int, weight: torch.Tensor) -> None:
        offset = shard * self.intermediate_size
        self.gate_up_proj.weight.data[offset : offset + self.intermediate_size].copy_(weight)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP on a residual stream that the norms add into (fused add + norm).
    `sandwich`: Gemma's extra norms on each block's output (four norms a layer)."""

    def __init__(self, config: ModelConfig, attn: Attention, mlp: nn.Module, sandwich: bool = False) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.sandwich = sandwich
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        rope: CosSin,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's output not yet added, the residual stream) -> the same after this layer."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, batch, attn)
        if not self.sandwich:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


_EXPERT = re.compile(r"layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight")
_ROUTER = re.compile(r"layers\.(\d+)\.(\w+)\.gate\.weight")


def load_moe_tensor(
    layers: nn.ModuleList, name: str, tensor: torch.Tensor, block: str, projections: dict[str, str]
) -> str | None:
    """Loads a routed-expert checkpoint tensor (`layers.N.<block>.experts.E.<proj>.weight`, or the
    router `layers.N.<block>.gate.weight`) into layer N's MoE (`mlp`); projections maps the
    checkpoint's projection names onto gate/up/down. Returns the parameter filled, or None."""
    if match := _EXPERT.fullmatch(name):
        layer, owner, expert, proj = match.groups()
        if owner == block and proj in projections:
            shard = projections[proj]
            layers[int(layer)].mlp.load_expert(int(expert), shard, tensor)
            return f"layers.{layer}.mlp.{'w2' if shard == 'down' else 'w13'}"
    if (match := _ROUTER.fullmatch(name)) and match.group(2) == block:
        mlp = layers[int(match.group(1))].mlp
        if hasattr(mlp, "load_expert"):
            mlp.gate.weight.data.copy_(tensor)
            return f"layers.{match.group(1)}.mlp.gate.weight"
    return None


class DecoderForCausalLM(nn.Module):
    """A decoder-only language model; a family subclass builds its layers in `make_layer`."""

    supports_cpu_decoder: ClassVar[bool] = False
    # Checkpoints that store q/k/v and gate/up already fused under our names (Phi-3).
    fused_checkpoint: ClassVar[bool] = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layer_types = self.resolve_layer_types(config)
        self.layers = nn.ModuleList([self.make_layer(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Multiplies the embeddings (Gemma: sqrt(hidden_size) in the model's dtype); None: unscaled.
        self.embed_scale: float | None = None
        self.final_logit_softcap: float | None = None
        # One table per distinct rotary spec (Gemma 3: local and global), and each layer's table's
        # index; set by init_rotary once on the device.
        self.rotaries: list[RotaryEmbedding] = []
        self.layer_rotary: list[int] = []
        # Runs the decoder layers in one C++ call where the executor found it can (CPU kernel linears).
        self.cpu_decoder: LlamaCpuDecoder | None = None

    # --- what a family decides ---

    def make_layer(self, config: ModelConfig, layer_id: int) -> DecoderLayer:
        raise NotImplementedError

    @classmethod
    def resolve_layer_types(cls, config: ModelConfig) -> tuple[str, ...]:
        """The config's `layer_types`, else every layer windowed where it has a window (Mistral)."""
        if config.layer_types is not None:
            if len(config.layer_types) != config.num_layers:
                raise ValueError(
                    f"layer_types lists {len(config.layer_types)} layers, not {config.num_layers}"
                )
            return config.layer_types
        kind = SLIDING_ATTENTION if config.sliding_window is not None else FULL_ATTENTION
        return (kind,) * config.num_layers

    def attention_scale(self) -> float:
        return self.config.head_dim**-0.5

    def attention_softcap(self) -> float | None:
        return None

    def transform_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as the parameter `name` holds it (Gemma folds its norms' +1 in here)."""
        return tensor

    def load_extra(self, name: str, tensor: torch.Tensor) -> str | None:
        """Loads a tensor the generic loader does not know (MoE experts); returns the parameter name it
        filled, or None if it is not one of the family's."""
        return None

    # --- the model ---

    def attention_layers(self) -> tuple[AttentionLayer, ...]:
        """Every layer's attention parameters, for the attention backend."""
        window = self.config.sliding_window
        if window is None and SLIDING_ATTENTION in self.layer_types:
            raise ValueError("config lists sliding_attention layers but no sliding_window")
        scale, cap = self.attention_scale(), self.attention_softcap()
        return tuple(
            AttentionLayer(scale, window if kind == SLIDING_ATTENTION else None, cap)
            for kind in self.layer_types
        )

    def init_rotary(self, context_len: int, device: torch.device, hf_config: Callable[[], Any]) -> None:
        """Builds each layer type's rotary table on the device (after the weights: tables are not
        parameters, so building on the meta device must not touch them). hf_config loads the
        transformers config, needed by scaled RoPE variants only."""
        specs: list[RopeSpec] = []
        for kind in self.layer_types:
            spec = self.config.rope_for(kind)
            if spec not in specs:  # layer types that share a spec (Qwen2's windowed layers) share a table
                specs.append(spec)
                self.rotaries.append(
                    build_rotary(
                        hf_config, self.config.head_dim, spec.theta, spec.scaling, context_len, device, kind
                    )
                )
            self.layer_rotary.append(specs.index(spec))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Returns float32 logits for the rows in batch.logits_indices only: projecting every prefill
        token onto a large vocabulary would cost more than the rest of a small model."""
        hidden = self.embed_tokens(batch.input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        ropes = [rotary.cos_sin(batch.positions) for rotary in self.rotaries]
        if self.cpu_decoder is not None:
            hidden, residual = self.cpu_decoder.forward(hidden, ropes, batch)
        else:
            residual = None
            for layer, table in zip(self.layers, self.layer_rotary):
                hidden, residual = layer(ropes[table], hidden, residual, batch, attn)
        if batch.logits_indices.numel() != batch.num_tokens:
            hidden = hidden.index_select(0, batch.logits_indices)
            residual = residual.index_select(0, batch.logits_indices)
        hidden, _ = self.norm(hidden, residual)
        logits = self.lm_head(hidden).float()
        if self.final_logit_softcap is not None:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits

    def linear_shards(self) -> list[LinearShards]:
        """Every linear layer with the checkpoint weights fused into it, for quantization."""
        config = self.config
        targets = []
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}"
            attn = layer.self_attn
            if self.fused_checkpoint:
                qkv = [("self_attn.qkv_proj", attn.q_size + 2 * attn.kv_size)]
            else:
                qkv = [
                    (f"self_attn.{n}", r)
                    for n, r in (("q_proj", attn.q_size), ("k_proj", attn.kv_size), ("v_proj", attn.kv_size))
                ]
            linears = [
                ("self_attn.qkv_proj", attn.qkv_proj, qkv),
                ("self_attn.o_proj", attn.o_proj, [("self_attn.o_proj", config.hidden_size)]),
            ]
            mlp = layer.mlp
            if isinstance(mlp, GatedMLP):
                inter = mlp.intermediate_size
                gate_up = (
                    [("mlp.gate_up_proj", 2 * inter)]
                    if self.fused_checkpoint
                    else [("mlp.gate_proj", inter), ("mlp.up_proj", inter)]
                )
                linears += [
                    ("mlp.gate_up_proj", mlp.gate_up_proj, gate_up),
                    ("mlp.down_proj", mlp.down_proj, [("mlp.down_proj", config.hidden_size)]),
                ]
            for name, linear, shards in linears:
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
            tensor = self.transform_weight(name, tensor)
            extra = self.load_extra(name, tensor)
            if extra is not None:
                loaded.add(extra)
                continue
            packed = None if self.fused_checkpoint else next((f for f in PACKED if f".{f}." in name), None)
            if packed is not None:
                fused, shard = PACKED[packed]
                layer = self.layers[int(name.split(".")[1])]
                if fused == "qkv_proj":
                    layer.self_attn.load_shard(shard, tensor, bias=name.endswith(".bias"))
                else:
                    layer.mlp.load_shard(shard, tensor)
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
