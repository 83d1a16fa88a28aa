"""The CUDA expert path of layers/moe.py: a grouped GEMM over token slots sorted by expert, as vLLM's and
SGLang's fused_moe. Imported on the first CUDA forward, so a CPU process never loads Triton.

A slot is one (token, k) pair, slot = token * top_k + k. `align_block_size` sorts the slots by expert
and pads each expert's run to a multiple of BLOCK_M, so every BLOCK_M-row tile belongs to one expert:
one launch of `_expert_matmul_kernel` then multiplies every tile by its expert's weight. Three
launches in all: x @ w13 per slot, SiLU-and-mul (fused_triton), @ w2 with the routing weight applied,
then `_sum_slots_kernel` adds each token's top_k rows. The alignment is torch ops without a host sync
(its sizes depend only on T), so the whole path can be captured in a CUDA graph.

One tile shape for every T, K walked from 0 up and never split, and the top_k rows summed in slot order:
a slot's result is the same sequence of operations whatever other tokens are in the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm_runtime.kernels.triton_dot import dot_dtype
from radixlm_runtime.layers import fused_triton

# BLOCK_M 16 keeps the padding small at decode, where each expert gets a row or two (vLLM's small-M
# choice); one fixed shape is what makes the kernel batch-invariant. Not tuned per GPU yet.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit(do_not_specialize=["num_slots"])
def _expert_matmul_kernel(
    A,
    W,
    C,
    SlotWeights,
    SortedSlots,
    BlockExperts,
    NumPadded,
    num_slots,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[slot] = A[slot // A_ROW_DIV] @ W[expert]^T (times SlotWeights[slot] with MUL_WEIGHT) for the
    BLOCK_M sorted slots of tile program_id(0), all of one expert, and BLOCK_N columns. Padding slots
    (== num_slots) are masked; tiles past the padded total exit at once (the grid is an upper bound)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    slots = tl.load(SortedSlots + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = slots < num_slots
    rows = slots // A_ROW_DIV
    expert = tl.load(BlockExperts + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_base = W + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(
            A + rows[:, None] * stride_a + k[None, :], mask=valid[:, None] & (k[None, :] < K), other=0.0
        )
        w = tl.load(
            w_base + cols[None, :] * stride_wn + k[:, None],
            mask=(cols[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        # "ieee" keeps float32 operands from being rounded to tf32; fp16/bf16 ignore it.
        acc = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision="ieee")
    if MUL_WEIGHT:
        acc *= tl.load(SlotWeights + slots, mask=valid, other=0.0).to(tl.float32)[:, None]
    mask = valid[:, None] & (cols[None, :] < N)
    tl.store(C + slots[:, None] * stride_c + cols[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _sum_slots_kernel(Y, Out, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Out[t] = sum over k of Y[t, k] (Y [T, TOP_K, hidden] contiguous), in float32 and k order: one
    program = BLOCK columns of one token."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    base = Y + token * TOP_K * hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(TOP_K):
        acc += tl.load(base + k * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + token * hidden + cols, acc.to(Out.dtype.element_ty), mask=mask)


def align_block_size(
    ids: torch.Tensor, num_experts: int, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For expert ids [T, top_k]: (sorted_slots [capacity] int32, the slots grouped by expert in slot
    order, each expert's run padded to a multiple of block with the sentinel T * top_k;
    block_experts [capacity / block] int64, the expert of each tile; num_padded [1], the padded length).
    capacity bounds the padded length from T alone, so no size is read back to the host."""
    flat = ids.flatten()
    n = flat.numel()
    capacity = min(n + num_experts * (block - 1), n * block)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block - 1) // block * block
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(n, device=ids.device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_slots = torch.full((capacity,), n, dtype=torch.int32, device=ids.device)
    sorted_slots[(padded_end - padded)[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block, device=ids.device)
    block_experts = torch.searchsorted(padded_end, tile_starts, right=True)
    return sorted_slots, block_experts, padded_end[-1:]


def _expert_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_row_div: int,
    mul_weight: bool,
) -> None:
    sorted_slots, block_experts, num_padded = aligned
    n, k = w.shape[1], w.shape[2]
    kernel = _expert_matmul_kernel
    kernel[(block_experts.numel(), triton.cdiv(n, BLOCK_N))](
        a,
        w,
        out,
        weights,
        sorted_slots,
        block_experts,
        num_padded,
        out.shape[0],
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=mul_weight,
        DOT_DTYPE=dot_dtype(a.dtype, kernel),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H] (rows of contiguous elements),
    w13 [E, 2I, H] and w2 [E, H, I] with contiguous rows, weights and ids [T, top_k]; out [T, H] in
    x's dtype."""
    tokens, hidden = x.shape
    num_experts, inter2, _ = w13.shape
    top_k = ids.shape[1]
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 need rows of contiguous elements")
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    slots = tokens * top_k
    aligned = align_block_size(ids, num_experts, BLOCK_M)
    weights = weights.contiguous()
    gate_up = torch.empty(slots, inter2, dtype=x.dtype, device=x.device)
    _expert_matmul(x, w13, gate_up, weights, aligned, a_row_div=top_k, mul_weight=False)
    hidden_act = fused_triton.silu_and_mul(gate_up)
    per_slot = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    _expert_matmul(hidden_act, w2, per_slot, weights, aligned, a_row_div=1, mul_weight=True)
    block = min(triton.next_power_of_2(hidden), 1024)
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, block))](
        per_slot, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=min(max(block // 256, 1), 8)
    )
    return out
