"""A GGUF file's quantized linear weights, re-packed into QuantizedWeight exactly.

Every type here maps onto the runtime's int4/int8 format (layers/quantization.py) so that the runtime
multiplies by the very numbers gguf's dequantization gives (fp16 scales widened to fp32; scale * code is
exact in fp32 and the min is added with the same single rounding):
- Q4_0 `d * (q - 8)` (min -8d), Q4_1 `d * q + m`: int4, group 32, the code bytes copied as they are.
- Q8_0 `d * q`: int8, group 32, copied. Q5_0 `d * (q - 16)`, Q5_1 `d * q + m` (q 0..31): int8, group 32.
- Q4_K: 256-column super-blocks of 8 sub-blocks of 32, `d * sc * q - dmin * m` with 6-bit sc and m:
  int4 with group 32, scale d * sc and min -dmin * m. Q5_K: the same with 5-bit q, as int8 codes.
- Q6_K: 16 sub-blocks of 16, `d * sc * (q - 32)` with int8 sc: int8 codes q - 32, group 16 (one group
  per sub-block; no int8 grouping of 32 columns holds two sub-blocks' scales exactly).
Other tensor types (F32, F16, ...) are left to the float path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from radixlm_runtime.layers.quantization import CHUNK, HALF_CHUNK, QuantizedWeight, pack_int4

# Hugging Face projection name -> GGUF tensor name inside blk.N (llama.cpp's names, the same for the llama,
# qwen2, qwen3, gemma3 and phi3 architectures; phi3 checkpoints fuse qkv_proj and gate_up_proj, which
# llama.cpp names attn_qkv and ffn_up).
_BLOCK_LINEARS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_LEVEL = {"lm_head.weight": "output.weight", "model.embed_tokens.weight": "token_embd.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight")
# Architectures whose q/k rows llama.cpp's converter interleaves (Llama, Mistral, SmolLM2); gemma3, qwen2,
# qwen3 and phi3 keep Hugging Face's row order (transformers un-permutes only "llama" on load).
_PERMUTED_ARCHS = {"llama"}


def gguf_tensor_name(hf_name: str) -> str | None:
    """The GGUF name of a Hugging Face linear weight name, or None for anything else."""
    if hf_name in _TOP_LEVEL:
        return _TOP_LEVEL[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in _BLOCK_LINEARS:
        return f"blk.{match.group(1)}.{_BLOCK_LINEARS[match.group(2)]}.weight"
    return None


def _fp16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as float32 [rows, blocks]."""
    return torch.from_numpy(blocks[..., start : start + 2].copy().view(np.float16)[..., 0]).float()


def _bytes(blocks: np.ndarray, start: int, count: int) -> torch.Tensor:
    return torch.from_numpy(blocks[..., start : start + count].copy())


def _chunk_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Codes [..., 32] of the 16 bytes of a Q4_0-layout chunk: byte j holds column j low, j + 16 high."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit i of the little-endian bytes qh [..., count // 8], as [..., count] of 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :count]


def _int8(codes: torch.Tensor, rows: int) -> torch.Tensor:
    return codes.to(torch.int8).reshape(rows, -1)


def _q4_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    # Q4_0 / Q4_1 blocks hold their 16 code bytes in exactly the runtime's int4 chunk layout.
    scales = _fp16(blocks, 0)
    return QuantizedWeight(4, _bytes(blocks, 2, 16).reshape(rows, -1), scales, -8.0 * scales, CHUNK)


def _q4_1(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    qweight = _bytes(blocks, 4, 16).reshape(rows, -1)
    return QuantizedWeight(4, qweight, _fp16(blocks, 0), _fp16(blocks, 2), CHUNK)


def _q8_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, -1)
    return QuantizedWeight(8, codes, _fp16(blocks, 0), None, CHUNK)


def _q5_codes(blocks: np.ndarray, start: int) -> torch.Tensor:
    """A Q5_0/Q5_1 block's codes 0..31: 4 bytes of high bits (bit i: column i), then Q4_0-layout nibbles."""
    low = _chunk_nibbles(_bytes(blocks, start + 4, 16))
    return low | (_high_bits(_bytes(blocks, start, 4), CHUNK) << 4)


def _q5_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    codes = _int8(_q5_codes(blocks, 2).to(torch.int16) - 16, rows)
    return QuantizedWeight(8, codes, _fp16(blocks, 0), None, CHUNK)


def _q5_1(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    return QuantizedWeight(8, _int8(_q5_codes(blocks, 4), rows), _fp16(blocks, 0), _fp16(blocks, 2), CHUNK)


def _k_scales(blocks: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's per-32-column scales d * sc and mins -dmin * m, float32 [rows, cols // 32]."""
    packed = blocks[..., 4:16].reshape(-1, Q4_K.K_SCALE_SIZE)
    sc, m = (torch.from_numpy(a.astype(np.float32)).view(rows, -1, 8) for a in Q4_K.get_scale_min(packed))
    d, dmin = _fp16(blocks, 0).unsqueeze(-1), _fp16(blocks, 2).unsqueeze(-1)
    return (d * sc).reshape(rows, -1), (-(dmin * m)).reshape(rows, -1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's low codes [..., 256] from 128 bytes: 32 bytes per 64 columns, low nibbles first."""
    runs = qs.unflatten(-1, (4, 1, 32)) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    return (runs & 15).flatten(-3)


def _q4_k(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    scales, mins = _k_scales(blocks, rows)
    codes = _k_nibbles(_bytes(blocks, 16, 128)).reshape(rows, -1)
    return QuantizedWeight(4, pack_int4(codes), scales, mins, CHUNK)


def _q5_k(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    scales, mins = _k_scales(blocks, rows)
    # 32 bytes of high bits: bit s of byte i belongs to column 32 * s + i.
    high = _high_bits(_bytes(blocks, 16, 32), 256).unflatten(-1, (32, 8)).transpose(-1, -2).flatten(-2)
    codes = _k_nibbles(_bytes(blocks, 48, 128)) | (high << 4)
    return QuantizedWeight(8, _int8(codes, rows), scales, mins, CHUNK)


def _q6_k(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    # Per 128-column half: 64 bytes of low nibbles (columns 0-63 low, 64-127 high) and 32 bytes of
    # 2-bit high parts (bits 2t..2t+1 of byte i: column 32 * t + i).
    low = _bytes(blocks, 0, 128).unflatten(-1, (2, 1, 64)) >> torch.tensor([0, 4], dtype=torch.uint8).view(
        2, 1
    )
    high = _bytes(blocks, 128, 64).unflatten(-1, (2, 1, 32)) >> torch.tensor(
        [0, 2, 4, 6], dtype=torch.uint8
    ).view(4, 1)
    codes = ((low & 15).flatten(-3) | ((high & 3).flatten(-3) << 4)).to(torch.int16) - 32
    sub_scales = torch.from_numpy(blocks[..., 192:208].copy().view(np.int8)).float()
    scales = (_fp16(blocks, 208).unsqueeze(-1) * sub_scales).reshape(rows, -1)
    return QuantizedWeight(8, _int8(codes, rows), scales, None, HALF_CHUNK)


_REPACKERS: dict[str, Callable[[np.ndarray, int], QuantizedWeight]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def repack_blocks(type_name: str, data: np.ndarray, rows: int, cols: int) -> QuantizedWeight | None:
    """QuantizedWeight from the raw blocks of a [rows, cols] GGUF tensor; None for other types."""
    repack = _REPACKERS.get(type_name)
    if repack is None:
        return None
    block_cols, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // block_cols, block_bytes)
    return repack(blocks, rows)


def unpermute_rows(weight: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """Undoes llama.cpp's q/k row interleaving (convert_hf_to_gguf's `permute`), as transformers does."""
    rows = weight.out_features
    order = torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(-1)
    return QuantizedWeight(
        weight.bits,
        weight.qweight[order],
        weight.scales[order],
        None if weight.mins is None else weight.mins[order],
        weight.group_size,
    )


# The tensor index of a GGUF (GGUFTensors), kept in the directory of its export (models/loader.py).
INDEX_FILE = "gguf_tensors.json"


@dataclass(frozen=True)
class GGUFTensor:
    type_name: str
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    offset: int  # of its data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFTensors:
    """Where each tensor of a GGUF file lies, and whether its q/k rows are llama.cpp-permuted.

    gguf-py's reader parses every metadata field, the whole vocabulary included: seconds of each
    start-up for a tensor table that never changes. So it runs once per file and its table is kept
    beside the file's export, keyed by the export (which changes whenever the file does)."""

    tensors: dict[str, GGUFTensor]
    permuted: bool

    @classmethod
    def load(cls, path: Path, cache_dir: Path | None = None) -> GGUFTensors:
        cached = cache_dir / INDEX_FILE if cache_dir is not None else None
        if cached is not None and cached.is_file():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                return cls.from_json(json.loads(cached.read_text()))
        index = cls.read(path)
        if cached is not None:
            # Written whole or not at all; a read-only cache only costs the next start-up the parse.
            with contextlib.suppress(OSError):
                tmp = cached.with_name(f".{INDEX_FILE}.{os.getpid()}")
                tmp.write_text(json.dumps(index.to_json()))
                os.replace(tmp, cached)
        return index

    @classmethod
    def read(cls, path: Path) -> GGUFTensors:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = reader.fields["general.architecture"]
        tensors = {
            t.name: GGUFTensor(
                t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes)
            )
            for t in reader.tensors
        }
        return cls(tensors, bytes(arch.parts[arch.data[0]]).decode() in _PERMUTED_ARCHS)

    def to_json(self) -> dict[str, Any]:
        return {
            "permuted": self.permuted,
            "tensors": {n: dataclasses.astuple(t) for n, t in self.tensors.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GGUFTensors:
        tensors = {
            n: GGUFTensor(kind, tuple(shape), offset, nbytes)
            for n, (kind, shape, offset, nbytes) in data["tensors"].items()
        }
        return cls(tensors, bool(data["permuted"]))


class GGUFQuantizedWeights:
    """Callable: a Hugging Face weight name -> the GGUF's own quantized blocks of it, or None."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int, cache_dir: Path | None = None) -> None:
        index = GGUFTensors.load(path, cache_dir)
        self._tensors = index.tensors
        self._permuted = index.permuted
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}

    def __call__(self, hf_name: str) -> QuantizedWeight | None:
        name = gguf_tensor_name(hf_name)
        tensor = self._tensors.get(name) if name is not None else None
        if tensor is None:
            return None
        cols, rows = tensor.shape
        data = self._data[tensor.offset : tensor.offset + tensor.nbytes]
        weight = repack_blocks(tensor.type_name, data, rows, cols)
        kind = name.split(".")[-2]
        if weight is not None and self._permuted and kind in self._heads:
            weight = unpermute_rows(weight, self._heads[kind])
        return weight
