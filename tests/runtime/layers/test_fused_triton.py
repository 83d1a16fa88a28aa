"""The Triton elementwise kernels must equal the layers' torch reference paths, and the layers must
take them for CUDA tensors only.

The kernels run on the test device: natively on a GPU under RADIXLM_TEST_DEVICE=cuda, otherwise under
the Triton interpreter (tests/device_helpers.py sets TRITON_INTERPRET) on CPU tensors, so the wrappers
are called directly here, bypassing `supports`, which is CUDA-only.
The interpreter keeps bf16 as raw bits and rounds float32 -> bf16 casts toward zero where torch (and
the GPU) round to nearest, so its bf16 results may sit one bf16 ulp per rounding away from the
reference: the bf16 tolerance allows a few ulps, far below what a wrong formula or index gives.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from device_helpers import TEST_DEVICE

from radixlm_runtime.kvcache.pool import KVPool
from radixlm_runtime.layers import fused_triton
from radixlm_runtime.layers.activation import SiluAndMul
from radixlm_runtime.layers.norm import RMSNorm
from radixlm_runtime.layers.rotary import RotaryEmbedding, build_rotary

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 3e-2},
}
WRAPPERS = ("rms_norm", "rope_", "silu_and_mul", "store_kv")


@pytest.fixture
def device(test_device: torch.device) -> str:
    """The test device by name, as the helpers below take it."""
    return test_device.type


def _randn(*shape: int, dtype: torch.dtype, device: str, pad: int = 0) -> torch.Tensor:
    """Random rows; with pad, the columns [pad, pad + last) of a wider tensor (rows with a stride)."""
    base = torch.randn(*shape[:-1], shape[-1] + 2 * pad, device=device).to(dtype)
    return base[..., pad : pad + shape[-1]]


def _assert_close(got: torch.Tensor, want: torch.Tensor, rounded_to: torch.dtype | None = None) -> None:
    """Close within the tolerance of `rounded_to`, the narrowest dtype the values were rounded to on
    the way (want's dtype if not given)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[rounded_to or want.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [37, 64])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_rms_norm_matches_the_reference(
    device: str, dtype: torch.dtype, hidden: int, with_residual: bool, fp32_weight: bool
) -> None:
    torch.manual_seed(0)
    # A large eps, so that where it enters the formula shows.
    norm = RMSNorm(hidden, eps=0.1).to(device=device, dtype=torch.float32 if fp32_weight else dtype)
    norm.weight.data.normal_()
    x = _randn(5, hidden, dtype=dtype, device=device, pad=3)
    residual = _randn(5, hidden, dtype=dtype, device=device) if with_residual else None
    want = norm.reference(x.clone(), None if residual is None else residual.clone())
    got_residual = None if residual is None else residual.clone()
    got = fused_triton.rms_norm(x, norm.weight, norm.eps, got_residual)
    if with_residual:
        want, want_residual = want
        _assert_close(got_residual, want_residual)  # the stream, updated in place
    # With a float32 weight the output is float32, but the normalised row is rounded to dtype first.
    _assert_close(got, want, rounded_to=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (9, 3, 20), (4, 4, 32)])
def test_rope_matches_split_qkv_reference(
    device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(0)
    rotary = build_rotary(
        None, head_dim=head_dim, theta=10000.0, scaling=None, max_positions=4096, device=device
    )
    positions = torch.tensor([0, 1, 7, 300, 4095], device=device)
    cos_sin = rotary.cos_sin(positions)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    wide = torch.randn(len(positions), width + 10, device=device).to(dtype)
    qkv = wide[:, 5 : 5 + width]
    before = wide.clone()
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q_ref, k_ref = RotaryEmbedding.apply(
        cos_sin, q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim)
    )
    cos, sin = cos_sin
    fused_triton.rope_(qkv, cos.squeeze(1), sin.squeeze(1), num_heads + num_kv_heads, head_dim)
    _assert_close(q.reshape(q_ref.shape), q_ref)
    _assert_close(k.reshape(k_ref.shape), k_ref)
    # v and the columns around qkv are untouched; position 0 is the identity rotation.
    assert torch.equal(v, before[:, 5 : 5 + width][:, -v.shape[1] :])
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(
        wide[:, 5 + width :], before[:, 5 + width :]
    )
    assert torch.equal(wide[0], before[0])


def test_rope_rejects_mismatched_tables(device: str) -> None:
    qkv = torch.zeros(3, 5 * 8, device=device)
    with pytest.raises(ValueError, match="cos/sin"):
        fused_triton.rope_(qkv, torch.zeros(2, 4, device=device), torch.zeros(2, 4, device=device), 4, 8)
    with pytest.raises(ValueError, match="do not fit"):
        fused_triton.rope_(qkv, torch.zeros(3, 4, device=device), torch.zeros(3, 4, device=device), 6, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [45, 1500])
def test_silu_and_mul_matches_the_reference(device: str, dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(0)
    gate_up = _randn(3, 2 * inter, dtype=dtype, device=device, pad=2)
    want = SiluAndMul.reference(gate_up.clone())
    got = fused_triton.silu_and_mul(gate_up)
    assert got.is_contiguous()
    _assert_close(got, want)


def _pools(device: str, dtype: torch.dtype) -> tuple[KVPool, KVPool]:
    """Two pools with the same random contents: one for the reference path (CPU), one for the kernel."""
    ref = KVPool(16, num_layers=2, num_kv_heads=3, head_dim=20, dtype=dtype, device="cpu")
    pool = KVPool(16, num_layers=2, num_kv_heads=3, head_dim=20, dtype=dtype, device=device)
    for bufs, ref_bufs in ((pool.k_buffers, ref.k_buffers), (pool.v_buffers, ref.v_buffers)):
        for buf, ref_buf in zip(bufs, ref_bufs):
            ref_buf.copy_(torch.randn(ref_buf.shape))
            buf.copy_(ref_buf)
    return ref, pool


@pytest.mark.parametrize("pool_dtype", DTYPES)
def test_store_kv_matches_set_kv(device: str, pool_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ref, pool = _pools(device, pool_dtype)
    # k a strided view of a fused projection's output (as split_qkv returns it), v contiguous, float32.
    k = torch.randn(4, 2 * 3 * 20 + 7)[:, 7 : 7 + 60].view(4, 3, 20)
    v = torch.randn(4, 3, 20)
    loc = torch.tensor([9, 2, 15, 5])
    ref.set_kv(1, loc, k, v)
    fused_triton.store_kv(pool.k_buffers[1], pool.v_buffers[1], loc.to(device), k.to(device), v.to(device))
    for got, want in zip(pool.k_buffers + pool.v_buffers, ref.k_buffers + ref.v_buffers):
        got = got.cpu()
        untouched = torch.ones(len(want), dtype=torch.bool)
        untouched[loc] = False
        assert torch.equal(got[untouched], want[untouched])  # the other slots and layer 0
        _assert_close(got[loc], want[loc])


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts calls of the Triton wrappers the layers make."""
    calls: Counter[str] = Counter()

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in WRAPPERS:
        monkeypatch.setattr(fused_triton, name, spy(name, getattr(fused_triton, name)))
    return calls


def _run_layers(device: str, dtype: torch.dtype) -> None:
    """Each dispatching layer on device, checked against its reference path."""
    torch.manual_seed(0)
    norm = RMSNorm(37, eps=1e-6).to(device=device, dtype=dtype)
    norm.weight.data.normal_()
    x, residual = _randn(4, 37, dtype=dtype, device=device), _randn(4, 37, dtype=dtype, device=device)
    _assert_close(norm(x), norm.reference(x.clone()))
    want, want_residual = norm.reference(x.clone(), residual.clone())
    got, got_residual = norm(x, residual)
    assert got_residual is residual
    _assert_close(got, want)
    _assert_close(got_residual, want_residual)

    gate_up = _randn(4, 2 * 24, dtype=dtype, device=device)
    _assert_close(SiluAndMul()(gate_up), SiluAndMul.reference(gate_up.clone()))

    rotary = build_rotary(None, head_dim=16, theta=10000.0, scaling=None, max_positions=64, device=device)
    cos_sin = rotary.cos_sin(torch.tensor([0, 3, 9, 63], device=device))
    qkv = _randn(4, (6 + 2 * 2) * 16, dtype=dtype, device=device)
    q_ref, k_ref = RotaryEmbedding.apply(
        cos_sin, qkv[:, :96].reshape(4, 6, 16), qkv[:, 96:128].reshape(4, 2, 16)
    )
    q, k, v = RotaryEmbedding.split_qkv(cos_sin, qkv, 6, 2, 16)
    _assert_close(q, q_ref)
    _assert_close(k, k_ref)

    pool = KVPool(8, num_layers=1, num_kv_heads=2, head_dim=16, dtype=dtype, device=device)
    loc = torch.tensor([3, 1], device=device)
    pool.set_kv(0, loc, k[:2], v[:2])
    assert torch.equal(pool.k_buffers[0][loc], k[:2]) and torch.equal(pool.v_buffers[0][loc], v[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layers_take_the_triton_path(
    device: str, dtype: torch.dtype, spies: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if device == "cpu":
        # No GPU: let the layers take their Triton branch on CPU tensors, under the interpreter.
        monkeypatch.setattr(fused_triton, "supports", lambda x: True)
    _run_layers(device, dtype)
    assert spies == {"rms_norm": 2, "silu_and_mul": 1, "rope_": 1, "store_kv": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_tensors_never_take_the_triton_path(dtype: torch.dtype, spies: Counter[str]) -> None:
    assert not fused_triton.supports(torch.zeros(2, 4, dtype=dtype))
    _run_layers("cpu", dtype)
    assert not spies


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA tensors: runs under RADIXLM_TEST_DEVICE=cuda")
def test_supports_cuda_rows_of_float_dtypes() -> None:
    for dtype in DTYPES:
        assert fused_triton.supports(torch.zeros(2, 4, dtype=dtype, device="cuda"))
    assert not fused_triton.supports(torch.zeros(2, 4, dtype=torch.float64, device="cuda"))
    assert not fused_triton.supports(torch.zeros(4, 2, device="cuda").t())
