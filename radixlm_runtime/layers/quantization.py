"""Weight-only quantized weights: their format, quantizing float weights into it, and the per-linear
plan of `--quantization` (which linears get int8 or int4, from a checkpoint's own blocks or from floats).

Format (what the CPU kernels in linear_cpu.cpp read): per output row, chunks of 32 input columns in
GGUF's block layout (int4: 16 bytes, byte j holding column j in its low nibble and column j + 16 in its
high nibble; int8: 32 signed bytes), with fp32 `scales` and `mins` per group of `group_size` columns;
the weight is `scale * q + min`. GGUF Q4_0/Q4_1/Q8_0 blocks are this format with group 32, so they are
copied rather than re-encoded (models/gguf_weights.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

QUANTIZATION_MODES = ("none", "auto", "int8", "int4")
CHUNK = 32
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
        if self.group_size % CHUNK or self.in_features % self.group_size:
            raise ValueError(
                f"group_size must be a multiple of {CHUNK} dividing in_features {self.in_features}, "
                f"got {self.group_size}"
            )
        groups = (self.out_features, self.in_features // self.group_size)
        for name in ("scales", "mins"):
            tensor = getattr(self, name)
            if tensor is not None and (tuple(tensor.shape) != groups or tensor.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {groups}, got {tensor.dtype} {tuple(tensor.shape)}")

    @functools.cached_property
    def kernel_args(self) -> tuple[int | None, ...]:
        """rq_linear's weight arguments (qweight, scales, mins pointers, N, group, bits), built once:
        decode calls the kernel 121 times a step. The tensors are never replaced after construction."""
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
        """The integer codes as int16 [N, K] in column order (int4: 0..15, int8: -128..127)."""
        if self.bits == 8:
            return self.qweight.to(torch.int16)
        chunks = self.qweight.view(self.out_features, -1, CHUNK // 2).to(torch.int16)
        return torch.cat([chunks & 15, chunks >> 4], dim=-1).view(self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the kernels multiply by (the reference for tests and accuracy checks)."""
        shape = (self.out_features, self.in_features // self.group_size, self.group_size)
        weight = self.codes().float().view(shape) * self.scales.unsqueeze(-1)
        if self.mins is not None:
            weight = weight + self.mins.unsqueeze(-1)
        return weight.view(self.out_features, self.in_features)

    @staticmethod
    def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Stacks weights along out_features (fused q/k/v and gate/up projections)."""
        first = parts[0]
        if any(
            (p.bits, p.group_size, p.mins is None) != (first.bits, first.group_size, first.mins is None)
            for p in parts
        ):
            raise ValueError("cannot fuse quantized weights of different formats")
        return QuantizedWeight(
            bits=first.bits,
            qweight=torch.cat([p.qweight for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            mins=None if first.mins is None else torch.cat([p.mins for p in parts]),
            group_size=first.group_size,
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
      loaded float weight. The lm_head gets int8 under int4 (its accuracy loss at 4 bits is the largest
      of any layer; see benchmarks/README.md), and a checkpoint's int8 lm_head stays int8.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_MODES)}, got {mode!r}")
    if mode == "none":
        return None
    own = [source(name) if source is not None else None for name, _ in target.shards]
    if mode == "auto":
        if any(w is None for w in own) or len({(w.bits, w.group_size) for w in own}) != 1:
            return None
        return QuantizedWeight.concat_rows(own)
    bits = 8 if mode == "int8" or target.is_lm_head else 4
    kept = [w if w is not None and w.bits == bits else None for w in own]
    # Float shards fused with a checkpoint's blocks are quantized to the same group size.
    group = next((w.group_size for w in kept if w is not None), None)
    weight = target.linear.weight
    parts, offset = [], 0
    for (_, rows), mine in zip(target.shards, kept, strict=True):
        if mine is None:
            rows_weight = weight[offset : offset + rows]
            mine = (
                quantize_int8(rows_weight, group)
                if bits == 8
                else quantize_int4(rows_weight, group or INT4_GROUP_SIZE)
            )
        parts.append(mine)
        offset += rows
    return QuantizedWeight.concat_rows(parts)
