"""Tokenizer loading and the text side of a request: encoding, decoding, stop-string trimming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.limits import InvalidRequest

# A prompt text longer than context length x longest token (in characters) x this factor cannot fit
# the context, and is refused before it is tokenized. The factor covers normalizers (NFC, NFKC) that
# merge a few characters into one before tokenizing.
PROMPT_CHARS_SLACK = 4


def load_tokenizer(model_dir: Path) -> Any:
    """AutoTokenizer's tokenizer for model_dir, given a stand-in for the model's config: AutoTokenizer
    reads only the config's fields (model_type, tokenizer_class, the name) to pick the class, and
    loading the family's own config class imports its modeling stack, a second of every start-up in
    every process. Where config.json cannot be read, AutoTokenizer reads it as usual."""
    from transformers import AutoTokenizer, PreTrainedConfig

    try:
        fields = json.loads((model_dir / "config.json").read_text())
        model_type = fields["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return AutoTokenizer.from_pretrained(str(model_dir))
    stand_in = type(f"{model_type}StandInConfig", (PreTrainedConfig,), {"model_type": model_type})
    config = stand_in(**{**fields, "_name_or_path": str(model_dir)})
    return AutoTokenizer.from_pretrained(str(model_dir), config=config)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """An empty text is an empty prompt (rejected by the limits), not a lone BOS token."""
    return tokenizer.encode(text) if text else []


class PromptEncoder:
    """A prompt text's ids, for every entry point (Engine, /generate, /v1). A text that cannot fit
    the context whatever it says (more characters than context length x the most characters one
    token of this tokenizer spells, x PROMPT_CHARS_SLACK) is refused, naming the field, before the
    seconds it would take to tokenize."""

    def __init__(self, tokenizer: Any, context_len: int) -> None:
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.chars_per_token = PROMPT_CHARS_SLACK * max(map(len, tokenizer.get_vocab()), default=1)

    def __call__(self, text: str, field: str = "prompt") -> list[int]:
        self.check_chars(text, field)
        return encode_prompt(self.tokenizer, text)

    def check_chars(self, text: str, field: str) -> None:
        bound = self.context_len * self.chars_per_token
        if len(text) > bound:
            raise InvalidRequest(
                f"{field}: {len(text)} characters cannot fit the context length {self.context_len} (at "
                f"most {bound} characters: {self.chars_per_token} per token)",
                field,
                code="context_length_exceeded",
            )


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
