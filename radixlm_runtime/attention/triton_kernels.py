"""Triton attention kernels that read K/V straight from the paged KV pool.

Both kernels gather keys/values through ``req_to_token`` (one KV slot id per token position), so
requests with a shared radix-cache prefix never have their K/V copied into a contiguous buffer.
Softmax is computed online in fp32 whatever the storage dtype; results are cast to ``o.dtype``.

Quantized pools (--kv-cache-dtype) are read directly: an int8 pool's codes are loaded with their
per-(slot, kv head) float32 scales (``k_scale`` / ``v_scale``, [slots, Hkv]) and dequantized per KV
block in registers (code x scale in fp32, then the queries' dtype for tl.dot); a float8_e4m3fn pool's
values are cast the same way, without a scale. No dequantized copy of the pool is made.

Per-layer features are constexpr switches (a plain layer compiles to the same code as without them)
with their values as runtime scalars: a sliding window W (a query at position p sees keys
p - W < j <= p; KV blocks wholly before a block's window are never read) and a logit soft-cap
(scores s become cap * tanh(s / cap) before the softmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm_runtime.kernels.triton_dot import dot_dtype
from radixlm_runtime.kvcache.pool import QUANTIZED_KV_DTYPES

# Finite stand-in for -inf as the running max: keeps ``exp(m_old - m_new)`` at 0 instead of NaN
# for rows that have not seen an unmasked key yet (padding rows, padding heads).
_NEG_LARGE = tl.constexpr(-1.0e30)

# tl.dot lower bound on the M/N dims (tensor-core tiles need >= 16 rows/cols).
_MIN_DOT = 16


def _block_d(head_dim: int) -> int:
    """Padded power-of-two head dim; the tail lanes are masked in the kernels."""
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
    return max(_MIN_DOT, triton.next_power_of_2(head_dim))


def _kv_args(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kernel: object,
) -> dict[str, object]:
    """The pool's scale tensors (an int8 pool's; k_buffer stands in where there are none, never read)
    and the tl.dot dtype: the pool's, or the queries' for a quantized pool."""
    if (k_buffer.dtype == torch.int8) != (k_scale is not None and v_scale is not None):
        raise ValueError("an int8 KV pool is read with its k_scale and v_scale, and only an int8 pool")
    quantized = k_buffer.dtype in QUANTIZED_KV_DTYPES
    return {
        "K_Scale": k_buffer if k_scale is None else k_scale,
        "V_Scale": k_buffer if v_scale is None else v_scale,
        "stride_scale": 0 if k_scale is None else k_scale.stride(0),
        "KV_SCALED": k_scale is not None,
        "DOT_DTYPE": dot_dtype(q.dtype if quantized else k_buffer.dtype, kernel),
    }


def _layer_args(sliding_window: int | None, logit_softcap: float | None) -> dict[str, object]:
    """A layer's window / soft-cap as kernel arguments: flags that compile the feature in, values
    that stay runtime scalars (placeholders where the flag is off)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"logit_softcap must be > 0, got {logit_softcap}")
    return {
        "window": sliding_window or 0,
        "softcap": logit_softcap or 1.0,
        "HAS_WINDOW": sliding_window is not None,
        "HAS_SOFTCAP": logit_softcap is not None,
    }


@triton.jit
def _tanh(x):
    """tanh through the sigmoid (not every Triton version has tl tanh): exp(-2x) overflowing to inf
    for large negative x gives -1 exactly, never NaN."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attend_kv_block(
    acc,
    m_i,
    l_i,
    q,
    kv_pos,
    mask_n,
    visible,
    Req_to_token,
    req_row,
    K_Buffer,
    V_Buffer,
    K_Scale,
    V_Scale,
    kv_head,
    stride_kbs,
    stride_kh,
    stride_vbs,
    stride_vh,
    stride_scale,
    offs_d,
    mask_d,
    sm_scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    KV_SCALED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """One online-softmax step of both kernels: the query rows ``q`` against the keys at positions
    ``kv_pos`` (``mask_n``: the ones in range, read; ``visible``: the ones each row sees). Returns
    the updated (acc, m_i, l_i); rows that have seen no visible key yet keep m_i at _NEG_LARGE.
    KV_SCALED: the block's int8 codes times their slots' scales, in fp32, before the cast."""
    slots = tl.load(Req_to_token + req_row + kv_pos, mask=mask_n, other=0)
    k_ptrs = K_Buffer + slots[None, :] * stride_kbs + kv_head * stride_kh + offs_d[:, None]
    k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
    if KV_SCALED:
        k_scale = tl.load(K_Scale + slots * stride_scale + kv_head, mask=mask_n, other=0.0)
        k = k.to(tl.float32) * k_scale[None, :]
    k = k.to(DOT_DTYPE)
    # "ieee" only changes fp32 inputs (no TF32 truncation); fp16/bf16 ignore it.
    qk = tl.dot(q, k, input_precision="ieee")
    qk = softcap * _tanh(qk * (sm_scale / softcap)) if HAS_SOFTCAP else qk * sm_scale
    qk = tl.where(visible, qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v_ptrs = V_Buffer + slots[:, None] * stride_vbs + kv_head * stride_vh + offs_d[None, :]
    v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    if KV_SCALED:
        v_scale = tl.load(V_Scale + slots * stride_scale + kv_head, mask=mask_n, other=0.0)
        v = v.to(tl.float32) * v_scale[:, None]
    v = v.to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _decode_splits(seq_len, window, HAS_WINDOW: tl.constexpr, NUM_KV_SPLITS: tl.constexpr):
    """(first key position, split length) of a decode over ``seq_len`` keys: the splits cover only
    the window, so none is spent on keys it hides. Shared by the split and the merge kernel."""
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - window, 0)
    return kv_start, tl.cdiv(seq_len - kv_start, NUM_KV_SPLITS)


@triton.jit
def _extend_fwd_kernel(
    Q,
    Out,
    K_Buffer,
    V_Buffer,
    K_Scale,
    V_Scale,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Extend_lens,
    Extend_start_loc,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kh,
    stride_vbs,
    stride_vh,
    stride_scale,
    stride_req,
    window,
    softcap,
    HEAD_DIM: tl.constexpr,
    KV_GROUP: tl.constexpr,
    KV_SCALED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one block of BLOCK_M new tokens of one request, for one query head."""
    cur_b = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_block = tl.program_id(2)
    cur_kv_head = cur_head // KV_GROUP

    extend_len = tl.load(Extend_lens + cur_b)
    block_start = cur_block * BLOCK_M
    if block_start < extend_len:
        seq_len = tl.load(Seq_lens + cur_b)
        prefix_len = seq_len - extend_len
        q_start = tl.load(Extend_start_loc + cur_b)
        req_row = tl.load(Req_pool_indices + cur_b) * stride_req

        offs_m = block_start + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < extend_len
        mask_d = offs_d < HEAD_DIM
        q_pos = prefix_len + offs_m

        q_ptrs = Q + (q_start + offs_m)[:, None] * stride_qt + cur_head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

        m_i = tl.full([BLOCK_M], _NEG_LARGE, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # Keys past the last query of this block are causally invisible to every row: stop there.
        kv_end = tl.minimum(seq_len, prefix_len + tl.minimum(block_start + BLOCK_M, extend_len))
        # Keys before the first row's window are hidden from every row: start there.
        kv_start = 0
        if HAS_WINDOW:
            kv_start = tl.maximum(prefix_len + block_start - window + 1, 0)
        for start_n in range(kv_start, kv_end, BLOCK_N):
            kv_pos = start_n + offs_n
            mask_n = kv_pos < kv_end
            visible = (kv_pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
            if HAS_WINDOW:
                visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
            acc, m_i, l_i = _attend_kv_block(
                acc,
                m_i,
                l_i,
                q,
                kv_pos,
                mask_n,
                visible,
                Req_to_token,
                req_row,
                K_Buffer,
                V_Buffer,
                K_Scale,
                V_Scale,
                cur_kv_head,
                stride_kbs,
                stride_kh,
                stride_vbs,
                stride_vh,
                stride_scale,
                offs_d,
                mask_d,
                sm_scale,
                softcap,
                HAS_SOFTCAP,
                KV_SCALED,
                DOT_DTYPE,
            )

        # Padding rows have l_i == 0; guard the divide so they hold finite junk that is never stored.
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = Out + (q_start + offs_m)[:, None] * stride_ot + cur_head * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Causal prefill/extend attention over cached prefix + new tokens; writes ``o`` in place. An int8
    pool is read with its scales (``k_scale`` / ``v_scale``).

    ``q``/``o`` are ``[T, num_q_heads, D]`` (new tokens of all requests, concatenated); request b's
    i-th new token sits at position ``seq_lens[b] - extend_lens[b] + i`` and sees positions up to it
    (the last ``sliding_window`` of them when set).
    """
    batch = seq_lens.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    if batch == 0 or max_extend_len == 0:
        return
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and o.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    assert req_to_token.stride(1) == 1

    block_d = _block_d(head_dim)
    # Smaller tiles for big heads keep the Q/K/V/acc tiles within shared memory and registers.
    block_m = 64 if block_d <= 128 else 32
    block_n = 64 if block_d <= 64 else 32
    grid = (batch, num_q_heads, triton.cdiv(max_extend_len, block_m))
    kv = _kv_args(q, k_buffer, k_scale, v_scale, _extend_fwd_kernel)
    _extend_fwd_kernel[grid](
        q,
        o,
        k_buffer,
        v_buffer,
        kv.pop("K_Scale"),
        kv.pop("V_Scale"),
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        extend_start_loc,
        sm_scale,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        kv.pop("stride_scale"),
        req_to_token.stride(0),
        **_layer_args(sliding_window, logit_softcap),
        **kv,
        HEAD_DIM=head_dim,
        KV_GROUP=num_q_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4 if block_d <= 64 else 8,
        num_stages=1,
    )


@triton.jit
def _decode_split_kernel(
    Q,
    K_Buffer,
    V_Buffer,
    K_Scale,
    V_Scale,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Mid_O,
    Mid_LSE,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kh,
    stride_vbs,
    stride_vh,
    stride_scale,
    stride_req,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    stride_mid_lb,
    stride_mid_lh,
    window,
    softcap,
    HEAD_DIM: tl.constexpr,
    KV_GROUP: tl.constexpr,
    KV_SCALED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one KV split of one request, for all query heads sharing one KV head.

    Stores the split's normalised partial output and its log-sum-exp; empty splits store nothing
    (the merge kernel recomputes which splits are empty from ``seq_lens`` and the window).
    """
    cur_b = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    cur_split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + cur_b)
    kv_start, split_len = _decode_splits(seq_len, window, HAS_WINDOW, NUM_KV_SPLITS)
    split_start = kv_start + cur_split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    if split_start < split_end:
        req_row = tl.load(Req_pool_indices + cur_b) * stride_req
        offs_h = tl.arange(0, BLOCK_H)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_h = offs_h < KV_GROUP
        mask_d = offs_d < HEAD_DIM
        heads = cur_kv_head * KV_GROUP + offs_h

        q_ptrs = Q + cur_b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0).to(DOT_DTYPE)

        m_i = tl.full([BLOCK_H], _NEG_LARGE, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for start_n in range(split_start, split_end, BLOCK_N):
            kv_pos = start_n + offs_n
            mask_n = kv_pos < split_end
            # The split lies inside the window: every key in range is visible to every head.
            acc, m_i, l_i = _attend_kv_block(
                acc,
                m_i,
                l_i,
                q,
                kv_pos,
                mask_n,
                mask_n[None, :],
                Req_to_token,
                req_row,
                K_Buffer,
                V_Buffer,
                K_Scale,
                V_Scale,
                cur_kv_head,
                stride_kbs,
                stride_kh,
                stride_vbs,
                stride_vh,
                stride_scale,
                offs_d,
                mask_d,
                sm_scale,
                softcap,
                HAS_SOFTCAP,
                KV_SCALED,
                DOT_DTYPE,
            )

        # A non-empty split has >= 1 visible key per head, so l_i > 0 on every stored row.
        mid_o_ptrs = (
            Mid_O
            + cur_b * stride_mid_ob
            + heads[:, None] * stride_mid_oh
            + cur_split * stride_mid_os
            + offs_d[None, :]
        )
        tl.store(mid_o_ptrs, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        lse_ptrs = Mid_LSE + cur_b * stride_mid_lb + heads * stride_mid_lh + cur_split
        tl.store(lse_ptrs, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    Mid_O,
    Mid_LSE,
    Out,
    Seq_lens,
    stride_mid_ob,
    stride_mid_oh,
    stride_mid_os,
    stride_mid_lb,
    stride_mid_lh,
    stride_ob,
    stride_oh,
    window,
    HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one (request, query head): LSE-weighted sum of the non-empty splits."""
    cur_b = tl.program_id(0)
    cur_head = tl.program_id(1)

    seq_len = tl.load(Seq_lens + cur_b)
    kv_start, split_len = _decode_splits(seq_len, window, HAS_WINDOW, NUM_KV_SPLITS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = (offs_s < NUM_KV_SPLITS) & (kv_start + offs_s * split_len < seq_len)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(
        Mid_LSE + cur_b * stride_mid_lb + cur_head * stride_mid_lh + offs_s, mask=mask_s, other=float("-inf")
    )
    part_ptrs = (
        Mid_O
        + cur_b * stride_mid_ob
        + cur_head * stride_mid_oh
        + offs_s[:, None] * stride_mid_os
        + offs_d[None, :]
    )
    part = tl.load(part_ptrs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)

    # Split 0 is never empty (seq_len >= 1), so the max is finite and weights sum to >= 1.
    weight = tl.exp(lse - tl.max(lse, 0))
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    o_ptrs = Out + cur_b * stride_ob + cur_head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 8,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Single-token decode attention over all ``seq_lens[b]`` cached positions (the last
    ``sliding_window`` of them when set); writes ``o``. An int8 pool is read with its scales
    (``k_scale`` / ``v_scale``).

    Split-K ("flash decoding"): the KV range of each request is cut into ``num_kv_splits`` chunks
    processed in parallel, so small batches with long contexts still fill the GPU; a second kernel
    merges the partial results. Each program handles a whole GQA group so K/V is read once per group.
    """
    batch = q.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    if batch == 0:
        return
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert num_kv_splits >= 1
    assert q.stride(2) == 1 and o.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1
    assert req_to_token.stride(1) == 1

    kv_group = num_q_heads // num_kv_heads
    block_d = _block_d(head_dim)
    block_n = 64 if block_d <= 128 else 32
    mid_o = torch.empty((batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    layer = _layer_args(sliding_window, logit_softcap)
    kv = _kv_args(q, k_buffer, k_scale, v_scale, _extend_fwd_kernel)

    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        kv.pop("K_Scale"),
        kv.pop("V_Scale"),
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        kv.pop("stride_scale"),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        **layer,
        **kv,
        HEAD_DIM=head_dim,
        KV_GROUP=kv_group,
        NUM_KV_SPLITS=num_kv_splits,
        BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(kv_group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4,
        num_stages=2,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o,
        mid_lse,
        o,
        seq_lens,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        layer["window"],
        HEAD_DIM=head_dim,
        HAS_WINDOW=layer["HAS_WINDOW"],
        NUM_KV_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_D=block_d,
        num_warps=4,
    )
