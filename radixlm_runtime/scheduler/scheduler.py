"""The scheduler loop: radix match -> batch -> forward -> sample -> finish, one step at a time.

Every step forms one mixed batch: one decode token for each running request, plus prefill chunks
of waiting requests (in cache-aware order) up to the per-step token budget (admission.py). The
executor runs it from a plan of plain data (plan.py) and answers with plain data; what the answer
does to each request (tokens, stops, jump-forward) is output.py. Finished requests leave at once
and their KV stays in the radix tree for reuse. When decode runs out of KV slots the newest
requests are retracted to the queue and later recomputed from their prompt plus what they already
generated, so nothing is lost or duplicated. Nothing here touches a tensor.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from radixlm_runtime.config import SchedulerConfig
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.messages import GenerateReq, ReqOutput
from radixlm_runtime.kvcache.allocator import RowAllocator, TokenAllocator, WindowedAllocator
from radixlm_runtime.scheduler.admission import Admission, ScheduledItem
from radixlm_runtime.scheduler.cache import CacheManager
from radixlm_runtime.scheduler.constraints import ConstraintQueue
from radixlm_runtime.scheduler.output import OutputProcessor, req_output
from radixlm_runtime.scheduler.plan import build_plan
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.session import check_session_id
from radixlm_runtime.scheduler.speculative import Drafter, record_verify, roll_back_rejected
from radixlm_runtime.scheduler.stats import SchedulerStats
from radixlm_runtime.scheduler.step_budget import StepShape
from radixlm_runtime.step import Executor, ForwardItem, ItemResult, StepPlan, future_token
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class _Launched:
    items: list[ScheduledItem]
    plan: StepPlan
    handle: Any  # the executor's, for collect
    launched_at: float  # time.perf_counter() before the launch


class Scheduler:
    def __init__(
        self, runner: Executor, config: SchedulerConfig, tokenizer: Any, eos_ids: frozenset[int]
    ) -> None:
        self.runner = runner
        self.runner_info = runner.info
        self.config = config
        self.eos_ids = eos_ids
        self.stats = SchedulerStats()
        info = self.runner_info
        self.cache = CacheManager(
            _allocator(info.max_total_tokens, info.window_slots),
            RowAllocator(info.max_reqs),
            config.disable_radix_cache,
            config.session_timeout_s,
            config.session_pin_fraction,
            _allocator(info.host_kv_tokens, info.host_window_slots) if info.host_kv_tokens else None,
            config.kv_host_write_policy == "write_through",
            TokenAllocator(info.disk_kv_tokens) if info.disk_kv_tokens else None,
            config.kv_disk_write_policy == "write_through",
            runner.move_kv if info.disk_kv_tokens else None,
            info.disk_entries,
            info.disk_entry_slots,
            runner.prefetch_kv if info.disk_kv_tokens and not config.disable_kv_disk_prefetch else None,
            info.sliding_window if info.window_slots else 0,
        )
        self.drafter = (
            Drafter(
                config.speculative_num_draft_tokens,
                config.speculative_ngram_min_match_window_size,
                config.speculative_ngram_max_match_window_size,
                eos_ids,
                self.runner_info.context_len,
                self.runner_info.vocab_size,
            )
            if config.speculative_num_draft_tokens > 0
            else None
        )
        self.admission = Admission(config, self.cache, self.runner_info.max_reqs, self.stats, self.drafter)
        self.constraints = ConstraintQueue(
            tokenizer, eos_ids, self.runner_info.vocab_size, config.grammar_backend
        )
        self.output = OutputProcessor(config, tokenizer, eos_ids, self.runner_info.context_len, self.stats)
        self._seeds = itertools.count()
        self._aborts: set[str] = set()
        # Overlap scheduling: where steps run asynchronously, the step launched last, whose results
        # are read after the next one is launched.
        self.overlap = (
            self.runner_info.async_launch and not config.disable_overlap_schedule and self.drafter is None
        )
        self._inflight: _Launched | None = None
        # Requests that ended on arrival (`_computes_nothing`), reported by the next step.
        self._ended: list[Req] = []
        # When the last step's results were read: a step queued while the one before still ran
        # (overlap) starts computing only then.
        self._collected_at = 0.0
        # Since when steps have run nothing (no forward, no output); None while the last one did.
        self.idle_since: float | None = None

    # -- requests in --------------------------------------------------------------------------
    def submit(self, m: GenerateReq) -> Req:
        """Queues one sample; a constrained one first compiles in the background while others run."""
        # Unseeded requests still get a seed of their own, so their draws never depend on the batch.
        seed = m.seed if m.seed is not None else self.config.random_seed * 1_000_003 + next(self._seeds)
        req = Req(m, seed)
        self.stats.num_requests += 1
        if req.session_id is not None:
            self.cache.sessions.open(req.session_id, req.rid)
        if self._computes_nothing(req):
            req.finished_reason = FinishReason.by_length(0)
            self._finish(req)
            self._ended.append(req)
        elif req.is_constrained:
            self.constraints.submit(req)
        else:
            self.admission.waiting.append(req)
        return req

    def _computes_nothing(self, req: Req) -> bool:
        """A prompt-only request (no tokens, no logprobs) whose KV nothing would keep: with the radix
        cache disabled, its forward has no observable result. `select` sends such a request to warm
        the cache before scoring the choices; without a cache it would be a wasted prefill."""
        return (
            self.cache.tree is None
            and req.sampling_params.max_new_tokens == 0
            and not req.return_logprob
            and req.session_id is None
            and not req.is_constrained
        )

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    def close_session(self, session_id: str) -> bool:
        """Releases the session's pinned KV; False when no such session is open."""
        check_session_id(session_id)
        return self.cache.sessions.close(session_id)

    def flush_cache(self) -> bool:
        if self.num_live() > 0:
            return False
        if self._inflight is not None:  # only requests that already finished: nothing to report
            self._complete(self._inflight)
            self._inflight = None
        return self.cache.flush()

    def stalled_s(self) -> float:
        """Seconds that steps have run nothing while work waits (0 when the last step ran): with
        nothing else to wait on, a scheduling stall, which the entry points report."""
        if self.idle_since is None or not self.has_work():
            return 0.0
        return time.monotonic() - self.idle_since

    def has_work(self) -> bool:
        return self.num_live() > 0 or self._inflight is not None

    def queue_sizes(self) -> tuple[int, int]:
        """(running, waiting) requests, for the server's gauges."""
        return len(self.admission.running), len(self.admission.waiting)

    def num_live(self) -> int:
        a = self.admission
        return len(a.waiting) + len(a.running) + len(self.constraints) + len(a.partial) + len(self._ended)

    def info(self) -> dict[str, Any]:
        """KV memory and counters; when idle, free_tokens + cached_tokens_in_tree == max_total_tokens."""
        self.cache.sessions.expire()  # expiry is lazy: settle it before reading the counters
        tree = self.cache.tree
        a = self.admission
        return {
            "max_total_tokens": self.runner_info.max_total_tokens,
            "context_length": self.runner_info.context_len,
            "free_tokens": self.cache.allocator.available_size(),
            "cached_tokens_in_tree": tree.total_size() if tree is not None else 0,
            "evictable_tokens": tree.evictable_size() if tree is not None else 0,
            "protected_tokens": tree.protected_size() if tree is not None else 0,
            "num_running": len(a.running),
            "num_waiting": len(a.waiting) + len(self.constraints) + len(a.partial),
            "num_sessions": len(self.cache.sessions),
            "pinned_tokens": self.cache.sessions.pinned_tokens(),
            # Window slots of the sliding-window layers (0: they use the tokens' slots); free ones.
            "window_slots": self.runner_info.window_slots,
            "free_window_slots": windows.windows.available_size() if (windows := self.cache.windows) else 0,
            "host_window_slots": self.runner_info.host_window_slots,
            "free_host_window_slots": host.windows.available_size()
            if tree is not None and isinstance(host := tree.host_allocator, WindowedAllocator)
            else 0,
            **self._tier_info(),
            **vars(self.stats),
        }

    def _tier_info(self) -> dict[str, int | float]:
        """The host and disk KV tiers: their size and use, the prompt tokens served from each, and
        the tokens and bytes moved through them since start; the disk tier's reads and their time."""
        tree = self.cache.tree
        # (tokens, a windowed pool's window slots' rows beside them) moved each way.
        moved = (
            {
                "host_stored": (tree.stored_tokens, tree.stored_windows),
                "host_loaded": (tree.loaded_tokens, tree.loaded_windows),
                "disk_stored": (tree.disk_stored_tokens, tree.disk_stored_windows),
                "disk_loaded": (tree.disk_loaded_tokens, tree.disk_loaded_windows),
            }
            if tree is not None
            else dict.fromkeys(("host_stored", "host_loaded", "disk_stored", "disk_loaded"), (0, 0))
        )
        per_token, per_window = self.runner_info.kv_bytes_per_token, self.runner_info.kv_bytes_per_window_slot
        return {
            "host_tier_tokens": self.runner_info.host_kv_tokens,
            "cached_tokens_on_host": tree.host_size() if tree is not None else 0,
            "disk_tier_tokens": self.runner_info.disk_kv_tokens,
            "kv_bytes_per_token": per_token,
            "cached_tokens_on_disk": tree.disk_size() if tree is not None else 0,
            "device_hit_tokens": self.cache.device_hit_tokens,
            "host_hit_tokens": self.cache.host_hit_tokens,
            "disk_hit_tokens": self.cache.disk_hit_tokens,
            **{f"{k}_tokens": tokens for k, (tokens, _) in moved.items()},
            **{f"{k}_bytes": t * per_token + w * per_window for k, (t, w) in moved.items()},
            "host_evicted_tokens": tree.host_evicted_tokens if tree is not None else 0,
            "disk_evicted_tokens": tree.disk_evicted_tokens if tree is not None else 0,
            "disk_failed_tokens": tree.disk_failed_tokens if tree is not None else 0,
            "disk_reads": self.cache.disk_reads,
            "disk_read_seconds": self.cache.disk_read_seconds,
        }

    def close(self) -> None:
        """Shuts the disk tier down whole: what the tree holds only in memory is written to it (as far
        as it has room), with the moves still pending (written by the next step otherwise), and the
        executor finishes its writes."""
        tree = self.cache.tree
        if tree is not None and tree.disk_allocator is not None:
            tree.persist()
            self.runner.move_kv(tree.take_copies())
        self.runner.close()

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[ReqOutput]:
        """Runs one forward step; reports every request that got tokens or finished in it (under
        overlap scheduling, in the step before it, whose results are read after this one launches)."""
        updated = self._ended + self._apply_aborts() + self._queue_compiled()
        self._ended = []
        if self._inflight is not None and not self._can_overlap():
            updated += self._complete(self._inflight)
            self._inflight = None
        items = self.admission.schedule()
        launched = None
        if items:
            launched, failed = self._launch(items)
            updated += failed
        if self._inflight is not None:
            updated += self._complete(self._inflight)
            self._inflight = None
        if launched is not None and not self.overlap:
            updated += self._complete(launched)
        elif not items and len(self.constraints) and not updated:
            self.constraints.wait()
        outputs = [req_output(r) for r in dict.fromkeys(updated)]
        if items or outputs:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = time.monotonic()
        if launched is not None and self.overlap:
            self._inflight = launched
            self._append_futures(launched)
        return outputs

    def _launch(self, items: list[ScheduledItem]) -> tuple[_Launched | None, list[Req]]:
        """Plans and queues a step; when queueing raises, its requests fail (the loop goes on)."""
        launched_at = time.perf_counter()
        plan = build_plan(items, self.cache, self.eos_ids, self.runner_info.vocab_size)
        try:
            handle = self.runner.launch(plan)
        except Exception as e:
            logger.exception("forward step failed; aborting its %d requests", len(items))
            return None, self._fail(items, e)
        self.stats.forward_passes += 1
        return _Launched(items, plan, handle, launched_at), []

    def _complete(self, launched: _Launched) -> list[Req]:
        """Reads a launched step's results back and applies them. Requests that ended while it ran
        (under overlap: finished by the step before, or aborted) are skipped: their KV is released."""
        try:
            result = self.runner.collect(launched.handle)
        except Exception as e:
            logger.exception("forward step failed; aborting its %d requests", len(launched.items))
            live = [it for it in launched.items if not it.req.finished]
            return self._fail(live, e)
        self._time_step(launched)
        keep = [i for i, it in enumerate(launched.items) if not it.req.finished]
        items = [launched.items[i] for i in keep]
        planned = [launched.plan.items[i] for i in keep]
        results = [result.items[i] for i in keep]
        for it, fwd in zip(items, planned):
            if fwd.sample is not None and it.req.token_ids[-1] < 0:
                it.req.token_ids.pop()  # the future token stands in no longer
        self.output.apply(items, planned, results)
        if self.drafter is not None:
            self._settle_drafts(items, planned, results)
        return self._settle(items)

    def _time_step(self, launched: _Launched) -> None:
        """Feeds the step's wall time (planning, forward, read-back) to the step budget."""
        now = time.perf_counter()
        seconds = now - max(launched.launched_at, self._collected_at)
        self._collected_at = now
        shape = StepShape.of(launched.items)
        budget = self.admission.step_budget
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step %.1f ms (model: %.1f): %d tokens (%d prefill, attention work %.0f, "
                "%d partial prompts), %d requests; prompt chunks (context, tokens) %s",
                seconds * 1000,
                budget.predict(shape) * 1000,
                shape.tokens,
                shape.prefill,
                shape.attention,
                len(self.admission.partial),
                len(launched.items),
                [(it.prefix_len, it.extend_len) for it in launched.items if it.is_prefill][:8],
            )
        budget.observe(shape, seconds)

    def _append_futures(self, launched: _Launched) -> None:
        """Gives every request sampled in the launched step its future token, so the next step can
        be planned (the token is its decode input) before the results are read. A prompt whose last
        chunk is in the step joins the running requests now, as SGLang's overlap does: it decodes in
        the next step rather than a step after its prefill is read."""
        running = set(map(id, self.admission.running))
        row = 0
        for it, fwd in zip(launched.items, launched.plan.items):
            if fwd.sample is None:
                continue
            req = it.req
            if not req.finished and it.is_prefill and it.completes and id(req) not in running:
                self.admission.running.append(req)
                running.add(id(req))
            if not req.finished and id(req) in running:
                req.token_ids.append(future_token(row))
            row += 1

    def _can_overlap(self) -> bool:
        """Whether the next step may be planned before the launched one's results: not when a
        request's next input depends on more than its sampled token (a constraint's forced text,
        penalties' history, drafts), nor when admission could have to retract a request."""
        assert self._inflight is not None
        for it in self._inflight.items:
            sp = it.req.sampling_params
            if sp.is_constrained or sp.has_penalties:
                return False
        need = sum(r.pending_len for r in self.admission.running) + self.config.chunked_prefill_size
        return self.cache.available_tokens() >= need

    def _settle(self, items: list[ScheduledItem]) -> list[Req]:
        updated: list[Req] = []
        running = set(map(id, self.admission.running))
        for it in items:
            req = it.req
            if req.finished:
                self._finish(req)
                updated.append(req)
                continue
            if it.is_prefill:
                # Publish the prefilled tokens right away, so waiting requests sharing them match
                # them from the next step on instead of recomputing them.
                self.cache.cache_unfinished(req, it.prefix_len + it.extend_len)
            if it.completes:
                if id(req) not in running:
                    self.admission.running.append(req)
                    running.add(id(req))
                updated.append(req)
        return updated

    def _settle_drafts(
        self, items: list[ScheduledItem], planned: list[ForwardItem], results: list[ItemResult]
    ) -> None:
        """Counts each decode step as a verify step and rolls back the KV of the draft tokens a
        request did not keep, before anything of it can enter the radix tree."""
        for it, fwd, res in zip(items, planned, results):
            if it.is_prefill:
                continue
            record_verify(it.req, fwd, res)
            self.stats.spec_verify_steps += 1
            self.stats.spec_draft_tokens += fwd.draft_len
            self.stats.spec_accepted_tokens += len(res.accepted)
            if fwd.draft_len:
                roll_back_rejected(it.req, fwd, self.cache.allocator)

    def _fail(self, items: list[ScheduledItem], error: Exception) -> list[Req]:
        """Ends the requests of a step whose forward raised: the slots planned for it hold no valid
        KV and go back to the free list; what earlier steps computed stays cached as usual."""
        failed = []
        for it in items:
            req = it.req
            req.kv_len = it.prefix_len
            self.cache.allocator.free(req.kv_slots[req.kv_len :])
            del req.kv_slots[req.kv_len :]
            req.table_synced = min(req.table_synced, req.kv_len)
            req.finished_reason = FinishReason.abort(f"internal error in the forward step: {error}")
            if req in self.admission.partial:
                self.admission.partial.remove(req)
            self._finish(req)
            failed.append(req)
        return failed

    def _queue_compiled(self) -> list[Req]:
        """Queues requests whose constraint compiled, with the text it forces from the start already
        appended; finishes (and returns) those whose constraint failed or forced the whole output."""
        ended: list[Req] = []
        for req in self.constraints.collect():
            kept = len(req.token_ids)
            if not req.finished and self.output.jump_forward(req, tail=0):
                self.output.check_finish(req)
            if not req.finished:
                self.output.complete_within_budget(req, kept)
            if req.finished:
                self._finish(req)
                ended.append(req)
            else:
                self.admission.waiting.append(req)
        return ended

    def _finish(self, req: Req) -> None:
        if req.token_ids and req.token_ids[-1] < 0:
            req.token_ids.pop()  # a future token that will not be read (aborted or failed)
        if req in self.admission.running:
            self.admission.running.remove(req)
        self.cache.finish(req)
        self.stats.prompt_tokens += req.prompt_len
        self.stats.cached_tokens += max(req.cached_tokens, 0)
        self.stats.finished_requests += 1

    def _apply_aborts(self) -> list[Req]:
        if not self._aborts:
            return []
        a = self.admission
        rids, self._aborts = self._aborts, set()
        live = [*a.waiting, *a.running, *a.partial]
        aborted = [r for r in live if r.rid in rids] + self.constraints.drop(rids)
        for req in aborted:
            req.finished_reason = FinishReason.abort("aborted by request")
            if req in a.waiting:
                a.waiting.remove(req)
            if req in a.partial:
                a.partial.remove(req)
            self._finish(req)
        return aborted


def _allocator(size: int, window_slots: int) -> TokenAllocator:
    """The free list of a pool (or tier) of `size` token slots and `window_slots` window slots."""
    return WindowedAllocator(size, window_slots) if window_slots else TokenAllocator(size)
