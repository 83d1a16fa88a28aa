"""Incremental detokenization and stop-string hold-back, on the default model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.server.tokenizer_manager import IncrementalDetokenizer

TEXTS = [
    "héllo wörld, naïve café",
    "数学是科学的语言。世界你好",
    "emoji 🎉🚀 and flags 🇫🇷 mixed with text",
    "  leading spaces\n\nand\ttabs  ",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path):
    return load_tokenizer(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_decode_is_exact_and_never_partial(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    previous = ""
    for n in range(1, len(ids) + 1):
        current = detok.update(ids[:n])
        assert "\ufffd" not in current
        assert current.startswith(previous)
        previous = current
    assert previous == tokenizer.decode(ids)
