"""The argument shapes of a generate call, shared by the HTTP /generate and the offline Engine (SGLang's
GenerateReqInput): one prompt or a batch, as text or token ids, and every other argument either once
for the whole batch or as a list with one entry per prompt. Errors are ValueErrors that start with
the field they name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def prompt_ids(
    text: Any, input_ids: Any, tokenize: Callable[[str], list[int]], text_field: str
) -> tuple[list[list[int]], bool, str]:
    """Token ids of every prompt, whether a single prompt was given, and the field they came from."""
    if (text is None) == (input_ids is None):
        raise ValueError(f"{text_field}: give exactly one of {text_field} and input_ids")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{text_field} must be a string or a list of strings")
        id_lists, field = [tokenize(t) for t in texts], text_field
    else:
        single = (
            isinstance(input_ids, list) and bool(input_ids) and all(isinstance(t, int) for t in input_ids)
        )
        id_lists, field = ([input_ids] if single else input_ids), "input_ids"
        if not isinstance(id_lists, list) or not all(
            isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            for ids in id_lists
        ):
            raise ValueError("input_ids must be a list of token ids or a list of such lists")
    if not id_lists:
        raise ValueError(f"{field}: the batch is empty")
    return id_lists, single, field


def per_prompt(value: T | list[T], n: int, field: str) -> list[T]:
    """value for each of n prompts: a list gives one entry per prompt, anything else is shared."""
    values = value if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise ValueError(f"{field}: got {len(values)} entries for {n} prompts")
    return values


@dataclass(frozen=True)
class LogprobArgs:
    """What one prompt asks for in logprobs: input tokens from logprob_start_len on (-1: none) and
    the top_logprobs_num most likely tokens at each position."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


def logprob_args(
    return_logprob: bool | list[bool],
    logprob_start_len: int | None | list[int | None],
    top_logprobs_num: int | None | list[int | None],
    n: int,
) -> list[LogprobArgs]:
    """Per-prompt logprob settings; the list forms let one batch score each prompt from its own
    offset (SGLang's multiple-choice scoring: every question's choices in one call)."""
    out = []
    for want, start, top in zip(
        per_prompt(return_logprob, n, "return_logprob"),
        per_prompt(logprob_start_len, n, "logprob_start_len"),
        per_prompt(top_logprobs_num, n, "top_logprobs_num"),
    ):
        if not isinstance(want, bool):
            raise ValueError(f"return_logprob must be a boolean, got {want!r}")
        for name, v in (("logprob_start_len", start), ("top_logprobs_num", top)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if top is not None and top < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top}")
        out.append(LogprobArgs(want, -1 if start is None else start, top or 0))
    return out


# Priorities travel as int64; a wider value is a client error, not a serialization crash.
PRIORITY_LIMIT = 2**31


def check_priority(value: Any) -> int:
    """A request's priority (None: 0), as an integer in [-2**31, 2**31)."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not -PRIORITY_LIMIT <= value < PRIORITY_LIMIT:
        raise ValueError(f"priority must be an integer in [-2**31, 2**31), got {value!r}")
    return value


MAX_SESSION_ID_LEN = 256


def check_session_id(session_id: object) -> None:
    """Raises ValueError naming the field unless session_id is a short printable string."""
    if (
        not isinstance(session_id, str)
        or not 1 <= len(session_id) <= MAX_SESSION_ID_LEN
        or not session_id.isprintable()
    ):
        raise ValueError(
            f"session_id must be a printable string of 1 to {MAX_SESSION_ID_LEN} characters, "
            f"got {session_id!r:.80}"
        )
