"""Turns the scheduled items into the executor's StepPlan: KV slots for the new tokens, which
logits rows each request needs, and how each next token is to be sampled."""

from __future__ import annotations

from radixlm_runtime.scheduler.admission import ScheduledItem
from radixlm_runtime.scheduler.cache import CacheManager
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.step import ForwardItem, PromptLogprobSpec, SampleSpec, StepPlan


def build_plan(
    items: list[ScheduledItem], cache: CacheManager, eos_ids: frozenset[int], vocab_size: int
) -> StepPlan:
    for it in items:  # window slots no query of this step sees go first, for this step to use
        cache.trim_windows(it.req, it.prefix_len)
    total = sum(it.extend_len for it in items)
    slots = cache.alloc_slots(total)
    if slots is None:
        raise RuntimeError(f"KV pool exhausted: needed {total} slots, {cache.available_tokens()} available")
    forward: list[ForwardItem] = []
    offset = 0
    for it in items:
        req = it.req
        assert len(req.kv_slots) == it.prefix_len, "a request's slots and its computed KV disagree"
        end = it.prefix_len + it.extend_len
        req.kv_slots += slots[offset : offset + it.extend_len]
        offset += it.extend_len
        needs_prompt = req.needs_prompt_logprobs
        first = _first_logit_pos(it, needs_prompt)
        due = it.completes and req.sampling_params.max_new_tokens > 0
        specs = _sample_specs(req, it.draft, eos_ids, vocab_size) if due else []
        input_ids = req.token_ids[it.prefix_len : end - len(it.draft)]
        wants_prompt = needs_prompt and first < end
        forward.append(
            ForwardItem(
                row=_row(req),
                prefix_len=it.prefix_len,
                input_ids=input_ids + it.draft if it.draft else input_ids,
                seq_slots=req.kv_slots,
                write_from=req.table_synced,
                logits_from=first,
                sample=specs[0] if specs else None,
                prompt_logprobs=_prompt_logprob_spec(req, first, end) if wants_prompt else None,
                draft_len=len(it.draft),
                draft_samples=specs[1:],
                window_slots=cache.window_slots(req, req.table_synced, end),
            )
        )
        req.table_synced = end
        # Counted as computed from now on: whatever runs after this step on the device sees its KV.
        req.kv_len = end
    return StepPlan(forward, cache.take_copies())


def _row(req: Req) -> int:
    assert req.req_pool_idx is not None, "a scheduled request has a table row"
    return req.req_pool_idx


def _first_logit_pos(it: ScheduledItem, needs_prompt: bool) -> int:
    """First position of this chunk whose logits are needed: the prompt-logprob range when asked
    for, else only the last token (and only when the chunk completes the request's tokens)."""
    last = it.prefix_len + it.extend_len - 1 - len(it.draft)
    if needs_prompt:
        return max(it.prefix_len, it.req.logprob_start_len - 1, 0)
    return last if it.completes else last + 1


def _prompt_logprob_spec(req: Req, first: int, end: int) -> PromptLogprobSpec:
    """Row i (position first + i) predicts the token at first + i + 1, which is a prompt token
    whose logprob is wanted while logprob_start_len <= first + i + 1 < prompt_len."""
    keep = [i for i in range(end - first) if req.logprob_start_len <= first + i + 1 < req.prompt_len]
    return PromptLogprobSpec(
        rows=keep,
        targets=[req.token_ids[first + i + 1] for i in keep],
        positions=[first + i + 1 for i in keep],
        top_logprobs_num=req.top_logprobs_num,
    )


def _sample_specs(req: Req, draft: list[int], eos_ids: frozenset[int], vocab_size: int) -> list[SampleSpec]:
    """How to sample the row of req's last token, then the row of each draft token as if the draft
    up to it were accepted: min_new_tokens, penalties and the constraint see those tokens too."""
    if not draft:
        return [_sample_spec(req, draft, eos_ids, vocab_size)]
    specs = []
    for i in range(len(draft) + 1):
        specs.append(_sample_spec(req, draft[:i], eos_ids, vocab_size))
        if i < len(draft) and req.guide is not None:
            req.guide.advance(draft[i])
    if req.guide is not None:
        req.guide.rollback(len(draft))
    return specs


def _sample_spec(req: Req, ahead: list[int], eos_ids: frozenset[int], vocab_size: int) -> SampleSpec:
    """The spec of the row after req's tokens followed by `ahead` (draft tokens; the guide already
    advanced through them)."""
    sp = req.sampling_params
    draw = req.output_len + len(ahead)
    early = draw < sp.min_new_tokens
    banned = sorted(eos_ids | set(sp.stop_token_ids)) if early else []
    if not early and sp.ignore_eos and req.guide is not None:
        # A constraint ends its output on EOS; under ignore_eos it goes on while any other token
        # fits (the ban is soft: lifted where EOS is all the constraint allows).
        banned = sorted(eos_ids)
    return SampleSpec(
        params=sp,
        seed=req.seed,
        draw=draw,
        banned_ids=banned,
        history=(req.origin_input_ids, req.output_ids + ahead) if sp.has_penalties else None,
        allowed=req.guide.allowed_mask(vocab_size) if req.guide is not None else None,
        return_logprob=req.return_logprob,
        top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
    )
