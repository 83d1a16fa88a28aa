"""The free lists of KV memory, on the host: which pool slots and which request-table rows are
taken. Slots are plain integers the scheduler owns; the tensors they index live in the executor
(kvcache/pool.py), so handing out or taking back memory never touches the device.
"""

from __future__ import annotations


class TokenAllocator:
    """Free list of KV slots 1..size (slot 0 is the pool's dummy slot).

    Frees are validated: freeing a slot twice or a slot that is not allocated raises, so leaks and
    double frees surface in tests instead of corrupting another request's KV.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"TokenAllocator size must be positive, got {size}")
        self.size = size
        self.clear()

    def clear(self) -> None:
        # Kept in descending order so that taking from the end hands out the lowest slots first,
        # which keeps a prefix prefilled in one piece contiguous in the pool.
        self._free: list[int] = list(range(self.size, 0, -1))
        # Freed slots are parked unsorted and merged only when the free list runs short, so a free
        # is a cheap append.
        self._released: list[int] = []
        self._allocated = bytearray(self.size + 1)

    def available_size(self) -> int:
        return len(self._free) + len(self._released)

    def alloc_tokens(self, n: int) -> list[int] | None:
        """n slots and nothing beside them (a WindowedAllocator's come without window slots)."""
        return TokenAllocator.alloc(self, n)

    def alloc(self, n: int) -> list[int] | None:
        """Returns n slots, or None without allocating anything when fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self.available_size():
            return None
        if n == 0:
            return []
        if n > len(self._free):
            self._free = sorted(self._free + self._released, reverse=True)
            self._released = []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        allocated = self._allocated
        for s in out:
            allocated[s] = 1
        return out

    def claim(self, slots: list[int]) -> None:
        """Takes these particular free slots (a tier restored at start, whose slots the executor
        numbered); raises RuntimeError where one is not free."""
        allocated = self._allocated
        bad = [s for s in slots if not 1 <= s <= self.size or allocated[s]]
        if bad or len(set(slots)) != len(slots):
            raise RuntimeError(f"claiming slots that are not free: {bad[:16] or 'a slot twice'}")
        for s in slots:
            allocated[s] = 1
        self._free = [s for s in sorted(self._free + self._released, reverse=True) if not allocated[s]]
        self._released = []

    def free(self, slots: list[int]) -> None:
        """Returns slots to the free list; raises RuntimeError on a double free or an invalid slot."""
        if not slots:
            return
        allocated = self._allocated
        if len(set(slots)) != len(slots):
            raise RuntimeError("freeing the same slot twice in one call")
        bad = [s for s in slots if not 1 <= s <= self.size or not allocated[s]]
        if bad:
            raise RuntimeError(f"freeing slots that are not allocated (double free?): {bad[:16]}")
        for s in slots:
            allocated[s] = 0
        self._released.extend(slots)


class RowAllocator:
    """Rows of the request-to-token table: one per request holding KV."""

    def __init__(self, max_reqs: int) -> None:
        if max_reqs <= 0:
            raise ValueError(f"RowAllocator needs at least one row, got {max_reqs}")
        self.max_reqs = max_reqs
        self.clear()

    def clear(self) -> None:
        # Reversed so pop() hands out the lowest free row first.
        self._free_rows: list[int] = list(range(self.max_reqs - 1, -1, -1))
        self._in_use = [False] * self.max_reqs

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        idx = self._free_rows.pop()
        self._in_use[idx] = True
        return idx

    def free(self, idx: int) -> None:
        if not 0 <= idx < self.max_reqs:
            raise RuntimeError(f"request row {idx} outside 0..{self.max_reqs - 1}")
        if not self._in_use[idx]:
            raise RuntimeError(f"request row {idx} is not allocated (double free?)")
        self._in_use[idx] = False
        self._free_rows.append(idx)


class WindowedAllocator(TokenAllocator):
    """Token slots that each come with a window slot (the KV of the sliding-window layers of a
    windowed pool, kvcache/pool.py), which can go back early: a token's window KV is needed only
    while some query within the window may still run. `window_of[slot]` is the token slot's window
    slot (0: none). Freeing a token slot frees its window slot too; available_size counts token
    slots, and an alloc needs as many of both."""

    def __init__(self, size: int, window_size: int) -> None:
        self.windows = TokenAllocator(window_size)
        super().__init__(size)

    def clear(self) -> None:
        super().clear()
        self.windows.clear()
        self.window_of = [0] * (self.size + 1)

    def alloc(self, n: int) -> list[int] | None:
        if n > self.windows.available_size():
            return None
        slots = super().alloc(n)
        if slots is None:
            return None
        windows = self.windows.alloc(n)
        assert windows is not None
        window_of = self.window_of
        for s, w in zip(slots, windows):
            window_of[s] = w
        return slots

    def free(self, slots: list[int]) -> None:
        super().free(slots)  # validates first
        self.drop_windows(slots)

    def claim(self, slots: list[int]) -> None:
        raise RuntimeError("a windowed KV pool has no tier to restore slots from")

    def add_windows(self, slots: list[int]) -> bool:
        """Gives each of these token slots (none with a window slot) a window slot: all, or none
        and False where too few are free (a tier's copy of KV that had windows)."""
        windows = self.windows.alloc(len(slots))
        if windows is None:
            return False
        window_of = self.window_of
        for s, w in zip(slots, windows, strict=True):
            assert not window_of[s], "a window slot for a token slot that has one"
            window_of[s] = w
        return True

    def drop_windows(self, slots: list[int]) -> None:
        """Frees the window slots of these token slots where they have one."""
        window_of = self.window_of
        windows = [w for s in slots if (w := window_of[s])]
        if not windows:
            return
        for s in slots:
            window_of[s] = 0
        self.windows.free(windows)

    def move_windows(self, src: list[int], dst: list[int]) -> None:
        """Gives dst[i] the window slot of src[i] (which loses it): the same tokens' KV, computed
        twice, kept in the tree's slots (no copy: the window layers' KV lives at the window slot)."""
        window_of = self.window_of
        for s, d in zip(src, dst, strict=True):
            assert window_of[s] and not window_of[d], "moving a window onto a slot that has one"
            window_of[d], window_of[s] = window_of[s], 0

    def windowed_from(self, slots: list[int]) -> int:
        """Where the run of `slots` that have window slots, to their end, begins (len: none)."""
        window_of = self.window_of
        start = len(slots)
        while start > 0 and window_of[slots[start - 1]]:
            start -= 1
        return start

    def windows_of(self, slots: list[int]) -> list[int]:
        window_of = self.window_of
        return [window_of[s] for s in slots]
