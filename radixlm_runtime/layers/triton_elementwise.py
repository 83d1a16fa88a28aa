"""The Triton device code of layers/fused_triton.py (its launchers): imported on first use, so a process
that never touches a CUDA tensor never loads Triton."""

import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, Res, W, Out, stride_x, stride_r, stride_o, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    """One program = one row. The stream (x + residual, rounded to the residual's dtype) is written
    back to the residual and normalised in float32; the normalised row is rounded to the stream's
    dtype before the weight multiply, as in the reference."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = Res + row * stride_r + cols
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(Res.dtype.element_ty)
        tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    X,
    Cos,
    Sin,
    stride_x,
    stride_cs,
    heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program = one row: its first `heads` heads as one [heads, D/2] tile per half."""
    row = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h < heads)[:, None] & mask_d[None, :]
    cos = tl.load(Cos + row * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + row * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    ptrs1 = X + row * stride_x + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(ptrs1, mask=mask, other=0.0)
    x2 = tl.load(ptrs1 + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptrs1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(ptrs1 + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    """One program = BLOCK columns of one row. silu(gate) is rounded to x's dtype before the
    multiply, as torch's two ops round it."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (silu * up).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    K,
    V,
    K_Buf,
    V_Buf,
    Loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_bs,
    stride_bh,
    heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one token: its [H, D] key and value tiles, cast to the pool's dtype."""
    token = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < heads) & (offs_d < head_dim)
    dst = tl.load(Loc + token) * stride_bs + offs_h * stride_bh + offs_d
    k = tl.load(K + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(V + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(K_Buf + dst, k.to(K_Buf.dtype.element_ty), mask=mask)
    tl.store(V_Buf + dst, v.to(V_Buf.dtype.element_ty), mask=mask)
