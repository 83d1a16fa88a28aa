"""Weight-only quantized weights: their format, quantizing float weights into it, and the per-linear
plan of `--quantization` (which linears get int8 or int4, from a checkpoint's own blocks or from floats).

Format (what the CPU kernels in linear_cpu.cpp read): per output row, chunks of 32 input columns in
GGUF's block layout (int4: 16 bytes, byte j holding column j in its low nibble and column j + 16 in its
high nibble; int8: 32 signed bytes), with fp32 `scales` and `mins` per group of `group_size` columns
(16 or a multiple of 32); the weight is `scale * q + min`. GGUF Q4_0/Q4_1/Q8_0 blocks are this format
with group 32, so they are copied rather than re-encoded; the other GGUF types and AWQ/GPTQ int4 map onto
it exactly (models/gguf_weights.py, models/quantized_checkpoint.py).

A weight may hold its input columns in another order (`input_order`): GPTQ's act-order groups columns
that are scattered over K, and the kernels need each group contiguous, so the activations are gathered
into the weight's order first (layers/linear.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

QUANTIZATION_MODES = ("none", "auto", "int8", "int4")
CHUNK = 32
# The one group size below a chunk: GGUF Q6_K's 16-column sub-blocks (the kernels scale half-chunks).
HALF_CHUNK = 16
# int4 of float checkpoints uses GGUF Q4_1's group size: the accuracy of the embedded model's own blocks.
INT4_GROUP_SIZE = 32


@dataclass
class QuantizedWeight:
    """An [out_features, in_features] weight as `scales * q + mins` per group of columns."""

    bits: int
    # int4: uint8 [N, K // 2] (two weights a byte, see the module docstring); int8: int8 [N, K].
    qweight: torch.Tensor
    scales: torch.Tensor  # float32 [N, K // group_size]
    mins: torch.Tensor | None  # float32 [N, K // group_size]; None for symmetric int8
    group_size: int
    # int64 [K]: stored column j multiplies input column input_order[j]; None for the identity.
    input_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        expected = {4: torch.uint8, 8: torch.int8}
        if expected.get(self.bits) != self.qweight.dtype:
            raise ValueError(
                f"bits must be 4 (uint8 qweight) or 8 (int8), got {self.bits} {self.qweight.dtype}"
            )
        # The kernels walk raw row-major memory.
        self.qweight = self.qweight.contiguous()
        self.scales = self.scales.contiguous()
        self.mins = None if self.mins is None else self.mins.contiguous()
        aligned = self.group_size == HALF_CHUNK or self.group_size % CHUNK == 0
        if not aligned or self.in_features % self.group_size or self.in_features % CHUNK:
            raise ValueError(
                f"group_size must be {HALF_CHUNK} or a multiple of {CHUNK} dividing in_features "
                f"{self.in_features} (itself a multiple of {CHUNK}), got {self.group_size}"
            )
        if self.input_order is not None and tuple(self.input_order.shape) != (self.in_features,):
            raise ValueError(
                f"input_order must hold {self.in_features} column indices, "
                f"got shape {tuple(self.input_order.shape)}"
            )
        groups = (self.out_features, self.in_features // self.group_size)
        for name in ("scales", "mins"):
            tensor = getattr(self, name)
            if tensor is not None and (tuple(tensor.shape) != groups or tensor.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {groups}, got {tensor.dtype} {tuple(tensor.shape)}")

    def without_codes(self) -> QuantizedWeight:
        """This weight's format (bits, shape, group, input order) without its codes, scales and mins (meta
        tensors): what a layer keeps once a repacked copy (QuantPanels, Act8Panels) serves it, so the
        weights are not held twice."""
        if self.qweight.is_meta:
            return self
        meta = [None if t is None else t.to("meta") for t in (self.qweight, self.scales, self.mins)]
        return QuantizedWeight(self.bits, meta[0], meta[1], meta[2], self.group_size, self.input_order)

    def _check_held(self) -> None:
        if self.qweight.is_meta:
            raise ValueError("this quantized weight's codes were dropped: its layer serves a repacked copy")

    @functools.cached_property
    def kernel_args(self) -> tuple[int | None, ...]:
        """rq_linear's weight arguments (qweight, scales, mins pointers, N, group, bits), built once:
        decode calls the kernel 121 times a step. The tensors are never replaced after construction."""
        self._check_held()
        mins = None if self.mins is None else self.mins.data_ptr()
        return (
            self.qweight.data_ptr(),
            self.scales.data_ptr(),
            mins,
            self.out_features,
            self.group_size,
            self.bits,
        )

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    def codes(self) -> torch.Tensor:
        """The integer codes as int16 [N, K] in stored column order (int4: 0..15, int8: -128..127)."""
        self._check_held()
        if self.bits == 8:
            return self.qweight.to(torch.int16)
        chunks = self.qweight.view(self.out_features, -1, CHUNK // 2).to(torch.int16)
        return torch.cat([chunks & 15, chunks >> 4], dim=-1).view(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the layer multiplies by, in input column order (the reference for tests and
        accuracy checks)."""
        shape = (self.out_features, self.in_features // self.group_size, self.group_size)
        weight = self.codes().float().view(shape) * self.scales.unsqueeze(-1)
        if self.mins is not None:
            weight = weight + self.mins.unsqueeze(-1)
        weight = weight.view(self.out_features, self.in_features)
        if self.input_order is None:
            return weight
        unpermuted = torch.empty_like(weight)
        unpermuted[:, self.input_order] = weight
        return unpermuted

    def same_input_order(self, other: QuantizedWeight) -> bool:
        """Whether both read their inputs in one order (what weights sharing an input must do to fuse)."""
        if self.input_order is None or other.input_order is None:
            return self.input_order is other.input_order
        return torch.equal(self.input_order, other.input_order)

    @staticmethod
    def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Stacks weights along out_features (fused q/k/v and gate/up projections). Parts without mins
        get zero mins where another part has them (e.g. GGUF Q8_0 beside Q5_1): the same weights."""
        first = parts[0]
        if any((p.bits, p.group_size) != (first.bits, first.group_size) for p in parts):
            raise ValueError("cannot fuse quantized weights of different formats")
        if not all(first.same_input_order(p) for p in parts):
            raise ValueError("cannot fuse quantized weights with different input_order")
        with_mins = any(p.mins is not None for p in parts)
        return QuantizedWeight(
            bits=first.bits,
            qweight=torch.cat([p.qweight for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            mins=torch.cat([torch.zeros_like(p.scales) if p.mins is None else p.mins for p in parts])
            if with_mins
            else None,
            group_size=first.group_size,
            input_order=first.input_order,
        )


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] from int4 codes [N, K] in 0..15, in the chunk layout of the module docstring."""
    rows, cols = codes.shape
    chunks = codes.to(torch.uint8).view(rows, cols // CHUNK, CHUNK)
    return (chunks[..., : CHUNK // 2] | (chunks[..., CHUNK // 2 :] << 4)).reshape(rows, cols // 2)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric int8, scale = max |w| / 127 per output channel (or per group of group_size columns)."""
    weight = weight.detach().float()
    rows, cols = weight.shape
    group_size = group_size or cols
    if cols % group_size:
        raise ValueError(f"in_features {cols} is not a multiple of the int8 group size {group_size}")
    groups = weight.view(rows, cols // group_size, group_size)
    scales = (groups.abs().amax(dim=-1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round(groups / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(8, codes.view(rows, cols), scales, None, group_size)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """Asymmetric group-wise int4 (scale = (max - min) / 15 and min per group), as GGUF Q4_1 does."""
    weight = weight.detach().float()
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"in_features {cols} is not a multiple of the int4 group size {group_size}")
    groups = weight.view(rows, cols // group_size, group_size)
    mins = groups.amin(dim=-1)
    scales = ((groups.amax(dim=-1) - mins) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - mins.unsqueeze(-1)) / scales.unsqueeze(-1)).clamp_(0, 15)
    return QuantizedWeight(4, pack_int4(codes.view(rows, cols)), scales, mins, group_size)


def resolve_quantization(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """The mode served on device with dtype activations: `auto` becomes `none` where no quantized kernel
    exists; an explicit int8/int4 there is a ValueError naming what is supported."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_MODES)}, got {mode!r}")
    if mode == "none":
        return mode
    if device.type != "cpu":
        if mode == "auto":
            return "none"
        raise ValueError(
            f"quantization {mode!r} is implemented for CPU only; on {device.type} pass quantization "
            "'none' or 'auto' (float weights there)"
        )
    if dtype != torch.float32:
        if mode == "auto":
            return "none"
        raise ValueError(
            f"quantization {mode!r} runs float32 activations on CPU; pass dtype 'float32' (the CPU "
            f"default), got {dtype}"
        )
    return mode


@dataclass
class LinearShards:
    """One (possibly fused) linear layer of a model and the checkpoint weights stacked into it."""

    name: str
    linear: torch.nn.Module  # a layers.linear.Linear
    # (checkpoint weight name, rows) in stacking order, e.g. q_proj, k_proj, v_proj for qkv_proj.
    shards: list[tuple[str, int]]
    is_lm_head: bool = False


# A checkpoint's own quantized tensor by weight name (e.g. from a GGUF), or None if it holds floats.
QuantizedSource = Callable[[str], "QuantizedWeight | None"]


def plan_linear(target: LinearShards, mode: str, source: QuantizedSource | None) -> QuantizedWeight | None:
    """The quantized weight `mode` gives one linear layer, or None to keep it in float.

    - auto: a checkpoint's own blocks, when every shard has them in one format; otherwise float.
    - int8 / int4: a checkpoint's own blocks of that width are kept; other shards are quantized from the
      loaded float weight (in the kept blocks' group size and input order). The lm_head gets int8 under
      int4 (its accuracy loss at 4 bits is the largest of any layer; see benchmarks/README.md), and a
      checkpoint's int8 lm_head stays int8.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_MODES)}, got {mode!r}")
    if mode == "none":
        return None
    own = _own_weights(target, source)
    if mode == "auto":
        if any(w is None for w in own) or len({(w.bits, w.group_size) for w in own}) != 1:
            return None
        return QuantizedWeight.concat_rows(own)
    bits = 8 if mode == "int8" or target.is_lm_head else 4
    kept = [w if w is not None and w.bits == bits else None for w in own]
    # Float shards fused with a checkpoint's blocks are quantized to the same group size and order.
    group = next((w.group_size for w in kept if w is not None), None)
    order = next((w.input_order for w in kept if w is not None), None)
    weight = target.linear.weight
    parts, offset = [], 0
    for (_, rows), mine in zip(target.shards, kept, strict=True):
        if mine is None:
            rows_weight = weight[offset : offset + rows]
            if order is not None:
                rows_weight = rows_weight[:, order]
            mine = (
                quantize_int8(rows_weight, group)
                if bits == 8
                else quantize_int4(rows_weight, group or INT4_GROUP_SIZE)
            )
            mine.input_order = order
        parts.append(mine)
        offset += rows
    return QuantizedWeight.concat_rows(parts)


def _own_weights(target: LinearShards, source: QuantizedSource | None) -> list[QuantizedWeight | None]:
    """The checkpoint's own weight of each shard (None: float). Shards whose input orders differ (act-order
    GPTQ shards with different g_idx) cannot share the one gather of the fused layer's input: they are
    all left to the float path, whose weights the checkpoint loader dequantized."""
    if source is None:
        return [None] * len(target.shards)
    own = [source(name) for name, _ in target.shards]
    cols = target.linear.in_features
    for (name, rows), weight in zip(target.shards, own, strict=True):
        if weight is not None and (weight.out_features, weight.in_features) != (rows, cols):
            raise ValueError(
                f"checkpoint weight {name} is {weight.out_features}x{weight.in_features}, "
                f"its shard of {target.name} {rows}x{cols}"
            )
    present = [w for w in own if w is not None]
    if any(not present[0].same_input_order(w) for w in present[1:]):
        logger.info(
            "%s: its shards read the input in different orders (act-order g_idx), so it is served from "
            "the float weights",
            target.name,
        )
        return [None] * len(own)
    return own
