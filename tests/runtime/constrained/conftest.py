"""Fixtures for constrained decoding: the tiny test tokenizer, the real SmolLM2 one, and each grammar
backend bound to the latter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixlm_runtime.config import GRAMMAR_BACKENDS
from radixlm_runtime.constrained.backend import GrammarBackend, make_backend
from radixlm_runtime.io.tokenizer import load_tokenizer

SMOL_VOCAB = 49152


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir: Path) -> Any:
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="session")
def smol_tokenizer(default_model_dir: Path) -> Any:
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def smol_eos(smol_tokenizer: Any) -> int:
    return int(smol_tokenizer.eos_token_id)


@pytest.fixture(scope="session", params=GRAMMAR_BACKENDS)
def backend(request: pytest.FixtureRequest, smol_tokenizer: Any, smol_eos: int) -> GrammarBackend:
    if request.param == "xgrammar":
        pytest.importorskip("xgrammar")  # an extra (the test extra has it; a bare GPU image does not)
    return make_backend(request.param, smol_tokenizer, frozenset({smol_eos}), SMOL_VOCAB)
