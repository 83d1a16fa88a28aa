"""The decoder stack of a Llama-shaped model in one C++ call on the CPU (llama_cpu.cpp).

Serves a forward when the family declares `supports_cpu_decoder`, every layer's ops are ones the C++
loop has (pre-norm or Gemma's sandwich norms, per-head q/k norms, SwiGLU or GeGLU, a rotary table per
layer type, per-layer windows and soft-caps), every decoder linear runs on the CPU linear kernels
(float32 panels or weight-only int8/int4), the activations are float32 on the CPU and attention runs on
the C++ CPU backend (over a float32 KV pool, a bf16 one under --dtype bfloat16, or an int8 one under
--kv-cache-dtype int8): then each layer is nothing but calls into the C++ kernels, and making them from
C++ instead of Python takes the interpreter out of the step (a fifth of a single-stream int4 decode step).
The outputs are bit-identical to the Python path's: the same kernels in the same order. Everything else
(embeddings and their scale, final norm, lm_head, --deterministic's per-token attention) stays in
Python. A model with an op the loop lacks is refused with the reason logged, and its layers run from
Python. Under tensor parallelism the loop calls back into Python after each o_proj and down_proj for
the all-reduce of the ranks' partial sums (the linears' `collective`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.attention.cpu_backend import CpuAttentionBackend, kv_type, layer_pointers
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.kernels.native import KernelBuildError, load_library
from radixlm_runtime.layers import fused_cpu
from radixlm_runtime.layers.activation import GeluAndMul, SiluAndMul
from radixlm_runtime.layers.linear import Linear
from radixlm_runtime.layers.linear_kernels import kernel_mode
from radixlm_runtime.layers.rotary import CosSin
from radixlm_runtime.models.base import GatedMLP
from radixlm_runtime.utils.logging import get_logger

if TYPE_CHECKING:
    from radixlm_runtime.layers.norm import RMSNorm
    from radixlm_runtime.models.base import DecoderForCausalLM, DecoderLayer

logger = get_logger(__name__)

_SOURCE = Path(__file__).with_name("llama_cpu.cpp")
# The MLP activations the C++ loop runs, as fused_cpu.cpp numbers them.
_ACTIVATIONS = {SiluAndMul: fused_cpu.SILU, GeluAndMul: fused_cpu.GELU_TANH}
# Tensor parallelism's sum over the ranks, called back from the loop after o_proj and down_proj.
_REDUCE = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)
_NO_REDUCE = ctypes.cast(None, _REDUCE)


@functools.cache
def _library() -> ctypes.CDLL:
    lib = load_library(_SOURCE)
    i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    # layers, attention, num_layers, hidden, inter, q_heads, kv_heads, head_dim, eps, hidden, residual,
    # tokens, cos, sin, loc, table, table_stride, window_loc, window_table, requests, num_reqs, groups,
    # num_groups, members, the KV type, three modes, threads
    lib.lc_forward.argtypes = [
        ptr,
        ptr,
        *[i64] * 6,
        f32,
        ptr,
        ptr,
        i64,
        *[ptr] * 4,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        i64,
        ptr,
    ]
    lib.lc_forward.argtypes += [c_int] * 5 + [_REDUCE]
    lib.lc_forward.restype = None
    return lib


def _linears(layer: DecoderLayer) -> tuple[Linear, Linear, Linear, Linear]:
    """The layer's linears in the order llama_cpu.cpp reads them."""
    a, mlp = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj


def _norm_slots(layer: DecoderLayer) -> list[RMSNorm | None]:
    """The layer's RMSNorms in the order llama_cpu.cpp reads them, None where the layer has none:
    input, post-attention, pre- and post-feedforward (Gemma's sandwich), q and k (per head)."""
    attn = layer.self_attn
    sandwich = (layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if layer.sandwich else ()
    qk = (attn.q_norm, attn.k_norm) if attn.qk_norm is not None else ()
    return [
        layer.input_layernorm,
        layer.post_attention_layernorm,
        *(sandwich or (None, None)),
        *(qk or (None, None)),
    ]


def _unsupported(model: DecoderForCausalLM) -> str | None:
    """Why llama_cpu.cpp cannot run this model's layers as the Python path does, or None if it can."""
    eps = model.layers[0].input_layernorm.eps
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, GatedMLP) or type(layer.mlp.act) not in _ACTIVATIONS:
            return f"layer {i}'s MLP is not a gated MLP with SiLU or GELU(tanh)"
        if layer.self_attn.qk_norm not in (None, "head"):
            return f"layer {i} normalizes q/k over {layer.self_attn.qk_norm!r}, not per head"
        linears = _linears(layer)
        if any(lin.kernel_weight is None or lin.row_block for lin in linears):
            return f"layer {i} has a linear off the CPU linear kernels"
        reduce = model.layers[0].self_attn.o_proj.collective
        if any(lin.collective != reduce for lin in linears[1::2]) or any(
            lin.collective is not None for lin in linears[::2]
        ):
            return (
                f"layer {i}'s linears sum their outputs over tensor-parallel ranks otherwise than the first's"
            )
        if any(lin.bias is not None for lin in linears[1:]):
            return f"layer {i} has an o_proj or MLP bias"
        for norm in filter(None, _norm_slots(layer)):
            if norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu" or norm.eps != eps:
                return f"layer {i} has a norm that is not float32 on the CPU with eps {eps}"
    return None


def _linear_fields(linear: Linear) -> list[int]:
    """The linear kernel's weight arguments, then in_features (see llama_cpu.cpp)."""
    w = linear.kernel_weight
    assert w is not None
    return [arg or 0 for arg in w.kernel_args] + [w.in_features]


class LlamaCpuDecoder:
    """Built by `build` where the model and attention backend qualify; holds the layers' weight
    pointers (the tensors are never replaced after loading, and the model keeps them alive) and
    attention parameters (each layer its own: a sliding window on some layers only, Qwen2's and
    Gemma's)."""

    def __init__(self, model: DecoderForCausalLM, attn: CpuAttentionBackend) -> None:
        config = model.config
        rows = []
        for i, (layer, params, rotary) in enumerate(zip(model.layers, attn.layers, model.layer_rotary)):
            norms = [0 if norm is None else norm.weight.data_ptr() for norm in _norm_slots(layer)]
            bias = layer.self_attn.qkv_proj.bias
            k_buf, v_buf, k_scale, v_scale = layer_pointers(attn.kv_pool, i)
            rows.append(
                norms
                + [
                    0 if bias is None else bias.data_ptr(),
                    k_buf,
                    v_buf,
                    params.sliding_window or 0,
                    rotary,
                    _ACTIVATIONS[type(layer.mlp.act)],
                    k_scale,
                    v_scale,
                ]
                + [f for lin in _linears(layer) for f in _linear_fields(lin)]
            )
        self.fields = torch.tensor(rows, dtype=torch.int64)
        self.attention = torch.tensor(
            [[params.scale, params.logit_softcap or 0.0] for params in attn.layers], dtype=torch.float32
        )
        self.shape = (
            config.num_layers,
            config.hidden_size,
            config.intermediate_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.eps = model.layers[0].input_layernorm.eps
        self.attn = attn
        self.kv_type = kv_type(attn.kv_pool.k_buffers[0])
        self.fused_mode = fused_cpu.default_mode()
        self.compute = model.layers[0].self_attn.qkv_proj.compute
        # Tensor parallelism: the in-place sum over the ranks of o_proj's and down_proj's outputs.
        self.reduce = model.layers[0].self_attn.o_proj.collective

    @classmethod
    def build(cls, model: DecoderForCausalLM, attn: AttentionBackend) -> LlamaCpuDecoder | None:
        """The decoder for this model, or None where it cannot serve (and the Python path runs)."""
        if not model.supports_cpu_decoder:
            return None
        if not isinstance(attn, CpuAttentionBackend) or attn.per_token:
            return None
        reason = _unsupported(model)
        if reason is not None:
            logger.info("the one-call CPU decoder does not serve this model (%s); Python runs it", reason)
            return None
        if not fused_cpu.supports(model.layers[0].input_layernorm.weight[None]):
            return None
        try:
            _library()
        except KernelBuildError as e:
            logger.warning("the one-call CPU decoder is unavailable, layers run from Python: %s", e)
            return None
        return cls(model, attn)

    def forward(
        self, hidden: torch.Tensor, ropes: list[CosSin], batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] (the embeddings; overwritten) and the step's rows of each rotary table ->
        (last MLP output, residual stream)."""
        if not hidden.is_contiguous():
            hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        if len(ropes) == 1:
            cos, sin = (t.contiguous() for t in ropes[0])
        else:
            cos, sin = (torch.stack(tables) for tables in zip(*ropes))
        tokens = hidden.shape[0]
        layers, hidden_size, inter, q_heads, kv_heads, head_dim = self.shape
        table = self.attn.req_to_token
        failed: list[BaseException] = []

        def reduce(_data: object, _count: int) -> None:
            # The loop's output is `hidden` itself; an error cannot cross the C++ frames, so it is
            # raised once the call returns (the ranks' later collectives fail with it).
            if not failed:
                try:
                    self.reduce(hidden)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    failed.append(e)

        _library().lc_forward(
            self.fields.data_ptr(),
            self.attention.data_ptr(),
            layers,
            hidden_size,
            inter,
            q_heads,
            kv_heads,
            head_dim,
            self.eps,
            hidden.data_ptr(),
            residual.data_ptr(),
            tokens,
            cos.data_ptr(),
            sin.data_ptr(),
            batch.out_cache_loc.data_ptr(),
            table.data_ptr(),
            table.stride(0),
            None if batch.window_loc is None else batch.window_loc.data_ptr(),
            None if self.attn.req_to_window is None else self.attn.req_to_window.data_ptr(),
            *batch.attn_metadata.args(),
            self.kv_type,
            kernel_mode(tokens, self.compute),
            self.fused_mode,
            self.attn.mode,
            torch.get_num_threads(),
            _NO_REDUCE if self.reduce is None else _REDUCE(reduce),
        )
        if failed:
            raise failed[0]
        return hidden, residual
