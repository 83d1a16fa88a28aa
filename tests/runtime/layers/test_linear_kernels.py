"""The float32 panel kernels of layers/linear_cpu.cpp and the Linear layer that serves float weights on
them: equal to torch's matmul, the same bits on every SIMD path, batch-invariant, and oneDNN's GEMM as
the fallback where the kernels have no SIMD path. On the CPU whatever the test device."""

from __future__ import annotations

import pytest
import torch
from batch_invariance import assert_batch_invariant

from radixlm_runtime.layers import linear_kernels
from radixlm_runtime.layers.linear import Linear
from radixlm_runtime.layers.linear_kernels import (
    PANEL_GEMM,
    PANEL_GEMM_MIN_ROWS,
    ROW_DOT,
    ROW_DOT_512,
    SCALAR,
    FloatPanels,
    QuantPanels,
    cpu_linear,
)
from radixlm_runtime.layers.quantization import QuantizedWeight, pack_int4, quantize_int4
from radixlm_runtime.utils import cpu

# Every mode: the scalar loop, AVX2 (1; 2 also picks the widest path), AVX-512 (AVX2 on a CPU without it).
MODES = [SCALAR, ROW_DOT, PANEL_GEMM, ROW_DOT_512]


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (1, 50, 64),  # a panel group cut short, the last panel 2 columns wide
        (3, 16, 7),  # one panel, an odd K
        (5, 33, 96),  # the 8-row blocking with fewer rows
        (13, 100, 576),  # one full block of 8 and a remainder
        (37, 200, 40),  # several blocks, 13 panels over two threads
        (0, 17, 8),
    ],
)
def test_panels_match_torch_on_every_path_to_the_bit(rows: int, out_features: int, in_features: int) -> None:
    torch.manual_seed(rows + out_features)
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    bias = torch.randn(out_features)
    panels = FloatPanels.pack(w)
    assert torch.equal(panels.dequantize(), w)
    outs = [cpu_linear(x, panels, bias, mode=mode) for mode in MODES]
    torch.testing.assert_close(outs[0], x @ w.T + bias, rtol=1e-5, atol=1e-4)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_panels_are_batch_invariant() -> None:
    """A row's output is the same bits alone or among any number of other rows (one FMA chain over k
    per output, whatever the blocking): what --deterministic needs, at no cost."""
    torch.manual_seed(0)
    panels = FloatPanels.pack(torch.randn(200, 576))
    assert_batch_invariant(lambda rows: cpu_linear(rows, panels), torch.randn(40, 576))


def test_panels_check_their_inputs() -> None:
    panels = FloatPanels.pack(torch.randn(20, 32))
    assert (panels.out_features, panels.in_features) == (20, 32)
    assert cpu_linear(torch.randn(2, 3, 32), panels).shape == (2, 3, 20)
    with pytest.raises(ValueError, match="float32"):
        cpu_linear(torch.randn(1, 32, dtype=torch.bfloat16), panels)
    with pytest.raises(ValueError, match="features"):
        cpu_linear(torch.randn(1, 31), panels)


def test_linear_serves_float_weights_on_panels_and_drops_the_dense_copy() -> None:
    torch.manual_seed(1)
    linear = Linear(64, 40, bias=True)
    weight = linear.weight.detach().clone()
    linear.prepack()
    assert linear.panels is not None and linear.batch_invariant and linear.kernel_weight is linear.panels
    assert linear.weight.numel() == 0
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x), x @ weight.T + linear.bias, rtol=1e-5, atol=1e-5)

    shared = Linear(64, 40, bias=False)
    shared.keep_weight = True  # a tied lm_head reads the embedding table
    shared.prepack()
    assert shared.panels is not None and shared.weight.shape == (40, 64)


def test_linear_falls_back_to_onednn_without_a_simd_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU the kernels have no SIMD path for (ARM, or x86 without AVX2) multiplies on oneDNN's GEMM."""
    monkeypatch.setattr(cpu, "detect", lambda: cpu.CpuInfo("fake CPU", frozenset({"sse4_2"}), 2))
    assert not linear_kernels.panels_available()
    linear = Linear(64, 40, bias=False)
    weight = linear.weight.detach().clone()
    linear.prepack()
    assert linear.panels is None and linear.kernel_weight is None and not linear.batch_invariant
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x), x @ weight.T, rtol=1e-5, atol=1e-5)


def _int8_weight(rows: int, cols: int, group: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return QuantizedWeight(8, codes, torch.rand(rows, cols // group, generator=gen) * 0.01, None, group)


@pytest.mark.parametrize(
    ("rows", "out_features", "group"), [(1, 50, 32), (3, 16, 32), (5, 4099, 64), (11, 33, 32)]
)
def test_int8_row_panels_are_float32_accurate_and_the_same_bits_on_every_path(
    rows: int, out_features: int, group: int
) -> None:
    """Against float64 on the weight's own numbers, within the row-dot kernel's float32 error (x's 24-bit
    fixed point per 32 columns rounds no more than a float32 dot product does); heavy-tailed x, whose
    small entries share a chunk with large ones; the portable loop gives the same bits."""
    weight = _int8_weight(out_features, 640, group, rows)
    panels = linear_kernels.Int8Panels.pack(weight)
    x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(7)) ** 3 * 10
    want = x.double() @ weight.dequantize().double().T
    got = linear_kernels.int8_panel_linear(x, panels)
    row_dot = cpu_linear(x, weight, mode=ROW_DOT_512)
    bound = 4 * (row_dot.double() - want).abs().max().item() + 1e-6
    assert (got.double() - want).abs().max().item() <= bound
    assert torch.equal(linear_kernels.int8_panel_linear(x, panels, mode=SCALAR), got)
    # A row's outputs do not depend on the rows beside it.
    assert torch.equal(linear_kernels.int8_panel_linear(x[-1:], panels), got[-1:])


def test_int8_row_panels_propagate_nan_and_infinity() -> None:
    panels = linear_kernels.Int8Panels.pack(_int8_weight(20, 64, 32, 0))
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("nan"), float("inf")
    out = linear_kernels.int8_panel_linear(x, panels)
    assert out.isnan().all()


def test_linear_serves_every_row_count_from_row_panels() -> None:
    """pack_row_panels (the lm_head's): every row count reads the row panels where the CPU runs them, so
    a row's logits are the same bits among any rows; a weight with mins does not fit them and keeps the
    kernels it had."""
    linear = Linear(640, 300, bias=False)
    linear.set_quantized(_int8_weight(300, 640, 32, 1))
    linear.pack_row_panels()
    assert (linear.row_panels is not None) == linear_kernels.int8_panels_available()
    x = torch.randn(PANEL_GEMM_MIN_ROWS + 5, 640)
    if linear.row_panels is not None:
        out = linear(x)
        assert torch.equal(out, linear_kernels.int8_panel_linear(x, linear.row_panels))
        assert torch.equal(linear(x[:3]), out[:3])
    else:
        assert torch.equal(linear(x), cpu_linear(x, linear.quantized))
    with_mins = Linear(640, 300, bias=False)
    with_mins.set_quantized(quantize_int4(torch.randn(300, 640)))
    with_mins.pack_row_panels()
    assert with_mins.row_panels is None


def _fma_dequantized(weight: QuantizedWeight) -> torch.Tensor:
    """The weight as fma(code, scale, min) in float32: the product of a code (at most 8 bits) and a
    scale is exact in float64, and scales and mins of like size keep the float64 sum exact, so one
    rounding to float32 is the fused multiply-add's."""
    shape = (weight.out_features, weight.in_features // weight.group_size, weight.group_size)
    exact = weight.codes().double().view(shape) * weight.scales.double().unsqueeze(-1)
    if weight.mins is not None:
        exact = exact + weight.mins.double().unsqueeze(-1)
    return exact.view(weight.out_features, weight.in_features).float()


@pytest.mark.parametrize(
    ("bits", "group", "out_features", "rows"),
    [(4, 32, 960, 12), (4, 64, 37, 13), (4, 16, 21, 40), (8, 32, 5, 16), (8, 16, 50, 12)],
)
def test_quantized_panel_gemm_multiplies_the_fma_dequantized_weight_to_the_bit(
    bits: int, group: int, out_features: int, rows: int
) -> None:
    """The panel GEMM dequantises 16 output rows at a time into a float32 panel (every value
    fma(code, scale, min)) and runs the float32 panels' micro-kernel on it: its output is the float32
    panels' on that weight, bit for bit, with N cut short of a panel (rows past it read zero), groups of
    16 (a scale per half chunk), of 32 and wider, and int8 without mins."""
    gen = torch.Generator().manual_seed(bits * 100 + group + out_features)
    k = 576
    scales = 0.01 + 0.01 * torch.rand(out_features, k // group, generator=gen)
    if bits == 4:
        codes = torch.randint(0, 16, (out_features, k), generator=gen)
        mins = -8 * scales * (0.5 + torch.rand(out_features, k // group, generator=gen))
        weight = QuantizedWeight(4, pack_int4(codes), scales, mins, group)
    else:
        codes = torch.randint(-128, 128, (out_features, k), generator=gen, dtype=torch.int8)
        weight = QuantizedWeight(8, codes, scales, None, group)
    x = torch.randn(rows, k, generator=gen)
    expected = cpu_linear(x, FloatPanels.pack(_fma_dequantized(weight)))
    assert torch.equal(cpu_linear(x, weight, mode=PANEL_GEMM), expected)


def _quantized(
    bits: int, group: int, n: int, k: int, symmetric: bool, seed: int, half: bool = False
) -> QuantizedWeight:
    """Random codes, scales and mins; with `half` the scales and mins float16 values, as a GGUF file's."""
    gen = torch.Generator().manual_seed(seed)
    scales = 0.01 + 0.01 * torch.rand(n, k // group, generator=gen)
    if bits == 4:
        codes = pack_int4(torch.randint(0, 16, (n, k), generator=gen))
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    mins = None if symmetric else -8 * scales * (0.5 + torch.rand(n, k // group, generator=gen))
    if half:
        scales, mins = scales.half().float(), None if mins is None else mins.half().float()
    return QuantizedWeight(bits, codes, scales, mins, group)


@pytest.mark.parametrize(
    ("bits", "group", "symmetric", "out_features", "in_features", "half"),
    [
        (4, 32, False, 960, 576, True),  # the default model's Q4_1 qkv (float16 scales and mins)
        (4, 32, False, 960, 576, False),  # quantized from float weights: float32 scales
        (4, 64, False, 37, 128, False),  # N cut short of a panel
        (4, 16, False, 21, 96, True),  # Q6_K's half-chunk groups
        (8, 32, True, 50, 64, True),  # Q8_0
        (8, 32, True, 50, 64, False),
        (8, 16, False, 70, 64, False),
        (4, 32, True, 16, 32, False),
    ],
)
def test_quantized_panels_multiply_the_fma_dequantized_weight_at_every_row_count(
    bits: int, group: int, symmetric: bool, out_features: int, in_features: int, half: bool
) -> None:
    """QuantPanels (the k-major layout float32 arithmetic serves quantized weights from) dequantize in
    registers, fma(code, scale, min), and run one FMA chain per output: the float32 panels' bits on the
    fma-dequantized weight, on every path (scalar, 256-bit, AVX-512) and at every row count, across
    the blockings (1-4 rows x 4 panels, blocks of up to 8 rows, and from 20 rows the dequantized panels
    the float32 kernels read), and the same as the GGUF layout's panel GEMM; with scales and mins held
    as float16 where they are float16 values, float32 otherwise."""
    weight = _quantized(bits, group, out_features, in_features, symmetric, bits + group + out_features, half)
    panels = QuantPanels.pack(weight)
    assert (panels.out_features, panels.in_features) == (out_features, in_features)
    assert panels.scales.dtype == (torch.float16 if half else torch.float32)
    assert panels.mins is None or panels.mins.dtype == panels.scales.dtype
    dense = FloatPanels.pack(_fma_dequantized(weight))
    x = torch.randn(41, in_features, generator=torch.Generator().manual_seed(3))
    for rows in (1, 2, 3, 4, 5, 12, 19, 20, 41):
        expected = cpu_linear(x[:rows], dense)
        for mode in MODES:
            assert torch.equal(cpu_linear(x[:rows], panels, mode=mode), expected), (rows, mode)
        assert torch.equal(cpu_linear(x[:rows], weight, mode=PANEL_GEMM), expected)


def test_quantized_panels_widen_every_float16_scale_exactly() -> None:
    """float16 scales and mins widen to the same floats on every path (the scalar one in software):
    subnormals, the largest float16 and negative zero included, so the bits match the float32 weight's."""
    weight = _quantized(4, 32, 64, 64, False, 8, half=True)
    special = torch.tensor([2.0**-24, 3 * 2.0**-20, 65504.0, -0.0, 2.0**-14, 1.0], dtype=torch.float32)
    weight.scales[:6, 0] = special
    weight.mins[:6, 1] = -special
    panels = QuantPanels.pack(weight)
    assert panels.scales.dtype == torch.float16
    dense = FloatPanels.pack(_fma_dequantized(weight))
    x = torch.randn(21, 64, generator=torch.Generator().manual_seed(9))
    for rows in (1, 5, 21):
        expected = cpu_linear(x[:rows], dense)
        for mode in MODES:
            assert torch.equal(cpu_linear(x[:rows], panels, mode=mode), expected), (rows, mode)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_panels_are_batch_invariant(mode: int) -> None:
    panels = QuantPanels.pack(_quantized(4, 32, 200, 576, False, 5))
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(4))
    assert_batch_invariant(lambda rows: cpu_linear(rows, panels, mode=mode), x)


def test_quantized_panels_propagate_nan_and_infinity_to_their_row() -> None:
    panels = QuantPanels.pack(_quantized(4, 32, 40, 64, False, 6))
    x = torch.randn(30, 64)
    x[2, 5], x[25, 60] = float("nan"), float("inf")
    for mode in MODES:
        out = cpu_linear(x, panels, mode=mode)
        assert out[2].isnan().all() and not out[25].isfinite().any()
        assert out[[i for i in range(30) if i not in (2, 25)]].isfinite().all()


def test_linear_serves_quantized_weights_on_float32_arithmetic_from_quantized_panels() -> None:
    """prepack gives a quantized Linear QuantPanels for float32 arithmetic: its kernel weight, batch-
    invariant at every row count; a weight with its columns in another order, bf16 arithmetic, and a CPU
    without the SIMD kernels keep the GGUF layout's kernels."""
    weight = _quantized(4, 32, 48, 64, False, 7)
    linear = Linear(64, 48, bias=False)
    linear.set_quantized(weight)
    linear.prepack()
    assert linear.quant_panels is not None and linear.kernel_weight is linear.quant_panels
    assert linear.batch_invariant
    # The GGUF-layout codes are dropped (not held twice); the format stays readable.
    kept = linear.quantized
    assert kept is not None and kept.qweight.is_meta and (kept.bits, kept.out_features) == (4, 48)
    with pytest.raises(ValueError, match="dropped"):
        cpu_linear(torch.randn(1, 64), kept)
    x = torch.randn(9, 64)
    assert torch.equal(linear(x), cpu_linear(x, FloatPanels.pack(_fma_dequantized(weight))))
    assert torch.equal(linear(x[:1]), linear(x)[:1])
    packed = linear.quant_panels
    linear.prepack()  # again: a no-op, not a repack of the dropped codes
    assert linear.quant_panels is packed

    bf16 = Linear(64, 48, bias=False)
    bf16.set_quantized(weight)
    bf16.compute = linear_kernels.BF16
    bf16.prepack()
    assert bf16.quant_panels is None and bf16.kernel_weight is weight and not weight.qweight.is_meta

    ordered = _quantized(4, 32, 48, 64, False, 7)
    ordered.input_order = torch.arange(64).flip(0)
    gathered = Linear(64, 48, bias=False)
    gathered.set_quantized(ordered)
    gathered.prepack()
    assert gathered.quant_panels is None
    torch.testing.assert_close(gathered(x), x @ ordered.dequantize().T, rtol=1e-4, atol=1e-4)


def test_quantized_panels_stay_off_without_a_simd_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "detect", lambda: cpu.CpuInfo("fake CPU", frozenset({"sse4_2"}), 2))
    linear = Linear(64, 48, bias=False)
    linear.set_quantized(_quantized(4, 32, 48, 64, False, 8))
    linear.prepack()
    assert linear.quant_panels is None and linear.kernel_weight is linear.quantized
