"""The flat tensors one model forward consumes: prefill chunks and decode tokens side by side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """Every request contributes `extend_lens[b]` new tokens (1 for a decode) on top of the
    `seq_lens[b] - extend_lens[b]` tokens whose KV is already in the pool."""

    input_ids: torch.Tensor  # [T] new tokens of all requests, concatenated
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV pool slots the new tokens are written to
    req_pool_indices: torch.Tensor  # [B] rows of req_to_token
    seq_lens: torch.Tensor  # [B] KV length after this forward
    extend_lens: torch.Tensor  # [B]
    extend_start_loc: torch.Tensor  # [B] offset of request b's first new token in input_ids
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    logits_indices: torch.Tensor  # rows of the hidden states projected to vocab logits
    attn_metadata: Any = field(default=None)

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
        out_cache_loc: torch.Tensor,
        logits_indices: list[int],
        device: torch.device,
    ) -> ForwardBatch:
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        positions = torch.cat(
            [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)]
        )
        starts = [0]
        for e in extend_lens[:-1]:
            starts.append(starts[-1] + e)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            input_ids=t(input_ids),
            positions=positions.to(device),
            out_cache_loc=out_cache_loc.to(device),
            req_pool_indices=t(req_pool_indices),
            seq_lens=t(seq_lens),
            extend_lens=t(extend_lens),
            extend_start_loc=t(starts),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(extend_lens),
            logits_indices=t(logits_indices),
        )
