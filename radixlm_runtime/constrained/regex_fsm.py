"""Regex → character DFA (via interegular) → token-level index over a tokenizer's whole vocabulary.

The index answers, for every live DFA state, which token ids may come next and where each one leads,
so a decode step is a table lookup. It is built by walking the DFA over a character trie of the
vocabulary, vectorised with numpy over all (state, trie node) pairs that are still alive at each
depth, so shared prefixes are walked once and dead branches are dropped as early as possible.

Token texts: each token contributes exactly the text its bytes decode to. A token whose bytes are not
valid UTF-8 on their own (a partial multi-byte character) is never allowed — the output is then
always a concatenation of whole characters, at the cost of not reaching characters that the
vocabulary only spells with split bytes. Special tokens are never allowed, except EOS in
accepting states.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import interegular
import numpy as np
from interegular.fsm import anything_else

try:  # Python >= 3.11 moved the regex parser; it is only used to name unsupported constructs.
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse  # type: ignore[no-redef]

DEFAULT_MAX_STATES = 20_000
DEFAULT_TIME_LIMIT_S = 30.0

# Python regex opcodes that have no DFA equivalent (or that interegular would silently misread).
_UNSUPPORTED_OPS = {
    "ASSERT": "lookahead/lookbehind",
    "ASSERT_NOT": "negative lookahead/lookbehind",
    "GROUPREF": "backreference",
    "GROUPREF_EXISTS": "conditional group",
    "AT": "anchor inside the pattern (only a leading ^ and a trailing $ are allowed)",
    "ATOMIC_GROUP": "atomic group",
    "POSSESSIVE_REPEAT": "possessive quantifier",
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_LEVEL_DECODE = {ord(ch): b for b, ch in _bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_text(piece: str, byte_level: bool) -> str | None:
    """Text a vocabulary piece decodes to on its own; None when its bytes are not valid UTF-8."""
    if byte_level:
        raw = piece.translate(_BYTE_LEVEL_DECODE).encode("latin-1")
    else:
        match = _BYTE_FALLBACK.fullmatch(piece)
        raw = bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class VocabTrie:
    """Character trie over the vocabulary's distinct texts, stored level by level as arrays.

    Node k at depth d (1-based) has character `distinct_chars[char_ids[d][k]]` (a code point), its
    children are nodes `child_lo[d][k] : child_lo[d][k] + child_cnt[d][k]` at depth d+1, and
    `terminal[d][k]` is the index of the text ending there (-1 if none). Lists are indexed by depth;
    entry 0 stands for the root (only its `child_lo` / `child_cnt` are used).
    """

    char_ids: list[np.ndarray]
    child_lo: list[np.ndarray]
    child_cnt: list[np.ndarray]
    terminal: list[np.ndarray]
    # Token ids spelling distinct text u: text_tokens[text_offsets[u] : text_offsets[u + 1]].
    text_offsets: np.ndarray
    text_tokens: np.ndarray
    distinct_chars: np.ndarray  # sorted distinct code points over the whole vocabulary

    @classmethod
    def build(cls, texts: Sequence[str | None]) -> VocabTrie:
        # Sorting ids by text (not building a list per text) keeps this free of per-token allocations.
        ids = [i for i, text in enumerate(texts) if text]
        ids.sort(key=texts.__getitem__)
        sorted_texts = [texts[i] for i in ids]
        is_new = [True] + [a != b for a, b in zip(sorted_texts, sorted_texts[1:])]
        new_flags = np.array(is_new, dtype=bool)
        uniq = [t for t, new in zip(sorted_texts, is_new) if new]
        lens = np.fromiter((len(t) for t in uniq), dtype=np.int64, count=len(uniq))
        flat = np.frombuffer("".join(uniq).encode("utf-32-le"), dtype=np.uint32).astype(np.int32)
        starts = np.concatenate(([0], np.cumsum(lens)))
        depth_max = int(lens.max(initial=0))
        padded = np.full((len(uniq), depth_max), -1, dtype=np.int32)
        row = np.repeat(np.arange(len(uniq)), lens)
        padded[row, np.arange(len(flat)) - starts[row]] = flat
        # Longest common prefix with the previous (sorted) text; texts are distinct, so they differ somewhere.
        lcp = np.zeros(len(uniq), dtype=np.int64)
        if len(uniq) > 1:
            lcp[1:] = np.argmax(padded[1:] != padded[:-1], axis=1)
        node_rows: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        for d in range(1, depth_max + 1):
            node_rows.append(np.flatnonzero((lens >= d) & (lcp < d)))
        node_rows.append(np.zeros(0, dtype=np.int64))
        distinct_chars = np.unique(flat)
        char_ids, child_lo, child_cnt, terminal = [np.zeros(0, np.int64)], [], [], [np.zeros(0, np.int64)]
        for d in range(depth_max + 1):
            rows, below = node_rows[d], node_rows[d + 1]
            lo = np.searchsorted(below, rows, side="left")
            hi = np.append(lo[1:], len(below)) if d > 0 else np.array([len(below)])
            child_lo.append(lo)
            child_cnt.append(hi - lo)
            if d > 0:
                char_ids.append(np.searchsorted(distinct_chars, padded[rows, d - 1]))
                terminal.append(np.where(lens[rows] == d, rows, -1))
        return cls(
            char_ids=char_ids,
            child_lo=child_lo,
            child_cnt=child_cnt,
            terminal=terminal,
            text_offsets=np.append(np.flatnonzero(new_flags), len(ids)),
            text_tokens=np.asarray(ids, dtype=np.int64),
            distinct_chars=distinct_chars,
        )


@dataclass(eq=False)
class TokenVocab:
    """A tokenizer's vocabulary as the text each token contributes, prepared once and shared by indices."""

    texts: list[str | None]  # per token id; None = never allowed (special, partial UTF-8 or empty)
    eos_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, eos_ids: Sequence[int] | None = None) -> TokenVocab:
        size = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
        added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special.update(i for i, tok in added.items() if getattr(tok, "special", False))
        base = [p for i, p in enumerate(pieces) if i not in added and p is not None]
        byte_chars = set(_BYTE_LEVEL_DECODE)
        byte_level = all(ord(ch) in byte_chars for p in base for ch in p)
        texts: list[str | None] = []
        for i, piece in enumerate(pieces):
            if piece is None or i in special:
                texts.append(None)
            elif i in added:
                texts.append(str(added[i].content) or None)
            else:
                texts.append(_piece_text(piece, byte_level) or None)
        if eos_ids is None:
            eos_ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        return cls(texts=texts, eos_ids=tuple(sorted(set(eos_ids))))

    @property
    def size(self) -> int:
        return len(self.texts)

    @cached_property
    def fingerprint(self) -> str:
        """Identifies the vocabulary in cache keys: equal texts and EOS ids give equal indices."""
        payload = json.dumps([self.texts, list(self.eos_ids)], ensure_ascii=False).encode()
        return hashlib.sha256(payload).hexdigest()[:32]

    @cached_property
    def trie(self) -> VocabTrie:
        return VocabTrie.build(self.texts)


@dataclass(frozen=True)
class CharDFA:
    """A minimal-enough character DFA restricted to live states (every state can still reach acceptance).

    Characters map to classes: `char_class` for the characters the pattern names, `other_class` (-1 if
    none) for every other character. `trans[s, c]` is the next state or -1.
    """

    trans: np.ndarray  # [S, C] int32
    accepting: np.ndarray  # [S] bool
    char_class: dict[str, int]
    other_class: int
    initial: int = 0

    @property
    def num_states(self) -> int:
        return int(self.trans.shape[0])

    def class_of(self, ch: str) -> int:
        return self.char_class.get(ch, self.other_class)

    def step(self, state: int, ch: str) -> int:
        cls = self.class_of(ch)
        return -1 if state < 0 or cls < 0 else int(self.trans[state, cls])

    def walk(self, state: int, text: str) -> int:
        for ch in text:
            state = self.step(state, ch)
            if state < 0:
                break
        return state

    @cached_property
    def _class_chars(self) -> list[list[str]]:
        chars: list[list[str]] = [[] for _ in range(self.trans.shape[1])]
        for ch, cls in self.char_class.items():
            chars[cls].append(ch)
        return chars

    def forced_string(self, state: int) -> str | None:
        """The text every match must continue with from `state`: the unique character path up to the
        first branching or accepting state (None when there is no such character)."""
        out: list[str] = []
        for _ in range(self.num_states):
            if state < 0 or self.accepting[state]:
                break
            live = np.flatnonzero(self.trans[state] >= 0)
            if len(live) != 1 or live[0] == self.other_class or len(self._class_chars[live[0]]) != 1:
                break
            out.append(self._class_chars[live[0]][0])
            state = int(self.trans[state, live[0]])
        return "".join(out) or None


_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class CompileTimeout(ValueError):
    """Compilation ran past its time limit (a ValueError so callers report it like any bad pattern)."""


@contextmanager
def deadline_guard(deadline: float | None, what: str) -> Iterator[None]:
    """Aborts pure-Python work in this thread (interegular's subset construction, which can blow up
    exponentially) once `deadline` (time.monotonic) passes, by checking it on every function call."""
    if deadline is None:
        yield
        return
    previous = sys.gettrace()

    def check() -> None:
        if time.monotonic() > deadline:
            raise CompileTimeout(f"{what}: compiling took longer than the time limit")

    def tracer(frame: Any, event: str, arg: Any) -> None:
        # Not in generator frames: a generator closed by the garbage collector would swallow the
        # exception, and Python drops a trace function that raised, leaving the work unbounded.
        if event == "call" and not frame.f_code.co_flags & _GENERATOR_FLAGS:
            check()

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)
    # Work that ended past the deadline without another traced call (or with the tracer lost)
    # still counts as too slow.
    check()


def _check_supported(pattern: str, field_name: str) -> str:
    """Validates `pattern` with Python's parser and strips a leading ^ / trailing $ (no-ops under
    full-match semantics); raises ValueError naming the first construct a DFA cannot express."""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{field_name}: invalid regular expression: {e}") from None
    if pattern.startswith("^"):
        pattern = pattern[1:]
    trailing_backslashes = len(pattern[:-1]) - len(pattern[:-1].rstrip("\\"))
    if pattern.endswith("$") and trailing_backslashes % 2 == 0:
        pattern = pattern[:-1]

    def walk(items: Any) -> None:
        for op, av in items:
            if str(op) in _UNSUPPORTED_OPS:
                raise ValueError(f"{field_name}: unsupported construct: {_UNSUPPORTED_OPS[str(op)]}")
            for part in av if isinstance(av, (tuple, list)) else (av,):
                for sub in part if isinstance(part, list) else (part,):
                    if isinstance(sub, sre_parse.SubPattern):
                        walk(sub)

    walk(sre_parse.parse(pattern))
    return pattern


def compile_char_dfa(
    pattern: str,
    max_states: int = DEFAULT_MAX_STATES,
    deadline: float | None = None,
    field_name: str = "regex",
) -> CharDFA:
    """Full-match character DFA of `pattern`, renumbered in BFS order (initial state 0), live states only."""
    body = _check_supported(pattern, field_name)
    try:
        with deadline_guard(deadline, field_name):
            fsm = interegular.parse_pattern(body).to_fsm()
    except (interegular.patterns.Unsupported, interegular.patterns.InvalidSyntax) as e:
        raise ValueError(f"{field_name}: unsupported construct: {e}") from None
    if len(fsm.states) > max_states:
        raise ValueError(
            f"{field_name}: the automaton has {len(fsm.states)} states, over the limit {max_states}"
        )
    keys = sorted(fsm.alphabet.by_transition)
    column = {key: i for i, key in enumerate(keys)}
    char_class: dict[str, int] = {}
    other_class = -1
    for key, symbols in fsm.alphabet.by_transition.items():
        for sym in symbols:
            if sym is anything_else:
                other_class = column[key]
            else:
                char_class[sym] = column[key]
    # Live = reachable backwards from an accepting state; then renumber live states reachable from the start.
    reverse: dict[Any, set[Any]] = {}
    for src, edges in fsm.map.items():
        for dst in edges.values():
            reverse.setdefault(dst, set()).add(src)
    live, queue = set(fsm.finals), deque(fsm.finals)
    while queue:
        for src in reverse.get(queue.popleft(), ()):
            if src not in live:
                live.add(src)
                queue.append(src)
    if fsm.initial not in live:
        raise ValueError(f"{field_name}: the pattern matches no string")
    order = {fsm.initial: 0}
    queue = deque([fsm.initial])
    while queue:
        for dst in fsm.map.get(queue.popleft(), {}).values():
            if dst in live and dst not in order:
                order[dst] = len(order)
                queue.append(dst)
    trans = np.full((len(order), len(keys)), -1, dtype=np.int32)
    accepting = np.zeros(len(order), dtype=bool)
    for state, idx in order.items():
        accepting[idx] = state in fsm.finals
        for key, dst in fsm.map.get(state, {}).items():
            if dst in order:
                trans[idx, column[key]] = order[dst]
    return CharDFA(trans=trans, accepting=accepting, char_class=char_class, other_class=other_class)


@dataclass(eq=False)
class TokenIndex:
    """Token-level automaton: the allowed tokens of each DFA state (CSR rows) and where each one leads."""

    dfa: CharDFA
    offsets: np.ndarray  # [S + 1] int64
    token_ids: np.ndarray  # [nnz] int32, grouped by state (unordered within a state)
    next_states: np.ndarray  # [nnz] int32
    eos_ids: np.ndarray  # int64
    vocab_size: int
    _masks: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def initial_state(self) -> int:
        return self.dfa.initial

    @property
    def num_states(self) -> int:
        return self.dfa.num_states

    def allowed(self, state: int) -> np.ndarray:
        """Allowed non-EOS token ids at `state`, in no particular order."""
        return self.token_ids[self.offsets[state] : self.offsets[state + 1]]

    def next_state(self, state: int, token_id: int) -> int:
        """State after `token_id`, or -1 when the token is not allowed (EOS included: it ends, not moves)."""
        if state < 0:
            return -1
        # A linear scan of one row (tens of microseconds at worst) beats keeping rows sorted or dense tables.
        lo = int(self.offsets[state])
        hits = np.flatnonzero(self.allowed(state) == token_id)
        return int(self.next_states[lo + hits[0]]) if len(hits) else -1

    def is_accepting(self, state: int) -> bool:
        return state >= 0 and bool(self.dfa.accepting[state])

    def eos_allowed(self, state: int) -> bool:
        return self.is_accepting(state) and len(self.eos_ids) > 0

    def has_continuation(self, state: int) -> bool:
        return state >= 0 and self.offsets[state + 1] > self.offsets[state]

    def forced_string(self, state: int) -> str | None:
        return self.dfa.forced_string(state)

    def mask(self, state: int, vocab_size: int | None = None) -> np.ndarray:
        """Bool mask [vocab_size] of the tokens allowed at `state` (EOS only when accepting); cached per
        state, so callers must not modify it. `vocab_size` may exceed the tokenizer's (padded logits)."""
        size = self.vocab_size if vocab_size is None else vocab_size
        cached = self._masks.get((state, size))
        if cached is None:
            cached = np.zeros(size, dtype=np.bool_)
            if state >= 0:
                ids = self.allowed(state).astype(np.int64)
                if self.is_accepting(state):
                    ids = np.concatenate([ids, self.eos_ids])
                cached[ids[ids < size]] = True
            cached.flags.writeable = False
            self._masks[(state, size)] = cached
        return cached


def _walk_trie(dfa: CharDFA, trie: VocabTrie, deadline: float | None) -> tuple[np.ndarray, ...]:
    """All (state, text, next state) triples where walking the text's characters from state stays live."""
    num_classes = dfa.trans.shape[1]
    # One extra all-dead column for characters the pattern cannot produce (class -1 indexes it).
    trans = np.concatenate([dfa.trans, np.full((dfa.num_states, 1), -1, np.int32)], axis=1)
    char_cls = np.fromiter(
        (dfa.class_of(chr(cp)) for cp in trie.distinct_chars), dtype=np.int64, count=len(trie.distinct_chars)
    )
    char_cls[char_cls < 0] = num_classes

    def classes(depth: int, nodes: np.ndarray) -> np.ndarray:
        return char_cls[trie.char_ids[depth][nodes]]

    out_state, out_text, out_next = [], [], []
    depth1 = np.arange(len(trie.char_ids[1])) if len(trie.char_ids) > 1 else np.zeros(0, np.int64)
    step = trans[:, classes(1, depth1)]  # [S, N1]
    origin, node = np.nonzero(step >= 0)
    cur = step[origin, node]
    depth = 1
    while len(origin):
        if deadline is not None and time.monotonic() > deadline:
            raise CompileTimeout("regex: building the token index took longer than the time limit")
        term = trie.terminal[depth][node]
        ends = term >= 0
        out_state.append(origin[ends])
        out_text.append(term[ends])
        out_next.append(cur[ends])
        counts = trie.child_cnt[depth][node]
        has_children = counts > 0
        origin, node, cur, counts = (
            origin[has_children],
            node[has_children],
            cur[has_children],
            counts[has_children],
        )
        if not len(node):
            break
        parent = np.repeat(np.arange(len(node)), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        child = trie.child_lo[depth][node][parent] + (np.arange(len(parent)) - first)
        nxt = trans[cur[parent], classes(depth + 1, child)]
        alive = nxt >= 0
        origin, node, cur = origin[parent][alive], child[alive], nxt[alive]
        depth += 1
    if not out_state:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(out_state), np.concatenate(out_text), np.concatenate(out_next)


def _token_live_states(
    num_states: int, src: np.ndarray, dst: np.ndarray, accepting: np.ndarray
) -> np.ndarray:
    """States from which some token sequence reaches acceptance (a char-live state can still be a token
    dead end when the only spellings need tokens that are never allowed)."""
    pairs = np.unique(src.astype(np.int64) * num_states + dst)
    reverse: dict[int, list[int]] = {}
    for s, d in zip((pairs // num_states).tolist(), (pairs % num_states).tolist()):
        reverse.setdefault(d, []).append(s)
    live = accepting.copy()
    queue = deque(np.flatnonzero(accepting).tolist())
    while queue:
        for s in reverse.get(queue.popleft(), ()):
            if not live[s]:
                live[s] = True
                queue.append(s)
    return live


def build_token_index(
    pattern: str,
    vocab: TokenVocab,
    max_states: int = DEFAULT_MAX_STATES,
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
    field_name: str = "regex",
) -> TokenIndex:
    """Compiles `pattern` (full-match semantics) into a token index over `vocab`; ValueError when the
    pattern is invalid, unsupported, too large, too slow to compile or unreachable with this vocabulary."""
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    dfa = compile_char_dfa(pattern, max_states=max_states, deadline=deadline, field_name=field_name)
    trie = vocab.trie
    state, text, nxt = _walk_trie(dfa, trie, deadline)
    if len(trie.text_tokens) == len(trie.text_offsets) - 1:  # every text is spelled by exactly one token
        token = trie.text_tokens[text]
    else:
        per_text = trie.text_offsets[text + 1] - trie.text_offsets[text]
        rep = np.repeat(np.arange(len(text)), per_text)
        first = np.repeat(np.cumsum(per_text) - per_text, per_text)
        token = trie.text_tokens[trie.text_offsets[text][rep] + (np.arange(len(rep)) - first)]
        state, nxt = state[rep], nxt[rep]
    live = _token_live_states(dfa.num_states, state, nxt, dfa.accepting)
    if not live[dfa.initial]:
        raise ValueError(f"{field_name}: no token sequence of this tokenizer can match the pattern")
    keep = live[state] & live[nxt]
    state, token, nxt = state[keep], token[keep], nxt[keep]
    # Grouping by state is enough (rows need no order), and the walk already emits runs sorted by state.
    order = np.argsort(state, kind="stable")
    offsets = np.zeros(dfa.num_states + 1, dtype=np.int64)
    np.cumsum(np.bincount(state, minlength=dfa.num_states), out=offsets[1:])
    return TokenIndex(
        dfa=dfa,
        offsets=offsets,
        token_ids=token[order].astype(np.int32),
        next_states=nxt[order].astype(np.int32),
        eos_ids=np.asarray(vocab.eos_ids, dtype=np.int64),
        vocab_size=vocab.size,
    )
