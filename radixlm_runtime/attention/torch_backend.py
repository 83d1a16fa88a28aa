"""Attention in plain torch, tuned for CPU.

Prefill chunks run one scaled-dot-product call per request over its KV gathered through the
request-to-token table. Decode tokens are batched, and so are short extends (the tokens a
jump-forward appended, a small chunk): each request's new tokens become a block of query rows
under a causal mask, so its KV is gathered once per step however many tokens it adds. Requests whose
KV starts with the same pool slots (a shared few-shot prefix or system prompt, found through the
radix cache) attend to that prefix together: its K/V is gathered once per group instead of once per
request, and the partial results are merged with their log-sum-exp. On CPU the gather is the
dominant cost of decode, so this is what keeps decode cheap when many requests share a long prefix.

Layers with a sliding window or a logit soft-cap run a plain per-request path instead
(`_attend_general`): scores in float32, soft-capped, masked to each token's window. It is the
reference every faster backend's windowed and soft-capped kernels are tested against.

K/V are read in the queries' dtype through KVPool.read_kv: a bf16 pool on the CPU (--dtype bfloat16,
float32 activations) is widened, exactly, an int8 pool (--kv-cache-dtype int8) dequantized and an fp8
one widened, as the rows a call needs are gathered (never a converted copy of the pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.kvcache.pool import QUANTIZED_KV_DTYPES, KVPool

# Shorter shared prefixes are cheaper to gather per request than to handle as a group.
MIN_SHARED_PREFIX = 32
# Extends up to this long run with the decode tokens, as a block of query rows per request: cheaper
# than one attention call per request. Blocks are padded to the longest in their call, so single
# tokens and multi-token blocks run as two calls: a decode must not pay for a neighbour's jump.
MAX_BATCHED_EXTEND = 16


@dataclass(frozen=True)
class _LayerKV:
    """One layer of the pool, read by the rows a call needs."""

    pool: KVPool
    layer_id: int

    def read(self, slots: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.read_kv(self.layer_id, slots, dtype)


@dataclass
class _ExtendItem:
    start: int
    length: int
    kv_slots: torch.Tensor  # [L]
    mask: torch.Tensor | None  # [length, L] bool, None when the chunk has no cached prefix


@dataclass
class _PrefixGroup:
    members: torch.Tensor | None  # positions among the call's requests; None when it is all of them
    slots: torch.Tensor  # [P] the shared prefix's KV slots
    # When the slots are one ascending run (a prefix prefilled in one piece), K/V are read as a view.
    slot_range: tuple[int, int] | None


@dataclass
class _DecodeMeta:
    """Bd requests with up to N new tokens each; q rows are laid out [Bd, Hkv, N * G, D], token j
    of a request holding rows j*G .. j*G+G-1 of its block (G = the GQA group size)."""

    token_rows: torch.Tensor | None  # [Bd * N] rows of q, padded by repeating a request's last
    # token; None when the requests are all of the batch, one token each, in order
    valid: torch.Tensor | None  # positions in token_rows that are real tokens; None when all are
    out_rows: torch.Tensor | None  # rows of q the real tokens are: token_rows[valid]
    num_rows: int  # N
    suffix_slots: torch.Tensor  # [Bd, S] KV slots past each request's group prefix, padded with 0
    suffix_mask: torch.Tensor  # [Bd, 1, N, S] additive: 0 for keys a token sees, -inf otherwise
    groups: list[_PrefixGroup]
    _row_mask: torch.Tensor | None = None

    def row_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """suffix_mask with a row per query row (token j's row for each of its G heads) in the queries'
        dtype, expanded once per step rather than in every layer."""
        if self._row_mask is None:
            mask = self.suffix_mask.to(dtype)
            self._row_mask = mask if self.num_rows == 1 else mask.repeat_interleave(group, dim=2)
        return self._row_mask


@dataclass
class _TorchMeta:
    extends: list[_ExtendItem]
    decode: list[_DecodeMeta]  # decode tokens; short extends
    # Per request: (first new token row, new tokens, sequence length, KV slots [seq]); built on
    # first use by a windowed or soft-capped layer.
    general: list[tuple[int, int, int, torch.Tensor]] | None = None


@dataclass
class _RowBlock:
    """One request's new tokens run with the decode tokens."""

    start: int  # first token row in q
    length: int
    slots: list[int]  # the request's KV slots, new tokens included (host)


class TorchAttentionBackend(AttentionBackend):
    """Plans each step from the batch's host lists (no reads of device data); per-request Python
    work and variable shapes make it the CPU backend, not one for CUDA graphs."""

    supports_sliding_window = True
    supports_logit_softcap = True

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        extends: list[_ExtendItem] = []
        blocks: list[_RowBlock] = []
        device = self.req_to_token.device
        for b, (seq_len, ext) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
            start = batch.extend_start_loc_cpu[b]
            if ext <= MAX_BATCHED_EXTEND:
                blocks.append(_RowBlock(start, ext, batch.seq_slots_cpu[b]))
                continue
            prefix = seq_len - ext
            mask = None
            if prefix > 0:
                q_pos = torch.arange(prefix, seq_len, device=device)[:, None]
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos
            slots = self.req_to_token[batch.req_pool_indices_cpu[b], :seq_len]
            extends.append(_ExtendItem(start, ext, slots, mask))
        buckets = ([b for b in blocks if b.length == 1], [b for b in blocks if b.length > 1])
        decode = [self._decode_metadata(batch, bucket) for bucket in buckets if bucket]
        batch.attn_metadata = _TorchMeta(extends, decode)

    def _decode_metadata(self, batch: ForwardBatch, blocks: list[_RowBlock]) -> _DecodeMeta:
        device = self.req_to_token.device
        prefix_lens = [0] * len(blocks)
        groups: list[_PrefixGroup] = []
        found = shared_prefix_groups([blk.slots for blk in blocks], [blk.length for blk in blocks])
        for members, shared in found:
            for i in members:
                prefix_lens[i] = shared
            slots = blocks[members[0]].slots[:shared]
            first = slots[0]
            contiguous = slots == list(range(first, first + shared))
            groups.append(
                _PrefixGroup(
                    None if len(members) == len(blocks) else torch.tensor(members, device=device),
                    torch.tensor(slots, device=device),
                    (first, first + shared) if contiguous else None,
                )
            )
        num_rows = max(blk.length for blk in blocks)
        suffix_len = max(len(blk.slots) - p for blk, p in zip(blocks, prefix_lens))
        padded: list[int] = []
        rows: list[int] = []
        valid: list[int] = []
        for i, (blk, p) in enumerate(zip(blocks, prefix_lens)):
            suffix = blk.slots[p:]
            padded.extend(suffix)
            padded.extend([0] * (suffix_len - len(suffix)))
            rows.extend(range(blk.start, blk.start + blk.length))
            rows.extend([blk.start + blk.length - 1] * (num_rows - blk.length))
            valid.extend(range(i * num_rows, i * num_rows + blk.length))
        suffix_slots = torch.tensor(padded, dtype=torch.int64).view(len(blocks), suffix_len).to(device)
        # Keys token j of block i sees: its suffix up to and including its own position; padded
        # rows repeat the block's last token.
        lengths = torch.tensor([blk.length for blk in blocks])
        first_new = torch.tensor([len(blk.slots) - blk.length - p for blk, p in zip(blocks, prefix_lens)])
        visible = first_new[:, None] + torch.minimum(torch.arange(1, num_rows + 1)[None], lengths[:, None])
        keys = torch.arange(suffix_len)[None, None, :]
        mask_dtype = torch.float32 if self.kv_pool.dtype in QUANTIZED_KV_DTYPES else self.kv_pool.dtype
        suffix_mask = torch.zeros(len(blocks), num_rows, suffix_len, dtype=mask_dtype)
        suffix_mask.masked_fill_(keys >= visible[:, :, None], float("-inf"))
        all_rows = len(valid) == len(rows)
        in_order = all_rows and len(rows) == batch.num_tokens and rows == list(range(len(rows)))
        token_rows = None if in_order else torch.tensor(rows, device=device)
        valid_t = None if all_rows else torch.tensor(valid, device=device)
        return _DecodeMeta(
            token_rows=token_rows,
            valid=valid_t,
            out_rows=token_rows
            if valid_t is None
            else token_rows[valid_t],  # token_rows is set wherever rows are padded
            num_rows=num_rows,
            suffix_slots=suffix_slots,
            suffix_mask=suffix_mask[:, None].to(device),
            groups=groups,
        )

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        meta: _TorchMeta = batch.attn_metadata
        kv = _LayerKV(self.kv_pool, layer_id)
        layer = self.layers[layer_id]
        if layer.sliding_window is not None or layer.logit_softcap is not None:
            return self._attend_general(q, layer_id, batch, kv)
        out = torch.empty_like(q)
        for item in meta.extends:
            out[item.start : item.start + item.length] = self._extend(q, item, kv, layer.scale)
        for d in meta.decode:
            qd = q if d.token_rows is None else q.index_select(0, d.token_rows)
            od = self._decode(qd, d, kv, layer.scale)  # [Bd * N, Hq, D]
            if d.token_rows is None:
                return od
            if d.valid is not None:
                od = od.index_select(0, d.valid)
            out.index_copy_(0, d.out_rows, od)
        return out

    def _attend_general(
        self, q: torch.Tensor, layer_id: int, batch: ForwardBatch, kv: _LayerKV
    ) -> torch.Tensor:
        """Each request's new tokens against the keys of their windows, one request at a time (a
        layer with window slots reads them from the window table)."""
        layer = self.layers[layer_id]
        meta: _TorchMeta = batch.attn_metadata
        if meta.general is None:
            device = q.device
            meta.general = [
                (start, n, seq, torch.tensor(slots, device=device))
                for start, n, seq, slots in zip(
                    batch.extend_start_loc_cpu, batch.extend_lens_cpu, batch.seq_lens_cpu, batch.seq_slots_cpu
                )
            ]
        out = torch.empty_like(q)
        group = q.shape[1] // self.kv_pool.num_kv_heads
        window = layer.sliding_window
        windowed = layer_id in self.kv_pool.window_layers
        for b, (start, n, seq, slots) in enumerate(meta.general):
            first = seq - n  # position of the first new token
            lo = 0 if window is None else max(0, first - window + 1)
            if windowed:
                slots = self.table_of(layer_id)[batch.req_pool_indices_cpu[b]]
            k, v = kv.read(slots[lo:seq], torch.float32)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            qi = q[start : start + n].float()
            scores = torch.einsum("qhd,khd->hqk", qi, k).mul_(layer.scale)
            if layer.logit_softcap is not None:
                scores = torch.tanh(scores.div_(layer.logit_softcap)).mul_(layer.logit_softcap)
            q_pos = torch.arange(first, seq, device=q.device)[:, None]
            k_pos = torch.arange(lo, seq, device=q.device)[None, :]
            hidden = k_pos > q_pos
            if window is not None:
                hidden |= k_pos <= q_pos - window
            scores.masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        return out

    @staticmethod
    def _extend(q: torch.Tensor, item: _ExtendItem, kv: _LayerKV, scale: float) -> torch.Tensor:
        # 4-D inputs: torch's CPU flash-attention kernel only takes [B, H, L, D]; 3-D inputs fall
        # back to the unfused math path, which is 4-5x slower.
        qi = q[item.start : item.start + item.length].transpose(0, 1)[None]  # [1, Hq, n, D]
        k, v = kv.read(item.kv_slots, q.dtype)
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
        causal = item.mask is None
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=item.mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, meta: _DecodeMeta, kv: _LayerKV, scale: float) -> torch.Tensor:
        """Each request's query rows are its N tokens x the G q heads of each kv head, so torch's
        CPU flash kernel runs them without expanding K/V to q heads; its log-sum-exp output lets the
        shared-prefix part be merged in afterwards. q is [Bd * N, Hq, D], and so is the result."""
        rows, num_q_heads, head_dim = q.shape
        num_kv_heads = self.kv_pool.num_kv_heads
        n = meta.num_rows
        bsz, suffix = meta.suffix_slots.shape
        qg = (
            q.view(bsz, n, num_kv_heads, -1, head_dim)
            .transpose(1, 2)
            .reshape(bsz, num_kv_heads, -1, head_dim)
        )
        group = num_q_heads // num_kv_heads
        mask = meta.row_mask(group, q.dtype)
        flat = meta.suffix_slots.view(-1)
        k, v = kv.read(flat, q.dtype)
        k = k.view(bsz, suffix, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(bsz, suffix, num_kv_heads, head_dim).transpose(1, 2)
        out, lse = _flash(qg, k, v, mask, scale)  # [Bd, Hkv, N * G, D], [Bd, Hkv, N * G]
        for g in meta.groups:
            self._merge_shared_prefix(qg, out, lse, g, kv, scale)
        return (
            out.view(bsz, num_kv_heads, n, group, head_dim)
            .transpose(1, 2)
            .reshape(rows, num_q_heads, head_dim)
        )

    def _merge_shared_prefix(
        self,
        qg: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        group: _PrefixGroup,
        kv: _LayerKV,
        scale: float,
    ) -> None:
        """Attends all the group's queries to their shared prefix at once (its K/V gathered once,
        the members' query rows stacked) and folds the result into the per-request attention."""
        _, num_kv_heads, g, head_dim = qg.shape
        m = group.members
        qm = qg if m is None else qg.index_select(0, m)
        n = qm.shape[0]
        qm = qm.transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)
        slots = group.slots if group.slot_range is None else slice(*group.slot_range)
        kp, vp = kv.read(slots, qg.dtype)
        p_out, p_lse = _flash(qm, kp.transpose(0, 1)[None], vp.transpose(0, 1)[None], None, scale)
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
    """Attention that also returns the log-sum-exp (to merge in a shared prefix's part): torch's
    fused CPU kernel, which unlike the public SDPA returns it; elsewhere the plain formulation, so
    the backend stays a reference on any device."""
    if q.device.type != "cpu":
        return attention_with_lse(q, k, v, mask, scale)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, attn_mask=mask, scale=scale)
    return out, lse


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v and the rows' log-sum-exp, in float32, for [B, H, L, D]
    inputs and an additive mask broadcastable to [B, H, Lq, Lk]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def shared_prefix_groups(slots: list[list[int]], new_lens: list[int]) -> list[tuple[list[int], int]]:
    """Sequences (positions in `slots`) whose KV starts with the same MIN_SHARED_PREFIX or more slots,
    grouped, each group with the length of the prefix its members share. The shared part stops before
    every member's new tokens: the causal mask then only applies within each member's suffix."""
    by_first: dict[int, list[int]] = {}
    for i, seq in enumerate(slots):
        by_first.setdefault(seq[0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min(len(slots[i]) - new_lens[i] for i in members)
        shared = shared_prefix_len([slots[i] for i in members], limit)
        if shared >= MIN_SHARED_PREFIX:
            groups.append((members, shared))
    return groups


def shared_prefix_len(seqs: list[list[int]], limit: int) -> int:
    """Length of the longest common prefix of seqs (at most limit), by binary search over slice
    comparisons, which run in C: the lists are a few thousand slots long."""
    first = seqs[0]
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(s[:mid] == first[:mid] for s in seqs[1:]):
            lo = mid
        else:
            hi = mid - 1
    return lo
