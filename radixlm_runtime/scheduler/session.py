"""Program sessions: a frontend program runs as a sequence of requests whose prompts extend each
other, so between two calls the session keeps its whole history pinned in the radix tree (one
lock_ref on the node ending its last sequence) and the next call re-hits it even under memory
pressure.

A pin is a cache hint, never a reservation. When KV does not fit, pins give way: idle sessions'
(least recently used first) while pins hold more than their share of the pool, and any session's
when nothing else could run, so pins can delay a request but never block the queue. A session idle
for longer than its timeout is closed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Set
from dataclasses import dataclass, field

# The id check is the request builder's (io/inputs.py); re-exported for the scheduler's close_session.
from radixlm_runtime.io.inputs import MAX_SESSION_ID_LEN as MAX_SESSION_ID_LEN
from radixlm_runtime.io.inputs import check_session_id as check_session_id
from radixlm_runtime.kvcache.radix_cache import RadixCache, TreeNode


@dataclass(eq=False)
class Session:
    session_id: str
    last_used: float
    # Deepest node of the pinned sequence; the session holds one lock_ref on it (None: no pin).
    node: TreeNode | None = None
    # Requests of this session in flight (queued, compiling, running): while any is, the session
    # neither expires nor counts as idle.
    rids: set[str] = field(default_factory=set)


class SessionTable:
    """Open sessions and their pins. With the radix cache disabled sessions are tracked but pin
    nothing. Expiry is lazy: every query first closes the sessions idle past the timeout, so no
    timer is needed."""

    def __init__(
        self,
        tree: RadixCache | None,
        timeout_s: float,
        max_pinned: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tree = tree
        self.timeout_s = timeout_s
        # Pinned tokens kept when KV is short; above it idle sessions' pins give way.
        self.max_pinned = max_pinned
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        # Sessions with no request in flight, least recently used first: the expiry and unpin order.
        self._idle: OrderedDict[str, Session] = OrderedDict()
        self._pinned: set[str] = set()

    def __len__(self) -> int:
        self.expire()
        return len(self._sessions)

    def is_open(self, session_id: str | None) -> bool:
        self.expire()
        return session_id in self._sessions

    def pinned_ids(self) -> Set[str]:
        """Sessions that hold a pin now (a read-only view)."""
        self.expire()
        return self._pinned

    def pinned_tokens(self) -> int:
        """Tokens held by session pins, shared prefixes counted once."""
        self.expire()
        seen: set[TreeNode] = set()
        total = 0
        for sid in self._pinned:
            node = self._sessions[sid].node
            while node is not None and node.parent is not None and node not in seen:
                seen.add(node)
                total += len(node.key)
                node = node.parent
        return total

    def open(self, session_id: str, rid: str) -> None:
        """Registers request rid of the session, opening the session on its first request."""
        self.expire()
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = Session(session_id, self.clock())
        session.rids.add(rid)
        self._idle.pop(session_id, None)

    def finish(self, session_id: str, rid: str, node: TreeNode | None) -> None:
        """Records that rid ended. node, when given, ends the request's whole sequence, is already
        locked once on the session's behalf and replaces the session's previous pin; None (a
        request that never held KV) keeps the previous pin."""
        session = self._sessions.get(session_id)
        if session is None:
            assert node is None, "a pin for a closed session"
            return
        if node is not None:
            self._unpin(session)
            session.node = node
            self._pinned.add(session_id)
        session.rids.discard(rid)
        session.last_used = self.clock()
        if not session.rids:
            self._idle.pop(session_id, None)
            self._idle[session_id] = session

    def close(self, session_id: str) -> bool:
        """Releases the session's pin and forgets it; False when no such session is open. Requests of
        the session still in flight finish normally but pin nothing."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._idle.pop(session_id, None)
        self._unpin(session)
        return True

    def expire(self) -> int:
        """Closes sessions idle for longer than the timeout; returns how many."""
        cutoff = self.clock() - self.timeout_s
        expired = 0
        while self._idle:
            session = next(iter(self._idle.values()))
            if session.last_used > cutoff:
                break
            self.close(session.session_id)
            expired += 1
        return expired

    def give_way(self, stalled: bool, spare: str | None = None) -> bool:
        """Drops one session's pin because KV does not fit; returns False when no pin may go. The
        session stays open and its next finished request pins again.

        While pins hold more than max_pinned tokens, idle sessions' pins go, least recently used
        first. When the scheduler is stalled (nothing runs, so nothing else would ever free KV),
        any session's: idle ones first, then those with requests in flight, `spare` (the session
        of the request being admitted, whose pin is its own prefix) last of all.
        """
        self.expire()
        if not stalled and not self._over_cap():
            return False
        for session in self._idle.values():
            if session.node is not None:
                self._unpin(session)
                return True
        if not stalled:
            return False
        active = [self._sessions[sid] for sid in self._pinned if self._sessions[sid].rids]
        if not active:
            return False
        self._unpin(min(active, key=lambda s: (s.session_id == spare, s.last_used)))
        return True

    def _over_cap(self) -> bool:
        # Pins are a subset of the locked tokens: skip the walk over their paths when few are locked.
        if self.tree is None or self.tree.protected_size() <= self.max_pinned:
            return False
        return self.pinned_tokens() > self.max_pinned

    def unpin_all(self) -> None:
        """Drops every pin (a cache flush); the sessions stay open."""
        for sid in list(self._pinned):
            self._unpin(self._sessions[sid])

    def _unpin(self, session: Session) -> None:
        if session.node is not None:
            assert self.tree is not None
            self.tree.dec_lock_ref(session.node)
            session.node = None
            self._pinned.discard(session.session_id)
