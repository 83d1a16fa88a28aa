"""The flat tensors one model forward consumes: prefill chunks and decode tokens side by side.

A leaf module: attention backends, models and the executor import it, and it imports none of them.
Every index list of a step is packed into one host tensor and copied to the device once; the host
lists stay alongside (`*_cpu`) so backends plan their work without reading the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from operator import add, ne
from typing import Any

import torch

from radixlm_runtime.utils.transfer import host_tensor, to_device


@dataclass
class ForwardBatch:
    """Every request contributes `extend_lens[b]` new tokens (1 for a decode) on top of the
    `seq_lens[b] - extend_lens[b]` tokens whose KV is already in the pool."""

    input_ids: torch.Tensor  # [T] device: new tokens of all requests, concatenated
    positions: torch.Tensor  # [T] device
    out_cache_loc: torch.Tensor  # [T] device: KV pool slots the new tokens are written to
    req_pool_indices: torch.Tensor  # [B] device: rows of req_to_token
    seq_lens: torch.Tensor  # [B] device: KV length after this forward
    extend_lens: torch.Tensor  # [B] device
    extend_start_loc: torch.Tensor  # [B] device: offset of request b's first new token in input_ids
    logits_indices: torch.Tensor  # [R] device: rows of the hidden states projected to vocab logits
    req_pool_indices_cpu: list[int]
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    extend_start_loc_cpu: list[int]
    # Each request's KV slots, new tokens included (host mirror of its req_to_token row).
    seq_slots_cpu: list[list[int]]
    attn_metadata: Any = field(default=None)
    # [T] device: the window slots of the new tokens, where sliding-window layers keep their KV in
    # slots of their own (kvcache/pool.py); None otherwise.
    window_loc: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_extend_len(self) -> int:
        return max(self.extend_lens_cpu)

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: list[int],
        logits_indices: list[int],
        seq_slots: list[list[int]],
        device: torch.device,
    ) -> ForwardBatch:
        seq_lens = list(map(add, prefix_lens, extend_lens))
        if any(map(ne, map(len, seq_slots), seq_lens)):
            raise ValueError("seq_slots: each request needs exactly one KV slot per token of its sequence")
        if extend_lens.count(1) == len(extend_lens):  # one token each (a decode step)
            positions = list(prefix_lens)
        else:
            positions = [pos for p, e in zip(prefix_lens, extend_lens) for pos in range(p, p + e)]
        starts = list(accumulate(extend_lens[:-1], initial=0)) if extend_lens else []
        parts = [
            input_ids,
            positions,
            out_cache_loc,
            req_pool_indices,
            seq_lens,
            extend_lens,
            starts,
            logits_indices,
        ]
        packed = to_device(host_tensor(parts), device)
        views = packed.split([len(part) for part in parts])
        return cls(
            *views,
            req_pool_indices_cpu=list(req_pool_indices),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(extend_lens),
            extend_start_loc_cpu=starts,
            seq_slots_cpu=seq_slots,
        )
