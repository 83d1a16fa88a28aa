"""The shortest valid completion of a constrained output, so a request whose token budget runs out
can still end on output that parses.

Every completion a byte-level grammar admits can be spelled in single-byte tokens, so the search
walks the guide over the single-byte ASCII tokens of the vocabulary, greedily: at each state it takes
the first allowed byte in an order that closes open structures first (`"`, `}`, `]`, `)`, then `,`
which ends a number or moves on to a required member), then digits, letters and the rest, avoiding a
byte that would repeat the text's last one to four bytes (which would loop, e.g. digits of an
unbounded integer) unless nothing else is allowed; its steps are undone with the guide's rollback.
The result is an upper bound on the shortest completion (greedy, single-byte tokens), found in at
most `limit` mask computations.
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable
from typing import Any

import numpy as np

from radixlm_runtime.constrained.backend import Guide

# Bytes that close what is open come first, and are taken even where they repeat.
_CLOSERS = b'"}])'
_BYTE_ORDER = (
    _CLOSERS.decode() + "," + string.digits + string.ascii_lowercase + string.ascii_uppercase + " .-+_/(["
)


@functools.cache
def single_byte_tokens(tokenizer: Any) -> tuple[tuple[int, ...], bytes]:
    """Token ids spelling one byte each, in search order, and those bytes: printable ASCII first,
    then the bytes >= 0x80 that continue a character cut mid-way (byte-level BPE pieces or
    `<0xNN>` byte-fallback tokens). Bytes the vocabulary has no single token for are skipped."""
    order = _BYTE_ORDER + "".join(c for c in string.printable if c not in _BYTE_ORDER)
    ids, spelled = [], bytearray()
    for ch in order:
        encoded = tokenizer.encode(ch, add_special_tokens=False)
        if len(encoded) == 1 and tokenizer.decode(encoded) == ch:
            ids.append(encoded[0])
            spelled.append(ord(ch))
    vocab = tokenizer.get_vocab()
    for byte in range(0x80, 0x100):
        token = vocab.get(_BYTE_LEVEL[byte], vocab.get(f"<0x{byte:02X}>"))
        if token is not None:
            ids.append(token)
            spelled.append(byte)
    return tuple(ids), bytes(spelled)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character map of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


_BYTE_LEVEL = _byte_level_alphabet()


def shortest_completion(
    guide: Guide,
    tokens: tuple[tuple[int, ...], bytes],
    encode: Callable[[str], list[int]],
    vocab_size: int,
    limit: int,
) -> list[int] | None:
    """Token ids that take the guide to a complete match: the walk's text in the tokenizer's own
    tokens where the guide accepts them, else the walk's single-byte tokens. [] when the output is
    already complete; None when the walk found none within `limit` steps. The guide is left unchanged,
    unless the grammar engine failed on the way (`guide.error()` says why; the guide is then unusable)."""
    walked = _walk(guide, tokens, encode, vocab_size, limit)
    if walked is None or not walked[0]:
        return None if walked is None else []
    ids, text = walked
    canonical = encode(text)
    if len(canonical) < len(ids) and guide.advance_tokens(canonical):
        complete = guide.is_accepting()
        guide.rollback(len(canonical))
        if complete:
            return canonical
    return ids


def _walk(
    guide: Guide,
    tokens: tuple[tuple[int, ...], bytes],
    encode: Callable[[str], list[int]],
    vocab_size: int,
    limit: int,
) -> tuple[list[int], str] | None:
    """The greedy walk: forced text in the tokenizer's tokens, other steps in single-byte tokens."""
    ids, spelled = tokens
    words, bits = np.asarray(ids) // 32, np.asarray(ids) % 32
    taken: list[int] = []
    text = bytearray()
    try:
        while not guide.is_accepting():
            if len(taken) >= limit:
                return None
            forced = guide.jump_forward()
            if forced is not None and guide.advance_tokens(forced_ids := encode(forced)):
                taken.extend(forced_ids)
                text.extend(forced.encode())
                continue
            allowed = np.flatnonzero((guide.allowed_mask(vocab_size)[words] >> bits) & 1)
            if len(allowed) == 0:
                return None
            pick = next((int(i) for i in allowed if not _repeats(text, spelled[i])), int(allowed[0]))
            if not guide.advance_tokens([ids[pick]]):
                return None
            taken.append(ids[pick])
            text.append(spelled[pick])
        return taken, text.decode("utf-8", errors="replace")
    finally:
        if taken and guide.error() is None:
            guide.rollback(len(taken))


def _repeats(text: bytearray, byte: int) -> bool:
    """Whether appending byte (not a closer) makes the text end in a block of one to four bytes
    written twice."""
    if byte in _CLOSERS:
        return False
    tail = bytes(text[-7:]) + bytes([byte])
    return any(len(tail) >= 2 * k and tail[-k:] == tail[-2 * k : -k] for k in range(1, 5))
