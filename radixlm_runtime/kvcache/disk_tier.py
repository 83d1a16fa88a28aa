"""The disk KV tier's storage: one file per entry (a node's KV written as it reached the tier), in a
directory of its own per model identity, so that a server started again on the same model and
directory serves the prefixes it finds there.

An entry file is `MAGIC`, the JSON header's length (4 bytes, little-endian), a JSON header naming the
identity (the model's weights and config, the KV dtype and layout) and the tensors' names, dtypes
and per-token shapes, then four little-endian uint32s (the tokens stored, the tokens of their path,
the payload's CRC-32, whether it holds windows), the path's token ids (int32 each; the stored tokens
are its last `num_tokens`) and the raw bytes of every tensor the pool holds per token slot, tensor
after tensor (no pickle); with a windowed pool (kvcache/pool.py) an entry may hold its tokens' window
rows too (`window_layout`, after the others): the sliding-window layers' KV of a prefix's end. So a
file's size is a function of its token counts and that flag alone (`entry_bytes`), which the radix
tree charges its disk capacity in whole files with (RunnerInfo.disk_entry_slots). The CRC is
zlib's: a few times faster than a cryptographic digest, and the writer thread's time is taken from
the CPU kernels; it detects corruption, not tampering. A file is written to a
temporary name, fsynced and renamed, so a crash leaves no half-written entry; at start, files of
another identity or layout, or shorter or longer than their header says, are deleted; a payload
whose checksum does not match is reported when read (never served) and the file deleted.

The radix tree (scheduler) hands out disk slots, one per token; this store maps each slot to a row
of an entry and deletes an entry's file once none of its slots is held. The tree charges each entry
its file's whole size (`entry_slots`) until then, so the files stay within the disk tier's bytes.
Writes run on a thread of their own: a step waits only for the gather of the rows it stores, and
reads of an entry still being written are served from memory. Reads can start ahead too (`prefetch`,
for a request waiting with a prefix on disk): a reader thread loads the entries' files into memory,
within a budget of bytes, and the read that needs them later waits only for what is still being
read. A prefetched file is checked when it is used, like any other: one that failed is never served.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixlm_runtime.step import DiskEntry
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

MAGIC = b"RLMKV3\n"
_COUNTS = struct.Struct("<IIII")  # tokens stored, tokens of the path, CRC-32, windows held (0/1)
TOKEN_ID_BYTES = 4  # a path token id in the header (int32)
LOCK = ".lock"
# A read ahead that no prefetch call asked for again in this many calls is let go when another one
# needs its room (its request went away, say); one still asked for never is, so the requests waiting
# on reads ahead never take each other's room in turns.
PREFETCH_STALE_CALLS = 256
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
SUFFIX = ".kv"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)}
_DTYPES.update({str(d): d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the pool holds per token: its name, dtype and the shape of one token's row."""

    name: str
    dtype: str
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.row_shape:
            n *= d
        return n * torch.empty((), dtype=_DTYPES[self.dtype]).element_size()


def layout_of(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """The specs of a pool's per-token tensors (KVPool.named_tensors)."""
    return [TensorSpec(name, str(t.dtype), tuple(t.shape[1:])) for name, t in tensors]


def model_identity(
    model_path: Path, settings: dict[str, Any], layout: Sequence[TensorSpec], digests: Path | None = None
) -> str:
    """A digest of everything the stored KV depends on: the model's files (weights, config), the
    numeric settings (dtype, arithmetic, quantization) and the pool's layout. `digests`: a JSON file
    remembering each file's digest by path, size and modification time, so that a restart does not
    read gigabytes of weights again."""
    known: dict[str, str] = {}
    if digests is not None:
        try:
            known = json.loads(digests.read_text())
        except (OSError, ValueError):
            known = {}
    h = hashlib.blake2b(digest_size=20)
    files = [model_path] if model_path.is_file() else sorted(p for p in model_path.rglob("*") if p.is_file())
    changed = False
    for path in files:
        if path.name == "config.json" or path.suffix in _WEIGHT_SUFFIXES:
            stat = path.stat()
            key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
            if key not in known:
                with path.open("rb") as f:
                    known[key] = hashlib.file_digest(f, "blake2b").hexdigest()
                changed = True
            h.update(path.name.encode() + b"\0" + known[key].encode())
    if digests is not None and changed:
        tmp = digests.with_name(f"{digests.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, digests)
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(json.dumps([(s.name, s.dtype, s.row_shape) for s in layout]).encode())
    return h.hexdigest()


class _Prefetch:
    """An entry's file read ahead on the reader thread: once `done` is set, its rows per tensor (None:
    the file could not be read or failed its checksum); `used`: rows of it read since."""

    __slots__ = ("done", "rows", "used", "asked")

    def __init__(self, asked: int) -> None:
        self.done = threading.Event()
        self.rows: list[torch.Tensor] | None = None
        self.used = 0
        self.asked = asked  # DiskStore.prefetch's call count when it was last asked for


@dataclass
class _Entry:
    path: Path
    num_tokens: int
    live: int  # slots of this entry the tree holds
    windows: bool = False  # whether it holds its tokens' window rows too
    rows: list[torch.Tensor] | None = None  # while its write is queued: the data, per tensor
    prefetch: _Prefetch | None = None  # its file read ahead (or being read)


class DiskStore:
    """Entry files under `root/<identity>`, slot-addressed, of at most `capacity_tokens` tokens' worth
    of bytes; up to `prefetch_bytes` of them read ahead into memory at a time. `window_layout`: the
    window slots' tensors of a windowed pool, which an entry may hold beside its tokens'."""

    def __init__(
        self,
        root: Path,
        identity: str,
        layout: list[TensorSpec],
        capacity_tokens: int,
        prefetch_bytes: int = 0,
        window_layout: list[TensorSpec] | None = None,
    ) -> None:
        self.dir = Path(root) / identity[:32]
        self.dir.mkdir(parents=True, exist_ok=True)
        # One server per directory: another one's scan would take this one's files for its own.
        self._lock = (self.dir / LOCK).open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(
                f"kv_disk_dir: {self.dir} is in use by another server (one directory per server)"
            ) from None
        self.identity = identity
        self.layout = layout
        self.window_layout = window_layout or []
        self.capacity_tokens = capacity_tokens
        self.token_bytes = sum(s.row_bytes for s in layout)
        self.window_bytes = sum(s.row_bytes for s in self.window_layout)
        self._header_json = json.dumps({"identity": identity, "tensors": self._layout_json()}).encode()
        # An entry file's bytes before its path's token ids: the same for every entry of this store.
        self.header_bytes = len(MAGIC) + 4 + len(self._header_json) + _COUNTS.size
        self._slots: dict[int, tuple[_Entry, int]] = {}  # disk slot -> (entry, row)
        self._names = (f"{time.time_ns():x}-{os.getpid()}-{i}" for i in range(1 << 62))
        # ("write", entry, tokens) and ("delete", entry, None), in order; None stops the thread.
        self._jobs: queue.Queue[tuple[str, _Entry, list[int] | None] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        # Entries read ahead or being read, oldest first, and their bytes.
        self.prefetch_bytes = prefetch_bytes
        self._prefetched: OrderedDict[int, _Entry] = OrderedDict()
        self._prefetched_size = 0
        self._prefetch_calls = 0
        self._reads: queue.Queue[_Entry | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-reader", daemon=True)
        self._reader.start()
        # Since start: bytes written and read, entries that failed their checksum; entry files read
        # when a read needed them, read ahead, and read ahead then used.
        self.bytes_written = self.bytes_read = self.corrupt_entries = 0
        self.files_read = self.files_prefetched = self.prefetch_hits = 0

    # -- start ---------------------------------------------------------------------------------
    def scan(self) -> list[DiskEntry]:
        """The entries a previous run left, newest first as far as the capacity holds them, with
        disk slots numbered from 1 in order; every other file in the directory is deleted."""
        found: list[tuple[float, Path, dict[str, Any]]] = []
        for path in self.dir.iterdir():
            if path.name == LOCK:
                continue
            header = self._valid_header(path) if path.suffix == SUFFIX else None
            if header is None:
                logger.warning(
                    "disk KV tier: deleting %s (not a valid entry of this model and layout)", path.name
                )
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime, path, header))
        found.sort(key=lambda f: f[0], reverse=True)
        entries: list[DiskEntry] = []
        total = cost = 0
        for _, path, header in found:
            n, windows = header["num_tokens"], header["windows"]
            # Kept while the files' bytes, in whole tokens' worth each as the tree counts them, fit.
            entry_cost = self.entry_slots(n, len(header["tokens"]), windows)
            if cost + entry_cost > self.capacity_tokens:
                path.unlink(missing_ok=True)
                continue
            entry = _Entry(path, n, n, windows)
            slots = tuple(range(total + 1, total + n + 1))
            for row, slot in enumerate(slots):
                self._slots[slot] = (entry, row)
            entries.append(DiskEntry(tuple(header["tokens"]), slots, windows))
            total += n
            cost += entry_cost
        if entries:
            logger.info("disk KV tier: %d entries, %d tokens found in %s", len(entries), total, self.dir)
        return entries

    def _valid_header(self, path: Path) -> dict[str, Any] | None:
        """The header of an entry file of this identity and layout whose size matches it, else None."""
        try:
            with path.open("rb") as f:
                header, payload_at = self._read_header(f)
            size = path.stat().st_size
        except (OSError, ValueError):
            return None
        if header.get("identity") != self.identity or header.get("tensors") != self._layout_json():
            return None
        n, tokens, windows = header["num_tokens"], header["tokens"], header["windows"]
        if not 0 < n <= len(tokens) or (windows and not self.window_layout):
            return None
        return header if size == payload_at + n * self._row_bytes(windows) else None

    def _row_bytes(self, windows: bool) -> int:
        """The payload bytes of one token of an entry (with its window rows, or not)."""
        return self.token_bytes + (self.window_bytes if windows else 0)

    def entry_bytes(self, num_tokens: int, path_tokens: int, windows: bool = False) -> int:
        """The size of an entry file of num_tokens rows (with their window rows, or not) under a path
        of path_tokens token ids."""
        return self.header_bytes + TOKEN_ID_BYTES * path_tokens + num_tokens * self._row_bytes(windows)

    def entry_slots(self, num_tokens: int, path_tokens: int, windows: bool = False) -> int:
        """An entry file's bytes in whole tokens' worth: the disk slots the tree charges for it
        (RunnerInfo.disk_entry_slots, from `header_bytes`, computes the same)."""
        return -(-self.entry_bytes(num_tokens, path_tokens, windows) // self.token_bytes)

    @staticmethod
    def _read_header(f: Any) -> tuple[dict[str, Any], int]:
        """An entry's header (identity, tensors, num_tokens, tokens, crc32) and where its payload
        starts."""
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a KV entry file")
        length = int.from_bytes(f.read(4), "little")
        raw = f.read(length)
        counts = f.read(_COUNTS.size)
        if len(raw) != length or len(counts) != _COUNTS.size:
            raise ValueError("truncated header")
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        num_tokens, path_tokens, crc, windows = _COUNTS.unpack(counts)
        ids = f.read(TOKEN_ID_BYTES * path_tokens)
        if len(ids) != TOKEN_ID_BYTES * path_tokens or windows > 1:
            raise ValueError("truncated header")
        tokens = list(struct.unpack(f"<{path_tokens}i", ids))
        header.update(num_tokens=num_tokens, tokens=tokens, crc32=crc, windows=bool(windows))
        return header, len(MAGIC) + 4 + length + _COUNTS.size + len(ids)

    def _layout_json(self) -> list[list[Any]]:
        return [[s.name, s.dtype, list(s.row_shape)] for s in (*self.layout, *self.window_layout)]

    # -- moves ---------------------------------------------------------------------------------
    def write(self, slots: list[int], tokens: list[int], rows: list[torch.Tensor]) -> None:
        """Stores one entry: `rows[i]` holds tensor i's rows of the tokens in `slots` (on the CPU,
        owned by the store from now on), of `layout`, then of `window_layout` for an entry holding
        windows; `tokens` the path through them. Returns at once; the file is written on the writer
        thread."""
        windows = len(rows) > len(self.layout)
        assert len(rows) == len(self.layout) + (len(self.window_layout) if windows else 0)
        entry = _Entry(self.dir / f"{next(self._names)}{SUFFIX}", len(slots), len(slots), windows, rows)
        for row, slot in enumerate(slots):
            if slot in self._slots:
                raise RuntimeError(f"disk slot {slot} written while held")
            self._slots[slot] = (entry, row)
        self._jobs.put(("write", entry, tokens))

    def read(self, slots: list[int], window: bool = False) -> tuple[list[torch.Tensor], list[int]]:
        """The rows of these slots, per tensor of `layout`, or with `window` of `window_layout` (their
        entries hold windows) ([len(slots), *row_shape] each; rows of failed slots are left zero),
        and the slots whose entry failed its checksum: that entry is deleted and none of its rows is
        returned."""
        layout = self.window_layout if window else self.layout
        out = [torch.zeros((len(slots), *s.row_shape), dtype=_DTYPES[s.dtype]) for s in layout]
        by_entry: dict[int, tuple[_Entry, list[int], list[int]]] = {}
        for i, slot in enumerate(slots):
            entry, row = self._slots[slot]
            by_entry.setdefault(id(entry), (entry, [], []))[1].append(i)
            by_entry[id(entry)][2].append(row)
        failed: list[int] = []
        for entry, positions, rows in by_entry.values():
            data = self._entry_rows(entry, len(positions))
            if data is None:
                failed.extend(slots[i] for i in positions)
                continue
            assert entry.windows or not window, "window rows read from an entry without them"
            part = data[len(self.layout) :] if window else data[: len(self.layout)]
            pos = torch.tensor(positions, dtype=torch.int64)
            idx = torch.tensor(rows, dtype=torch.int64)
            for dst, src in zip(out, part, strict=True):
                dst[pos] = src[idx]
        return out, failed

    def _entry_rows(self, entry: _Entry, wanted: int) -> list[torch.Tensor] | None:
        """An entry's rows per tensor (`wanted` of them are read): from memory while its write is
        pending, else from its file, read ahead (waiting for what is still being read) or now,
        checked against its digest (None when that fails, the file then deleted)."""
        rows = entry.rows
        if rows is not None:
            return rows
        ahead = entry.prefetch
        if ahead is not None:
            ahead.done.wait()
            rows = ahead.rows
            ahead.used += wanted
            self.prefetch_hits += 1
            if rows is None or ahead.used >= entry.live:
                self._forget_prefetch(entry)  # read whole (what the tree holds of it): memory back
        else:
            rows = self._load(entry)
            self.files_read += 1
        if rows is None:
            self.corrupt_entries += 1
            logger.warning(
                "disk KV tier: %s failed its checksum; dropped, its tokens are recomputed", entry.path.name
            )
            entry.path.unlink(missing_ok=True)
            return None
        self.bytes_read += entry.num_tokens * self._row_bytes(entry.windows)
        return rows

    def _load(self, entry: _Entry) -> list[torch.Tensor] | None:
        """An entry's rows per tensor from its file; None where the file is gone, short or fails its
        checksum. No side effect: the reader thread runs it too."""
        expected = entry.num_tokens * self._row_bytes(entry.windows)
        buf = bytearray(expected)
        try:
            with entry.path.open("rb") as f:
                header, payload_at = self._read_header(f)
                whole = os.fstat(f.fileno()).st_size == payload_at + expected
                whole = whole and f.readinto(buf) == expected
        except (OSError, ValueError):
            header, whole = {}, False
        if not whole or zlib.crc32(buf) != header.get("crc32"):
            return None
        out: list[torch.Tensor] = []
        offset = 0
        for spec in (*self.layout, *(self.window_layout if entry.windows else ())):
            size = entry.num_tokens * spec.row_bytes
            flat = torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=offset)
            out.append(flat.view(_DTYPES[spec.dtype]).reshape(entry.num_tokens, *spec.row_shape))
            offset += size
        return out

    def drop(self, slots: list[int]) -> None:
        """Lets go of these slots; an entry none of whose slots is held is deleted."""
        for slot in slots:
            entry, _ = self._slots.pop(slot)
            entry.live -= 1
            if entry.live == 0:
                self._forget_prefetch(entry)
                self._jobs.put(("delete", entry, None))

    # -- reads ahead ---------------------------------------------------------------------------
    def prefetch(self, slots: list[int]) -> int:
        """Starts reading the files of the entries holding these slots on the reader thread, as far
        as `prefetch_bytes` allows (finished ones nobody asked for lately are let go for room);
        entries in memory already or being read are left as they are. Returns how many of these slots are in
        entries still being read (0: a read of them now waits for no file)."""
        self._prefetch_calls += 1
        pending = 0
        for slot in slots:
            entry, _ = self._slots[slot]
            if entry.rows is not None:
                continue
            ahead = entry.prefetch
            if ahead is None:
                size = entry.num_tokens * self._row_bytes(entry.windows)
                if not self._room_ahead(size):
                    continue
                ahead = entry.prefetch = _Prefetch(self._prefetch_calls)
                self._prefetched[id(entry)] = entry
                self._prefetched_size += size
                self.files_prefetched += 1
                self._reads.put(entry)
            ahead.asked = self._prefetch_calls
            if not ahead.done.is_set():
                pending += 1
        return pending

    def _room_ahead(self, size: int) -> bool:
        """Whether `size` more bytes can be read ahead, once finished reads ahead that nobody asked
        for lately (PREFETCH_STALE_CALLS) are let go as far as needed."""
        stale = self._prefetch_calls - PREFETCH_STALE_CALLS
        for entry in list(self._prefetched.values()):
            if self._prefetched_size + size <= self.prefetch_bytes:
                break
            ahead = entry.prefetch
            assert ahead is not None
            if ahead.done.is_set() and ahead.asked < stale:
                self._forget_prefetch(entry)
        return self._prefetched_size + size <= self.prefetch_bytes

    def _forget_prefetch(self, entry: _Entry) -> None:
        if entry.prefetch is None:
            return
        del self._prefetched[id(entry)]
        self._prefetched_size -= entry.num_tokens * self._row_bytes(entry.windows)
        entry.prefetch = None

    def prefetched_bytes(self) -> int:
        """Bytes of entries read ahead (or being read) and not let go yet."""
        return self._prefetched_size

    def _read_loop(self) -> None:
        while (entry := self._reads.get()) is not None:
            ahead = entry.prefetch
            if ahead is None or ahead.done.is_set():
                continue  # let go before its turn
            try:
                ahead.rows = self._load(entry)
            except Exception:
                logger.exception("disk KV tier: reading %s ahead failed", entry.path.name)
            finally:
                ahead.done.set()

    def held_tokens(self) -> int:
        return len(self._slots)

    # -- the writer thread ---------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            op, entry, tokens = job
            try:
                if tokens is not None:
                    self._write_file(entry, tokens)
                else:
                    entry.path.unlink(missing_ok=True)
            except OSError:
                # The entry stays readable from memory; it is not on disk for a restart.
                logger.exception("disk KV tier: %s %s failed", op, entry.path.name)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _write_file(self, entry: _Entry, tokens: list[int]) -> None:
        rows = entry.rows
        assert rows is not None
        # Each tensor's bytes as they lie in memory: hashed and written without a joined copy.
        parts = [memoryview(r.contiguous().view(torch.uint8).numpy()).cast("B") for r in rows]
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        raw = self._header_json
        counts = _COUNTS.pack(entry.num_tokens, len(tokens), crc, int(entry.windows))
        tmp = entry.path.with_suffix(".tmp")
        try:
            with tmp.open("wb") as f:
                f.write(MAGIC + len(raw).to_bytes(4, "little") + raw + counts)
                f.write(struct.pack(f"<{len(tokens)}i", *tokens))
                for part in parts:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, entry.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # the disk full, say: the entry stays served from memory
            raise
        self.bytes_written += sum(p.nbytes for p in parts)
        entry.rows = None

    def flush(self) -> None:
        """Waits until every queued write and delete is done."""
        self._jobs.join()

    def close(self) -> None:
        """Finishes the queued writes and stops the writer and reader threads."""
        self._jobs.put(None)
        self._reads.put(None)
        self._writer.join()
        self._reader.join()
        self._lock.close()
