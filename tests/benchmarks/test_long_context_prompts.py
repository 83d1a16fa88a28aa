"""The long-context benchmark's prompts on each model's own tokenizer: a document starts as the
tokenizer starts a text (Gemma's BOS, nothing for SmolLM2), and nothing later in a conversation adds
another start token, so every turn extends the one before it token for token."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_long_context import conversation_turns  # noqa: E402
from bench_serving import long_documents  # noqa: E402

from radixlm_runtime.io.tokenizer import load_tokenizer  # noqa: E402
from radixlm_runtime.models.loader import resolve_model_path  # noqa: E402


@pytest.mark.parametrize("model", [None, "gemma3-270m"])
def test_turns_extend_one_document(model: str | None) -> None:
    tokenizer = load_tokenizer(resolve_model_path(model))
    start = tokenizer.encode("")
    docs = long_documents(2, 300, tokenizer)
    assert [len(d) for d in docs] == [300, 300] and docs[0] != docs[1]
    for doc in docs:
        assert doc[: len(start)] == start
        turns = conversation_turns(tokenizer, doc, 3)
        assert turns[0][:300] == doc
        for before, after in zip(turns, turns[1:], strict=False):
            assert after[: len(before)] == before and len(after) > len(before)
        special = set(tokenizer.all_special_ids)
        assert not special & set(turns[-1][len(start) :])
