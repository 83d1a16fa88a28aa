"""The scheduler loop: radix match -> batch -> forward -> sample -> finish, one step at a time.

Every step forms one mixed batch: one decode token for each running request, plus prefill chunks
of waiting requests (in cache-aware order) up to the per-step token budget. Where a constraint forces
the next text (JSON keys, punctuation, literals), jump-forward appends it right after sampling and
the request computes those tokens in its next step, as a short extend. Finished requests leave
at once and their KV stays in the radix tree for reuse. When decode runs out of KV slots the newest
requests are retracted to the queue and later recomputed from their prompt plus what they
already generated, so nothing is lost or duplicated.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixlm_runtime.constrained import (
    ConstraintCompiler,
    RegexGuide,
    TokenIndex,
    TokenVocab,
    build_vocab_mask,
    plan_jump,
)
from radixlm_runtime.engine.forward_batch import ForwardBatch
from radixlm_runtime.engine.limits import RequestLimits
from radixlm_runtime.engine.model_runner import ModelRunner
from radixlm_runtime.engine.tokenizer import eos_token_ids
from radixlm_runtime.sampling.sampler import Sampler, SamplingBatchInfo
from radixlm_runtime.scheduler.cache import CacheManager
from radixlm_runtime.scheduler.policy import SchedulePolicy
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

# After a retraction, admission reserves KV for every remaining token of running requests, then
# relaxes back to ServerArgs.new_token_ratio step by step.
NEW_TOKEN_RATIO_DECAY = 0.002
# Requests whose uncached parts start with this many identical tokens are not prefilled in the
# same step: the second one will find the first one's KV in the tree next step.
IN_BATCH_PREFIX_CHECK = 32
# A chunked prefill always advances by at least this many tokens, however many requests decode.
MIN_CHUNK = 16
# How long a step with nothing to run waits for a constraint compile: long enough not to spin,
# short enough that the server loop keeps reading new requests.
COMPILE_POLL_S = 0.01


@dataclass
class _Item:
    req: Req
    prefix_len: int
    extend_len: int
    logit_row: int = 0  # first row of this request's logits
    num_rows: int = 0
    first_logit_pos: int = 0  # sequence position of the first logits row
    # Whether this chunk reaches the end of the request's tokens (so a next token is due); fixed at
    # scheduling time, before sampling grows fill_ids.
    completes_fill: bool = False

    is_prefill: bool = True

    def __post_init__(self) -> None:
        self.completes_fill = self.prefix_len + self.extend_len == len(self.req.fill_ids)


class Scheduler:
    def __init__(self, runner: ModelRunner, args: ServerArgs, tokenizer, eos_token_ids: list[int]) -> None:
        self.runner = runner
        self.limits = RequestLimits(runner.config.vocab_size, runner.context_len, runner.max_total_tokens)
        self._seed_counter = itertools.count()
        self.args = args
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.context_len = runner.context_len
        self.vocab_size = runner.config.vocab_size
        self.cache = CacheManager(
            runner.allocator,
            runner.req_to_token_pool,
            args.disable_radix_cache,
            args.session_timeout_s,
            args.session_pin_fraction,
        )
        self.policy = SchedulePolicy(args.schedule_policy, self.cache.tree)
        self.sampler = Sampler()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = args.new_token_ratio
        self._aborts: set[str] = set()
        self.stats = SchedulerStats()
        # Built on the first constrained request, so unconstrained use pays nothing at start-up.
        self.compiler: ConstraintCompiler | None = None
        # Constrained requests whose compile is in flight; they join `waiting` once it is done.
        self.compiling: list[tuple[Req, Future[TokenIndex]]] = []

    @classmethod
    def build(cls, model_dir: Path, args: ServerArgs, tokenizer: Any) -> Scheduler:
        """Loads the model and KV memory and wires a scheduler to them: the whole runtime below
        the tokenizer, as both the offline Engine and the server's scheduler process run it."""
        runner = ModelRunner(model_dir, args)
        return cls(runner, args, tokenizer, eos_token_ids(tokenizer, runner.config.eos_token_ids))

    # -- public API ---------------------------------------------------------------------------
    def new_generator(self, seed: int | None) -> torch.Generator:
        """A request's own RNG: seeded requests sample the same tokens whatever batch they join."""
        if seed is None:
            seed = self.args.random_seed * 1_000_003 + next(self._seed_counter)
        gen = torch.Generator(device=self.runner.device)
        gen.manual_seed(seed)
        return gen

    def info(self) -> dict[str, Any]:
        """KV memory and counters; when idle, free_tokens + cached_tokens_in_tree == max_total_tokens."""
        self.cache.sessions.expire()  # expiry is lazy: settle it before reading the counters
        tree = self.cache.tree
        return {
            "max_total_tokens": self.runner.max_total_tokens,
            "context_length": self.context_len,
            "free_tokens": self.runner.allocator.available_size(),
            "cached_tokens_in_tree": tree.total_size() if tree is not None else 0,
            "evictable_tokens": tree.evictable_size() if tree is not None else 0,
            "protected_tokens": tree.protected_size() if tree is not None else 0,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + len(self.compiling) + (self.chunked is not None),
            "num_sessions": len(self.cache.sessions),
            "pinned_tokens": self.cache.sessions.pinned_tokens(),
            **vars(self.stats),
        }

    def add_request(self, req: Req) -> None:
        """Queues req; a constrained one first compiles in the background while others keep running."""
        self.stats.num_requests += 1
        if req.session_id is not None:
            self.cache.sessions.open(req.session_id, req.rid)
        if req.is_constrained and req.guide is None:
            sp = req.sampling_params
            self.compiling.append(
                (req, self._constraint_compiler().submit_constraint(sp.regex, sp.json_schema))
            )
        else:
            self.waiting.append(req)

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.compiling)

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        return self.cache.flush()

    def step(self) -> list[Req]:
        """Runs one forward step; returns the requests that got a token or finished in it."""
        done = self._apply_aborts() + self._collect_compiled()
        items = self._schedule()
        if not items:
            if self.compiling and not done:
                wait([f for _, f in self.compiling], timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
            return done
        batch = self._prepare(items)
        logits = self.runner.forward(batch)
        self.stats.forward_passes += 1
        return done + self._process(items, logits)

    # -- constraints --------------------------------------------------------------------------
    def _constraint_compiler(self) -> ConstraintCompiler:
        if self.compiler is None:
            vocab = TokenVocab.from_tokenizer(self.tokenizer, eos_ids=sorted(self.eos_token_ids))
            self.compiler = ConstraintCompiler(vocab)
        return self.compiler

    def _collect_compiled(self) -> list[Req]:
        """Moves requests whose compile is done to the queue, each with its own guide and the text its
        constraint forces from the start already appended; finishes (and returns) those whose
        constraint did not compile or forced the whole output."""
        if not any(f.done() for _, f in self.compiling):
            return []
        ended: list[Req] = []
        pending: list[tuple[Req, Future[TokenIndex]]] = []
        for req, future in self.compiling:
            if not future.done():
                pending.append((req, future))
            elif (exc := future.exception()) is not None:
                field_name = "regex" if req.sampling_params.regex is not None else "json_schema"
                message = str(exc) if str(exc).startswith(field_name) else f"{field_name}: {exc}"
                req.finished_reason = {"type": "abort", "message": message}
                self._finish(req)
                ended.append(req)
            else:
                req.guide = RegexGuide(future.result())
                if self._jump_forward(req, tail=0):
                    self._check_finish(req)
                if req.finished:
                    self._finish(req)
                    ended.append(req)
                else:
                    self.waiting.append(req)
        self.compiling = pending
        return ended

    # -- scheduling ---------------------------------------------------------------------------
    def _schedule(self) -> list[_Item]:
        self.new_token_ratio = max(self.args.new_token_ratio, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        pending = self.chunked
        want = 0
        if pending is not None:
            room = max(self.args.chunked_prefill_size - self._pending_tokens(), MIN_CHUNK)
            want = min(len(pending.fill_ids) - pending.kv_len, room)
        decode = self._reserve_decode(want)
        # A running request computes its sampled token, plus any tokens jump-forward appended.
        items = [_Item(r, r.kv_len, r.pending_len, is_prefill=False) for r in decode]
        decode_tokens = sum(it.extend_len for it in items)
        budget = self.args.chunked_prefill_size - decode_tokens
        if pending is not None:
            items.append(_Item(pending, pending.kv_len, want))
            budget -= want
            if pending.kv_len + want == len(pending.fill_ids):
                self.chunked = None
        if budget > 0 and self.chunked is None and self.waiting:
            items.extend(self._admit(budget, decode_tokens))
        return items

    def _reserve_decode(self, extra: int) -> list[Req]:
        """Makes sure every running request can store its pending tokens (and the chunked prefill in
        progress its next `extra` tokens), retracting the newest requests when the pool (free plus
        evictable) is too small. Idle sessions' pins beyond their share go first."""
        while self.running and self.cache.available_tokens() < self._pending_tokens() + extra:
            if self.cache.sessions.give_way(stalled=False):
                continue
            victim = max(self.running, key=lambda r: (r.arrival_time, r.rid))
            self.running.remove(victim)
            self.cache.release(victim)
            self.waiting.appendleft(victim)
            self.new_token_ratio = 1.0
            self.stats.num_retractions += 1
            logger.debug("retracted %s (%d tokens generated)", victim.rid, len(victim.output_ids))
        return list(self.running)

    def _pending_tokens(self) -> int:
        """Tokens the running requests compute next step: one each, more after a jump-forward."""
        return sum(r.pending_len for r in self.running)

    def _admit(self, budget: int, decode_tokens: int) -> list[_Item]:
        ordered = self.policy.order(list(self.waiting), self.cache.sessions.pinned_ids())
        reserved = (
            sum(int(r.remaining_new_tokens() * self.new_token_ratio) for r in self.running) + decode_tokens
        )
        items: list[_Item] = []
        seen_prefixes: set[tuple[int, ...]] = set()
        admitted: set[int] = set()
        for req in ordered:
            if budget <= 0 or len(self.running) + len(items) >= self.args.max_running_requests:
                break
            prefix_len = len(req.prefix_indices)
            fill = req.fill_ids
            probe = tuple(fill[: prefix_len + IN_BATCH_PREFIX_CHECK])
            if len(probe) == prefix_len + IN_BATCH_PREFIX_CHECK and probe in seen_prefixes:
                continue
            ext = min(len(fill) - prefix_len, budget)
            need = len(fill) - prefix_len + int(req.remaining_new_tokens() * self.new_token_ratio)
            if not self._fits(need + reserved, req, admitted_any=bool(items)):
                break
            if not self.cache.admit(req):
                break
            seen_prefixes.add(probe)
            admitted.add(id(req))
            items.append(_Item(req, req.kv_len, ext))
            budget -= ext
            reserved += need
            if req.kv_len + ext < len(fill):
                self.chunked = req
                break
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
        return items

    def _fits(self, need: int, req: Req, admitted_any: bool) -> bool:
        """Whether req's KV needs fit, once session pins gave way as far as they must (see
        SessionTable.give_way): when nothing runs nor was admitted this step, waiting would stall
        the queue for good."""
        while need > self.cache.available_tokens() - self._pinned_by_admission(req):
            stalled = not self.running and not admitted_any
            if not self.cache.sessions.give_way(stalled, spare=req.session_id):
                return False
        return True

    def _pinned_by_admission(self, req: Req) -> int:
        """Tokens of req's prefix that are evictable now but become pinned once it is admitted."""
        node = req.last_node
        pinned = 0
        while node is not None and node.lock_ref == 0:
            pinned += len(node.key)
            node = node.parent
        return pinned

    # -- batch preparation --------------------------------------------------------------------
    def _prepare(self, items: list[_Item]) -> ForwardBatch:
        total = sum(it.extend_len for it in items)
        slots = self.cache.alloc_slots(total)
        if slots is None:
            raise RuntimeError(
                f"KV pool exhausted: needed {total} slots, {self.cache.available_tokens()} available"
            )
        input_ids: list[int] = []
        logits_rows: list[int] = []
        offset = 0
        table = self.cache.req_to_token
        for it in items:
            req = it.req
            fill = req.fill_ids
            input_ids.extend(fill[it.prefix_len : it.prefix_len + it.extend_len])
            table[req.req_pool_idx, it.prefix_len : it.prefix_len + it.extend_len] = slots[
                offset : offset + it.extend_len
            ]
            first = self._first_logit_pos(it)
            last = it.prefix_len + it.extend_len - 1
            it.logit_row = len(logits_rows)
            it.first_logit_pos = first
            if first <= last:
                it.num_rows = last - first + 1
                start_row = offset + (first - it.prefix_len)
                logits_rows.extend(range(start_row, start_row + it.num_rows))
            offset += it.extend_len
        return ForwardBatch.build(
            input_ids=input_ids,
            req_pool_indices=[it.req.req_pool_idx for it in items],
            prefix_lens=[it.prefix_len for it in items],
            extend_lens=[it.extend_len for it in items],
            out_cache_loc=slots,
            logits_indices=logits_rows,
            device=self.runner.device,
        )

    def _first_logit_pos(self, it: _Item) -> int:
        """First position of this chunk whose logits are needed: the prompt-logprob range when asked
        for, else only the last token (and only when the chunk completes the request's tokens)."""
        req = it.req
        last = it.prefix_len + it.extend_len - 1
        if req.wants_input_logprobs and not req.output_ids:
            return max(it.prefix_len, req.logprob_start_len - 1, 0)
        return last if it.completes_fill else last + 1

    # -- results ------------------------------------------------------------------------------
    def _process(self, items: list[_Item], logits: torch.Tensor) -> list[Req]:
        to_sample: list[_Item] = []
        for it in items:
            req = it.req
            req.kv_len = it.prefix_len + it.extend_len
            if req.wants_input_logprobs and not req.output_ids and it.num_rows:
                self._collect_input_logprobs(it, logits)
            if not it.completes_fill:
                continue
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = {"type": "length", "length": 0}
            else:
                to_sample.append(it)
        self.stats.computed_tokens += sum(it.extend_len for it in items)
        if to_sample:
            self._sample(to_sample, logits)
        updated: list[Req] = []
        for it in items:
            req = it.req
            if req.finished:
                self._finish(req)
                updated.append(req)
                continue
            if it.is_prefill:
                # Publish the prefilled tokens right away, so waiting requests sharing them match
                # them from the next step on instead of recomputing them.
                self.cache.cache_unfinished(req)
            if it.completes_fill:
                if req not in self.running:
                    self.running.append(req)
                updated.append(req)
        return updated

    def _sample(self, items: list[_Item], logits: torch.Tensor) -> None:
        rows = torch.tensor([it.logit_row + it.num_rows - 1 for it in items], device=logits.device)
        reqs = [it.req for it in items]
        params = [r.sampling_params for r in reqs]
        need_history = any(
            p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 for p in params
        )
        history = [(r.origin_input_ids, r.output_ids) for r in reqs] if need_history else None
        banned = [self._banned_ids(r) for r in reqs]
        info = SamplingBatchInfo.build(
            params,
            [r.generator for r in reqs],
            history,
            self.vocab_size,
            logits.device,
            banned_token_ids=banned if any(banned) else None,
        )
        info.vocab_mask = build_vocab_mask([r.guide for r in reqs], self.vocab_size, logits.device)
        want_lp = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        out = self.sampler(logits.index_select(0, rows), info, return_logprob=want_lp, top_logprobs_num=top_n)
        next_ids = out.next_token_ids.tolist()
        now = time.monotonic()
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            req.output_ids.append(tok)
            if req.guide is not None:
                try:
                    req.guide.advance(tok)
                except ValueError as e:
                    # A constraint out of step with its own mask fails this request, not the loop.
                    req.finished_reason = {"type": "abort", "message": f"constraint error: {e}"}
            self.stats.generated_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            if req.return_logprob:
                req.output_token_logprobs.append(float(out.logprobs[i]))
                if req.top_logprobs_num and out.top_logprobs is not None:
                    vals, ids = out.top_logprobs
                    k = req.top_logprobs_num
                    req.output_top_logprobs.append(list(zip(vals[i, :k].tolist(), ids[i, :k].tolist())))
            if not req.finished:
                self._check_finish(req)
            if not req.finished and self._jump_forward(req, tail=1):
                self._check_finish(req)

    def _banned_ids(self, req: Req) -> list[int]:
        sp = req.sampling_params
        if len(req.output_ids) >= sp.min_new_tokens:
            return []
        return sorted(self.eos_token_ids | set(sp.stop_token_ids))

    def _collect_input_logprobs(self, it: _Item, logits: torch.Tensor) -> None:
        req = it.req
        fill = req.fill_ids
        rows = logits[it.logit_row : it.logit_row + it.num_rows]
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        if it.prefix_len == 0 and req.logprob_start_len == 0:
            req.input_token_logprobs.append(None)
            req.input_top_logprobs.append(None)
        # Row i (position p) predicts the token at p + 1, which belongs to the prompt only while
        # p + 1 < prompt_len.
        positions = range(it.first_logit_pos, it.first_logit_pos + it.num_rows)
        keep = [i for i, p in enumerate(positions) if req.logprob_start_len <= p + 1 < req.prompt_len]
        if not keep:
            return
        idx = torch.tensor(keep)
        targets = torch.tensor([fill[it.first_logit_pos + i + 1] for i in keep])
        chosen = logprobs[idx].gather(1, targets[:, None]).squeeze(1)
        req.input_token_logprobs.extend(chosen.tolist())
        if req.top_logprobs_num:
            vals, ids = logprobs[idx].topk(req.top_logprobs_num, dim=-1)
            req.input_top_logprobs.extend(list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist()))

    def _jump_forward(self, req: Req, tail: int) -> bool:
        """Appends the text req's constraint forces, tokenized together with the last `tail` output
        tokens (the token sampled this step, not yet computed nor reported, so rewriting it changes
        no KV and nothing a client has seen). Returns whether it jumped.

        Forced tokens count as output tokens (bounded by max_new_tokens) but were not sampled, so
        requests returning logprobs never jump; nor does a jump ever cross a stop token or string.
        """
        if self.args.disable_jump_forward or req.guide is None or req.return_logprob:
            return False
        kept = len(req.output_ids) - tail
        room = min(req.sampling_params.max_new_tokens, self.context_len - req.prompt_len) - kept
        jump = plan_jump(
            req.guide,
            req.output_ids[kept:],
            self._constraint_compiler().vocab.texts,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
            min(room, self.args.chunked_prefill_size),
        )
        if jump is None or self._crosses_stop(req, kept, jump.ids):
            return False
        del req.output_ids[kept:]
        req.output_ids.extend(jump.ids)
        req.guide.advance_text(jump.text)
        self.stats.jump_forwards += 1
        self.stats.jump_forward_tokens += len(jump.ids) - tail
        return True

    def _crosses_stop(self, req: Req, kept: int, ids: list[int]) -> bool:
        """Whether appending ids after output_ids[:kept] would complete a stop token or string, which
        must end the request where decoding token by token would."""
        sp = req.sampling_params
        if sp.stop_token_ids and not set(ids).isdisjoint(sp.stop_token_ids):
            return True
        if not sp.stop:
            return False
        longest = max(len(s) for s in sp.stop)
        text = self.tokenizer.decode(req.output_ids[max(kept - longest, 0) : kept] + ids)
        return any(s in text for s in sp.stop)

    def _check_finish(self, req: Req) -> None:
        sp = req.sampling_params
        tok = req.output_ids[-1]
        if tok in self.eos_token_ids and not sp.ignore_eos or tok in sp.stop_token_ids:
            req.finished_reason = {"type": "stop", "matched": tok}
        elif sp.stop and (matched := self._match_stop_str(req)) is not None:
            req.finished_reason = {"type": "stop", "matched": matched}
        elif req.guide is not None and req.guide.is_finished():
            # The output is a complete match that no token can extend (or took EOS under ignore_eos).
            req.finished_reason = {"type": "stop", "matched": None}
        elif len(req.output_ids) >= sp.max_new_tokens:
            req.finished_reason = {"type": "length", "length": sp.max_new_tokens}
        elif len(req.fill_ids) >= self.context_len:
            req.finished_reason = {"type": "length", "length": len(req.output_ids)}

    def _match_stop_str(self, req: Req) -> str | None:
        longest = max(len(s) for s in req.sampling_params.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 2) :])
        for s in req.sampling_params.stop:
            if s in tail:
                return s
        return None

    def _finish(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        self.cache.finish(req)
        self.stats.prompt_tokens += req.prompt_len
        self.stats.cached_tokens += max(req.cached_tokens, 0)
        self.stats.finished_requests += 1

    def _apply_aborts(self) -> list[Req]:
        if not self._aborts:
            return []
        aborted: list[Req] = []
        compiling = [r for r, _ in self.compiling]
        for req in [*self.waiting, *compiling, *self.running, *([self.chunked] if self.chunked else [])]:
            if req.rid in self._aborts:
                req.finished_reason = {"type": "abort", "message": "aborted by request"}
                aborted.append(req)
        self._aborts.clear()
        for req in aborted:
            if req in self.waiting:
                self.waiting.remove(req)
            if req is self.chunked:
                self.chunked = None
            self._finish(req)
        self.compiling = [(r, f) for r, f in self.compiling if not r.finished]
        return aborted


@dataclass
class SchedulerStats:
    num_requests: int = 0
    finished_requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    forward_passes: int = 0
    # Jump-forward: jumps made, and output tokens they added without a decode step.
    jump_forwards: int = 0
    jump_forward_tokens: int = 0
