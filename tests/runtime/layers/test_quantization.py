"""Weight-only quantized linears: the format, quantizing floats, the CPU kernels against a dequantized
reference (every kernel path), input orders (act-order), the per-linear plan and the `--quantization`
validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from radixlm_runtime.config import EngineConfig
from radixlm_runtime.layers import quantization
from radixlm_runtime.layers.linear import Linear
from radixlm_runtime.layers.linear_kernels import (
    PANEL_GEMM,
    PANEL_GEMM_MIN_ROWS,
    ROW_DOT,
    ROW_DOT_512,
    SCALAR,
    cpu_linear,
    has_avx2_fma,
    kernel_mode,
)
from radixlm_runtime.layers.quantization import (
    LinearShards,
    QuantizedWeight,
    pack_int4,
    plan_linear,
    quantize_int4,
    quantize_int8,
    resolve_quantization,
)

# ROW_DOT_512 runs the AVX2 row-dot kernel on a CPU without AVX-512.
MODES = [SCALAR, ROW_DOT, PANEL_GEMM, ROW_DOT_512]


def _weight(bits: int, n: int, k: int, group: int | None, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    return quantize_int4(w, group or 32) if bits == 4 else quantize_int8(w, group)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("bits", "group"),
    [(4, 32), (4, 64), (8, None), (8, 32), (8, 16), (4, 16)],
    ids=["int4g32", "int4g64", "int8", "int8g32", "int8g16", "int4g16"],
)
@pytest.mark.parametrize("rows", [1, 3, 5, 13, 40])
def test_kernels_match_the_dequantized_reference(mode: int, bits: int, group: int | None, rows: int) -> None:
    n, k = 72, 128  # n not a multiple of the 16-row panel or the 8-row blocks
    weight = _weight(bits, n, k, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    ref = x @ weight.dequantize().T + bias
    out = cpu_linear(x, weight, bias, mode=mode)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_kernel_paths_agree_on_model_shapes() -> None:
    """The default model's projection shapes (576 in, 960 out), decode and prefill row counts."""
    weight = _weight(4, 960, 576, 32)
    for rows in (1, 32):
        x = torch.randn(rows, 576)
        ref = x @ weight.dequantize().T
        torch.testing.assert_close(cpu_linear(x, weight), ref, rtol=1e-4, atol=1e-3)


def test_kernel_mode_follows_the_cpu_and_row_count() -> None:
    if not has_avx2_fma():
        assert kernel_mode(1) == kernel_mode(512) == SCALAR
        return
    flags = Path("/proc/cpuinfo").read_text().split()
    row_dot = ROW_DOT_512 if {"avx512f", "avx512bw", "avx512vl"} <= set(flags) else ROW_DOT
    assert kernel_mode(1) == kernel_mode(PANEL_GEMM_MIN_ROWS - 1) == row_dot
    assert kernel_mode(PANEL_GEMM_MIN_ROWS) == PANEL_GEMM


def test_batched_input_shapes_and_empty_rows() -> None:
    weight = _weight(8, 40, 64, None)
    x = torch.randn(2, 3, 64)
    assert cpu_linear(x, weight).shape == (2, 3, 40)
    torch.testing.assert_close(cpu_linear(x, weight)[1, 2], x[1, 2] @ weight.dequantize().T)
    assert cpu_linear(torch.empty(0, 64), weight).shape == (0, 40)


def test_bad_activations_are_rejected() -> None:
    weight = _weight(4, 16, 64, 32)
    with pytest.raises(ValueError, match="float32"):
        cpu_linear(torch.randn(1, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="features"):
        cpu_linear(torch.randn(1, 32), weight)


def test_int4_quantization_error_is_within_half_a_step() -> None:
    w = torch.randn(64, 256)
    q = quantize_int4(w)
    step = q.scales.repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert int(q.codes().min()) >= 0 and int(q.codes().max()) <= 15


def test_int8_quantization_is_per_channel_and_within_half_a_step() -> None:
    w = torch.randn(64, 256)
    q = quantize_int8(w)
    assert q.scales.shape == (64, 1) and q.mins is None
    assert ((q.dequantize() - w).abs() <= q.scales / 2 + 1e-6).all()


def test_int4_packing_round_trips() -> None:
    codes = torch.randint(0, 16, (8, 64))
    packed = pack_int4(codes)
    weight = QuantizedWeight(4, packed, torch.ones(8, 2), torch.zeros(8, 2), 32)
    assert torch.equal(weight.codes(), codes.to(torch.int16))
    # Byte j of a chunk: column j low, column j + 16 high.
    assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 16]) << 4


def test_concat_rows_stacks_and_rejects_mixed_formats() -> None:
    a, b = _weight(4, 16, 64, 32, seed=1), _weight(4, 8, 64, 32, seed=2)
    fused = QuantizedWeight.concat_rows([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="different formats"):
        QuantizedWeight.concat_rows([a, _weight(8, 8, 64, None)])


def test_concat_rows_gives_zero_mins_to_parts_without() -> None:
    """int8 with and without mins (GGUF Q8_0 beside Q5_1) fuse into the same weights."""
    plain = _weight(8, 8, 64, 32, seed=1)
    with_mins = dataclasses.replace(_weight(8, 8, 64, 32, seed=2), mins=torch.randn(8, 2))
    fused = QuantizedWeight.concat_rows([plain, with_mins])
    assert torch.equal(fused.mins[:8], torch.zeros(8, 2))
    assert torch.equal(fused.dequantize(), torch.cat([plain.dequantize(), with_mins.dequantize()]))


def _ordered(weight: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    return dataclasses.replace(weight, input_order=order)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_input_order_gathers_the_activations(rows: int) -> None:
    """An act-order weight: stored column j multiplies input column order[j]; the layer gathers x into that
    order (and so is not served by the kernels alone), and dequantize() gives the weight in input order."""
    n, k = 40, 128
    order = torch.randperm(k, generator=torch.Generator().manual_seed(3))
    stored = _weight(4, n, k, 32)
    weight = _ordered(stored, order)
    reference = torch.empty(n, k)
    reference[:, order] = stored.dequantize()
    assert torch.equal(weight.dequantize(), reference)
    linear = Linear(k, n, bias=True)
    linear.set_quantized(weight)
    assert linear.kernel_weight is None
    x = torch.randn(rows, k)
    torch.testing.assert_close(linear(x), x @ reference.T + linear.bias, rtol=1e-5, atol=1e-4)
    plain = Linear(k, n, bias=False)
    plain.set_quantized(stored)
    assert plain.kernel_weight is stored


def test_concat_rows_needs_one_input_order() -> None:
    order = torch.randperm(64)
    a, b = _ordered(_weight(4, 16, 64, 32, 1), order), _ordered(_weight(4, 8, 64, 32, 2), order.clone())
    fused = QuantizedWeight.concat_rows([a, b])
    assert torch.equal(fused.input_order, order)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    for other in (_weight(4, 8, 64, 32, 2), _ordered(_weight(4, 8, 64, 32, 2), torch.randperm(64))):
        with pytest.raises(ValueError, match="input_order"):
            QuantizedWeight.concat_rows([a, other])


def test_weight_format_validation_names_the_field() -> None:
    assert (
        QuantizedWeight(8, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 4), None, 16).group_size == 16
    )
    with pytest.raises(ValueError, match="group_size"):
        QuantizedWeight(8, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), None, 48)
    with pytest.raises(ValueError, match="group_size"):
        QuantizedWeight(8, torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 3), None, 16)
    with pytest.raises(ValueError, match="input_order"):
        QuantizedWeight(8, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2), None, 32, torch.arange(32))
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(8, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), None, 32)
    with pytest.raises(ValueError, match="bits"):
        QuantizedWeight(4, torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 2), None, 32)


def _target(n: int = 32, k: int = 64, lm_head: bool = False) -> LinearShards:
    linear = Linear(k, n, bias=False)
    torch.nn.init.normal_(linear.weight)
    return LinearShards("proj", linear, [("a.weight", n // 2), ("b.weight", n // 2)], is_lm_head=lm_head)


def test_plan_auto_keeps_only_a_checkpoints_own_blocks() -> None:
    target = _target()
    assert plan_linear(target, "auto", None) is None
    assert plan_linear(target, "none", None) is None
    own = {"a.weight": _weight(4, 16, 64, 32, 1), "b.weight": _weight(4, 16, 64, 32, 2)}
    fused = plan_linear(target, "auto", own.get)
    assert fused is not None and fused.bits == 4
    assert torch.equal(fused.qweight, torch.cat([own["a.weight"].qweight, own["b.weight"].qweight]))
    # One shard in float: auto leaves the whole fused layer in float.
    assert plan_linear(target, "auto", {"a.weight": own["a.weight"]}.get) is None


def test_plan_int4_and_int8_quantize_floats_and_keep_matching_blocks() -> None:
    target = _target()
    w = target.linear.weight.detach()
    int4 = plan_linear(target, "int4", None)
    assert int4.bits == 4 and torch.equal(int4.dequantize(), quantize_int4(w).dequantize())
    int8 = plan_linear(target, "int8", None)
    assert int8.bits == 8 and int8.group_size == 64
    own_a = _weight(8, 16, 64, 32, seed=3)  # a checkpoint's Q8_0-like block-32 int8 shard
    mixed = plan_linear(target, "int8", {"a.weight": own_a}.get)
    assert mixed.group_size == 32
    assert torch.equal(mixed.dequantize()[:16], own_a.dequantize())
    assert torch.equal(mixed.dequantize()[16:], quantize_int8(w[16:], 32).dequantize())
    assert plan_linear(_target(lm_head=True), "int4", None).bits == 8


def test_plan_fuses_act_order_shards_only_with_one_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards of one fused linear share its input, so they fuse only if they gather it the same way;
    otherwise the layer stays float (auto) or is re-quantized from floats (int4), with a log line."""
    target = _target()
    order = torch.randperm(64, generator=torch.Generator().manual_seed(5))
    a, b = _ordered(_weight(4, 16, 64, 32, 1), order), _ordered(_weight(4, 16, 64, 32, 2), order)
    fused = plan_linear(target, "auto", {"a.weight": a, "b.weight": b}.get)
    assert torch.equal(fused.input_order, order)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    other = _ordered(b, torch.randperm(64, generator=torch.Generator().manual_seed(6)))
    # Recorded at the logger: the runtime's loggers do not propagate to pytest's handler once an
    # engine in an earlier test has configured logging.
    lines: list[str] = []
    monkeypatch.setattr(quantization.logger, "info", lambda msg, *args: lines.append(msg % args))
    assert plan_linear(target, "auto", {"a.weight": a, "b.weight": other}.get) is None
    assert any("different orders" in line and "proj" in line for line in lines)
    requantized = plan_linear(target, "int4", {"a.weight": a, "b.weight": other}.get)
    assert requantized.input_order is None
    assert torch.equal(requantized.dequantize(), quantize_int4(target.linear.weight.detach()).dequantize())


def test_plan_quantizes_float_shards_in_a_kept_shards_order() -> None:
    target = _target()
    order = torch.randperm(64, generator=torch.Generator().manual_seed(7))
    kept = _ordered(_weight(4, 16, 64, 32, 1), order)
    mixed = plan_linear(target, "int4", {"a.weight": kept}.get)
    assert torch.equal(mixed.input_order, order)
    assert torch.equal(mixed.dequantize()[:16], kept.dequantize())
    floats = target.linear.weight.detach()[16:]
    expected = torch.empty(16, 64)
    expected[:, order] = quantize_int4(floats[:, order]).dequantize()
    assert torch.equal(mixed.dequantize()[16:], expected)


def test_plan_rejects_a_checkpoint_weight_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="a.weight is 8x64, its shard of proj 16x64"):
        plan_linear(_target(), "auto", {"a.weight": _weight(4, 8, 64, 32)}.get)


def test_set_quantized_checks_the_shape_and_drops_the_float_weight() -> None:
    linear = Linear(64, 32, bias=True)
    with pytest.raises(ValueError, match="32x64"):
        linear.set_quantized(_weight(8, 16, 64, None))
    weight = _weight(8, 32, 64, None)
    linear.set_quantized(weight)
    linear.prepack()
    assert linear.weight.numel() == 0
    x = torch.randn(2, 64)
    torch.testing.assert_close(linear(x), x @ weight.dequantize().T + linear.bias)


def test_resolve_quantization_per_device_and_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("int4", cpu, torch.float32) == "int4"
    assert resolve_quantization("auto", cuda, torch.bfloat16) == "none"
    assert resolve_quantization("auto", cpu, torch.bfloat16) == "none"
    with pytest.raises(ValueError, match="CPU only.*'none' or 'auto'"):
        resolve_quantization("int8", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        resolve_quantization("int4", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("int3", cpu, torch.float32)


def test_quantization_flag_is_validated() -> None:
    assert EngineConfig().quantization == "auto"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")
