"""Attention through the Triton kernels (the default on CUDA). An all-decode step uses the split-K
decode kernel; any step with a prefill chunk runs every request, decodes included, through the
extend kernel, which treats a decode as a one-token extend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.attention.triton_kernels import decode_attention_fwd, extend_attention_fwd
from radixlm_runtime.forward_batch import ForwardBatch


@dataclass
class _TritonMeta:
    all_decode: bool
    max_extend_len: int
    num_kv_splits: int


class TritonAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        max_ext = batch.max_extend_len
        longest = max(batch.seq_lens_cpu)
        # One split per 256 keys, up to 8: short sequences gain nothing from splitting.
        splits = min(8, max(1, longest // 256))
        batch.attn_metadata = _TritonMeta(max_ext == 1, max_ext, splits)

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        meta: _TritonMeta = batch.attn_metadata
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        out = torch.empty_like(q)
        if meta.all_decode:
            decode_attention_fwd(
                q,
                out,
                k_buf,
                v_buf,
                self.req_to_token,
                batch.req_pool_indices,
                batch.seq_lens,
                self.scale,
                num_kv_splits=meta.num_kv_splits,
            )
        else:
            extend_attention_fwd(
                q,
                out,
                k_buf,
                v_buf,
                self.req_to_token,
                batch.req_pool_indices,
                batch.seq_lens,
                batch.extend_lens,
                batch.extend_start_loc,
                meta.max_extend_len,
                self.scale,
            )
        return out
