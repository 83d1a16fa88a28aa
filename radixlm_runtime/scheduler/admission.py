"""Which requests run in the next step: the running requests' pending tokens first, then the
prompts being prefilled in chunks, then waiting requests in cache-aware order while the step's token
budget (sized by time, step_budget.py) and the KV pool allow.

Long prompts must not hold everyone up. Prompts partly prefilled ("partial") share each step's
prefill budget shortest remainder first, the one that started first keeping a share so that it always
advances. A waiting prompt goes ahead of them when it fits the step whole, or when it is much shorter
than every partial's remainder: it then starts chunking too (up to MAX_PARTIAL at once). A step in
which such a prompt completes ends early rather than fill up with the long prompt's chunk. So a short
request that arrives behind a 4,000-token prompt gets its first token after a step or two instead of
after the long prompt's last chunk. When decode runs out of KV the newest requests are retracted."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from radixlm_runtime.config import SchedulerConfig
from radixlm_runtime.scheduler.cache import CacheManager
from radixlm_runtime.scheduler.policy import PriorityRule, SchedulePolicy
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.speculative import Drafter
from radixlm_runtime.scheduler.stats import SchedulerStats
from radixlm_runtime.scheduler.step_budget import MIN_CHUNK, PrefillBudget, StepBudget
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

# After a retraction, admission reserves KV for every remaining token of running requests, then
# relaxes back to SchedulerConfig.new_token_ratio step by step.
NEW_TOKEN_RATIO_DECAY = 0.002
# Requests whose uncached parts start with this many identical tokens are not prefilled in the
# same step: the second one will find the first one's KV in the tree next step.
IN_BATCH_PREFIX_CHECK = 32
# While shorter prompts go ahead of it, the partial prefill that started first keeps at least this
# share of the step's prefill budget, so a stream of short requests slows a long prompt down but never
# stalls it. 0.1 rather than 0.25: on the long-prompt mix the short requests' TTFT P50 and P90 fell
# by a fifth and the long prompts' grew ~3 % (benchmarks/README.md, "Long-prompt mix").
CHUNKED_SHARE = 0.1
# A waiting prompt that does not fit the step whole starts chunking ahead of the partial prefills
# when its uncached tokens are at most this share of the shortest partial's remainder.
SHORTER_SHARE = 0.5
# At most this many prompts are partly prefilled at once (each holds KV for its computed chunks).
MAX_PARTIAL = 4
# The first this many waiting requests with a prefix on the disk tier have it read ahead each step
# (CacheManager.prefetch); one whose read is not done yet waits while other requests' steps run,
# at most PREFETCH_MAX_WAIT steps, instead of stalling a step on the disk.
PREFETCH_AHEAD = 8
PREFETCH_MAX_WAIT = 256


@dataclass(slots=True)
class ScheduledItem:
    """One request's share of a step: extend_len new tokens on top of prefix_len computed ones."""

    req: Req
    prefix_len: int
    extend_len: int
    is_prefill: bool = True
    # Whether this chunk reaches the end of the request's tokens (so a next token is due); fixed at
    # scheduling time, before sampling appends to token_ids.
    completes: bool = False
    # Speculative draft tokens computed after the request's tokens (the last of extend_len).
    draft: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.completes = self.prefix_len + self.extend_len - len(self.draft) == len(self.req.token_ids)


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheManager,
        max_running_requests: int,
        stats: SchedulerStats,
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.drafter = drafter
        self.cache = cache
        self.max_running_requests = max_running_requests
        priority = (
            PriorityRule(config.schedule_low_priority_values_first, config.priority_aging_s)
            if config.enable_priority_scheduling
            else None
        )
        self.policy = SchedulePolicy(config.schedule_policy, cache.tree, priority)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        # Prompts partly prefilled, in the order they started.
        self.partial: list[Req] = []
        self.new_token_ratio = config.new_token_ratio
        self.stats = stats
        target_s = config.prefill_step_target_ms / 1000
        self.step_budget = StepBudget(config.chunked_prefill_size, target_s, config.prefill_step_decode_ratio)

    def schedule(self) -> list[ScheduledItem]:
        cfg = self.config
        self.new_token_ratio = max(cfg.new_token_ratio, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        want = 0
        if self.partial:
            left = sum(_remaining(r) for r in self.partial)
            pending = self.step_budget.start(
                self._pending_tokens(), self._streamed(), self._pending_context()
            )
            fits = pending.fit(self.partial[0].kv_len, left)
            want = min(left, max(fits, MIN_CHUNK))
        decode = self._reserve_decode(want)
        # A running request computes its sampled token, plus any tokens jump-forward appended.
        items = self._decode_items(decode, want)
        decode_tokens = sum(it.extend_len for it in items)
        decode_context = sum(it.prefix_len for it in items)
        budget = self.step_budget.start(decode_tokens, self._streamed(), decode_context)
        if self.partial:
            if not cfg.disable_prefill_interleave and self.waiting and len(self.partial) < MAX_PARTIAL:
                first = self.partial[0]
                keep = _first_share(first, budget)
                budget.take(first.kv_len, keep)
                ahead = self._admit(budget, decode_tokens, interleave=True)
                budget.give_back(first.kv_len, keep)
                self.stats.interleaved_prefills += len(ahead)
                items.extend(ahead)
            scheduled = {id(it.req) for it in items}
            completing = any(it.is_prefill and it.completes for it in items)
            items.extend(self._partial_chunks(budget, scheduled, completing))
        if not budget.spent and not self.partial and self.waiting:
            items.extend(self._admit(budget, sum(it.extend_len for it in items)))
        self._prefetch_waiting()
        return items

    def _prefetch_waiting(self) -> None:
        """Has the disk-only prefixes of the first PREFETCH_AHEAD waiting requests that have one
        read ahead (from the matches of the last admission; stale ones read nothing)."""
        ahead = 0
        for req in self.waiting:
            if ahead == PREFETCH_AHEAD:
                break
            if req.disk_len:
                self.cache.prefetch(req)
                ahead += 1

    def _waits_for_prefetch(self, req: Req, busy: bool) -> bool:
        """Whether req, whose prefix is partly on disk, waits this step for that part to be read
        ahead: while it is being read and other work runs (whose steps the read overlaps), for at most
        PREFETCH_MAX_WAIT steps. Otherwise it is admitted, its read waiting for what is left."""
        if not busy or req.prefetch_waits >= PREFETCH_MAX_WAIT or not self.cache.prefetch(req):
            return False
        req.prefetch_waits += 1
        return True

    def _partial_chunks(
        self, budget: PrefillBudget, scheduled: set[int], completing: bool = False
    ) -> list[ScheduledItem]:
        """The next chunk of each partial prefill not already in this step, shortest remainder first;
        the one that started first (head of `partial`) is served its share of `budget` (at least
        MIN_CHUNK tokens) before the others, and what the others leave only when no prompt of this
        step completes (`completing`, or one of theirs): the step then ends early, so that prompt's
        first token is not held back by the long one's chunk. Partials whose last chunk is scheduled
        leave the list."""
        waiting = [r for r in self.partial if id(r) not in scheduled]
        if not waiting:
            return []
        first = waiting[0]
        share = {id(first): _first_share(first, budget)}
        budget.take(first.kv_len, share[id(first)])
        for req in sorted(waiting[1:], key=_remaining):
            share[id(req)] = budget.fit(req.kv_len, _remaining(req))
            budget.take(req.kv_len, share[id(req)])
        completing = completing or any(share[id(r)] == _remaining(r) for r in waiting[1:])
        if not completing:
            done = first.kv_len + share[id(first)]
            more = budget.fit(done, len(first.token_ids) - done)
            budget.take(done, more)
            share[id(first)] += more
        chunks = [ScheduledItem(r, r.kv_len, share[id(r)]) for r in waiting if share[id(r)] > 0]
        finished = {id(it.req) for it in chunks if it.completes}
        self.partial = [r for r in self.partial if id(r) not in finished]
        return chunks

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
            logger.debug("retracted %s (%d tokens generated)", victim.rid, victim.output_len)
        return list(self.running)

    def _decode_items(self, decode: list[Req], extra: int) -> list[ScheduledItem]:
        """The running requests' items, with speculative drafts in the free KV slots and the step's
        token budget left over (a draft never retracts a request nor evicts a cached prefix)."""
        if self.drafter is None:
            return [ScheduledItem(r, r.kv_len, r.pending_len, is_prefill=False) for r in decode]
        free = min(self.cache.allocator.available_size(), self.config.chunked_prefill_size)
        spare = free - self._pending_tokens() - extra
        items = []
        for r in decode:
            draft = self.drafter.draft(r, spare) if spare > 0 else []
            spare -= len(draft)
            extend = r.pending_len + len(draft)
            items.append(ScheduledItem(r, r.kv_len, extend, is_prefill=False, draft=draft))
        return items

    def _streamed(self) -> bool:
        """Whether a running request streams its tokens: only then are the gaps a prefill puts
        between its steps seen (a batch job waits for the end, which pacing only delays)."""
        return any(r.stream for r in self.running)

    def _pending_tokens(self) -> int:
        """Tokens the running requests compute next step: one each, more after a jump-forward."""
        return sum(r.pending_len for r in self.running)

    def _pending_context(self) -> int:
        """Keys the running requests' next tokens attend to, summed (what their decode step reads)."""
        return sum(r.kv_len for r in self.running)

    def _admit(self, budget: PrefillBudget, scheduled: int, interleave: bool = False) -> list[ScheduledItem]:
        """Admits waiting requests in policy order within the budget, the last one possibly
        chunked; `scheduled` tokens of this step already need KV slots, and so do the partial
        prefills' remaining tokens. `interleave`: these go ahead of the partial prefills' chunks, so
        only requests that fit the budget whole go, or that are much shorter than every partial's
        remainder (SHORTER_SHARE), which then start chunking too."""
        ordered = self.policy.order(list(self.waiting), self.cache.sessions.pinned_ids())
        reserved = sum(int(r.remaining_new_tokens() * self.new_token_ratio) for r in self.running) + scheduled
        for req in self.partial:
            reserved += _remaining(req) + int(req.remaining_new_tokens() * self.new_token_ratio)
        shorter_than = min((_remaining(r) for r in self.partial), default=0) * SHORTER_SHARE
        # Window slots this step's tokens take, and those the requests holding KV will still take as
        # their own windows fill up to one.
        reserved_windows = scheduled + sum(map(self.cache.window_growth, (*self.running, *self.partial)))
        items: list[ScheduledItem] = []
        seen_prefixes: set[tuple[int, ...]] = set()
        admitted: set[int] = set()
        for req in ordered:
            if budget.spent or len(self.running) + len(items) >= self.max_running_requests:
                break
            prefix_len = req.prefix_len
            total = len(req.token_ids)
            probe = tuple(req.token_ids[: prefix_len + IN_BATCH_PREFIX_CHECK])
            if len(probe) == prefix_len + IN_BATCH_PREFIX_CHECK and probe in seen_prefixes:
                continue
            ext = budget.fit(prefix_len, total - prefix_len)
            if ext <= 0:
                break
            if interleave and ext < total - prefix_len and total - prefix_len > shorter_than:
                continue
            # Host-tier tokens of the prefix take device slots when they are loaded back.
            need = total - prefix_len + req.load_len + int(req.remaining_new_tokens() * self.new_token_ratio)
            if req.disk_len and self._waits_for_prefetch(req, bool(scheduled or self.partial or items)):
                continue
            if not self._fits(need + reserved, req, busy=bool(scheduled or self.partial or items)):
                break
            # Window slots: its chunk's, the window it locks before its cached end, and its own
            # window as it decodes (older ones are freed as it goes).
            window_need = ext + 2 * self.cache.window
            if self.cache.window and window_need + reserved_windows > self.cache.available_windows():
                break
            if not self.cache.admit(req):
                break
            seen_prefixes.add(probe)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            admitted.add(id(req))
            items.append(ScheduledItem(req, req.kv_len, ext))
            budget.take(prefix_len, ext)
            reserved += need
            reserved_windows += window_need
            if req.kv_len + ext < total:
                self.partial.append(req)
                break
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)
        return items

    def _fits(self, need: int, req: Req, busy: bool) -> bool:
        """Whether req's KV needs fit, once session pins gave way as far as they must (see
        SessionTable.give_way): when nothing runs and this step carries nothing else (`busy`: no
        decode, no chunk, no admission), waiting would stall the queue for good."""
        while need > self.cache.available_tokens() - self._pinned_by_admission(req):
            stalled = not self.running and not busy
            if not self.cache.sessions.give_way(stalled, spare=req.session_id):
                return False
        return True

    def _pinned_by_admission(self, req: Req) -> int:
        """Tokens of req's prefix that are evictable now but become pinned once it is admitted."""
        node = req.last_node
        pinned = 0
        while node is not None and node.lock_ref == 0:
            if node.on_device:
                pinned += len(node.key)
            node = node.parent
        return pinned


def _first_share(first: Req, budget: PrefillBudget) -> int:
    """The tokens the partial prefill that started first is served ahead of the others: its share of
    the budget, at least MIN_CHUNK (so it always advances), at most what it has left."""
    left = _remaining(first)
    return min(left, max(MIN_CHUNK, budget.fit(first.kv_len, left, CHUNKED_SHARE)))


def _remaining(req: Req) -> int:
    """Prompt tokens of req not yet computed."""
    return len(req.token_ids) - req.kv_len
