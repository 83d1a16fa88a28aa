"""int8 activations into quantized weights (--cpu-act-quant int8, linear_cpu.cpp's "int8 activations"):
the exact product of the per-chunk int8-quantized activations and the weight's own codes, the VNNI path
equal to the scalar one to the bit, batch-invariant, NaN confined to its row, and picked only where
the CPU has AVX512-VNNI (faked CPU features reach every branch of that choice). On the CPU whatever
the test device."""

from __future__ import annotations

import logging

import pytest
import torch

from radixlm_runtime.layers import linear_kernels
from radixlm_runtime.layers.linear import Linear
from radixlm_runtime.layers.linear_kernels import (
    PANEL_GEMM,
    ROW_DOT_512,
    SCALAR,
    Act8Panels,
    act8_available,
    cpu_linear,
)
from radixlm_runtime.layers.quantization import LinearShards, QuantizedWeight, quantize_int4, quantize_int8
from radixlm_runtime.models import builder
from radixlm_runtime.utils import cpu


def _quantized(bits: int, n: int, k: int, group: int = 32) -> QuantizedWeight:
    w = torch.randn(n, k)
    return quantize_int4(w, group) if bits == 4 else quantize_int8(w, group)


def _reference(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x quantized per row and 32 columns as the kernel does (scale max |x| / 127, round half even),
    times the dequantized weight, in float64."""
    m, k = x.shape
    chunks = x.view(m, k // 32, 32)
    step = chunks.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(chunks / step).clamp(-127, 127)
    dense = cpu_linear(torch.eye(k), weight, mode=SCALAR).T  # the weight as the kernels read it
    return (codes * step).view(m, k).double() @ dense.double().T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "group"),
    [
        (1, 50, 64, 32),
        (3, 16, 32, 32),
        (5, 33, 96, 32),
        (13, 100, 576, 64),
        (37, 200, 64, 32),
        (0, 17, 32, 32),
    ],
)
def test_products_of_the_quantized_activations(
    bits: int, rows: int, out_features: int, in_features: int, group: int
) -> None:
    torch.manual_seed(rows + bits)
    weight = _quantized(bits, out_features, in_features, group)
    panels = Act8Panels.pack(weight)
    assert panels.in_features == in_features and panels.out_features == out_features
    x = torch.randn(rows, in_features)
    outs = [cpu_linear(x, panels, mode=mode) for mode in (SCALAR, PANEL_GEMM, ROW_DOT_512)]
    torch.testing.assert_close(outs[0].double(), _reference(x, weight), rtol=1e-5, atol=1e-4)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # the same integer sums and float operations in order
    # int8 activations are an approximation of float32 ones, a close one.
    if rows:
        exact = cpu_linear(x, weight, mode=SCALAR)
        assert (outs[0] - exact).norm() < 0.02 * exact.norm()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_the_same_bits_among_any_rows(bits: int) -> None:
    torch.manual_seed(bits)
    panels = Act8Panels.pack(_quantized(bits, 200, 576))
    x = torch.randn(40, 576)
    alone = torch.cat([cpu_linear(x[i : i + 1], panels) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 9, 16, 40):
        assert torch.equal(cpu_linear(x[:rows], panels), alone[:rows])
    assert torch.equal(cpu_linear(x[7:30], panels), alone[7:30])


@pytest.mark.parametrize("mode", [SCALAR, PANEL_GEMM])
def test_a_non_finite_activation_poisons_only_its_row(mode: int) -> None:
    torch.manual_seed(0)
    panels = Act8Panels.pack(_quantized(4, 40, 64))
    x = torch.randn(70, 64)
    x[3, 5], x[66, 40] = float("nan"), float("inf")
    out = cpu_linear(x, panels, mode=mode)
    assert out[3].isnan().all() and out[66].isnan().all()
    finite = [i for i in range(70) if i not in (3, 66)]
    assert out[finite].isfinite().all()
    zeros = cpu_linear(torch.zeros(2, 64), panels, mode=mode)
    assert torch.equal(zeros, torch.zeros(2, 40))


def test_only_whole_chunk_groups_in_column_order_fit() -> None:
    assert Act8Panels.fits(_quantized(4, 16, 64)) and Act8Panels.fits(_quantized(8, 16, 64, 64))
    assert not Act8Panels.fits(_quantized(8, 16, 64, 16))  # Q6_K's half-chunk groups
    ordered = _quantized(4, 16, 64)
    ordered.input_order = torch.arange(64).flip(0)
    assert not Act8Panels.fits(ordered)
    with pytest.raises(ValueError, match="groups of 32k"):
        Act8Panels.pack(ordered)


def _fake(flags: str) -> cpu.CpuInfo:
    return cpu.CpuInfo("fake CPU", frozenset(flags.split()), 2)


AVX512 = "avx2 fma avx512f avx512bw avx512vl"


@pytest.mark.parametrize(
    ("flags", "has"), [("avx2 fma avx_vnni", False), (AVX512, False), (AVX512 + " avx512_vnni", True)]
)
def test_vnni_is_asked_of_the_cpu(monkeypatch: pytest.MonkeyPatch, flags: str, has: bool) -> None:
    monkeypatch.setattr(cpu, "detect", lambda: _fake(flags))
    assert cpu.detect().vnni is has
    assert act8_available() is (has and bool(linear_kernels._library().rq_has_avx512_vnni()))


class _Model(torch.nn.Module):
    """The two kinds of linear shards the builder sees: decoder linears and the lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.odd, self.lm_head = Linear(64, 32), Linear(64, 16), Linear(64, 48)
        self.proj.set_quantized(_quantized(4, 32, 64))
        self.odd.set_quantized(_quantized(8, 16, 64, 16))
        self.lm_head.set_quantized(_quantized(8, 48, 64))

    def linear_shards(self) -> list[LinearShards]:
        return [
            LinearShards("proj", self.proj, []),
            LinearShards("odd", self.odd, []),
            LinearShards("lm_head", self.lm_head, [], is_lm_head=True),
        ]


def test_the_decoder_linears_take_int8_activations_the_lm_head_keeps_float(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if not act8_available():
        pytest.skip("this CPU has no AVX512-VNNI")
    model = _Model()
    with caplog.at_level(logging.INFO, logger=builder.logger.name):
        builder._quantize_activations(model)
    assert "1 of 2 decoder linears" in caplog.text
    assert model.proj.act8 is not None and model.proj.kernel_weight is model.proj.act8
    assert model.odd.act8 is None and model.lm_head.act8 is None
    assert model.proj.batch_invariant


def test_without_vnni_activations_stay_float_and_the_log_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu, "detect", lambda: _fake(AVX512))
    model = _Model()
    with caplog.at_level(logging.WARNING, logger=builder.logger.name):
        builder._quantize_activations(model)
    assert "no AVX512-VNNI" in caplog.text and "fake CPU" in caplog.text
    assert model.proj.act8 is None
