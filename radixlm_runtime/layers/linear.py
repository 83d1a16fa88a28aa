"""Linear layers whose CPU path runs on the project's kernels (linear_kernels.py): float32 weights
repacked once into panels, or the int8/int4 weights `set_quantized` gave them.

torch's default CPU GEMM repacks the weight on every call; for the small row counts of decode steps
that repacking costs as much as the multiply. The panel kernels read the weights as stored: 1.75x
oneDNN's prepacked GEMM at one row, 1.15-1.35x at 16-32, at par from 64 rows on
(benchmarks/bench_linear_cpu.py). Where they have no SIMD path (a CPU without AVX2, e.g. ARM) oneDNN's
GEMM with the weight prepacked once serves instead. Under --deterministic, CUDA linears run on the
batch-invariant Triton matmul (fused_triton.invariant_linear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm_runtime.layers import fused_triton
from radixlm_runtime.layers.linear_kernels import (
    BF16,
    FP32,
    Act8Panels,
    BF16Panels,
    FloatPanels,
    Int8Panels,
    QuantPanels,
    bf16_path,
    cpu_linear,
    int8_panel_linear,
    int8_panels_available,
    panels_available,
)
from radixlm_runtime.layers.quantization import QuantizedWeight

# What a tensor-parallel layer does with its output across the ranks (distributed/shard.py).
Collective = Callable[[torch.Tensor], torch.Tensor]


def onednn_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Linear):
    _packed: torch.Tensor | None = None  # oneDNN's prepacked weight (the fallback)
    quantized: QuantizedWeight | None = None
    panels: FloatPanels | BF16Panels | None = None
    # The CPU kernels' arithmetic (linear_kernels.FP32 or BF16): float weights are packed in its panels,
    # quantized ones multiplied in it from PANEL_GEMM_MIN_ROWS rows on.
    compute: str = FP32
    # The int8 weight also in row panels, which then serve every row (see pack_row_panels).
    row_panels: Int8Panels | None = None
    # The quantized weight repacked for int8 activations (--cpu-act-quant int8): then it serves every row.
    act8: Act8Panels | None = None
    # The quantized weight repacked k-major for float32 activations (prepack): one kernel's bits at every
    # row count, and faster than the GGUF layout's kernels at every count but one row (QuantPanels).
    quant_panels: QuantPanels | None = None
    # A quantized weight on float activations served by this one CPU kernel at every row count, not the
    # row-dot kernels below PANEL_GEMM_MIN_ROWS and a panel GEMM from there: batch-invariant outputs.
    pinned_mode: int | None = None
    # Set when the weight is shared (a tied lm_head reads the embedding table), so packing must
    # not drop it.
    keep_weight: bool = False
    # Batch invariance (--deterministic): the Triton matmul with one tile shape for every row count
    # (CUDA), or else rows per matmul call (0: one call for all rows).
    invariant_matmul: bool = False
    row_block: int = 0
    # Tensor parallelism: the sum over the ranks of a row-parallel layer's partial outputs, or the
    # gather of a vocabulary-parallel lm_head's logits; None: the layer is whole here.
    collective: Collective | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Serves this layer from weight from now on; the float weight is dropped unless shared."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight is {weight.out_features}x{weight.in_features}, "
                f"the layer {self.out_features}x{self.in_features}"
            )
        self.quantized = weight
        self._packed = self.panels = self.row_panels = self.act8 = self.quant_panels = None
        self._drop_weight()

    def quantize_activations(self) -> bool:
        """Serves this quantized layer with int8 activations (Act8Panels) from now on, where its weight
        fits that layout; returns whether it does."""
        if self.quantized is None or not Act8Panels.fits(self.quantized):
            return False
        self.act8 = Act8Panels.pack(self.quantized)
        self.row_panels = None  # served by act8 at every row count
        return True

    def pack_row_panels(self) -> None:
        """Serves every row from a second copy of an int8 weight in row panels (Int8Panels), where the
        weight fits them and the CPU runs them: for a wide layer read whole every token (a 262k
        vocabulary's lm_head), which they multiply at the memory's speed, and faster than the GEMM at
        every row count measured (49152 x 576: 1.1-1.7x at 16-256 rows); one kernel for every count
        also makes the logits batch-invariant."""
        w = self.quantized
        if w is not None and self.bias is None and Int8Panels.fits(w) and int8_panels_available():
            self.row_panels = Int8Panels.pack(w)

    @property
    def kernel_weight(self) -> QuantizedWeight | FloatPanels | BF16Panels | Act8Panels | None:
        """The weight the CPU linear kernels read, if they alone serve this layer: not for a weight with
        an input order, whose activations are gathered first (so the one-call C++ decoder, which calls
        the kernels directly, leaves such a model's layers to Python)."""
        if self.act8 is not None:
            return self.act8
        if self.quant_panels is not None:
            return self.quant_panels
        if self.quantized is not None:
            return self.quantized if self.quantized.input_order is None else None
        return self.panels

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's output never depends on the rows beside it (the panel kernels' FMA chains, the
        int8-activation kernel's exact integer sums)."""
        one_kernel = self.row_panels is not None or self.pinned_mode is not None
        packed = self.panels is not None or self.quant_panels is not None or self.act8 is not None
        return packed or one_kernel

    def prepack(self) -> None:
        """Call after the weights are loaded; later weight edits are not seen by the packed copy."""
        if self.quantized is not None:
            self._pack_quant_panels()
            if self.quant_panels is not None or self.act8 is not None:
                self.quantized = self.quantized.without_codes()  # served by the repacked copy alone
            return
        if not onednn_available(self.weight):
            return
        if panels_available():
            bf16 = self.compute == BF16 and self.in_features % 2 == 0
            self.panels = (BF16Panels if bf16 else FloatPanels).pack(self.weight)
        else:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self._drop_weight()

    def _pack_quant_panels(self) -> None:
        """Serves a quantized weight on float32 arithmetic from QuantPanels, where nothing else serves it
        (int8 activations, the lm_head's row panels) and its columns are in order."""
        w = self.quantized
        if (
            w is None
            or self.quant_panels is not None  # packed already (prepack runs once per load; twice is a no-op)
            or self.compute != FP32
            or self.act8 is not None
            or self.row_panels is not None
            or not QuantPanels.fits(w)
            or not panels_available()
        ):
            return
        self.quant_panels = QuantPanels.pack(w)

    def _drop_weight(self) -> None:
        if not self.keep_weight:
            # The forward reads only the packed or quantized copy; a zero-size stand-in avoids
            # holding the weights twice.
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant_matmul:
            out = fused_triton.invariant_linear(x, self.weight, self.bias)
        elif self.row_block:
            out = self._fixed_row_blocks(x)
        else:
            out = self._matmul(x)
        return out if self.collective is None else self.collective(out)

    def _fixed_row_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] multiplied in blocks of exactly row_block rows (the last zero-padded): every
        matmul then has one shape, so the library runs one algorithm and a row's result never
        depends on how many rows came with it (what --deterministic needs)."""
        n, r = x.shape[0], self.row_block
        if n % r:
            x = torch.cat([x, x.new_zeros(r - n % r, x.shape[1])])
        return torch.cat([self._matmul(block) for block in x.split(r)])[:n]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_panels is not None and x.dim() == 2:
            return int8_panel_linear(x, self.row_panels)
        weight = self.kernel_weight
        if weight is not None:
            return cpu_linear(x, weight, self.bias, self.pinned_mode, self.compute)
        if self.quantized is not None:
            # The weight's input columns are in another order (act-order GPTQ): gather x into it.
            x = x.index_select(-1, self.quantized.input_order)
            return cpu_linear(x, self.quantized, self.bias, self.pinned_mode, self.compute)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def prepack_linears(module: nn.Module, compute: str = FP32) -> str:
    """Prepacks every Linear in module for `compute` arithmetic: float ones in panels, quantized ones on
    float32 arithmetic in QuantPanels; returns what serves them (for the start-up log)."""
    kinds = set()
    for sub in module.modules():
        if isinstance(sub, Linear):
            sub.compute = compute
            sub.prepack()
            if sub.quant_panels is not None:
                kinds.add("quantized panels")
            elif sub.quantized is None:
                onednn = "oneDNN" if sub._packed is not None else "torch"
                kind = "panel kernels"
                if isinstance(sub.panels, BF16Panels):
                    kind = f"bf16 panel kernels ({bf16_path(64, sub.in_features)} at 64 rows)"
                kinds.add(kind if sub.panels is not None else onednn)
    return ", ".join(sorted(kinds)) or "none"
