"""Tokenizer loading and the text side of a request: encoding, decoding, stop-string trimming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixlm_runtime.io.finish import FinishReason


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """An empty text is an empty prompt (rejected by the limits), not a lone BOS token."""
    return tokenizer.encode(text) if text else []


def eos_token_ids(tokenizer: Any, config_eos: list[int]) -> list[int]:
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def decode_output(
    tokenizer: Any,
    output_ids: list[int],
    finished_reason: FinishReason | None,
    skip_special_tokens: bool = True,
    no_stop_trim: bool = False,
) -> str:
    """Final text of a request: a matched stop token or stop string is cut off (OpenAI semantics)
    unless no_stop_trim is set, and so is a character that the last token left incomplete (it
    decodes as U+FFFD), as streaming holds it back: both ways give the same text."""
    matched = finished_reason.matched if finished_reason is not None else None
    ids = output_ids
    if isinstance(matched, int) and not no_stop_trim and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).rstrip("\ufffd")
    if isinstance(matched, str) and not no_stop_trim:
        pos = text.find(matched)
        if pos >= 0:
            text = text[:pos]
    return text
