"""Attention through the Triton kernels (the default on CUDA). An all-decode step uses the split-K
decode kernel; any step with a prefill chunk runs every request, decodes included, through the
extend kernel, which treats a decode as a one-token extend. Both kernels serve each layer's sliding
window and logit soft-cap, passed per call as compile-time switches plus runtime scalars, and read a
quantized pool (--kv-cache-dtype int8 with its scales, or fp8_e4m3) directly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.attention.triton_kernels import decode_attention_fwd, extend_attention_fwd
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.utils.transfer import to_device

# KV splits of the decode kernel. Fixed, not sized from the batch's longest sequence: a CUDA graph
# replays the grid it captured, and a request's result then never depends on what it is batched
# with. Empty splits of short sequences cost one early exit each.
DECODE_KV_SPLITS = 8


@dataclass
class _TritonMeta:
    all_decode: bool
    max_extend_len: int
    # Per-token mode: each new token's req_to_token row and sequence length, decoded one by one.
    token_rows: torch.Tensor | None = None
    token_seq_lens: torch.Tensor | None = None


class TritonAttentionBackend(AttentionBackend):
    graph_capturable = True
    supports_per_token = True
    supports_sliding_window = True
    supports_logit_softcap = True

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        max_ext = batch.max_extend_len
        if max_ext == 1 or not self.per_token:
            batch.attn_metadata = _TritonMeta(max_ext == 1, max_ext)
            return
        rows, lens = self.per_token_decodes(batch)
        token_rows, token_lens = to_device(torch.tensor(rows + lens), batch.seq_lens.device).view(2, -1)
        batch.attn_metadata = _TritonMeta(True, max_ext, token_rows, token_lens)

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        meta: _TritonMeta = batch.attn_metadata
        pool = self.kv_pool
        k_buf, v_buf = pool.k_buffers[layer_id], pool.v_buffers[layer_id]
        # An int8 pool's scales, read beside its codes by the kernels.
        scales = (
            {"k_scale": pool.k_scales[layer_id], "v_scale": pool.v_scales[layer_id]} if pool.quantized else {}
        )
        layer = self.layers[layer_id]
        out = torch.empty_like(q)
        if meta.all_decode:
            decode_attention_fwd(
                q,
                out,
                k_buf,
                v_buf,
                self.table_of(layer_id),
                batch.req_pool_indices if meta.token_rows is None else meta.token_rows,
                batch.seq_lens if meta.token_seq_lens is None else meta.token_seq_lens,
                layer.scale,
                num_kv_splits=DECODE_KV_SPLITS,
                sliding_window=layer.sliding_window,
                logit_softcap=layer.logit_softcap,
                **scales,
            )
        else:
            extend_attention_fwd(
                q,
                out,
                k_buf,
                v_buf,
                self.table_of(layer_id),
                batch.req_pool_indices,
                batch.seq_lens,
                batch.extend_lens,
                batch.extend_start_loc,
                meta.max_extend_len,
                layer.scale,
                sliding_window=layer.sliding_window,
                logit_softcap=layer.logit_softcap,
                **scales,
            )
        return out
