"""Fixtures for constrained decoding: the tiny test vocabulary and the real SmolLM2 one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixlm_runtime.constrained.regex_fsm import TokenVocab
from radixlm_runtime.io.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir: Path) -> Any:
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_vocab(tiny_tokenizer: Any) -> TokenVocab:
    return TokenVocab.from_tokenizer(tiny_tokenizer)


@pytest.fixture(scope="session")
def smol_tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def smol_vocab(smol_tokenizer: Any) -> TokenVocab:
    return TokenVocab.from_tokenizer(smol_tokenizer)
