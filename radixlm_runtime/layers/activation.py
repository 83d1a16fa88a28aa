"""SwiGLU and GeGLU on a fused gate/up projection: one pass of the fused CPU kernel for float32 CPU rows
(the one-call C++ decoder runs the same kernel, so both paths give the same bits), one Triton kernel on
CUDA for SwiGLU, torch ops elsewhere (and as the reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm_runtime.layers import fused_cpu, fused_triton


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and fused_triton.supports(x):
            return fused_triton.silu_and_mul(x)
        if x.dim() == 2 and fused_cpu.supports(x):
            return fused_cpu.silu_and_mul(x)
        return self.reference(x)

    @staticmethod
    def reference(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        # Multiplying in place saves a pass over the activations and an allocation.
        return F.silu(gate).mul_(up)


class GeluAndMul(nn.Module):
    """GeGLU (Gemma): gelu(gate) * up with the tanh approximation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and fused_cpu.supports(x):
            return fused_cpu.gelu_tanh_and_mul(x)
        return self.reference(x)

    @staticmethod
    def reference(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)
