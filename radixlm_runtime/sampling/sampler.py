"""Batched next-token sampling: penalties, masks, temperature, top-k/top-p/min-p, per-request RNG.

Every step is a batched tensor op. A seeded row's one uniform number is a pure function of the
request's seed and which of its output tokens the row draws (`seeded_uniform`), computed on the
host with the row's other parameters and copied with them: no RNG state to keep per request, no
device call per row, and a request samples the same tokens whatever batch it joins, however often
it is retracted and recomputed, with or without speculative decoding. The costly pieces are only
paid for when some request needs them: penalties touch just the (row, token) pairs in the history,
top-k/top-p work on a `torch.topk` prefix, and a full vocabulary sort happens only for top-p rows
whose nucleus does not fit in that prefix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.utils.transfer import host_tensor, to_device

_NEG_INF = float("-inf")
_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny
# Prefix tried first for top-p rows without a top-k; a nucleus wider than this falls back to a sort.
# On CUDA such rows are sorted whole at once: a sort there is cheap, and checking which rows need
# the fallback would read the device back mid-step.
_NUCLEUS_PREFIX = 256


_MASK64 = 2**64 - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's output function: a bijection of 64-bit integers with full avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, draw: int) -> float:
    """U[0, 1) for draw number `draw` of a request seeded with `seed`: output `draw` of a SplitMix64
    stream whose state starts at the mixed seed (seeds are taken mod 2**64). 24 bits, so the value is
    exact in float32."""
    state = _mix64(seed & _MASK64)
    return (_mix64((state + (draw + 1) * _GOLDEN64) & _MASK64) >> 40) * 2.0**-24


def accepted_draft_len(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many draft tokens speculative verification accepts: sampled[i] is the token drawn (by
    the ordinary sampler, with the request's own processing) from the row before draft[i], and
    draft[i] is accepted while it equals that token.

    This is exact rejection sampling for a deterministic proposal q = one-hot(x): the draw y ~ p
    equals x with probability p(x) = min(1, p(x) / q(x)), and when it does not, y is distributed
    as p without x, renormalised, which is normalize(max(p - q, 0)). So every emitted token, the
    accepted drafts and then sampled[m] (the correction, or the bonus after a fully accepted
    draft), is drawn from the same distribution as without speculation; under greedy decoding y
    is the argmax and the output is token for token the same."""
    m = 0
    while m < len(draft) and draft[m] == sampled[m]:
        m += 1
    return m


def build_token_bitmask(
    allowed: Sequence[np.ndarray | None], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """`SamplingBatchInfo.vocab_mask` for a batch from each row's int32 bitmask (None: unconstrained,
    all bits set): [B, ceil(vocab_size / 32)] int32; None when no row is constrained. A copy of
    vocab/8 bytes per row goes to the device, where `apply_token_bitmask_` expands it."""
    if all(a is None for a in allowed):
        return None
    rows = np.full((len(allowed), (vocab_size + 31) // 32), -1, dtype=np.int32)
    for i, a in enumerate(allowed):
        if a is not None:
            rows[i] = a
    return to_device(torch.from_numpy(rows), device)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets the logits of tokens whose bit is clear to -inf, in place. On CPU the bits unpack with
    numpy (one pass over vocab/8 bytes); elsewhere with shifts on the logits' own device, so no
    host round trip."""
    rows, vocab = logits.shape
    expected = (rows, (vocab + 31) // 32)
    if bitmask.shape != expected:
        raise ValueError(f"vocab_mask: expected shape {expected}, got {tuple(bitmask.shape)}")
    unpack = unpack_bits_numpy if logits.device.type == "cpu" else unpack_bits_shifts
    logits.masked_fill_(~unpack(bitmask, vocab), _NEG_INF)


def unpack_bits_numpy(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] bool from a CPU bitmask, in one numpy pass (little-endian words: byte k holds
    tokens 8k..8k+7)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits).bool()


def unpack_bits_shifts(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] bool from a bitmask on any device, with tensor ops only (no host round trip)."""
    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(len(bitmask), -1)[:, :vocab]


@dataclass
class PenaltyInfo:
    """Penalties as sparse (row, token) entries, so their cost scales with history length, not vocab."""

    rep_rows: torch.Tensor  # [N] int64: (row, token) pairs over prompt + output, repeats allowed
    rep_ids: torch.Tensor  # [N] int64
    rep_penalty: torch.Tensor  # [N] float32: the row's repetition_penalty
    count_rows: torch.Tensor  # [M] int64: unique (row, token) pairs over output only
    count_ids: torch.Tensor  # [M] int64
    frequency_term: torch.Tensor  # [M] float32: frequency_penalty * count
    presence_term: torch.Tensor  # [M] float32: presence_penalty (count > 0 for every listed pair)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        token_history: list[tuple[list[int], list[int]]] | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> PenaltyInfo | None:
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        counted = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if not rep and not counted:
            return None
        if token_history is None or len(token_history) != len(params):
            raise ValueError("token_history: penalties need one (prompt ids, output ids) pair per request")
        # Repeated (row, token) pairs are left in: every copy writes the same penalised value, and
        # deduplicating a long prompt costs more than the duplicate writes.
        rep_rows, rep_ids = _pairs(
            rep, [token_history[i][0] + token_history[i][1] for i in rep], vocab_size, "token_history"
        )
        count_rows, count_ids, counts = _unique_pairs(
            counted, [token_history[i][1] for i in counted], vocab_size, "token_history"
        )

        def per_row(values: list[float], rows: torch.Tensor) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32)[rows]

        repetition = per_row([p.repetition_penalty for p in params], rep_rows)
        frequency = per_row([p.frequency_penalty for p in params], count_rows)
        presence = per_row([p.presence_penalty for p in params], count_rows)
        return cls(
            rep_rows=to_device(rep_rows, device),
            rep_ids=to_device(rep_ids, device),
            rep_penalty=to_device(repetition, device),
            count_rows=to_device(count_rows, device),
            count_ids=to_device(count_ids, device),
            frequency_term=to_device(frequency * counts, device),
            presence_term=to_device(presence, device),
        )


def apply_penalties(logits: torch.Tensor, penalties: PenaltyInfo) -> None:
    """Applies repetition, then frequency, then presence penalty in place to [B, V] logits."""
    if penalties.rep_rows.numel():
        index = (penalties.rep_rows, penalties.rep_ids)
        vals = logits[index]
        p = penalties.rep_penalty
        # Dividing by a small penalty can overflow; finite logits keep max-subtraction NaN-free.
        logits[index] = torch.where(vals > 0, vals / p, vals * p).clamp_(max=_F32_MAX)
    if penalties.count_rows.numel():
        index = (penalties.count_rows, penalties.count_ids)
        vals = logits[index] - penalties.frequency_term
        logits[index] = (vals - penalties.presence_term).clamp_(max=_F32_MAX)


@dataclass
class LogitBias:
    """Requests' logit_bias as sparse (row, token, bias) entries, added to the logits before sampling."""

    rows: torch.Tensor  # [N] int64
    ids: torch.Tensor  # [N] int64, unique per row
    values: torch.Tensor  # [N] float32

    @classmethod
    def build(
        cls, params: list[SamplingParams], vocab_size: int, device: torch.device | str
    ) -> LogitBias | None:
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if not biased:
            return None
        rows, ids = _pairs(biased, [list(params[i].logit_bias) for i in biased], vocab_size, "logit_bias")
        values = torch.tensor([b for i in biased for b in params[i].logit_bias.values()], dtype=torch.float32)
        return cls(rows=to_device(rows, device), ids=to_device(ids, device), values=to_device(values, device))


@dataclass
class BannedTokens:
    """(row, token id) pairs to block, e.g. EOS/stop ids until min_new_tokens is reached."""

    rows: torch.Tensor  # [N] int64
    ids: torch.Tensor  # [N] int64


@dataclass
class SamplingBatchInfo:
    """Per-batch tensors built once per step from the requests' params, so sampling is a few batched
    ops. The per-row values travel to the device in two copies (one float32, one int64)."""

    temperatures: torch.Tensor  # [B, 1] float32, floored at the smallest normal float so division is safe
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size where disabled
    min_ps: torch.Tensor  # [B] float32
    is_all_greedy: bool
    need_top_p: bool  # these flags only consider sampled (non-greedy) rows
    need_top_k: bool
    need_min_p: bool
    sampled_rows: torch.Tensor  # [S] int64: batch rows that are not greedy
    filtered: torch.Tensor  # [F] int64: positions within sampled_rows that use top-k or top-p
    candidate_len: int  # topk prefix length for the filtered rows (vocab size means a full sort)
    penalties: PenaltyInfo | None
    banned: BannedTokens | None
    logit_bias: LogitBias | None
    uniforms: torch.Tensor  # [S] float32: each sampled row's seeded draw (0 where unseeded)
    unseeded: torch.Tensor  # [Q] int64: positions within sampled_rows drawing from the shared RNG
    batch_size: int
    vocab_size: int
    # [B, ceil(V / 32)] int32 bitmask (bit set = allowed); set by constrained decoding
    vocab_mask: torch.Tensor | None = None

    @property
    def has_edits(self) -> bool:
        """Whether logits change before sampling (mask, penalties, logit bias, banned ids)."""
        return (
            self.vocab_mask is not None
            or self.penalties is not None
            or self.logit_bias is not None
            or self.banned is not None
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        draws: list[tuple[int, int] | None],
        token_history: list[tuple[list[int], list[int]]] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        banned_token_ids: list[list[int]] | None = None,
    ) -> SamplingBatchInfo:
        """`draws[i]` is (seed, draw number) of row i's request (see `seeded_uniform`), or None for a
        row drawing from the sampler's shared generator (greedy rows draw nothing)."""
        if len(draws) != len(params):
            raise ValueError(f"draws: expected {len(params)} entries, got {len(draws)}")
        if banned_token_ids is not None and len(banned_token_ids) != len(params):
            raise ValueError(f"banned_token_ids: expected {len(params)} entries, got {len(banned_token_ids)}")
        for p in params:
            if not math.isfinite(p.temperature):
                raise ValueError(f"sampling_params.temperature must be finite, got {p.temperature}")
        device = torch.device(device)
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        uses_top_k = [top_ks[i] < vocab_size for i in sampled]
        uses_top_p = [params[i].top_p < 1.0 for i in sampled]
        filtered = [pos for pos, (k, p) in enumerate(zip(uses_top_k, uses_top_p, strict=True)) if k or p]
        candidate_len = max((top_ks[i] for i, k in zip(sampled, uses_top_k, strict=True) if k), default=0)
        if any(p and not k for k, p in zip(uses_top_k, uses_top_p, strict=True)):
            prefix = vocab_size if device.type == "cuda" else _NUCLEUS_PREFIX
            candidate_len = max(candidate_len, prefix)
        banned = None
        if banned_token_ids is not None and any(banned_token_ids):
            rows, ids, _ = _unique_pairs(range(len(params)), banned_token_ids, vocab_size, "banned_token_ids")
            banned = BannedTokens(rows=to_device(rows, device), ids=to_device(ids, device))
        if sampled:
            row_draws = [draws[i] for i in sampled]
            unseeded = [pos for pos, d in enumerate(row_draws) if d is None]
            uniforms = [0.0 if d is None else seeded_uniform(*d) for d in row_draws]
            temperatures = [max(p.temperature, _F32_TINY) for p in params]
            floats = [temperatures, [p.top_p for p in params], [p.min_p for p in params], uniforms]
            f32 = to_device(host_tensor(floats, torch.float32), device)
            i64 = to_device(host_tensor([top_ks, sampled, filtered, unseeded]), device)
            temperatures, top_ps, min_ps, uniform_t = f32.split([len(params)] * 3 + [len(sampled)])
            top_k_t, sampled_t, filtered_t, unseeded_t = i64.split(
                [len(params), len(sampled), len(filtered), len(unseeded)]
            )
        else:
            # An all-greedy batch reads none of the per-row tensors: no copies to the device.
            f, i = _empty(device, torch.float32), _empty(device, torch.int64)
            temperatures, top_ps, min_ps, uniform_t = f, f, f, f
            top_k_t, sampled_t, filtered_t, unseeded_t = i, i, i, i
        return cls(
            temperatures=temperatures.unsqueeze(1),
            top_ps=top_ps,
            top_ks=top_k_t,
            min_ps=min_ps,
            is_all_greedy=not sampled,
            need_top_p=any(uses_top_p),
            need_top_k=any(uses_top_k),
            need_min_p=any(params[i].min_p > 0.0 for i in sampled),
            sampled_rows=sampled_t,
            filtered=filtered_t,
            candidate_len=min(candidate_len, vocab_size),
            penalties=PenaltyInfo.build(params, token_history, vocab_size, device),
            banned=banned,
            logit_bias=LogitBias.build(params, vocab_size, device),
            uniforms=uniform_t,
            unseeded=unseeded_t,
            batch_size=len(params),
            vocab_size=vocab_size,
        )


_EMPTY: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _empty(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A cached empty tensor: stands in for the per-row tensors of an all-greedy batch."""
    t = _EMPTY.get((device, dtype))
    if t is None:
        t = _EMPTY[device, dtype] = torch.empty(0, dtype=dtype, device=device)
    return t


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32 under the raw model distribution; None unless requested
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # (values [B, K], ids [B, K]), raw distribution


class Sampler:
    """Turns a step's logits into next tokens; holds the RNG shared by requests without a seed."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.default_generator = torch.Generator(device=device)
        if seed is None:
            self.default_generator.seed()
        else:
            self.default_generator.manual_seed(seed % 2**64)

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        """Next tokens for [B, >= vocab] logits. NaN/+inf entries are sanitised in place, so the
        caller's float32 logits are overwritten there (a copy would cost a large allocation per step)."""
        batch, width = logits.shape
        if width < info.vocab_size:
            raise ValueError(f"logits: width {width} is smaller than vocab_size {info.vocab_size}")
        if info.batch_size != batch:
            raise ValueError(f"logits: batch {batch} does not match {info.batch_size} requests")
        raw = logits[:, : info.vocab_size].float()
        x, row_max, next_ids = _allowed_logits(raw, info)
        if not info.is_all_greedy:
            rows = info.sampled_rows
            if rows.numel() == batch:
                # Shifting by the max makes the best token exactly 0 and everything else <= 0,
                # so dividing by even a tiny temperature cannot produce inf - inf.
                shifted = x.sub_(row_max.unsqueeze(1)) if x is not raw else x - row_max.unsqueeze(1)
                next_ids = self._sample(shifted.div_(info.temperatures), info)
            else:
                shifted = x[rows].sub_(row_max[rows].unsqueeze(1))
                next_ids[rows] = self._sample(shifted.div_(info.temperatures[rows]), info)

        logprobs = top = None
        if return_logprob or top_logprobs_num > 0:
            log_dist = torch.log_softmax(raw, dim=-1)
            logprobs = log_dist.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if top_logprobs_num > 0:
                values, ids = torch.topk(log_dist, min(top_logprobs_num, info.vocab_size), dim=-1)
                top = (values, ids)
        return SampleOutput(next_token_ids=next_ids, logprobs=logprobs, top_logprobs=top)

    def _sample(self, z: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Draws one token per sampled row from z = (logits - max) / temperature, which it may overwrite."""
        rows = info.sampled_rows
        u = self._uniforms(info)
        log_min_p = info.min_ps[rows].log().unsqueeze(1) if info.need_min_p else None
        if info.filtered.numel() == 0:
            return _draw_plain(z, log_min_p, u)
        if info.filtered.numel() == rows.numel():
            return _draw_filtered(z, info, info.candidate_len, log_min_p, u, info.filtered)
        out = torch.empty(rows.numel(), dtype=torch.int64, device=z.device)
        plain = torch.ones(rows.numel(), dtype=torch.bool, device=z.device)
        plain[info.filtered] = False
        plain_pos = plain.nonzero().squeeze(1)
        f = info.filtered
        plain_min_p = None if log_min_p is None else log_min_p[plain_pos]
        filtered_min_p = None if log_min_p is None else log_min_p[f]
        out[plain_pos] = _draw_plain(z[plain_pos], plain_min_p, u[plain_pos])
        out[f] = _draw_filtered(z[f], info, info.candidate_len, filtered_min_p, u[f], f)
        return out

    def _uniforms(self, info: SamplingBatchInfo) -> torch.Tensor:
        """One U[0, 1) per sampled row: its seeded draw, or else one from the shared generator."""
        n = info.unseeded.numel()
        if not n:
            return info.uniforms
        shared = torch.rand(n, generator=self.default_generator, device=info.uniforms.device)
        return info.uniforms.index_put((info.unseeded,), shared)


def _allowed_logits(
    raw: torch.Tensor, info: SamplingBatchInfo
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits with NaN/+inf sanitised (in place) and, on a copy, the vocab mask, penalties, logit
    bias and banned ids applied, with their row maxima and argmax. Returns `raw` itself when nothing edits it.
    Sanitising every row costs one elementwise pass; checking first whether any row needs it would
    read the device back every step."""
    torch.nan_to_num_(raw, nan=_NEG_INF, posinf=_F32_MAX, neginf=_NEG_INF)
    x = raw.clone() if info.has_edits else raw
    if info.vocab_mask is not None:
        apply_token_bitmask_(x, info.vocab_mask)
    if info.penalties is not None:
        apply_penalties(x, info.penalties)
    bias = info.logit_bias
    if bias is not None:
        # A masked (-inf) token stays masked whatever its bias; |bias| <= 100 is far below half an ulp
        # of F32_MAX, so a sanitised logit cannot round up to inf.
        x.index_put_((bias.rows, bias.ids), bias.values, accumulate=True)
    banned = info.banned
    if banned is not None:
        before_ban = x[banned.rows, banned.ids]
        x[banned.rows, banned.ids] = _NEG_INF
    row_max, argmax = x.max(dim=-1)
    if banned is None and info.vocab_mask is None:
        # Only a mask or banned ids leave a working model's row without any allowed token; checking
        # every step would read the device back every step.
        return x, row_max, argmax
    dead = torch.isneginf(row_max)
    if banned is not None and bool(dead.any()):
        # Banning is a soft constraint (min_new_tokens): where it would leave no token, it is lifted.
        undo = dead[banned.rows]
        x[banned.rows[undo], banned.ids[undo]] = before_ban[undo]
        dead_rows = dead.nonzero().squeeze(1)
        row_max[dead_rows], argmax[dead_rows] = x[dead_rows].max(dim=-1)
        dead = torch.isneginf(row_max)
    if bool(dead.any()):
        raise ValueError(f"vocab_mask: rows {dead.nonzero().flatten().tolist()} allow no token")
    return x, row_max, argmax


def _draw_plain(z: torch.Tensor, log_min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    # p / p_max = exp(z), so "p < min_p * p_max" is "z < log(min_p)"; log(0) = -inf disables it.
    keep = None if log_min_p is None else z >= log_min_p
    return _inverse_cdf(z.exp_(), keep, u)


def _draw_filtered(
    z: torch.Tensor,
    info: SamplingBatchInfo,
    length: int,
    log_min_p: torch.Tensor | None,
    u: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Applies top-k, then top-p, then min-p on the `length` best tokens of each row and draws there.

    `positions` are the rows' places within sampled_rows. A top-p row without top-k whose nucleus
    is wider than the prefix is redone with a full sort (length = vocab size)."""
    vocab = info.vocab_size
    rows = info.sampled_rows[positions]
    ks = info.top_ks[rows].unsqueeze(1)
    top_ps = info.top_ps[rows].unsqueeze(1)
    if length < vocab:
        values, order = torch.topk(z, length, dim=-1, sorted=True)
    else:
        values, order = torch.sort(z, dim=-1, descending=True)
    keep = torch.arange(length, device=z.device).unsqueeze(0) < ks
    probs = values.exp().mul_(keep)
    redo = None
    if info.need_top_p:
        cum = probs.cumsum(dim=-1)
        total = cum[:, -1:]
        unbounded = (ks >= vocab) & (top_ps < 1.0)
        # Without a top-k the nucleus is measured against the whole row's mass (summed the same way
        # on both paths, so the kept set doesn't depend on the batch); it fits the prefix iff the
        # prefix already holds top_p of that mass.
        total = torch.where(unbounded, z.exp().sum(dim=-1, keepdim=True), total)
        if length < vocab:
            redo = (unbounded & (cum[:, -1:] < top_ps * total)).squeeze(1)
        # Keep a token while the mass strictly before it is below top_p of the (top-k renormalised)
        # total; the best token has nothing before it, so it always stays.
        keep &= ((cum - probs) < top_ps * total) | (top_ps >= 1.0)
    if log_min_p is not None:
        keep &= values >= log_min_p
    out = order.gather(1, _inverse_cdf(probs, keep, u).unsqueeze(1)).squeeze(1)
    if redo is not None and bool(redo.any()):
        idx = redo.nonzero().squeeze(1)
        sub_min_p = None if log_min_p is None else log_min_p[idx]
        out[idx] = _draw_filtered(z[idx], info, vocab, sub_min_p, u[idx], positions[idx])
    return out


def _inverse_cdf(probs: torch.Tensor, keep: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from unnormalised probs [R, L] (restricted to keep) with one uniform per row.

    Inverse-CDF needs a single uniform per request, so a seeded row never depends on its neighbours.
    """
    if keep is not None:
        probs.mul_(keep)
    cdf = probs.cumsum_(dim=-1)
    total = cdf[:, -1:]
    # The target stays strictly below the total, and right=True picks the first index whose cdf
    # exceeds it: that index always carries non-zero mass, so masked tokens cannot be drawn.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)


def _pairs(
    rows: list[int] | range, token_lists: list[list[int]], vocab_size: int, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors for ragged per-row token lists, rejecting ids outside the vocab."""
    ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
        raise ValueError(f"{name}: token ids {bad} are outside [0, {vocab_size})")
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    return torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64), lengths), ids


def _unique_pairs(
    rows: list[int] | range, token_lists: list[list[int]], vocab_size: int, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unique (row, token id) pairs of ragged per-row token lists, with their counts."""
    row_ids, ids = _pairs(rows, token_lists, vocab_size, name)
    keys, counts = torch.unique(row_ids * vocab_size + ids, return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts
