"""The bf16 arithmetic of the CPU linear kernels (--dtype bfloat16 on CPU): bf16 pair panels and
quantized weights multiplied in bf16, against float32 math on the bf16-rounded operands, the AVX512-BF16
path equal to the scalar one, AMX-BF16 (where the CPU has it) close to them, each batch-invariant, and
picked only where the CPU has bf16 dot products (faked CPU features reach every branch of that choice).
On the CPU whatever the test device."""

from __future__ import annotations

import pytest
import torch
from batch_invariance import assert_batch_invariant

from radixlm_runtime.executor import model_runner
from radixlm_runtime.layers import linear_kernels
from radixlm_runtime.layers.linear import Linear, prepack_linears
from radixlm_runtime.layers.linear_kernels import (
    BF16,
    BF16_GEMM,
    FP32,
    NO_AMX,
    PANEL_GEMM,
    PANEL_GEMM_MIN_ROWS,
    ROW_DOT_512,
    SCALAR,
    BF16Panels,
    bf16_available,
    cpu_linear,
    kernel_mode,
)
from radixlm_runtime.layers.quantization import quantize_int4, quantize_int8
from radixlm_runtime.utils import cpu

needs_bf16 = pytest.mark.skipif(
    not bf16_available(), reason="this CPU has no bf16 dot products (AVX512-BF16)"
)
needs_amx_bf16 = pytest.mark.skipif(
    linear_kernels.bf16_path(16, 64) != "AMX-BF16", reason="this CPU has no usable AMX-BF16 tiles"
)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def test_pair_panels_round_trip_and_need_an_even_k() -> None:
    w = torch.randn(37, 64)
    panels = BF16Panels.pack(w)
    assert panels.panels.shape == (3, 32, 16, 2) and panels.in_features == 64
    assert torch.equal(panels.dequantize(), _bf16(w))
    with pytest.raises(ValueError, match="even in_features"):
        BF16Panels.pack(torch.randn(4, 7))


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 50, 64), (3, 16, 8), (5, 33, 96), (13, 100, 576), (37, 200, 40), (0, 17, 8)],
)
def test_pair_panels_compute_the_rounded_product(rows: int, out_features: int, in_features: int) -> None:
    """Every mode gives float32 math on bf16-rounded x and W; where the CPU has vdpbf16ps its bits equal
    the scalar path's pair order (hi product, then lo, each add rounded). AMX tiles (where the CPU has
    them, for K a multiple of 32) add their products their own way: close, one path for every mode."""
    torch.manual_seed(rows)
    x, w, bias = (
        torch.randn(rows, in_features),
        torch.randn(out_features, in_features),
        torch.randn(out_features),
    )
    panels = BF16Panels.pack(w)
    reference = _bf16(x).double() @ _bf16(w).double().T + bias.double()
    modes = (SCALAR, PANEL_GEMM, ROW_DOT_512, BF16_GEMM)
    outs = [cpu_linear(x, panels, bias, mode=mode) for mode in modes]
    vdp = [cpu_linear(x, panels, bias, mode=mode | NO_AMX) for mode in modes]
    for out in outs + vdp:
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)
    if bf16_available():
        assert all(torch.equal(out, vdp[0]) for out in vdp[1:])  # vdpbf16ps: the scalar pair order
        amx = linear_kernels.bf16_path(rows, in_features) == "AMX-BF16"
        assert all(torch.equal(out, outs[1] if amx else vdp[0]) for out in outs[1:])


@pytest.mark.parametrize("mode", [BF16_GEMM, BF16_GEMM | NO_AMX])
def test_pair_panels_are_batch_invariant(mode: int) -> None:
    torch.manual_seed(0)
    panels = BF16Panels.pack(torch.randn(200, 576))
    assert_batch_invariant(lambda rows: cpu_linear(rows, panels, mode=mode), torch.randn(40, 576))


@pytest.mark.parametrize("mode", [BF16_GEMM, BF16_GEMM | NO_AMX])
@pytest.mark.parametrize("in_features", [576, 330])
def test_a_prefills_x_is_rounded_to_bf16_on_every_thread_as_on_one(mode: int, in_features: int) -> None:
    """From 2^16 values x is rounded to bf16 by all the threads, in shares of whole vectors: a prefill's
    rows get the bits they get alone (k = 330: the values' last part vector, rounded apart, at its end)."""
    torch.manual_seed(1)
    panels = BF16Panels.pack(torch.randn(40, in_features))
    x = torch.randn(240, in_features)  # 79,200 or 138,240 values
    whole = cpu_linear(x, panels, mode=mode)
    for i in (0, 1, 117, 239):
        assert torch.equal(cpu_linear(x[i : i + 1], panels, mode=mode), whole[i : i + 1])


@needs_amx_bf16
@pytest.mark.parametrize("in_features", [576, 1536])
def test_amx_bf16_tiles_serve_every_row_count_close_to_vdpbf16ps(in_features: int) -> None:
    """On a CPU with AMX-BF16: a row's bits are the same alone, among 15, 16, 17 or 40 rows (whole and
    part tiles, one and two row tiles a block), and within float32 rounding of the AVX512-BF16 kernel's,
    whose bits they are not (a tile product sums its 32 products its own way)."""
    torch.manual_seed(in_features)
    panels = BF16Panels.pack(torch.randn(200, in_features))  # 13 panels: pairs and a last odd one
    x = torch.randn(40, in_features)
    amx, vdp = cpu_linear(x, panels), cpu_linear(x, panels, mode=BF16_GEMM | NO_AMX)
    torch.testing.assert_close(amx, vdp, rtol=1e-5, atol=1e-4)
    assert not torch.equal(amx, vdp)
    for rows in (1, 15, 16, 17):
        assert torch.equal(cpu_linear(x[:rows], panels), amx[:rows])
    # Past a block of 512 rows, a last block of fewer than 16 rows among tiles of 16.
    long = torch.randn(520, in_features)
    out = cpu_linear(long, panels)
    torch.testing.assert_close(out, cpu_linear(long, panels, mode=BF16_GEMM | NO_AMX), rtol=1e-5, atol=1e-4)
    assert torch.equal(out[512:], cpu_linear(long[512:], panels))


@needs_bf16
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_weights_multiply_in_bf16_from_the_panel_threshold(bits: int) -> None:
    """BF16_GEMM dequantises each 16-row panel and rounds it to bf16: the product of the rounded
    operands, the same bits for a row whatever the rows beside it, and not the float32 GEMM's bits."""
    torch.manual_seed(bits)
    w = torch.randn(70, 256)
    q = quantize_int4(w, 32) if bits == 4 else quantize_int8(w)
    x = torch.randn(40, 256)
    out = cpu_linear(x, q, mode=BF16_GEMM)
    reference = _bf16(x).double() @ _bf16(cpu_linear(torch.eye(256), q, mode=SCALAR).T).double().T
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-4)
    assert not torch.equal(out, cpu_linear(x, q, mode=PANEL_GEMM))
    for rows in (PANEL_GEMM_MIN_ROWS, 17, 33):
        assert torch.equal(cpu_linear(x[:rows], q, mode=BF16_GEMM), out[:rows])


def test_kernel_mode_takes_bf16_from_the_panel_threshold_only() -> None:
    few, many = PANEL_GEMM_MIN_ROWS - 1, PANEL_GEMM_MIN_ROWS
    assert kernel_mode(many, BF16) == BF16_GEMM and kernel_mode(many, FP32) != BF16_GEMM
    assert kernel_mode(few, BF16) == kernel_mode(few, FP32)


def _fake(flags: str) -> cpu.CpuInfo:
    return cpu.CpuInfo("fake CPU", frozenset(flags.split()), 2)


AVX512 = "avx2 fma avx512f avx512bw avx512vl"


@pytest.mark.parametrize(
    ("flags", "has"),
    [("avx2 fma", False), (AVX512, False), (AVX512 + " avx512_bf16", True), ("avx2 fma avx512_bf16", False)],
)
def test_bf16_is_asked_of_the_cpu(monkeypatch: pytest.MonkeyPatch, flags: str, has: bool) -> None:
    """AVX2-only and AVX-512-without-bf16 CPUs have no bf16 path (the bf16 kernel needs AVX-512 beside
    it); the built library is asked too, so a faked flag on a CPU without it is not believed."""
    monkeypatch.setattr(cpu, "detect", lambda: _fake(flags))
    assert cpu.detect().bf16 is has
    assert bf16_available() is (has and bool(linear_kernels._library().rq_has_avx512_bf16()))


AMX_BF16 = AVX512 + " avx512_bf16 amx_tile amx_bf16"


@pytest.mark.parametrize(
    ("flags", "rows", "in_features", "path"),
    [
        ("avx2 fma", 64, 576, "scalar"),
        (AVX512, 64, 576, "scalar"),
        (AVX512 + " avx512_bf16", 64, 576, "AVX512-BF16"),
        (AMX_BF16, 64, 576, "AMX-BF16"),
        (AMX_BF16, 16, 576, "AMX-BF16"),
        (AMX_BF16, 1, 576, "AMX-BF16"),  # every row count: the tiles' sums are their own
        (AMX_BF16, 64, 48, "AVX512-BF16"),  # K not whole tiles of 32 columns
        (AVX512 + " amx_tile amx_bf16", 64, 576, "scalar"),  # AMX without AVX512-BF16 beside it
    ],
)
def test_each_cpu_gets_its_bf16_path(flags: str, rows: int, in_features: int, path: str) -> None:
    """AMX-BF16 where the CPU has it, for K a multiple of 32, at every row count (its sums are not
    vdpbf16ps's, so a weight keeps one path whatever the rows: batch-invariant), else AVX512-BF16."""
    assert linear_kernels.bf16_path(rows, in_features, _fake(flags)) == path


def test_this_cpu_takes_amx_bf16_only_where_it_has_it_and_it_checks_out() -> None:
    here = linear_kernels.bf16_path(64, 576)
    from_flags = linear_kernels.bf16_path(64, 576, cpu.detect())
    assert here == from_flags or (from_flags, here) == ("AMX-BF16", "AVX512-BF16")


def test_bfloat16_on_a_cpu_without_bf16_runs_float32_and_says_so(
    monkeypatch: pytest.MonkeyPatch, runtime_caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu, "detect", lambda: _fake(AVX512))
    assert model_runner.resolve_dtype("bfloat16", torch.device("cpu")) == (torch.float32, FP32)
    assert "no bf16 dot products" in runtime_caplog.text and "fake CPU" in runtime_caplog.text
    assert model_runner.resolve_dtype("auto", torch.device("cpu")) == (torch.float32, FP32)
    assert model_runner.resolve_dtype("bfloat16", torch.device("cuda")) == (torch.bfloat16, FP32)


@needs_bf16
def test_bfloat16_on_a_bf16_cpu_packs_float_linears_in_pairs() -> None:
    assert model_runner.resolve_dtype("bfloat16", torch.device("cpu")) == (torch.float32, BF16)
    layers = torch.nn.Sequential(Linear(64, 32), Linear(32, 8, bias=False), Linear(7, 8))
    path = linear_kernels.bf16_path(64, 64)  # AVX512-BF16, or AMX-BF16 where the CPU has it
    assert prepack_linears(layers, BF16) == f"bf16 panel kernels ({path} at 64 rows), panel kernels"
    assert isinstance(layers[0].panels, BF16Panels) and isinstance(layers[1].panels, BF16Panels)
    assert not isinstance(layers[2].panels, BF16Panels)  # an odd in_features stays float32
    assert all(layer.compute == BF16 and layer.batch_invariant for layer in layers)
