"""Triton extend/decode attention kernels on the test device vs. a plain torch reference on the CPU:
natively on a GPU under RADIXLM_TEST_DEVICE=cuda, otherwise under the Triton interpreter
(tests/device_helpers.py switches it on for the whole session, before any Triton import)."""

from dataclasses import dataclass, fields, replace

import pytest
import torch
from device_helpers import TEST_DEVICE, tolerance

from radixlm_runtime.attention import triton_kernels
from radixlm_runtime.kvcache.pool import dequantize_int8, quantize_int8

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


def run_extend(batch: Batch, **scales: torch.Tensor) -> torch.Tensor:
    """`scales`: an int8 pool's k_scale and v_scale."""
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
        **scales,
    )
    return o


def run_decode(batch: Batch, num_kv_splits: int, **scales: torch.Tensor) -> torch.Tensor:
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
        **scales,
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


# ---------------------------------------------------------------- quantized pools


def int8_batch(batch: Batch) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """The batch over an int8 pool (KVPool.set_kv's quantize_int8) and its K and V scales, the unused
    slots' scales NaN to catch stray reads."""
    cpu = batch.to("cpu")
    unused = cpu.k_buffer[:, 0, 0].isnan()
    k, k_scale = quantize_int8(torch.nan_to_num(cpu.k_buffer))
    v, v_scale = quantize_int8(torch.nan_to_num(cpu.v_buffer))
    k_scale[unused] = v_scale[unused] = float("nan")
    device = batch.q.device
    return (
        replace(batch, k_buffer=k.to(device), v_buffer=v.to(device)),
        k_scale.to(device),
        v_scale.to(device),
    )


def int8_reference(batch: Batch, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """The reference over the float32 pool of the int8 pool's dequantized values."""
    k = dequantize_int8(batch.k_buffer.cpu(), k_scale.cpu(), torch.float32)
    v = dequantize_int8(batch.v_buffer.cpu(), v_scale.cpu(), torch.float32)
    return reference_attention(replace(batch.to("cpu"), k_buffer=k, v_buffer=v))


@pytest.mark.parametrize("head_dim", [64, 40])
def test_extend_reads_an_int8_pool(head_dim: int) -> None:
    """Extends over a cached prefix and fresh prompts, K/V int8 codes dequantized per block with their
    slots' scales: the attention of the dequantized pool (and within the quantization's error of the
    unquantized one)."""
    batch = make_batch([0, 37, 70], [20, 5, 66], head_dim=head_dim, seed=3)
    int8, k_scale, v_scale = int8_batch(batch)
    o = run_extend(int8, k_scale=k_scale, v_scale=v_scale)
    atol, rtol = tolerance(o.dtype)
    torch.testing.assert_close(o.cpu(), int8_reference(int8, k_scale, v_scale), atol=atol, rtol=rtol)
    torch.testing.assert_close(o.cpu(), reference_attention(batch), atol=0.05, rtol=0)


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_decode_reads_an_int8_pool(num_kv_splits: int) -> None:
    """Decodes over sequences shorter and longer than a KV block, split or not: the attention of the
    dequantized pool."""
    batch = make_batch([0, 63, 130], [1, 1, 1], seed=4)
    int8, k_scale, v_scale = int8_batch(batch)
    o = run_decode(int8, num_kv_splits, k_scale=k_scale, v_scale=v_scale)
    atol, rtol = tolerance(o.dtype)
    torch.testing.assert_close(o.cpu(), int8_reference(int8, k_scale, v_scale), atol=atol, rtol=rtol)


def test_an_int8_pool_needs_its_scales() -> None:
    batch = make_batch([0], [4], seed=5)
    int8, _, _ = int8_batch(batch)
    with pytest.raises(ValueError, match="int8 KV pool is read with its k_scale and v_scale"):
        run_decode(int8, num_kv_splits=1)
