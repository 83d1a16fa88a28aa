"""The fused CPU kernels (layers/fused_cpu.cpp) against the layers' torch reference paths, on both the
AVX2 path and the forced portable path, with sizes that leave vector tails and rows read through a
stride (a fused projection's q/k columns)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixlm_runtime.layers import fused_cpu
from radixlm_runtime.layers.activation import GeluAndMul, SiluAndMul
from radixlm_runtime.layers.norm import RMSNorm
from radixlm_runtime.layers.rotary import RotaryEmbedding, build_rotary

MODES = [fused_cpu.SCALAR, fused_cpu.SIMD]
TOL = {"atol": 2e-6, "rtol": 2e-5}


@pytest.fixture(autouse=True)
def built() -> None:
    assert fused_cpu.supports(torch.zeros(1, 1)), "the fused CPU ops must build where tests run"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows, hidden", [(1, 576), (5, 37), (300, 96)])
def test_rms_norm_with_and_without_residual(mode: int, rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(hidden, eps=1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    want_out, want_stream = norm.reference(x.clone(), residual.clone())
    stream = residual.clone()
    torch.testing.assert_close(fused_cpu.rms_norm(x, norm.weight, 1e-5, stream, mode=mode), want_out, **TOL)
    torch.testing.assert_close(stream, want_stream)
    torch.testing.assert_close(fused_cpu.rms_norm(x, norm.weight, 1e-5, mode=mode), norm.reference(x), **TOL)


def test_rms_norm_reads_strided_rows() -> None:
    norm = RMSNorm(40, eps=1e-6)
    wide = torch.randn(6, 64)
    torch.testing.assert_close(
        fused_cpu.rms_norm(wide[:, :40], norm.weight, 1e-6), norm.reference(wide[:, :40])
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head_dim", [64, 20])
def test_rope_rotates_q_and_k_inside_the_fused_projection(mode: int, head_dim: int) -> None:
    torch.manual_seed(head_dim)
    rotary = build_rotary(None, head_dim=head_dim, theta=10000.0, scaling=None, max_positions=512)
    positions = torch.tensor([0, 1, 7, 300, 511, 42, 42])
    cos, sin = rotary.cos_sin(positions)
    qkv = torch.randn(len(positions), (9 + 2 * 3) * head_dim)
    q, k, v = qkv.clone().split([9 * head_dim, 3 * head_dim, 3 * head_dim], dim=-1)
    want_q, want_k = RotaryEmbedding.apply((cos, sin), q.reshape(-1, 9, head_dim), k.reshape(-1, 3, head_dim))
    fused_cpu.rope_(qkv, cos.squeeze(1), sin.squeeze(1), 9 + 3, head_dim, mode=mode)
    torch.testing.assert_close(qkv[:, : 9 * head_dim].view(-1, 9, head_dim), want_q, **TOL)
    torch.testing.assert_close(qkv[:, 9 * head_dim : 12 * head_dim].view(-1, 3, head_dim), want_k, **TOL)
    torch.testing.assert_close(qkv[:, 12 * head_dim :], v)  # v is not rotated


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (9, 13), (64, 200)])
def test_silu_and_mul(mode: int, rows: int, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    # Gates over the range where exp over/underflows too.
    x = torch.randn(rows, 2 * inter, generator=gen) * 30
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused_cpu.silu_and_mul(x, mode=mode), F.silu(gate) * up, **TOL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows, inter", [(1, 2048), (9, 13), (64, 200)])
def test_gelu_tanh_and_mul(mode: int, rows: int, inter: int) -> None:
    """Against float64 GeGLU: float32 torch's 1 + tanh cancels to 0 for gates below about -5, where the
    kernel's sigmoid form keeps the (tiny) value."""
    gen = torch.Generator().manual_seed(inter)
    # Gates over the range where exp over/underflows too.
    x = torch.randn(rows, 2 * inter, generator=gen) * 30
    gate, up = x.double().chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") * up).float()
    torch.testing.assert_close(fused_cpu.gelu_tanh_and_mul(x, mode=mode), want, **TOL)
    torch.testing.assert_close(GeluAndMul.reference(x), want, atol=1e-4, rtol=2e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head_dim", [256, 20])
def test_head_rms_norm_normalizes_q_and_k_heads_in_place(mode: int, head_dim: int) -> None:
    """Each q head by the q norm's weight, each k head by the k norm's, v untouched: as the layer's
    RMSNorms do over the heads reshaped to rows (Qwen3's and Gemma 3's q/k norms)."""
    gen = torch.Generator().manual_seed(head_dim)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    q_norm.weight.data = torch.randn(head_dim, generator=gen)
    k_norm.weight.data = torch.randn(head_dim, generator=gen)
    qkv = torch.randn(5, (4 + 2 * 1) * head_dim, generator=gen)
    q, k, v = qkv.clone().split([4 * head_dim, head_dim, head_dim], dim=-1)
    fused_cpu.head_rms_norm_(qkv, q_norm.weight, k_norm.weight, 4, 1, head_dim, 1e-6, mode=mode)
    torch.testing.assert_close(
        qkv[:, : 4 * head_dim], q_norm.reference(q.reshape(-1, head_dim)).view(5, -1), **TOL
    )
    torch.testing.assert_close(qkv[:, 4 * head_dim : 5 * head_dim], k_norm.reference(k), **TOL)
    torch.testing.assert_close(qkv[:, 5 * head_dim :], v)


def test_layers_dispatch_to_the_fused_path_only_for_float32_cpu_rows() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 2 * 16)
    for act in (SiluAndMul(), GeluAndMul()):
        torch.testing.assert_close(act(x), act.reference(x.clone()), **TOL)
        # bfloat16 takes the torch path (the kernels are float32 only) and still computes the activation.
        xb = x.bfloat16()
        assert not fused_cpu.supports(xb)
        torch.testing.assert_close(act(xb).float(), act.reference(x.clone()), atol=5e-2, rtol=5e-2)
    rotary = build_rotary(None, head_dim=8, theta=10000.0, scaling=None, max_positions=16)
    cs = rotary.cos_sin(torch.tensor([3, 4, 5]))
    qkv = torch.randn(3, (2 + 2 * 1) * 8)
    want_q, want_k = RotaryEmbedding.apply(cs, qkv[:, :16].reshape(3, 2, 8), qkv[:, 16:24].reshape(3, 1, 8))
    q, k, v = RotaryEmbedding.split_qkv(cs, qkv.clone(), 2, 1, 8)
    torch.testing.assert_close(q, want_q, **TOL)
    torch.testing.assert_close(k, want_k, **TOL)
    torch.testing.assert_close(v, qkv[:, 24:].view(3, 1, 8))


def test_simd_path_is_chosen_by_asking_the_cpu() -> None:
    flags = Path("/proc/cpuinfo").read_text().split()
    assert fused_cpu.has_simd() == ("avx2" in flags and "fma" in flags)
