"""Speculative decoding without a draft model: prompt-lookup (n-gram) drafting and the bookkeeping
of a verified draft.

A decoding request proposes the tokens that followed the latest earlier occurrence of its last
few tokens in its own prompt and output (summaries, quotes, code edits and RAG answers repeat their
context). The draft tokens are computed in the same forward as the request's pending token, every
row is sampled as usual and the executor accepts drafts while they equal what was sampled
(`accepted_draft_len`); here the KV of what was not accepted is rolled back, so the radix tree and
the request hold only the tokens it really emitted. Nothing here touches a tensor.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from radixlm_runtime.constrained.backend import bit_allowed
from radixlm_runtime.kvcache.allocator import TokenAllocator
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.step import ForwardItem, ItemResult


def propose(token_ids: Sequence[int], max_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to max_tokens tokens that followed the latest earlier occurrence of the last n tokens of
    token_ids, trying n from ngram_max down to ngram_min; [] when none of them occurred before."""
    n_ids = len(token_ids)
    if max_tokens <= 0 or n_ids < 2:
        return []
    # bytes.rfind searches in C; a hit must start on a token boundary (a multiple of 4 bytes).
    data = array("I", token_ids).tobytes()
    for n in range(min(ngram_max, n_ids - 1), ngram_min - 1, -1):
        pattern = data[(n_ids - n) * 4 :]
        end = (n_ids - 1) * 4  # the match must end before the last token, so something follows it
        while (hit := data.rfind(pattern, 0, end)) >= 0:
            if hit % 4 == 0:
                start = hit // 4 + n
                return list(token_ids[start : start + max_tokens])
            end = hit + len(pattern) - 1
    return []


class Drafter:
    """Proposes each decoding request's draft, cut where it could not be emitted."""

    def __init__(
        self,
        num_draft_tokens: int,
        ngram_min: int,
        ngram_max: int,
        eos_ids: frozenset[int],
        context_len: int,
        vocab_size: int,
    ) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.eos_ids = eos_ids
        self.context_len = context_len
        self.vocab_size = vocab_size

    def draft(self, req: Req, room: int) -> list[int]:
        """At most `room` tokens (the KV slots the step can spare). A draft never passes
        max_new_tokens or the context, stops before a stop or EOS token (the request would end
        there, so nothing after it could be emitted) and before the first token the request's
        constraint forbids (it would be rejected anyway)."""
        limit = min(
            self.num_draft_tokens,
            room,
            req.remaining_new_tokens() - 1,
            self.context_len - len(req.token_ids),
        )
        tokens = propose(req.token_ids, limit, self.ngram_min, self.ngram_max)
        stops = self.eos_ids | set(req.sampling_params.stop_token_ids)
        for i, tok in enumerate(tokens):
            if tok in stops:
                del tokens[i:]
                break
        if req.guide is not None and tokens:
            del tokens[self._constrained_len(req, tokens) :]
        return tokens

    def _constrained_len(self, req: Req, tokens: list[int]) -> int:
        """How many leading draft tokens the constraint allows, each after the ones before it."""
        guide = req.guide
        assert guide is not None
        n = 0
        for tok in tokens:
            if guide.is_finished() or not bit_allowed(guide.allowed_mask(self.vocab_size), tok):
                break
            guide.advance(tok)
            n += 1
        guide.rollback(n)
        return n


def record_verify(req: Req, item: ForwardItem, result: ItemResult) -> None:
    """Counts one verify step of req in its meta_info counters."""
    req.spec_verify_ct += 1
    req.spec_draft_token_num += item.draft_len
    req.spec_accept_token_num += len(result.accepted)


def roll_back_rejected(req: Req, item: ForwardItem, allocator: TokenAllocator) -> int:
    """Frees the KV of the computed tokens req did not keep (rejected draft tokens, and accepted
    ones cut off by a stop, max_new_tokens or a jump-forward) and returns how many. Like every
    decoding request, req keeps its last token without KV: it is computed with the next step."""
    start = item.prefix_len
    kept = req.token_ids[start : start + len(item.input_ids)]
    same = next((i for i, (a, b) in enumerate(zip(kept, item.input_ids)) if a != b), len(kept))
    valid = min(start + same, len(req.token_ids) - 1)
    freed = req.kv_slots[valid:]
    allocator.free(freed)
    del req.kv_slots[valid:]
    req.kv_len = valid
    req.table_synced = min(req.table_synced, valid)
    return len(freed)
