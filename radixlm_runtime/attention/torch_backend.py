"""Attention in plain torch, tuned for CPU.

Prefill chunks run one scaled-dot-product call per request over its KV gathered through the
request-to-token table. Decode tokens are batched (and so are short extends, such as the tokens a
jump-forward appended, one query row per token), and requests whose KV starts with the same pool
slots (a shared few-shot prefix or system prompt, found through the radix cache) attend to that
prefix together: its K/V is gathered once per group instead of once per request, and the partial
results are merged with their log-sum-exp. On CPU the gather is the dominant cost of decode, so this
is what keeps decode cheap when many requests share a long prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.engine.forward_batch import ForwardBatch

# Shorter shared prefixes are cheaper to gather per request than to handle as a group.
MIN_SHARED_PREFIX = 32
# Extends up to this long run with the decode tokens, each token as a query row over the keys up to
# its own position: cheaper than one attention call per request, which gathers all its KV again.
MAX_BATCHED_EXTEND = 16


@dataclass
class _ExtendItem:
    start: int
    length: int
    kv_slots: torch.Tensor  # [L]
    mask: torch.Tensor | None  # [length, L] bool, None when the chunk has no cached prefix


@dataclass
class _PrefixGroup:
    members: torch.Tensor | None  # positions among the decode requests; None when it is all of them
    slots: torch.Tensor  # [P] the shared prefix's KV slots
    # When the slots are one ascending run (a prefix prefilled in one piece), K/V are read as a view.
    slot_range: tuple[int, int] | None


@dataclass
class _DecodeMeta:
    token_rows: torch.Tensor | None  # rows of q run here; None when it is all of them, in order
    suffix_slots: torch.Tensor  # [Bd, S] KV slots past each request's group prefix, padded with 0
    suffix_mask: torch.Tensor  # [Bd, 1, 1, S] additive: 0 for real keys, -inf for padding
    groups: list[_PrefixGroup]


@dataclass
class _TorchMeta:
    extends: list[_ExtendItem]
    decode: _DecodeMeta | None


class TorchAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        req_rows = batch.req_pool_indices.tolist()
        starts = batch.extend_start_loc.tolist()
        extends: list[_ExtendItem] = []
        # Rows of q batched like decode tokens, and the KV slots each of them attends to.
        q_rows: list[int] = []
        kv_rows: list[torch.Tensor] = []
        for b, (seq_len, ext) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
            slots = self.req_to_token[req_rows[b], :seq_len]
            prefix = seq_len - ext
            if ext <= MAX_BATCHED_EXTEND:
                q_rows.extend(range(starts[b], starts[b] + ext))
                kv_rows.extend(slots[: prefix + j + 1] for j in range(ext))
                continue
            mask = None
            if prefix > 0:
                q_pos = torch.arange(prefix, seq_len, device=slots.device)[:, None]
                mask = torch.arange(seq_len, device=slots.device)[None, :] <= q_pos
            extends.append(_ExtendItem(starts[b], ext, slots, mask))
        decode = self._decode_metadata(batch, q_rows, kv_rows) if q_rows else None
        batch.attn_metadata = _TorchMeta(extends, decode)

    def _decode_metadata(
        self, batch: ForwardBatch, q_rows: list[int], rows: list[torch.Tensor]
    ) -> _DecodeMeta:
        prefix_lens = [0] * len(rows)
        groups: list[_PrefixGroup] = []
        by_first: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_first.setdefault(int(r[0]), []).append(i)
        for members in by_first.values():
            if len(members) < 2:
                continue
            # The last key of every row is its own token, so the shared part stops before it.
            limit = min(len(rows[i]) for i in members) - 1
            if limit < MIN_SHARED_PREFIX:
                continue
            mat = torch.stack([rows[i][:limit] for i in members])
            shared = int((mat == mat[0]).all(0).to(torch.int32).cumprod(0).sum())
            if shared < MIN_SHARED_PREFIX:
                continue
            for i in members:
                prefix_lens[i] = shared
            slots = rows[members[0]][:shared]
            first, last = int(slots[0]), int(slots[-1])
            contiguous = last - first == shared - 1 and bool((slots.diff() == 1).all())
            groups.append(
                _PrefixGroup(
                    None if len(members) == len(rows) else torch.tensor(members),
                    slots,
                    (first, last + 1) if contiguous else None,
                )
            )
        suffix_len = max(len(r) - p for r, p in zip(rows, prefix_lens))
        suffix_slots = torch.zeros(len(rows), suffix_len, dtype=torch.int64, device=rows[0].device)
        suffix_mask = torch.full(
            (len(rows), 1, 1, suffix_len), float("-inf"), dtype=self.kv_pool.dtype, device=rows[0].device
        )
        for i, (r, p) in enumerate(zip(rows, prefix_lens)):
            suffix_slots[i, : len(r) - p] = r[p:]
            suffix_mask[i, ..., : len(r) - p] = 0.0
        token_rows = None
        if len(q_rows) != batch.num_tokens:
            token_rows = torch.tensor(q_rows, device=rows[0].device)
        return _DecodeMeta(token_rows, suffix_slots, suffix_mask, groups)

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        meta: _TorchMeta = batch.attn_metadata
        k_buf = self.kv_pool.k_buffers[layer_id]
        v_buf = self.kv_pool.v_buffers[layer_id]
        out = torch.empty_like(q)
        for item in meta.extends:
            out[item.start : item.start + item.length] = self._extend(q, item, k_buf, v_buf)
        if meta.decode is not None:
            d = meta.decode
            qd = q if d.token_rows is None else q.index_select(0, d.token_rows)
            od = self._decode(qd, d, k_buf, v_buf)
            if d.token_rows is None:
                out = od
            else:
                out.index_copy_(0, d.token_rows, od)
        return out

    def _extend(
        self, q: torch.Tensor, item: _ExtendItem, k_buf: torch.Tensor, v_buf: torch.Tensor
    ) -> torch.Tensor:
        # 4-D inputs: torch's CPU flash-attention kernel only takes [B, H, L, D]; 3-D inputs fall
        # back to the unfused math path, which is 4-5x slower.
        qi = q[item.start : item.start + item.length].transpose(0, 1)[None]  # [1, Hq, n, D]
        k = k_buf.index_select(0, item.kv_slots).transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = v_buf.index_select(0, item.kv_slots).transpose(0, 1)[None]
        causal = item.mask is None
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=item.mask, is_causal=causal, scale=self.scale, enable_gqa=True
        )
        return o[0].transpose(0, 1)

    def _decode(
        self, q: torch.Tensor, meta: _DecodeMeta, k_buf: torch.Tensor, v_buf: torch.Tensor
    ) -> torch.Tensor:
        """A decode step is attention of G query rows per kv head (the GQA group) over the
        request's keys, so torch's CPU flash kernel runs it without expanding K/V to q heads; its
        log-sum-exp output lets the shared-prefix part be merged in afterwards."""
        bsz, num_q_heads, head_dim = q.shape
        num_kv_heads = k_buf.shape[1]
        group = num_q_heads // num_kv_heads
        suffix = meta.suffix_slots.shape[1]
        qg = q.view(bsz, num_kv_heads, group, head_dim)
        flat = meta.suffix_slots.view(-1)
        k = k_buf.index_select(0, flat).view(bsz, suffix, num_kv_heads, head_dim).transpose(1, 2)
        v = v_buf.index_select(0, flat).view(bsz, suffix, num_kv_heads, head_dim).transpose(1, 2)
        out, lse = _flash(qg, k, v, meta.suffix_mask, self.scale)  # [B, Hkv, G, D], [B, Hkv, G]
        for g in meta.groups:
            self._merge_shared_prefix(qg, out, lse, g, k_buf, v_buf)
        return out.reshape(bsz, num_q_heads, head_dim)

    def _merge_shared_prefix(
        self,
        qg: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        group: _PrefixGroup,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
    ) -> None:
        """Attends all the group's queries to their shared prefix at once (its K/V gathered once,
        the members' query rows stacked) and folds the result into the per-request attention."""
        _, num_kv_heads, g, head_dim = qg.shape
        m = group.members
        qm = qg if m is None else qg.index_select(0, m)
        n = qm.shape[0]
        qm = qm.transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)
        if group.slot_range is not None:
            start, end = group.slot_range
            kp, vp = k_buf[start:end], v_buf[start:end]
        else:
            kp, vp = k_buf.index_select(0, group.slots), v_buf.index_select(0, group.slots)
        p_out, p_lse = _flash(qm, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], None, self.scale)
        p_out = p_out.view(num_kv_heads, n, g, head_dim).transpose(0, 1)
        p_lse = p_lse.view(num_kv_heads, n, g).transpose(0, 1)
        s_out, s_lse = (out, lse) if m is None else (out.index_select(0, m), lse.index_select(0, m))
        new_lse = torch.logaddexp(s_lse, p_lse)
        merged = s_out * torch.exp(s_lse - new_lse)[..., None] + p_out * torch.exp(p_lse - new_lse)[..., None]
        if m is None:
            out.copy_(merged)
        else:
            out.index_copy_(0, m, merged)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused CPU attention, which unlike the public SDPA also returns the log-sum-exp."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, attn_mask=mask, scale=scale)
    return out, lse
