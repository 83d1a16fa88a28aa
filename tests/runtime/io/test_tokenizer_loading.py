"""load_tokenizer hands AutoTokenizer a stand-in config (to skip importing the family's modeling
stack): it must pick the very tokenizer AutoTokenizer picks on its own, special tokens and chat
template included."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from radixlm_runtime.io.tokenizer import load_tokenizer

TEXT = "Hello world, <think>a b</think> 12345 <|im_start|>ünïcödé"


@pytest.mark.parametrize("fixture", ["default_model_dir", "tiny_llama_dir", "tiny_qwen3_dir"])
def test_same_tokenizer_as_autotokenizer(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert type(ours) is type(theirs)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.pad_token_id,
    )
    assert ours.chat_template == theirs.chat_template
    assert len(ours) == len(theirs)


def test_a_directory_without_a_readable_config_falls_back(tiny_llama_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(OSError):  # AutoTokenizer's own reading of config.json fails as before
        AutoTokenizer.from_pretrained(str(tmp_path))
    with pytest.raises(OSError):
        load_tokenizer(tmp_path)
