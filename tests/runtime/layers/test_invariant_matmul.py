"""fused_triton.invariant_linear, the matmul --deterministic runs CUDA linears on: equal to F.linear
within the dtype's rounding, and each row's result bit-identical whatever rows come with it.

On the test device: natively under RADIXLM_TEST_DEVICE=cuda, otherwise under the Triton interpreter on
CPU tensors (tests/device_helpers.py). There bit-identity follows from the same construction (one tile
shape, K walked in order); on a GPU it is what the test is for: cuBLAS picks its algorithm, and splits
K, by the row count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm_runtime.layers import fused_triton
from radixlm_runtime.layers.linear import Linear

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Sums of ~100 products of magnitude ~1: float32 differs from torch by summation order only; the
# interpreter rounds bf16 toward zero, a few ulps at these magnitudes.
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 0.3, "rtol": 4e-2},
}


def _operands(
    m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, k + 5, generator=gen)[:, 2 : 2 + k]  # rows with a stride, like a fused slice
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    return wide.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 48), (5, 100, 130), (70, 96, 64), (3, 600, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(
    test_device: torch.device, dtype: torch.dtype, m: int, k: int, n: int, with_bias: bool
) -> None:
    x, weight, bias = _operands(m, k, n, dtype, test_device)
    b = bias if with_bias else None
    got = fused_triton.invariant_linear(x, weight, b)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(dtype)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_its_batch(test_device: torch.device, dtype: torch.dtype) -> None:
    x, weight, bias = _operands(70, 96, 80, dtype, test_device, seed=1)
    others, _, _ = _operands(40, 96, 80, dtype, test_device, seed=2)
    full = fused_triton.invariant_linear(x, weight, bias)
    for i in (0, 31, 32, 69):  # first, last of a tile, first of the next, last
        alone = fused_triton.invariant_linear(x[i : i + 1], weight, bias)
        mixed = fused_triton.invariant_linear(torch.cat([others[:3], x[i : i + 1], others]), weight, bias)
        assert torch.equal(alone[0], full[i])
        assert torch.equal(mixed[3], full[i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_spans_of_k_give_the_same_bits_in_one_program_or_split(
    test_device: torch.device, dtype: torch.dtype
) -> None:
    """K of three spans (256, 256, 88): summed in one program per tile or by the split pair, each
    row's bits are the same, alone or among others; by default a few tiles take the split pair."""
    k = 2 * fused_triton.INVARIANT_SPLIT_K + 88
    x, weight, bias = _operands(70, k, 80, dtype, test_device, seed=3)
    whole = fused_triton.invariant_linear(x, weight, bias, split=False)
    assert torch.equal(fused_triton.invariant_linear(x, weight, bias, split=True), whole)
    for i in (0, 33, 69):
        for split in (None, True, False):
            alone = fused_triton.invariant_linear(x[i : i + 1], weight, bias, split=split)
            assert torch.equal(alone[0], whole[i])
    want = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
    torch.testing.assert_close(whole, want, **{key: 2 * tol for key, tol in TOL[dtype].items()})


def test_rejects_what_it_cannot_multiply(test_device: torch.device) -> None:
    x, weight, bias = _operands(3, 16, 8, torch.float32, test_device)
    with pytest.raises(ValueError, match="weight"):
        fused_triton.invariant_linear(x, weight[:, :8])
    with pytest.raises(ValueError, match="bias"):
        fused_triton.invariant_linear(x, weight, bias[:4])
    with pytest.raises(ValueError, match="dtype"):
        fused_triton.invariant_linear(x, weight.double())
    assert fused_triton.invariant_linear(x[:0], weight).shape == (0, 8)


def test_linear_runs_on_it_when_asked(test_device: torch.device) -> None:
    torch.manual_seed(0)
    layer = Linear(48, 40).to(test_device)
    x = torch.randn(7, 48, device=test_device)
    layer.invariant_matmul = True
    assert torch.equal(layer(x), fused_triton.invariant_linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL[torch.float32])
