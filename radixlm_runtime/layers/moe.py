"""The mixture-of-experts MLP of Mixtral, Qwen3-MoE and OLMoE: a router picks top_k of num_experts
SwiGLU experts per token, whose outputs are summed with the router's weights.

Routing is transformers' (Mixtral/Qwen3Moe/OlmoeTopKRouter) op for op, so expert choice and weights are
bit-identical to it given the same router logits: logits from the gate in the model dtype, softmax in
float32, torch.topk (its tie-breaking), optional renormalisation, the weights cast back to the
activation dtype (as Qwen3-MoE and OLMoE do; transformers' Mixtral keeps them in float32, which in
bf16 differs by the one rounding of the weight).

Two expert paths:
- CUDA: the fused Triton kernels of moe_triton.py (grouped GEMM over token slots sorted by expert).
- Elsewhere: gather by expert. The token slots are sorted by expert, each active expert runs one w13
  matmul, SiLU-and-mul and one w2 matmul on its gathered rows, and the weighted rows go back to slot
  order and are summed per token. Only experts that received a token cost anything, one Python step
  each. The way back is a gather by the inverse permutation and a sum over top_k, not index_add_:
  torch's CPU index_add_ of a token's top_k rows into one row took 70-110 ms with 2 threads at T=1
  (top-8, H=1024; one thread: 3 us), the gather and sum 5 us.

Batch invariance (a token's output independent of the batch around it): routing is per row, so a
token's router logits, and with them its expert choice, are invariant wherever the gate Linear is (its
panel kernels on the CPU, the invariant matmul under --deterministic on CUDA). The Triton expert
kernels compute each slot's row with one tile shape and one K order whatever the batch, and sum a
token's top_k rows in slot order in a separate kernel, so on CUDA the expert part is batch-invariant
too (by construction; not yet run on a GPU). The gather path is not: the row count of each expert's
matmul depends on the other tokens, and the CPU GEMM may block its sums by it, changing a token's
result in its last bits (not its expert choice, which the router made before).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from radixlm_runtime.layers import fused_triton
from radixlm_runtime.layers.activation import SiluAndMul
from radixlm_runtime.layers.linear import Linear

SHARDS = ("gate", "up", "down")


@functools.cache
def _triton() -> ModuleType:
    """moe_triton loads Triton: imported on the first CUDA forward only."""
    from radixlm_runtime.layers import moe_triton

    return moe_triton


class MoE(nn.Module):
    """Top-k routed SwiGLU experts."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        # Per expert: the gate projection's rows, then the up projection's (transformers' gate_up_proj).
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = SiluAndMul()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in x's dtype, expert ids [T, top_k] int64) for x [T, H], as transformers
        computes them."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, ids = self.route(x)
        if fused_triton.supports(x) and self.w13.device == x.device and self.w13.dtype == x.dtype:
            return _triton().fused_experts(x, self.w13, self.w2, weights, ids)
        return self._gather_experts(x, weights, ids)

    def _gather_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sort the T * top_k token slots by expert, one matmul pair per active expert on its rows."""
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)  # slots grouped by expert, each group in token order
        gathered = x.index_select(0, order // self.top_k)
        slot_weights = weights.flatten().index_select(0, order).unsqueeze(1)
        expert_out = torch.empty_like(gathered)
        start = 0
        for expert, count in enumerate(torch.bincount(flat_ids, minlength=self.num_experts).tolist()):
            if count == 0:
                continue
            rows = slice(start, start + count)
            hidden = self.act(F.linear(gathered[rows], self.w13[expert]))
            torch.mul(F.linear(hidden, self.w2[expert]), slot_weights[rows], out=expert_out[rows])
            start += count
        # Back to slot order, then each token's top_k rows summed (in top-k order).
        per_slot = expert_out.index_select(0, order.argsort())
        return per_slot.view(-1, self.top_k, self.hidden_size).sum(dim=1)

    def load_expert(self, expert: int, shard: str, weight: torch.Tensor) -> None:
        """Copies one expert's checkpoint projection in: "gate" and "up" [I, H] into w13's two halves,
        "down" [H, I] into w2 (checkpoints store each expert's projections as separate tensors)."""
        if shard not in SHARDS:
            raise ValueError(f"unknown expert shard {shard!r}: expected one of {SHARDS}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range for {self.num_experts} experts")
        inter = self.intermediate_size
        target = {
            "gate": self.w13.data[expert, :inter],
            "up": self.w13.data[expert, inter:],
            "down": self.w2.data[expert],
        }[shard]
        if weight.shape != target.shape:
            raise ValueError(
                f"expert {expert} {shard} weight is {tuple(weight.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(weight)
