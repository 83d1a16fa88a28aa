"""The Triton device code of `fused_triton.invariant_linear`: imported on first use, so a process that
never touches a CUDA tensor never loads Triton.

An output element is summed in one order whatever M is: K is cut into SPLIT_K-wide spans, each span
walked in BLOCK_K steps from zeros (float32, fixed tile shapes), and the spans' sums added in order to a
zero. The one-pass kernel does it all in a program per tile (prefill's many tiles fill the GPU); the
split pair computes each span in a program of its own, then adds them (decode's few tiles, each with a
long K walk, would leave most of the GPU idle). Both give the same bits, so a row's result does not
depend on the rows beside it nor on which pair ran (M is not specialised on: one binary serves every M).
"""

import triton
import triton.language as tl


@triton.jit
def _span(
    X,
    W,
    rows,
    cols,
    M,
    N,
    k_start,
    k_end,
    stride_x,
    stride_w,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The (BLOCK_M x BLOCK_N) tile's float32 sum over columns k_start..k_end of K, from zeros."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + ks
        inside = k < k_end
        x_mask = (rows[:, None] < M) & inside[None, :]
        w_mask = (cols[None, :] < N) & inside[:, None]
        x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=x_mask, other=0.0)
        w = tl.load(W + cols[None, :] * stride_w + k[:, None], mask=w_mask, other=0.0)
        # "ieee" keeps float32 operands from being rounded to tf32; fp16/bf16 ignore it.
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision="ieee")
    return acc


@triton.jit
def _finish(B, Y, rows, cols, M, N, stride_y, total, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        total += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], total.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    X,
    W,
    B,
    Y,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Y = X @ W^T (+ B) for X [M, K], W [N, K], one program per tile: every span of K in order."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, K, SPLIT_K):
        s1 = tl.minimum(s0 + SPLIT_K, K)
        total += _span(
            X, W, rows, cols, M, N, s0, s1, stride_x, stride_w, DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K
        )
    _finish(B, Y, rows, cols, M, N, stride_y, total, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _invariant_span_kernel(
    X,
    W,
    P,
    M,
    N,
    K,
    stride_x,
    stride_w,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """P[s] = the tile's sum over span s of K (program_id 2): the first of the split pair."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s0 = tl.program_id(2) * SPLIT_K
    s1 = tl.minimum(s0 + SPLIT_K, K)
    acc = _span(X, W, rows, cols, M, N, s0, s1, stride_x, stride_w, DOT_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(P + tl.program_id(2) * M * N + rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _invariant_sum_kernel(
    P,
    B,
    Y,
    M,
    N,
    SPANS,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Y = the spans' sums added in order to a zero (+ B): the second of the split pair."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SPANS):
        total += tl.load(P + s * M * N + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    _finish(B, Y, rows, cols, M, N, stride_y, total, HAS_BIAS)
