"""Compiling constraints off the scheduler's critical path, with in-memory (LRU) and on-disk caches.

Disk entries are plain numpy .npz archives (loaded with allow_pickle=False), keyed by a hash of the
pattern and the vocabulary fingerprint, so a corrupted or foreign file can never execute code.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np

from radixlm_runtime.constrained.json_schema import build_regex_from_schema
from radixlm_runtime.constrained.regex_fsm import (
    DEFAULT_MAX_STATES,
    DEFAULT_TIME_LIMIT_S,
    CharDFA,
    TokenIndex,
    TokenVocab,
    build_token_index,
    compile_char_dfa,
)

_FORMAT_VERSION = 1
# Validation runs on the caller's thread before a request is queued, so it gets a tighter budget
# than the background compile; a pattern past it would stall the compile pool anyway.
VALIDATE_TIME_LIMIT_S = 5.0


def constraint_pattern(
    regex: str | None = None, json_schema: str | dict[str, Any] | None = None
) -> tuple[str, str]:
    """(pattern, field name) of a request's constraint, exactly one of regex / json_schema; a schema
    that cannot be converted raises ValueError naming json_schema."""
    if (regex is None) == (json_schema is None):
        raise ValueError("exactly one of regex and json_schema must be given")
    if regex is not None:
        return regex, "regex"
    return build_regex_from_schema(json_schema), "json_schema"


def validate_constraint(regex: str | None = None, json_schema: str | dict[str, Any] | None = None) -> None:
    """Raises ValueError (naming the field) for an invalid, unsupported, oversize or unsatisfiable
    constraint. Builds only the character DFA, not the token index, so it is cheap enough to run
    synchronously and refuse a bad request before anything is queued."""
    if json_schema is not None:
        json_schema = _checked_schema(json_schema)
    _check_pattern(*constraint_pattern(regex, json_schema))


def _checked_schema(json_schema: str | dict[str, Any]) -> dict[str, Any] | bool:
    """The parsed schema, checked against its metaschema: the converter trusts keyword types."""
    schema = json_schema
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"json_schema: not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema: must be a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"json_schema: not a valid JSON Schema: {e.message}") from None
    return schema


@functools.lru_cache(maxsize=256)
def _check_pattern(pattern: str, field_name: str) -> None:
    """Cached on success: clients repeat their constraints, and a generic JSON object takes ~1 s."""
    compile_char_dfa(pattern, DEFAULT_MAX_STATES, time.monotonic() + VALIDATE_TIME_LIMIT_S, field_name)


def default_cache_dir() -> Path:
    """$RADIXLM_CACHE_DIR/fsm when set, else ~/.cache/radixlm/fsm."""
    root = os.environ.get("RADIXLM_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "radixlm") / "fsm"


def _index_to_arrays(index: TokenIndex, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    dfa = index.dfa
    chars = sorted(dfa.char_class)
    return {
        "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
        "trans": dfa.trans,
        "accepting": dfa.accepting,
        # Code points, not a unicode array: numpy would drop a "\x00" character.
        "alphabet_chars": np.array([ord(c) for c in chars], dtype=np.int32),
        "alphabet_classes": np.array([dfa.char_class[c] for c in chars], dtype=np.int32),
        "other_class": np.array(dfa.other_class, dtype=np.int32),
        "offsets": index.offsets,
        "token_ids": index.token_ids,
        "next_states": index.next_states,
        "eos_ids": index.eos_ids,
        "vocab_size": np.array(index.vocab_size, dtype=np.int64),
    }


def _index_from_arrays(data: Any) -> TokenIndex:
    char_class = {chr(int(c)): int(k) for c, k in zip(data["alphabet_chars"], data["alphabet_classes"])}
    dfa = CharDFA(
        trans=data["trans"],
        accepting=data["accepting"],
        char_class=char_class,
        other_class=int(data["other_class"]),
    )
    return TokenIndex(
        dfa=dfa,
        offsets=data["offsets"],
        token_ids=data["token_ids"],
        next_states=data["next_states"],
        eos_ids=data["eos_ids"],
        vocab_size=int(data["vocab_size"]),
    )


class IndexCache:
    """LRU of compiled indices in memory, backed by an optional directory of .npz files."""

    def __init__(self, max_entries: int = 64, cache_dir: Path | None = None) -> None:
        self.max_entries = max_entries
        self.cache_dir = cache_dir
        self._entries: OrderedDict[str, TokenIndex] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(pattern: str, fingerprint: str) -> str:
        return hashlib.sha256(f"{_FORMAT_VERSION}\0{fingerprint}\0{pattern}".encode()).hexdigest()

    def get(self, pattern: str, fingerprint: str) -> TokenIndex | None:
        key = self.key(pattern, fingerprint)
        with self._lock:
            index = self._entries.get(key)
            if index is not None:
                self._entries.move_to_end(key)
                return index
        index = self._load(key, pattern, fingerprint)
        if index is not None:
            self._remember(key, index)
        return index

    def put(self, pattern: str, fingerprint: str, index: TokenIndex) -> None:
        key = self.key(pattern, fingerprint)
        self._remember(key, index)
        if self.cache_dir is not None:
            self._store(
                key, index, {"pattern": pattern, "fingerprint": fingerprint, "version": _FORMAT_VERSION}
            )

    def _remember(self, key: str, index: TokenIndex) -> None:
        with self._lock:
            self._entries[key] = index
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def _load(self, key: str, pattern: str, fingerprint: str) -> TokenIndex | None:
        if self.cache_dir is None:
            return None
        path = self.cache_dir / f"{key}.npz"
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(data["meta"].tobytes())
                if meta != {"pattern": pattern, "fingerprint": fingerprint, "version": _FORMAT_VERSION}:
                    return None
                return _index_from_arrays(data)
        except (OSError, ValueError, KeyError):  # missing, truncated or foreign files are just misses
            return None

    def _store(self, key: str, index: TokenIndex, meta: dict[str, Any]) -> None:
        """Writes atomically (temp file + rename) so concurrent readers never see half a file; a read-only
        or full disk only costs the disk cache."""
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")
        except OSError:
            return
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **_index_to_arrays(index, meta))
            os.replace(tmp, self.cache_dir / f"{key}.npz")
        except OSError:
            Path(tmp).unlink(missing_ok=True)


class ConstraintCompiler:
    """Compiles regex / JSON Schema constraints for one vocabulary on a small thread pool, so the
    scheduler can keep decoding other requests while a new constraint compiles."""

    def __init__(
        self,
        vocab: TokenVocab,
        max_workers: int = 2,
        cache: IndexCache | None = None,
        max_states: int = DEFAULT_MAX_STATES,
        time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    ) -> None:
        self.vocab = vocab
        self.cache = cache if cache is not None else IndexCache(cache_dir=default_cache_dir())
        self.max_states = max_states
        self.time_limit_s = time_limit_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="constraint-compile")
        self._inflight: dict[str, Future[TokenIndex]] = {}
        self._lock = threading.Lock()

    def compile(self, pattern: str, field_name: str = "regex") -> TokenIndex:
        """Cached synchronous compile; ValueError (naming `field_name`) for bad or oversize patterns."""
        fingerprint = self.vocab.fingerprint
        index = self.cache.get(pattern, fingerprint)
        if index is None:
            index = build_token_index(
                pattern,
                self.vocab,
                max_states=self.max_states,
                time_limit_s=self.time_limit_s,
                field_name=field_name,
            )
            self.cache.put(pattern, fingerprint, index)
        return index

    def submit(self, pattern: str, field_name: str = "regex") -> Future[TokenIndex]:
        """Compiles in the pool; concurrent submissions of one pattern share a single future."""
        with self._lock:
            future = self._inflight.get(pattern)
            if future is not None:
                return future
            future = self._pool.submit(self.compile, pattern, field_name)
            self._inflight[pattern] = future
        # Outside the lock: a future that is already done runs the callback right here.
        future.add_done_callback(lambda _f: self._forget(pattern))
        return future

    def submit_constraint(
        self, regex: str | None = None, json_schema: str | dict[str, Any] | None = None
    ) -> Future[TokenIndex]:
        """A request's constraint (exactly one of regex / json_schema); schema errors come via the future."""
        if (regex is None) == (json_schema is None):
            raise ValueError("exactly one of regex and json_schema must be given")
        try:
            pattern, field_name = constraint_pattern(regex, json_schema)
        except ValueError as e:
            failed: Future[TokenIndex] = Future()
            failed.set_exception(e)
            return failed
        return self.submit(pattern, field_name)

    def _forget(self, pattern: str) -> None:
        with self._lock:
            self._inflight.pop(pattern, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
