"""Jump-forward decoding: append the text a constraint forces without spending decode steps on it.

Where the automaton admits a single character path (JSON keys and punctuation, fixed literals), that
text is appended at once. It is tokenized together with the output tokens the caller may still
rewrite (the scheduler passes the token sampled this step, which nobody has seen yet), so that merges
across the boundary give the tokens the tokenizer itself would produce, e.g. a sampled `"` followed
by the forced `,"age":` becomes `","` `age` `":` rather than `"` `,"` `age` `":`. The model then
reads canonical tokens, as it did in training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixlm_runtime.constrained.grammar import RegexGuide


@dataclass(frozen=True)
class Jump:
    """Replace the rewritable tail of the output by `ids`; the guide then consumes `text`."""

    ids: list[int]
    text: str  # the forced text `ids` add beyond the tail's own text


def plan_jump(
    guide: RegexGuide,
    tail_ids: Sequence[int],
    texts: Sequence[str | None],
    encode: Callable[[str], list[int]],
    max_tokens: int,
) -> Jump | None:
    """The jump from the guide's state (which already includes `tail_ids`), at most `max_tokens` ids
    long; None when nothing is forced, or when the forced text cannot be spelled as whole tokens of
    `texts` (the vocabulary's per-token text) that land on a state decoding can go on from."""
    forced = guide.jump_forward()
    tail_text = _spell(tail_ids, texts)
    if forced is None or tail_text is None or max_tokens <= 0:
        return None
    target = tail_text + forced
    ids = encode(target)[:max_tokens]
    text = _spell(ids, texts)
    # A tokenizer that adds text of its own (a leading space) or spells the forced text with special
    # or partial-character tokens cannot be followed by the guide: decoding goes on token by token.
    if text is None or len(text) <= len(tail_text) or not target.startswith(text):
        return None
    added = text[len(tail_text) :]
    index = guide.index
    state = index.dfa.walk(guide.state, added)
    if not (index.has_continuation(state) or index.is_accepting(state)):
        return None  # a state no token leads on from (the vocabulary cannot spell the rest from here)
    return Jump(ids, added)


def _spell(ids: Sequence[int], texts: Sequence[str | None]) -> str | None:
    """The text of `ids`; None when one of them has none of its own (special or partial UTF-8)."""
    pieces: list[str] = []
    for i in ids:
        piece = texts[i] if 0 <= i < len(texts) else None
        if piece is None:
            return None
        pieces.append(piece)
    return "".join(pieces)
