"""Pre-quantized Hugging Face checkpoints: AWQ and GPTQ int4 served exactly on the int4 kernels, FP8
dequantized at load.

config.json's `quantization_config` names the format. The model loads float weights as it does for any
checkpoint: `checkpoint_weights` yields each quantized linear's `<prefix>.weight` dequantized (float32,
exact). `quantized_source` hands plan_linear the int4 weights themselves, so --quantization auto serves
them quantized: bit for bit the weights of the float path. Both read one `open_checkpoint`, which holds
what the float path unpacked for the quantizer, so each linear is unpacked once.

- AWQ (GEMM version): qweight int32 [K, N / 8] with 8 output columns per int32 in AWQ's nibble order,
  qzeros int32 [K / G, N / 8] packed alike, scales fp16 [K / G, N]; w = scale * (q - zero).
- GPTQ: qweight int32 [K / 8, N] (nibble i of row j: input row 8j + i), qzeros int32 [K / G, N / 8]
  (nibble i: output column 8j + i) holding zero - 1 in the v1 format (checkpoint_format "gptq"; zero =
  stored + 1, as exllama and vLLM read it) or the zero itself in "gptq_v2", scales [K / G, N], g_idx [K]
  the group of each input column. With desc_act (act-order) the groups are scattered over K: the columns
  are reordered by group and the layer gathers its input to match (QuantizedWeight.input_order).
  Both are `scale * q + min` with min = -scale * zero: exact in fp32 (an fp16 scale times a small integer).
- FP8 (`fp8`, or compressed-tensors' float-quantized format): float8 weights times `weight_scale` (per
  tensor or per output channel) or `weight_scale_inv` (per block, DeepSeek-style 128x128). There is no FP8
  kernel on the CPU, so they are dequantized at load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixlm_runtime.layers.quantization import QuantizedSource, QuantizedWeight, pack_int4
from radixlm_runtime.models.gguf_weights import GGUFQuantizedWeights
from radixlm_runtime.models.loader import gguf_source, weight_files
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

SUPPORTED_METHODS = ("awq", "gptq", "fp8", "compressed-tensors")
_INT4_METHODS = ("awq", "gptq")
# The tensors of an int4 linear besides its qweight.
_INT4_SIDE_PARTS = ("qzeros", "scales", "g_idx")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")
# With the scales of activations and the KV cache, which go unused: the CPU runs neither in FP8.
_FP8_SIDE_PARTS = (*_FP8_WEIGHT_SCALES, "input_scale", "k_scale", "v_scale")
_DEFAULT_FP8_BLOCK = (128, 128)
# AWQ packs the 8 columns of an int32 in this order: nibble i holds column _AWQ_ORDER[i].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class CheckpointFormat:
    """What a checkpoint's quantization_config says, as far as loading it needs."""

    method: str  # "awq", "gptq" or "fp8" (compressed-tensors' float-quantized format too)
    group_size: int = 0  # int4; -1: one group over all of K
    desc_act: bool = False  # GPTQ act-order: g_idx scatters the groups over K
    zero_offset: int = 0  # GPTQ v1 stores zero - 1
    fp8_block: tuple[int, int] = _DEFAULT_FP8_BLOCK  # rows, columns per weight_scale_inv entry

    @property
    def int4(self) -> bool:
        return self.method in _INT4_METHODS


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"quantization_config: {what} is not supported; supported quant_method values: "
        f"{', '.join(SUPPORTED_METHODS)} (awq: GEMM version, 4 bits; gptq: 4 bits, checkpoint_format gptq or "
        "gptq_v2; compressed-tensors: float-quantized 8-bit weights)"
    )


def checkpoint_format(model_dir: Path) -> CheckpointFormat | None:
    """The quantization of the checkpoint in model_dir, or None for float weights; a ValueError names an
    unsupported format and lists the supported ones."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _unsupported(f"awq version {version!r}")
        if not qc.get("zero_point", True):
            raise _unsupported("awq with zero_point false")
        return CheckpointFormat("awq", group_size=_int4_group(qc, "awq"))
    if method == "gptq":
        stored = qc.get("checkpoint_format", qc.get("format", "gptq"))
        offsets = {"gptq": 1, "gptq_v2": 0}
        if stored not in offsets:
            raise _unsupported(f"gptq checkpoint_format {stored!r}")
        return CheckpointFormat(
            "gptq",
            group_size=_int4_group(qc, "gptq"),
            desc_act=bool(qc.get("desc_act", False)),
            zero_offset=offsets[stored],
        )
    if method == "fp8":
        return CheckpointFormat("fp8", fp8_block=tuple(qc.get("weight_block_size") or _DEFAULT_FP8_BLOCK))
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    raise _unsupported(f"quant_method {method!r}")


def _int4_group(qc: dict[str, Any], method: str) -> int:
    """The group size of an AWQ/GPTQ config (AutoAWQ also writes w_bit / q_group_size), checking 4 bits."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _unsupported(f"{method} with bits {bits!r} (only 4)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise ValueError(
            f"quantization_config: {method} group_size must be a positive int or -1, got {group!r}"
        )
    return group


def _compressed_tensors_format(qc: dict[str, Any]) -> CheckpointFormat:
    """compressed-tensors checkpoints with 8-bit float weights in every config group."""
    layout = qc.get("format")
    if layout != "float-quantized":
        raise _unsupported(f"compressed-tensors format {layout!r}")
    block = _DEFAULT_FP8_BLOCK
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise _unsupported(
                f"compressed-tensors config_groups.{name}.weights type {weights.get('type')!r} "
                f"num_bits {weights.get('num_bits')!r}"
            )
        block = tuple(weights.get("block_structure") or block)
    return CheckpointFormat("fp8", fp8_block=block)


class _Tensors:
    """Tensors of a checkpoint's safetensors files by name, read on demand (memory-mapped)."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self._handles: dict[str, Any] = {}
        for file in weight_files(model_dir):
            handle = safe_open(str(file), framework="pt")
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                self._handles[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def get(self, name: str) -> torch.Tensor:
        handle = self._handles.get(name)
        if handle is None:
            raise ValueError(f"checkpoint tensor {name!r} is missing (the quantization_config needs it)")
        return handle.get_tensor(name)


def _nibbles(packed: torch.Tensor, along_rows: bool) -> torch.Tensor:
    """The 4-bit values of int32 [R, C], nibble i at bit 4i, as int32 [8R, C] (along_rows: nibble i of
    row j is row 8j + i) or [R, 8C] (nibble i of column j is column 8j + i)."""
    packed = packed.to(torch.int32)
    if along_rows:
        return ((packed.unsqueeze(1) >> _NIBBLE_SHIFTS.view(1, 8, 1)) & 15).reshape(-1, packed.shape[1])
    return ((packed.unsqueeze(-1) >> _NIBBLE_SHIFTS) & 15).reshape(packed.shape[0], -1)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, C / 8] as int32 [R, C] in column order."""
    nibbles = _nibbles(packed, along_rows=False).view(packed.shape[0], -1, 8)
    columns = torch.empty_like(nibbles)
    columns[..., list(_AWQ_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def int4_weight(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, group: int
) -> QuantizedWeight:
    """QuantizedWeight of `scales[n, g] * (codes[n, k] - zeros[n, g])`, g = g_idx[k] (None: k // group), for
    codes [N, K] in 0..15 and zeros, scales [N, K / group]. Groups scattered over K (act-order) become
    contiguous by reordering the columns, which the weight's input_order records."""
    n, k = codes.shape
    expected = (n, k // group)
    for name, tensor in (("zeros", zeros), ("scales", scales)):
        if k % group or tuple(tensor.shape) != expected:
            raise ValueError(
                f"int4 {name} must be {expected} for a {n}x{k} weight in groups of {group}, "
                f"got {tuple(tensor.shape)}"
            )
    order = None
    if g_idx is not None:
        order = torch.argsort(g_idx.to(torch.int64), stable=True)
        if not torch.equal(g_idx[order].to(torch.int64), torch.arange(k) // group):
            raise ValueError(f"g_idx must give each of the {k // group} groups exactly {group} input columns")
        if torch.equal(order, torch.arange(k)):
            order = None
        else:
            codes = codes[:, order]
    scales = scales.float()
    mins = -scales * zeros.float()
    return QuantizedWeight(4, pack_int4(codes), scales, mins, group, order)


class QuantizedCheckpoint:
    """A pre-quantized checkpoint's weights: callable as a QuantizedSource (a Hugging Face weight name ->
    its exact int4 QuantizedWeight, or None), and every quantized weight dequantized for the float path."""

    def __init__(self, model_dir: Path, fmt: CheckpointFormat, keep_int4: bool = False) -> None:
        """keep_int4: the int4 weights will be served quantized, so each one the float path unpacks is
        held until the quantizer asks for it (one unpack per linear instead of two)."""
        self.format = fmt
        self.tensors = _Tensors(model_dir)
        self._keep_int4 = keep_int4
        self._kept: dict[str, QuantizedWeight] = {}

    def __call__(self, hf_name: str) -> QuantizedWeight | None:
        prefix = hf_name.removesuffix(".weight")
        if not self.format.int4 or prefix == hf_name or f"{prefix}.qweight" not in self.tensors:
            return None
        kept = self._kept.pop(prefix, None)
        return kept if kept is not None else self.int4(prefix)

    def dequantized_int4(self, prefix: str) -> torch.Tensor:
        """The float32 weight of the AWQ/GPTQ linear at prefix, its int4 weight kept if asked."""
        weight = self.int4(prefix)
        if self._keep_int4:
            self._kept[prefix] = weight
        return weight.dequantize()

    def int4(self, prefix: str) -> QuantizedWeight:
        """The AWQ/GPTQ linear at prefix (its qweight, qzeros, scales and, for act-order, g_idx)."""
        qweight, qzeros, scales = (self.tensors.get(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales"))
        if self.format.method == "awq":
            codes, zeros = _awq_columns(qweight), _awq_columns(qzeros)
        else:
            codes = _nibbles(qweight, along_rows=True)
            zeros = _nibbles(qzeros, along_rows=False) + self.format.zero_offset
        k = codes.shape[0]
        group = k if self.format.group_size == -1 else self.format.group_size
        g_idx = self.tensors.get(f"{prefix}.g_idx") if self.format.desc_act else None
        try:
            return int4_weight(codes.T, zeros.T, scales.T, g_idx, group)
        except ValueError as e:
            raise ValueError(f"{self.format.method} linear {prefix}: {e}") from e

    def fp8(self, prefix: str, weight: torch.Tensor) -> torch.Tensor:
        """The float32 weight of an FP8 linear: the float8 weight times its per-tensor, per-channel or
        per-block scale."""
        name = next((f"{prefix}.{p}" for p in _FP8_WEIGHT_SCALES if f"{prefix}.{p}" in self.tensors), None)
        if name is None:
            raise ValueError(f"fp8 weight {prefix}.weight has no weight_scale or weight_scale_inv")
        scale = self.tensors.get(name).float()
        rows, cols = weight.shape
        grid = tuple(math.ceil(d / b) for d, b in zip(weight.shape, self.format.fp8_block, strict=True))
        if scale.numel() == 1:
            scale = scale.reshape(1, 1)
        elif scale.numel() == rows and scale.shape[0] == rows:
            scale = scale.reshape(rows, 1)
        elif tuple(scale.shape) == grid:
            block_rows, block_cols = self.format.fp8_block
            scale = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
        else:
            raise ValueError(
                f"{name} has shape {tuple(scale.shape)}: expected one scale, one per output row ({rows}) or "
                f"one per {self.format.fp8_block} block {grid} of the {rows}x{cols} weight"
            )
        return weight.float() * scale


def open_checkpoint(model_dir: Path, keep_int4: bool = False) -> QuantizedCheckpoint | None:
    """The pre-quantized checkpoint in model_dir (see QuantizedCheckpoint for keep_int4), or None for float
    weights; a ValueError names an unsupported format."""
    fmt = checkpoint_format(model_dir)
    return None if fmt is None else QuantizedCheckpoint(model_dir, fmt, keep_int4)


def checkpoint_weights(
    checkpoint: QuantizedCheckpoint | None, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs as a float model loads them: float tensors pass through; a
    quantized linear yields its `<prefix>.weight` dequantized (float32) in place of its quantized parts."""
    if checkpoint is None:
        yield from weights
        return
    fmt = checkpoint.format
    if fmt.int4:
        logger.info("%s int4 checkpoint: float weights dequantized for the float path", fmt.method)
    else:
        logger.info(
            "fp8 checkpoint: weights dequantized at load, activation and KV-cache scales unused "
            "(the CPU has no FP8 kernel)"
        )
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if fmt.int4:
            if f"{prefix}.qweight" not in checkpoint.tensors:
                yield name, tensor
            elif part == "qweight":
                yield f"{prefix}.weight", checkpoint.dequantized_int4(prefix)
            elif part not in _INT4_SIDE_PARTS:  # e.g. the linear's bias
                yield name, tensor
        elif part == "weight" and tensor.dtype in _FP8_DTYPES:
            yield name, checkpoint.fp8(prefix, tensor)
        elif part not in _FP8_SIDE_PARTS:
            yield name, tensor


def quantized_source(
    model_path: str | None,
    checkpoint: QuantizedCheckpoint | None,
    num_heads: int,
    num_kv_heads: int,
    model_dir: Path | None = None,
) -> QuantizedSource | None:
    """The checkpoint's own quantized linears for plan_linear: a GGUF's blocks (model_path a .gguf or a
    short name of one; model_dir its export, where its tensor index is kept), an AWQ/GPTQ checkpoint's
    int4 weights, else None (float or FP8 weights)."""
    gguf = gguf_source(model_path)
    if gguf is not None:
        return GGUFQuantizedWeights(gguf, num_heads, num_kv_heads, model_dir)
    return checkpoint if checkpoint is not None and checkpoint.format.int4 else None
