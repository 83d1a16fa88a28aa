"""A GGUF file's Q4_0 / Q4_1 / Q8_0 linear weights, re-packed into QuantizedWeight block for block.

These GGUF blocks already are the runtime's int4/int8 format with group size 32 (layers/quantization.py):
the codes are copied byte for byte and the fp16 scales widened to fp32, so the runtime multiplies by the
same numbers llama.cpp reads. Q4_1 `w = d * q + m` keeps scale d and min m; Q4_0 `w = d * (q - 8)` is
min -8d; Q8_0 `w = d * q` has no min. Other tensor types (F32, F16, K-quants) are left to the float path.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from radixlm_runtime.layers.quantization import CHUNK, QuantizedWeight

# Hugging Face projection name -> GGUF tensor name inside blk.N (llama.cpp's names).
_BLOCK_LINEARS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_LEVEL = {"lm_head.weight": "output.weight", "model.embed_tokens.weight": "token_embd.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight")
# Bytes per 32-weight block.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def gguf_tensor_name(hf_name: str) -> str | None:
    """The GGUF name of a Hugging Face linear weight name, or None for anything else."""
    if hf_name in _TOP_LEVEL:
        return _TOP_LEVEL[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in _BLOCK_LINEARS:
        return f"blk.{match.group(1)}.{_BLOCK_LINEARS[match.group(2)]}.weight"
    return None


def repack_blocks(type_name: str, data: np.ndarray, rows: int, cols: int) -> QuantizedWeight | None:
    """QuantizedWeight from the raw blocks of a [rows, cols] GGUF tensor; None for other types."""
    block_bytes = _BLOCK_BYTES.get(type_name)
    if block_bytes is None:
        return None
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // CHUNK, block_bytes)

    def fp16_field(start: int) -> torch.Tensor:
        return torch.from_numpy(blocks[..., start : start + 2].copy().view(np.float16)[..., 0]).float()

    scales = fp16_field(0)
    if type_name == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(rows, cols)
        return QuantizedWeight(8, codes, scales, None, CHUNK)
    # Q4_0 / Q4_1 blocks hold their 16 code bytes in exactly the runtime's int4 chunk layout.
    first = 2 if type_name == "Q4_0" else 4
    qweight = torch.from_numpy(blocks[..., first : first + CHUNK // 2].copy()).reshape(rows, cols // 2)
    mins = -8.0 * scales if type_name == "Q4_0" else fp16_field(2)
    return QuantizedWeight(4, qweight, scales, mins, CHUNK)


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


class GGUFQuantizedWeights:
    """Callable: a Hugging Face weight name -> the GGUF's own quantized blocks of it, or None."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        self._tensors = {t.name: t for t in reader.tensors}
        arch = reader.fields["general.architecture"]
        # llama.cpp's converter interleaves the q/k rows of "llama" models (Llama, Mistral, SmolLM2).
        self._permuted = bytes(arch.parts[arch.data[0]]).decode() == "llama"
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}

    def __call__(self, hf_name: str) -> QuantizedWeight | None:
        name = gguf_tensor_name(hf_name)
        tensor = self._tensors.get(name) if name is not None else None
        if tensor is None:
            return None
        cols, rows = (int(d) for d in tensor.shape)  # GGUF lists the fastest-varying dimension first
        weight = repack_blocks(tensor.tensor_type.name, tensor.data, rows, cols)
        kind = name.split(".")[-2]
        if weight is not None and self._permuted and kind in self._heads:
            weight = unpermute_rows(weight, self._heads[kind])
        return weight
