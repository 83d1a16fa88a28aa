"""Triton extend/decode attention kernels on the test device vs. a plain torch reference on the CPU:
natively on a GPU under RADIXLM_TEST_DEVICE=cuda, otherwise under the Triton interpreter
(tests/device_helpers.py switches it on for the whole session, before any Triton import)."""

from dataclasses import dataclass, fields

import pytest
import torch
from device_helpers import TEST_DEVICE, tolerance

from radixlm_runtime.attention import triton_kernels

MAX_REQS = 4
MAX_CONTEXT = 160


@dataclass
class Batch:
    """A batch laid out like the runtime does it: paged KV pool + req_to_token indirection."""

    q: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    sm_scale: float

    def to(self, device: str) -> "Batch":
        """The same batch with every tensor on device."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()})


def make_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_q_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Random batch with shuffled, non-contiguous KV slots; unused slots hold NaN to catch stray reads.
    Drawn on the CPU (the same values on every device), then moved to the test device."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    num_used = sum(seq_lens)
    num_slots = 1 + 2 * num_used
    kv_shape = (num_slots, num_kv_heads, head_dim)
    k_buffer = torch.full(kv_shape, float("nan"))
    v_buffer = torch.full(kv_shape, float("nan"))
    # Every other slot (shuffled) is in use, so each request's tokens are scattered over the pool.
    slots = 1 + torch.randperm(num_slots - 1, generator=gen)[:num_used]
    k_buffer[slots] = torch.randn((num_used, num_kv_heads, head_dim), generator=gen)
    v_buffer[slots] = torch.randn((num_used, num_kv_heads, head_dim), generator=gen)

    req_pool_indices = torch.randperm(MAX_REQS, generator=gen)[: len(seq_lens)]
    req_to_token = torch.zeros((MAX_REQS, MAX_CONTEXT), dtype=torch.int64)
    offset = 0
    for req, seq_len in zip(req_pool_indices.tolist(), seq_lens, strict=True):
        req_to_token[req, :seq_len] = slots[offset : offset + seq_len]
        offset += seq_len

    extend = torch.tensor(extend_lens, dtype=torch.int64)
    q = torch.randn((int(extend.sum()), num_q_heads, head_dim), generator=gen)
    return Batch(
        q=q.to(dtype),
        k_buffer=k_buffer.to(dtype),
        v_buffer=v_buffer.to(dtype),
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        extend_lens=extend,
        extend_start_loc=torch.cumsum(extend, 0) - extend,
        sm_scale=head_dim**-0.5,
    ).to(TEST_DEVICE)


def reference_attention(batch: Batch) -> torch.Tensor:
    """fp32 causal attention of each request's new tokens over its whole (prefix + new) KV, on the CPU."""
    batch = batch.to("cpu")
    num_q_heads = batch.q.shape[1]
    group = num_q_heads // batch.k_buffer.shape[1]
    out = torch.empty(batch.q.shape, dtype=torch.float32)
    for b in range(batch.seq_lens.shape[0]):
        seq_len = int(batch.seq_lens[b])
        ext_len = int(batch.extend_lens[b])
        start = int(batch.extend_start_loc[b])
        slots = batch.req_to_token[batch.req_pool_indices[b], :seq_len]
        k = batch.k_buffer[slots].float().repeat_interleave(group, dim=1)
        v = batch.v_buffer[slots].float().repeat_interleave(group, dim=1)
        q = batch.q[start : start + ext_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.sm_scale
        q_pos = seq_len - ext_len + torch.arange(ext_len)
        visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + ext_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def run_extend(batch: Batch) -> torch.Tensor:
    o = torch.full_like(batch.q, float("nan"))
    triton_kernels.extend_attention_fwd(
        batch.q,
        o,
        batch.k_buffer,
        batch.v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.extend_lens,
        batch.extend_start_loc,
        int(batch.extend_lens.max()),
        batch.sm_scale,
    )
    return o


def run_decode(batch: Batch, num_kv_splits: int) -> torch.Tensor:
    o = torch.full_like(batch.q, float("nan"))
    triton_kernels.decode_attention_fwd(
        batch.q,
        o,
        batch.k_buffer,
        batch.v_buffer,
        batch.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.sm_scale,
        num_kv_splits=num_kv_splits,
    )
    return o


def assert_close(out: torch.Tensor, batch: Batch) -> None:
    atol, rtol = tolerance(out.dtype)
    torch.testing.assert_close(out.float().cpu(), reference_attention(batch), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "head_dim"),
    [
        pytest.param([0, 0], [70, 9], 64, id="no_prefix_multi_q_block"),
        pytest.param([40, 33, 17], [3, 1, 5], 64, id="long_prefix_short_extend"),
        pytest.param([0, 12, 40], [1, 1, 1], 64, id="extend_len_1"),
        pytest.param([100, 5], [20, 14], 64, id="multi_kv_block"),
        pytest.param([37, 0, 21], [11, 20, 2], 80, id="head_dim_80"),
    ],
)
def test_extend_matches_reference(prefix_lens: list[int], extend_lens: list[int], head_dim: int) -> None:
    batch = make_batch(prefix_lens, extend_lens, head_dim=head_dim)
    assert_close(run_extend(batch), batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_half_precision(dtype: torch.dtype) -> None:
    batch = make_batch([29, 0, 40], [6, 13, 1], dtype=dtype, seed=1)
    out = run_extend(batch)
    assert out.dtype == dtype
    assert_close(out, batch)


def test_extend_strided_q() -> None:
    """q may be a head-slice of a fused qkv projection output, so its token stride is not H*D."""
    batch = make_batch([8, 30], [12, 4], seed=2)
    qkv = torch.randn(batch.q.shape[0], batch.q.shape[1] + 6, batch.q.shape[2], device=batch.q.device)
    qkv[:, : batch.q.shape[1]] = batch.q
    batch.q = qkv[:, : batch.q.shape[1]]
    assert_close(run_extend(batch), batch)


@pytest.mark.parametrize(
    ("seq_lens", "num_kv_splits", "head_dim"),
    [
        pytest.param([3, 5, 1], 8, 64, id="seq_len_below_num_splits"),
        pytest.param([9, 37, 130], 8, 64, id="seq_len_not_block_multiple"),
        pytest.param([150, 65], 1, 64, id="single_split_multi_block"),
        pytest.param([41, 2, 77], 3, 96, id="head_dim_96_odd_splits"),
    ],
)
def test_decode_matches_reference(seq_lens: list[int], num_kv_splits: int, head_dim: int) -> None:
    batch = make_batch([s - 1 for s in seq_lens], [1] * len(seq_lens), head_dim=head_dim)
    assert_close(run_decode(batch, num_kv_splits), batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype: torch.dtype) -> None:
    batch = make_batch([4, 39, 17], [1, 1, 1], dtype=dtype, seed=3)
    out = run_decode(batch, num_kv_splits=4)
    assert out.dtype == dtype
    assert_close(out, batch)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 1)])
def test_decode_gqa_group_sizes(num_q_heads: int, num_kv_heads: int) -> None:
    """MHA (group 1) and MQA (one KV head for all q heads) exercise the padded head block."""
    batch = make_batch([20, 6], [1, 1], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, seed=4)
    assert_close(run_decode(batch, num_kv_splits=8), batch)


def test_decode_agrees_with_single_token_extend() -> None:
    """Under the interpreter the two kernels differ only in float32 summation order; on a GPU each
    may also round its softmax weights to tf32 at other points."""
    batch = make_batch([33, 0, 12], [1, 1, 1], seed=5)
    atol, rtol = (1e-5, 1e-5) if TEST_DEVICE == "cpu" else tolerance(torch.float32)
    torch.testing.assert_close(run_decode(batch, num_kv_splits=8), run_extend(batch), atol=atol, rtol=rtol)
