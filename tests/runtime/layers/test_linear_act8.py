"""int8 activations into quantized weights (--cpu-act-quant int8, linear_cpu.cpp's "int8 activations"):
the exact product of the per-chunk int8-quantized activations and the weight's own codes, every SIMD
path (AVX-512 VNNI, the 256-bit VNNI code that AVX-VNNI CPUs run, AVX2's byte products) equal to the
scalar one to the bit, batch-invariant, NaN confined to its row, and each picked where the CPU has it
(faked CPU features reach the Python side's choice, the library reports its own). On the CPU whatever
the test device."""

from __future__ import annotations

import pytest
import torch
from batch_invariance import assert_batch_invariant

from radixlm_runtime.layers import linear_kernels
from radixlm_runtime.layers.linear import Linear
from radixlm_runtime.layers.linear_kernels import (
    ACT8_PATHS,
    PANEL_GEMM,
    PANEL_GEMM_MIN_ROWS,
    ROW_DOT,
    ROW_DOT_512,
    SCALAR,
    VNNI_256,
    Act8Panels,
    act8_available,
    act8_path,
    cpu_linear,
    kernel_mode,
)
from radixlm_runtime.layers.quantization import LinearShards, QuantizedWeight, quantize_int4, quantize_int8
from radixlm_runtime.models import builder
from radixlm_runtime.utils import cpu

# Every mode: scalar, 256-bit (AVX2 here: this CPU has no AVX-VNNI), 256-bit VNNI on AVX512-VL, widest.
MODES = [SCALAR, ROW_DOT, VNNI_256, PANEL_GEMM, ROW_DOT_512]


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
        (100, 40, 96, 32),  # rows across the quantized activations' 48-row blocks
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
    assert (panels.mins is None) == (weight.mins is None)  # symmetric: no mins' term on any path
    x = torch.randn(rows, in_features)
    outs = [cpu_linear(x, panels, mode=mode) for mode in MODES]
    torch.testing.assert_close(outs[0].double(), _reference(x, weight), rtol=1e-5, atol=1e-4)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # the same integer sums and float operations in order
    # int8 activations are an approximation of float32 ones, a close one.
    if rows:
        exact = cpu_linear(x, weight, mode=SCALAR)
        assert (outs[0] - exact).norm() < 0.02 * exact.norm()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_the_same_bits_among_any_rows(bits: int, mode: int) -> None:
    torch.manual_seed(bits)
    panels = Act8Panels.pack(_quantized(bits, 200, 576))
    assert_batch_invariant(lambda rows: cpu_linear(rows, panels, mode=mode), torch.randn(40, 576))


def test_int8_codes_at_the_ends_of_their_range() -> None:
    """-128 and 127 codes against activations of both signs: AVX2's byte products take |q| times x
    signed as q, which holds for q = -128 where negating q would not."""
    n, k = 16, 64
    codes = torch.tensor([-128, 127, -1, 0], dtype=torch.int8).repeat(n, k // 4)
    weight = QuantizedWeight(8, codes, torch.full((n, k // 32), 0.5), None, 32)
    panels = Act8Panels.pack(weight)
    x = torch.linspace(-3, 3, 3 * k).view(3, k)
    outs = [cpu_linear(x, panels, mode=mode) for mode in MODES]
    torch.testing.assert_close(outs[0].double(), _reference(x, weight), rtol=1e-6, atol=1e-4)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("mode", MODES)
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
    ("flags", "has"), [("sse4_2", False), ("avx2 fma", True), ("avx2 fma avx_vnni", True), (AVX512, True)]
)
def test_int8_activations_need_the_avx2_kernels(
    monkeypatch: pytest.MonkeyPatch, flags: str, has: bool
) -> None:
    monkeypatch.setattr(cpu, "detect", lambda: _fake(flags))
    assert act8_available() is has


def test_the_library_picks_the_widest_path_this_cpu_has() -> None:
    """Which path each mode runs, from the CPU's own answers (the C++ side never takes Python's)."""
    lib = linear_kernels._library()
    vnni512, avxvnni = bool(lib.rq_has_avx512_vnni()), bool(lib.rq_has_avx_vnni())
    narrow = "AVX-VNNI" if avxvnni else "AVX2"
    assert lib.rq_act8_path(SCALAR, 1, -1) == 0
    assert ACT8_PATHS[lib.rq_act8_path(ROW_DOT, 1, -1)] == narrow
    assert ACT8_PATHS[lib.rq_act8_path(VNNI_256, 1, -1)] == ("AVX512-VL VNNI" if vnni512 else narrow)
    assert ACT8_PATHS[lib.rq_act8_path(PANEL_GEMM, 1, -1)] == ("AVX512-VNNI" if vnni512 else narrow)
    assert act8_path(1) in ACT8_PATHS[1:]


AMX = AVX512 + " avx512_vnni amx_tile amx_int8 amx_bf16"


@pytest.mark.parametrize(
    ("flags", "decode", "prefill"),
    [
        ("sse4_2", "scalar", "scalar"),
        ("avx2 fma", "AVX2", "AVX2"),
        ("avx2 fma avx_vnni", "AVX-VNNI", "AVX-VNNI"),
        (AVX512, "AVX2", "AVX2"),  # AVX-512 without VNNI (Skylake-X): the byte products
        (AVX512 + " avx512_vnni", "AVX512-VNNI", "AVX512-VNNI"),
        # Sapphire Rapids: AVX512-VNNI. AMX-INT8 tiles measured no faster there (benchmarks/README.md):
        # the weights' scale per 32 columns costs a tile store and a vector epilogue per tile product.
        (AMX, "AVX512-VNNI", "AVX512-VNNI"),
    ],
)
def test_each_cpu_gets_its_path(
    monkeypatch: pytest.MonkeyPatch, flags: str, decode: str, prefill: str
) -> None:
    """The dispatch on faked CPU features: decode (1 row) and prefill (512 rows) of each kind of CPU."""
    fake = _fake(flags)
    monkeypatch.setattr(cpu, "detect", lambda: fake)  # kernel_mode reads the faked SIMD level
    assert act8_path(1, fake) == decode
    assert act8_path(512, fake) == prefill


class _Model(torch.nn.Module):
    """The two kinds of linear shards the builder sees: decoder linears and the lm_head (its weight in
    groups of `head_group` columns: 32 fits the int8-activation layout, 16 does not)."""

    def __init__(self, head_group: int = 32) -> None:
        super().__init__()
        self.proj, self.odd, self.lm_head = Linear(64, 32), Linear(64, 16), Linear(64, 48, bias=False)
        self.proj.set_quantized(_quantized(4, 32, 64))
        self.odd.set_quantized(_quantized(8, 16, 64, 16))
        self.lm_head.set_quantized(_quantized(8, 48, 64, head_group))

    def linear_shards(self) -> list[LinearShards]:
        return [
            LinearShards("proj", self.proj, []),
            LinearShards("odd", self.odd, []),
            LinearShards("lm_head", self.lm_head, [], is_lm_head=True),
        ]


def test_the_linears_take_int8_activations_where_their_layout_fits(
    runtime_caplog: pytest.LogCaptureFixture,
) -> None:
    model = _Model()
    model.lm_head.pack_row_panels()
    assert model.lm_head.row_panels is not None
    builder._quantize_activations(model)
    assert "2 of 3 linears take int8 activations" in runtime_caplog.text
    for linear in (model.proj, model.lm_head):
        assert linear.act8 is not None and linear.kernel_weight is linear.act8
    assert model.lm_head.row_panels is None  # the int8-activation panels serve every row count
    assert model.odd.act8 is None
    # What stays on float activations runs one kernel at every row count: the panel GEMM for a
    # decoder linear; each row's bits whatever rows come with it.
    assert "1 float-activation linears pinned" in runtime_caplog.text
    assert model.odd.pinned_mode == kernel_mode(PANEL_GEMM_MIN_ROWS)
    x = torch.randn(40, 64)
    for linear in (model.proj, model.odd, model.lm_head):
        assert linear.batch_invariant
        with torch.no_grad():
            assert_batch_invariant(linear, x)


def test_an_lm_head_the_layout_does_not_fit_runs_the_row_dot_kernel_at_every_row_count() -> None:
    model = _Model(head_group=16)
    builder._quantize_activations(model)
    assert model.lm_head.act8 is None and model.lm_head.pinned_mode == kernel_mode(1)
    with torch.no_grad():
        assert_batch_invariant(model.lm_head, torch.randn(40, 64))


def test_without_simd_kernels_activations_stay_float_and_the_log_says_so(
    monkeypatch: pytest.MonkeyPatch, runtime_caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu, "detect", lambda: _fake("sse4_2"))
    model = _Model()
    builder._quantize_activations(model)
    assert "no SIMD path for int8 activations" in runtime_caplog.text and "fake CPU" in runtime_caplog.text
    assert model.proj.act8 is None
