"""The operand dtype of `tl.dot` in the project's Triton kernels (attention and the invariant matmul).
Imported only by Triton device-code modules, so a CPU process never loads Triton through it."""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(dtype: torch.dtype, kernel: object) -> tl.dtype:
    """The storage dtype, except bf16 under the Triton interpreter (`kernel` is then not a compiled
    JITFunction): the interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies those bits
    as integers, so there bf16 operands are upcast to float32 first."""
    if dtype not in TL_DTYPES:
        raise TypeError(f"unsupported tl.dot dtype {dtype}")
    if dtype == torch.bfloat16 and not isinstance(kernel, JITFunction):
        return tl.float32
    return TL_DTYPES[dtype]
