"""Splits a reasoning model's output into its reasoning (the text inside <think>...</think>) and its
answer, as vLLM's and SGLang's --reasoning-parser do: /v1/chat/completions answers them as
`reasoning_content` and `content`, and the frontend's separate_reasoning as two variables.

Text arrives in pieces (stream deltas) that may cut a tag anywhere, so the parser is incremental: a
tail that may still become a tag is held back until the next piece shows what it is. Feeding the
whole text at once gives the same split as feeding it piece by piece. The tags themselves are never
part of either side: `<think>` always switches to reasoning and `</think>` to the answer.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from radixlm_runtime.config import REASONING_PARSERS

THINK_START, THINK_END = "<think>", "</think>"
_TAG = re.compile(f"{re.escape(THINK_START)}|{re.escape(THINK_END)}")
# Parsers of models whose chat template writes <think> into the prompt: the output begins inside it.
_OPENED_BY_TEMPLATE = frozenset({"deepseek-r1"})


class Split(NamedTuple):
    """What a piece of output settles: its reasoning text and its answer text."""

    reasoning: str
    content: str


def check_parser_name(name: str) -> None:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {list(REASONING_PARSERS)}")


class ReasoningParser:
    """One output's split: feed() each new piece of its text, the last one with final=True."""

    def __init__(self, name: str) -> None:
        check_parser_name(name)
        self.in_reasoning = name in _OPENED_BY_TEMPLATE
        self._held = ""

    def feed(self, text: str, final: bool = False) -> Split:
        """The reasoning and answer text that `text` (after what was held back) settles. Unless
        final, a tail that is the start of a tag is held back; at the end it is plain text."""
        text = self._held + text
        reasoning: list[str] = []
        content: list[str] = []
        start = 0
        for tag in _TAG.finditer(text):
            (reasoning if self.in_reasoning else content).append(text[start : tag.start()])
            self.in_reasoning = tag.group() == THINK_START
            start = tag.end()
        keep = 0 if final else _partial_tag_len(text, start)
        end = len(text) - keep
        (reasoning if self.in_reasoning else content).append(text[start:end])
        self._held = text[end:]
        return Split("".join(reasoning), "".join(content))


def split_reasoning(name: str, text: str) -> Split:
    """The split of a whole output."""
    return ReasoningParser(name).feed(text, final=True)


def _partial_tag_len(text: str, start: int) -> int:
    """Length of the longest tail of text[start:] that a tag starts with (a tag cut by the piece's end)."""
    for k in range(min(len(THINK_END) - 1, len(text) - start), 0, -1):
        tail = text[-k:]
        if THINK_START.startswith(tail) or THINK_END.startswith(tail):
            return k
    return 0
