"""Jump-forward decoding: append the text a constraint forces without spending decode steps on it.

Where the grammar admits a single byte path (JSON keys and punctuation, fixed literals), that text is
appended at once. It is tokenized together with the output tokens the caller may still rewrite (the
scheduler passes the token sampled this step, which nobody has seen yet), so that merges across the
boundary give the tokens the tokenizer itself would produce, e.g. a sampled `"` followed by the
forced `,"age":` becomes `","` `age` `":` rather than `"` `,"` `age` `":`. The model then reads
canonical tokens, as it did in training. The guide follows by rolling back the rewritten tail and
consuming the new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixlm_runtime.constrained.backend import Guide


def plan_jump(
    guide: Guide,
    tail_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
    max_tokens: int,
) -> list[int] | None:
    """The ids that replace `tail_ids` (already consumed by the guide) to take in the forced text;
    None when nothing is forced, when they would be more than `max_tokens` (the budget left: decoding
    then goes on token by token, and the budget's completion takes over), or when the tail cannot be
    respelled (a partial character, or a tokenizer adding text of its own). The guide is left
    unchanged."""
    forced = guide.jump_forward()
    if forced is None or max_tokens <= 0:
        return None
    tail_text = decode(list(tail_ids))
    if "\ufffd" in tail_text:
        return None
    target = tail_text + forced
    ids = encode(target)
    if len(ids) > max_tokens:
        return None  # cut by the budget, the forced text would end the output mid-way
    text = decode(ids)
    if len(text) <= len(tail_text) or not target.startswith(text) or "\ufffd" in text:
        return None
    return ids


def apply_jump(guide: Guide, tail_ids: list[int], ids: list[int]) -> bool:
    """Moves the guide from after `tail_ids` to after `ids`; False (guide unchanged) when the
    constraint does not accept `ids` token by token, or when the grammar engine failed on them."""
    guide.rollback(len(tail_ids))
    if guide.advance_tokens(ids):
        return True
    if guide.error() is not None:
        return False  # the grammar engine failed on ids: the caller reports guide.error()
    if not guide.advance_tokens(tail_ids):
        raise ValueError(f"the constraint no longer accepts its own output tail {tail_ids}")
    return False
