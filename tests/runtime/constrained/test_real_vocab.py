"""The SmolLM2 vocabulary (49152 ids): a 6-field schema compiles to a correct index, walks decode to
valid documents, and jump-forward / token texts agree with the tokenizer's own decoding."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
from constrained_helpers import random_walk

from radixlm_runtime.constrained.grammar import RegexGuide
from radixlm_runtime.constrained.json_schema import build_regex_from_schema
from radixlm_runtime.constrained.regex_fsm import TokenVocab, build_token_index

# A ticket record: an enum, a nested object and a bounded array next to the scalar types.
SIX_FIELDS = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "title": {"type": "string", "maxLength": 24},
        "status": {"enum": ["open", "closed", "pending"]},
        "priority": {"type": "number"},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
        },
        "labels": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["id", "title", "status", "priority", "owner", "labels"],
}


def test_six_field_schema_index(smol_vocab: TokenVocab, smol_tokenizer: Any) -> None:
    index = build_token_index(build_regex_from_schema(SIX_FIELDS), smol_vocab)
    assert index.vocab_size == len(smol_tokenizer) == 49152
    assert index.forced_string(index.initial_state) == '{"id":'
    rng = random.Random(0)
    for _ in range(25):
        ids = random_walk(index, rng, budget=40)
        text = smol_tokenizer.decode(ids)
        assert text == "".join(smol_vocab.texts[i] for i in ids)
        jsonschema.validate(json.loads(text), SIX_FIELDS)
    # Multi-character tokens are used: e.g. '{"' is one SmolLM2 token and is allowed at the start.
    start = {smol_vocab.texts[i] for i in index.allowed(index.initial_state)}
    assert start == {"{", '{"'}
    # Special tokens other than EOS never appear.
    specials = set(smol_tokenizer.added_tokens_decoder)
    assert not specials & set(index.token_ids.tolist())


def test_guide_with_canonical_tokenization(smol_vocab: TokenVocab, smol_tokenizer: Any) -> None:
    pattern = r"(The answer is [0-9]+\.|I don't know\.)"
    guide = RegexGuide(build_token_index(pattern, smol_vocab))
    for token in smol_tokenizer.encode("The answer is 42.", add_special_tokens=False):
        assert guide.allowed_mask(49152)[token]
        guide.advance(token)
    assert guide.is_finished() and re.fullmatch(pattern, "The answer is 42.")


def test_unicode_text_in_strings(smol_vocab: TokenVocab, smol_tokenizer: Any) -> None:
    index = build_token_index(build_regex_from_schema({"type": "string"}), smol_vocab)

    def walk(text: str) -> int:
        state = index.initial_state
        for token in smol_tokenizer.encode(text, add_special_tokens=False):
            state = index.next_state(state, token)
        return state

    # Whole-character tokens (here "ïve", " café") are allowed like any others...
    assert index.is_accepting(walk('"naïve café"'))
    # ...but the byte-fallback spelling of an emoji uses partial UTF-8 tokens, which are never allowed.
    assert [smol_vocab.texts[i] for i in smol_tokenizer.encode("😀", add_special_tokens=False)] == [None] * 3
    assert walk('"😀"') == -1
