"""What a step's results do to its requests: KV progress, sampled tokens and logprobs, the
constraint's forced text (jump-forward), stop tokens and strings, and the deltas reported to the
entry points."""

from __future__ import annotations

import time
from typing import Any

from radixlm_runtime.config import SchedulerConfig
from radixlm_runtime.constrained.completion import shortest_completion, single_byte_tokens
from radixlm_runtime.constrained.jump_forward import apply_jump, plan_jump
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.messages import ReqOutput
from radixlm_runtime.scheduler.admission import ScheduledItem
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.stats import SchedulerStats
from radixlm_runtime.step import ForwardItem, ItemResult, TopLogprobs

# Remaining tokens (beyond its shortest output's length) from which a constrained request checks
# whether its budget still fits the shortest completion of its output.
BUDGET_HORIZON = 64


class OutputProcessor:
    def __init__(
        self,
        config: SchedulerConfig,
        tokenizer: Any,
        eos_ids: frozenset[int],
        context_len: int,
        stats: SchedulerStats,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_len = context_len
        self.stats = stats

    def apply(
        self, items: list[ScheduledItem], planned: list[ForwardItem], results: list[ItemResult]
    ) -> None:
        """Records a step's results on its requests; finishes those whose output is complete."""
        now = time.monotonic()
        for it, fwd, res in zip(items, planned, results):
            req = it.req
            spec = fwd.prompt_logprobs
            if spec is not None:
                tops = res.prompt_top_logprobs or [None] * len(spec.positions)
                for pos, lp, top in zip(spec.positions, res.prompt_logprobs, tops, strict=True):
                    req.record_logprob(pos, lp, top)
            if not it.completes:
                continue
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = FinishReason.by_length(0)
            elif res.next_token is not None:
                self._append_sampled(req, res, now)
        self.stats.computed_tokens += sum(it.extend_len for it in items)

    def _append_sampled(self, req: Req, res: ItemResult, now: float) -> None:
        """Appends the accepted draft tokens, then the sampled one, up to the first that ends the
        request or lets the constraint jump forward: nothing past a stop is emitted, and what
        follows a jump was computed for another sequence (its KV is rolled back). Then a
        constrained request whose budget is running out is completed (`complete_within_budget`)."""
        assert res.next_token is not None
        kept = len(req.token_ids)
        if not res.accepted and req.guide is None:  # the common case: one token, no constraint
            self._append_token(req, res.next_token, res.logprob, res.top_logprobs, now)
            return
        if self.grammar_failed(req):  # the mask this step sampled from no longer followed it
            return
        tokens: list[int] = [res.next_token]
        logprobs: list[float | None] = [res.logprob]
        tops: list[TopLogprobs | None] = [res.top_logprobs]
        if res.accepted:
            unknown = [None] * len(res.accepted)
            tokens[:0] = res.accepted
            logprobs[:0] = res.accepted_logprobs or unknown
            tops[:0] = res.accepted_top_logprobs or unknown
        for tok, logprob, top in zip(tokens, logprobs, tops, strict=True):
            self._append_token(req, tok, logprob, top, now)
            if req.finished:
                break
            if self.jump_forward(req, tail=1):
                self.check_finish(req)
                break
        if req.finished_reason is None or req.finished_reason.kind == "length":
            self.complete_within_budget(req, kept)
        self.grammar_failed(req)

    def _append_token(
        self, req: Req, tok: int, logprob: float | None, top: TopLogprobs | None, now: float
    ) -> None:
        req.token_ids.append(tok)
        if req.guide is not None:
            try:
                req.guide.advance(tok)
            except ValueError as e:
                # A constraint out of step with its own mask fails this request, not the loop.
                self.fail_constraint(req, str(e))
        self.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if req.return_logprob:
            assert logprob is not None
            req.output_token_logprobs.append(logprob)
            if req.top_logprobs_num and top is not None:
                req.output_top_logprobs.append(top)
            req.record_logprob(len(req.token_ids) - 1, logprob, top)
        if not req.finished:
            self.check_finish(req)

    # -- grammar-engine failures ---------------------------------------------------------------
    def grammar_failed(self, req: Req) -> bool:
        """Ends req with a constraint_error when its grammar engine gave up (its guide's mask then
        allows only EOS, which would otherwise end the request as an empty, successful stop)."""
        if req.guide is None or (error := req.guide.error()) is None:
            return False
        self.fail_constraint(req, f"the grammar engine gave up: {error}")
        return True

    def fail_constraint(self, req: Req, message: str) -> None:
        constraint = req.sampling_params.constraint
        assert constraint is not None
        req.finished_reason = FinishReason.constraint_error(str(constraint.error(message)), constraint.kind)

    # -- jump-forward -------------------------------------------------------------------------
    def jump_forward(self, req: Req, tail: int) -> bool:
        """Appends the text req's constraint forces, tokenized together with the last `tail` output
        tokens (the token sampled this step, not yet computed nor reported, so rewriting it changes
        no KV and nothing a client has seen). Returns whether it jumped.

        Forced tokens count as output tokens (bounded by max_new_tokens) but were not sampled, so
        requests returning logprobs never jump; nor does a jump ever cross a stop token or string.
        """
        if self.config.disable_jump_forward or req.guide is None or req.return_logprob or req.guide.error():
            return False
        kept = len(req.token_ids) - tail
        out_kept = kept - req.prompt_len
        room = min(req.sampling_params.max_new_tokens, self.context_len - req.prompt_len) - out_kept
        tail_ids = req.token_ids[kept:]
        ids = plan_jump(
            req.guide,
            tail_ids,
            self.tokenizer.decode,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            min(room, self.config.chunked_prefill_size),
        )
        if ids is None or self._crosses_stop(req, kept, ids) or not apply_jump(req.guide, tail_ids, ids):
            return False
        del req.token_ids[kept:]
        req.token_ids.extend(ids)
        self.stats.jump_forwards += 1
        self.stats.jump_forward_tokens += len(ids) - tail
        return True

    # -- valid under any budget ---------------------------------------------------------------
    def complete_within_budget(self, req: Req, kept: int) -> None:
        """Keeps a constrained request's output completable within its budget: where this step's
        tokens (from `kept` on: the token just sampled and what jump-forward added, not yet computed
        nor reported) made the shortest completion of its output outgrow the budget left, they are
        dropped, the completion from before them is appended (it fitted: the previous step checked)
        and the request ends (finish_reason length), so an output the budget cuts short still
        parses. While the completion fits, even exactly, decoding goes on: the model writes the
        output up to the last token it can. Requests returning logprobs are left alone (forced
        tokens have none)."""
        if req.guide is None or req.return_logprob or req.guide.error():
            return
        sp = req.sampling_params
        end = req.prompt_len + min(sp.max_new_tokens, self.context_len - req.prompt_len)
        # Watched from further out when the shortest output alone takes much of the budget: a few
        # free tokens there already leave no room for it.
        if end - len(req.token_ids) > BUDGET_HORIZON + req.shortest_output or req.guide.is_accepting():
            return
        need = self._shortest(req, end)  # None: not found within 4x the budget left
        fits = need is not None and len(need) <= end - len(req.token_ids)
        if fits or len(req.token_ids) == kept or req.guide.error():
            return  # an engine failure is reported by the caller (grammar_failed)
        dropped = req.token_ids[kept:]
        req.guide.rollback(len(dropped))
        del req.token_ids[kept:]
        need = self._shortest(req, end)
        if req.guide.error():
            return
        if need is None or len(need) > end - len(req.token_ids):
            self._force(req, dropped)  # nothing better from before them: decoding goes on with them
            return
        self._force(req, need)
        self.stats.budget_completions += 1
        req.finished_reason = FinishReason.by_length(req.output_len)

    def _force(self, req: Req, ids: list[int]) -> None:
        assert req.guide is not None
        if not req.guide.advance_tokens(ids):
            raise ValueError(f"the constraint refused its own completion {ids}")
        req.token_ids.extend(ids)

    def _shortest(self, req: Req, end: int) -> list[int] | None:
        """The shortest completion found of req's output, searched up to the budget's end."""
        assert req.guide is not None
        left = end - len(req.token_ids)
        tokens = single_byte_tokens(self.tokenizer)
        return shortest_completion(req.guide, tokens, self._encode, len(self.tokenizer), 4 * left + 16)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _crosses_stop(self, req: Req, kept: int, ids: list[int]) -> bool:
        """Whether appending ids after token_ids[:kept] would complete a stop token or string, which
        must end the request where decoding token by token would."""
        sp = req.sampling_params
        if sp.stop_token_ids and not set(ids).isdisjoint(sp.stop_token_ids):
            return True
        if not sp.stop:
            return False
        longest = max(len(s) for s in sp.stop)
        start = max(kept - longest, req.prompt_len)
        text = self.tokenizer.decode(req.token_ids[start:kept] + ids)
        return any(s in text for s in sp.stop)

    # -- finishing ----------------------------------------------------------------------------
    def check_finish(self, req: Req) -> None:
        sp = req.sampling_params
        tok = req.token_ids[-1]
        if tok in self.eos_ids and not sp.ignore_eos or tok in sp.stop_token_ids:
            req.finished_reason = FinishReason.stop(tok)
        elif sp.stop and (matched := self._match_stop_str(req)) is not None:
            req.finished_reason = FinishReason.stop(matched)
        elif req.guide is not None and req.guide.is_finished():
            # The output is a complete match that no token can extend (or took EOS under ignore_eos).
            req.finished_reason = FinishReason.stop(None)
        elif req.output_len >= sp.max_new_tokens:
            req.finished_reason = FinishReason.by_length(sp.max_new_tokens)
        elif len(req.token_ids) >= self.context_len:
            req.finished_reason = FinishReason.by_length(req.output_len)

    def _match_stop_str(self, req: Req) -> str | None:
        longest = max(len(s) for s in req.sampling_params.stop)
        start = max(len(req.token_ids) - (longest + 2), req.prompt_len)
        tail = self.tokenizer.decode(req.token_ids[start:])
        for s in req.sampling_params.stop:
            if s in tail:
                return s
        return None


def req_output(req: Req) -> ReqOutput:
    """What req gained since its last report: new tokens and logprobs (input logprobs once)."""
    start = req.sent_tokens
    req.sent_tokens = req.output_len
    out = ReqOutput(
        rid=req.rid,
        new_token_ids=req.token_ids[req.prompt_len + start :],
        finished_reason=req.finished_reason,
        prompt_tokens=req.prompt_len,
        completion_tokens=req.output_len,
        cached_tokens=max(req.cached_tokens, 0),
        spec_verify_ct=req.spec_verify_ct,
        spec_draft_token_num=req.spec_draft_token_num,
        spec_accept_token_num=req.spec_accept_token_num,
    )
    if req.first_scheduled_time is not None:
        out.queue_time = req.first_scheduled_time - req.arrival_time
    if req.return_logprob:
        out.output_token_logprobs = req.output_token_logprobs[start:]
        out.output_top_logprobs = req.output_top_logprobs[start:]
        if not req.sent_input_logprobs:
            req.sent_input_logprobs = True
            out.input_token_logprobs, out.input_top_logprobs = req.input_logprobs()
    return out
