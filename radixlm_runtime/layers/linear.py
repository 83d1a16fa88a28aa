"""Linear layers whose CPU fp32 path runs through oneDNN with the weight prepacked once, or through
the weight-only quantized kernels (quant_kernels.py) once `set_quantized` gave them int8/int4 weights.

torch's default CPU GEMM repacks the weight on every call; for the small row counts of decode
steps that repacking costs as much as the multiply. Prepacking once at load time makes decode-step
projections about 2x faster on AVX2 machines (and large prefill GEMMs ~1.4x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm_runtime.layers.quant_kernels import quantized_linear
from radixlm_runtime.layers.quantization import QuantizedWeight


def onednn_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Linear):
    _packed: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None
    # Set when the weight is shared (a tied lm_head reads the embedding table), so packing must
    # not drop it.
    keep_weight: bool = False
    # Rows per matmul call when batch invariance is wanted (--deterministic); 0: one call for all rows.
    row_block: int = 0

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Serves this layer from weight from now on; the float weight is dropped unless shared."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight is {weight.out_features}x{weight.in_features}, "
                f"the layer {self.out_features}x{self.in_features}"
            )
        self.quantized = weight
        self._packed = None
        self._drop_weight()

    def prepack(self) -> None:
        """Call after the weights are loaded; later weight edits are not seen by the packed copy."""
        if self.quantized is None and onednn_available(self.weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self._drop_weight()

    def _drop_weight(self) -> None:
        if not self.keep_weight:
            # The forward reads only the packed or quantized copy; a zero-size stand-in avoids
            # holding the weights twice.
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_block:
            return self._fixed_row_blocks(x)
        return self._matmul(x)

    def _fixed_row_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] multiplied in blocks of exactly row_block rows (the last zero-padded): every
        matmul then has one shape, so the library runs one algorithm and a row's result never
        depends on how many rows came with it (what --deterministic needs)."""
        n, r = x.shape[0], self.row_block
        if n % r:
            x = torch.cat([x, x.new_zeros(r - n % r, x.shape[1])])
        return torch.cat([self._matmul(block) for block in x.split(r)])[:n]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quantized_linear(x, self.quantized, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepack_linears(module: nn.Module) -> int:
    """Prepacks every float Linear in module; returns how many were packed."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.prepack()
            count += sub._packed is not None
    return count
