"""The Triton device code of `fused_triton.invariant_linear`: imported on first use, so a process that
never touches a CUDA tensor never loads Triton."""

import triton
import triton.language as tl


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
):
    """Y = X @ W^T (+ B) for X [M, K], W [N, K]: one program per (BLOCK_M x BLOCK_N) tile, K walked in
    BLOCK_K steps from 0 up, float32 accumulation. Tile sizes are fixed and K is never split, so an
    output element is the same sequence of operations on its row of X whatever M is: a row's result
    does not depend on the rows beside it (M is not specialised on, so one binary serves every M)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(
            X + rows[:, None] * stride_x + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0
        )
        w = tl.load(
            W + cols[None, :] * stride_w + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0
        )
        # "ieee" keeps float32 operands from being rounded to tf32; fp16/bf16 ignore it.
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], acc.to(Y.dtype.element_ty), mask=mask)
