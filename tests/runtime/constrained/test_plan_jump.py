"""plan_jump / apply_jump: forced text is retokenized with the rewritable tail into canonical tokens,
bounded by max_tokens; the guide follows by rollback, and is left unchanged where it cannot; and
decoding with jumps (as the scheduler does it) still gives valid documents."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import numpy as np
import pytest
from constrained_helpers import allowed_ids

from radixlm_runtime.constrained.backend import GrammarBackend
from radixlm_runtime.constrained.constraint import Constraint
from radixlm_runtime.constrained.jump_forward import apply_jump, plan_jump

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "maximum": 200}},
    "required": ["name", "age"],
}


def codec(tokenizer: Any) -> tuple[Any, Any]:
    return tokenizer.decode, lambda text: tokenizer.encode(text, add_special_tokens=False)


def test_sampled_token_merges_with_forced_text(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    decode, encode = codec(smol_tokenizer)
    guide = backend.guide(backend.compile(Constraint("json_schema", json.dumps(SCHEMA))))
    start = plan_jump(guide, [], decode, encode, max_tokens=64)
    assert start == encode('{"name":"')
    assert apply_jump(guide, [], start)
    assert guide.advance_tokens(encode("Al"))
    assert plan_jump(guide, [], decode, encode, 64) is None  # inside the string: nothing forced
    quote = encode('"')
    guide.advance(quote[0])
    ids = plan_jump(guide, quote, decode, encode, 64)
    # '"' + ',"age":' is spelled '","' 'age' '":' by the tokenizer itself: the sampled quote is replaced.
    assert ids == encode('","age":') and ids[0] != quote[0]
    assert apply_jump(guide, quote, ids)
    assert guide.advance_tokens(encode("7}")) and guide.is_accepting()


def test_a_jump_longer_than_max_tokens_is_not_made(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    decode, encode = codec(smol_tokenizer)
    guide = backend.guide(backend.compile(Constraint("regex", "hello world[0-9]")))
    assert plan_jump(guide, [], decode, encode, max_tokens=0) is None
    assert plan_jump(guide, [], decode, encode, max_tokens=len(encode("hello world")) - 1) is None
    ids = plan_jump(guide, [], decode, encode, max_tokens=len(encode("hello world")))
    assert ids == encode("hello world") and apply_jump(guide, [], ids)
    assert guide.jump_forward() is None


def test_a_jump_the_guide_refuses_leaves_it_unchanged(backend: GrammarBackend, smol_tokenizer: Any) -> None:
    _, encode = codec(smol_tokenizer)
    guide = backend.guide(backend.compile(Constraint("regex", "ab[0-9]+")))
    tail = encode("ab")
    assert guide.advance_tokens(tail)
    before = guide.allowed_mask(VOCAB).copy()
    assert not apply_jump(guide, tail, encode("abc"))
    assert np.array_equal(guide.allowed_mask(VOCAB), before)


@pytest.mark.parametrize("seed", range(4))
def test_decoding_with_jumps_gives_valid_documents(
    backend: GrammarBackend, smol_tokenizer: Any, smol_eos: int, seed: int
) -> None:
    """Samples like the scheduler: after each sampled token, jump with that token as the tail."""
    decode, encode = codec(smol_tokenizer)
    guide = backend.guide(backend.compile(Constraint("json_schema", json.dumps(SCHEMA))))
    rng, out = random.Random(seed), []
    for _ in range(60):
        allowed = allowed_ids(guide, VOCAB)
        if smol_eos in allowed:
            break
        # Prefer short tokens so strings and numbers end within the budget.
        short = [int(t) for t in allowed if len(decode([int(t)])) <= 2] or [int(t) for t in allowed]
        token = short[rng.randrange(len(short))]
        guide.advance(token)
        out.append(token)
        ids = plan_jump(guide, out[-1:], decode, encode, 64)
        if ids is not None and apply_jump(guide, out[-1:], ids):
            out[-1:] = ids
    document = json.loads(decode(out))
    jsonschema.validate(document, SCHEMA)
