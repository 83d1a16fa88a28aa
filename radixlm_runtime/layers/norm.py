"""RMSNorm with an optional fused residual add (the pre-norm transformer pattern): one Triton kernel on
CUDA, one pass of the fused CPU kernel for float32 CPU rows, torch ops elsewhere (and as the
reference)."""

from __future__ import annotations

import torch
from torch import nn

from radixlm_runtime.layers import fused_cpu, fused_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and fused_triton.supports(x):
            out = fused_triton.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if x.dim() == 2 and fused_cpu.supports(x) and self.weight.dtype == torch.float32:
            out = fused_cpu.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        return self.reference(x, residual)

    def reference(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            # The residual stream is this layer's own tensor: adding in place saves an allocation
            # and a pass per norm.
            x = residual.add_(x)
            residual = x
        orig_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(orig_dtype)
        return out if residual is None else (out, residual)
