"""The elementwise layers write in place or into preallocated halves to save passes over the
activations; each must still equal the textbook formula (as transformers writes it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm_runtime.layers.activation import SiluAndMul
from radixlm_runtime.layers.norm import RMSNorm
from radixlm_runtime.layers.rotary import RotaryEmbedding, build_rotary


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_the_reference_formula(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rotary = build_rotary(None, head_dim=64, theta=10000.0, scaling=None, max_positions=512)
    positions = torch.tensor([0, 1, 7, 300, 511])
    q = torch.randn(5, 9, 64, dtype=dtype)
    k = torch.randn(5, 3, 64, dtype=dtype)
    rq, rk = RotaryEmbedding.apply(rotary.cos_sin(positions), q, k)
    cos = torch.cat([rotary.cos_cache[positions]] * 2, dim=-1).unsqueeze(1)
    sin = torch.cat([rotary.sin_cache[positions]] * 2, dim=-1).unsqueeze(1)
    for got, x in ((rq, q), (rk, k)):
        want = x.float() * cos + _rotate_half(x.float()) * sin
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # Position 0 is the identity rotation.
    torch.testing.assert_close(rq[0], q[0])


def test_silu_and_mul_matches_the_reference_formula() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 2 * 48)
    gate, up = x.clone().chunk(2, dim=-1)
    out = SiluAndMul()(x)
    assert out.shape == (7, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.silu(gate) * up)


def test_rmsnorm_adds_the_residual_and_returns_the_new_stream() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6)
    norm.weight.data.normal_()
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    stream = x + residual
    want = norm.weight * stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-6)
    out, new_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(new_residual, stream)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(norm(stream), want)
