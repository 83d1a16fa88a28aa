"""plan_jump: forced text is retokenized with the rewritable tail into canonical tokens, bounded by
max_tokens, refused where the guide could not follow it, and decoding with jumps (as the scheduler
does it) still yields outputs that fullmatch the regex."""

from __future__ import annotations

import random
import re
from typing import Any

from constrained_helpers import distance_to_accept
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm_runtime.constrained.grammar import RegexGuide
from radixlm_runtime.constrained.json_schema import build_regex_from_schema
from radixlm_runtime.constrained.jump_forward import plan_jump
from radixlm_runtime.constrained.regex_fsm import TokenIndex, TokenVocab, build_token_index

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _encoder(tokenizer: Any) -> Any:
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def test_sampled_token_merges_with_forced_text(smol_vocab: TokenVocab, smol_tokenizer: Any) -> None:
    encode = _encoder(smol_tokenizer)
    guide = RegexGuide(build_token_index(build_regex_from_schema(SCHEMA), smol_vocab))
    start = plan_jump(guide, [], smol_vocab.texts, encode, max_tokens=64)
    assert start is not None and start.text == '{"name":"'
    assert start.ids == encode('{"name":"')
    guide.advance_text(start.text)
    for token in encode("Al"):
        guide.advance(token)
    assert plan_jump(guide, [], smol_vocab.texts, encode, 64) is None  # inside the string: nothing forced
    quote = encode('"')
    guide.advance(quote[0])
    jump = plan_jump(guide, quote, smol_vocab.texts, encode, 64)
    # '"' + ',"age":' is spelled '","' 'age' '":' by the tokenizer itself: the sampled quote is replaced.
    assert jump is not None and jump.text == ',"age":'
    assert jump.ids == encode('","age":') and jump.ids[0] != quote[0]


def test_max_tokens_truncates_to_a_prefix(smol_vocab: TokenVocab, smol_tokenizer: Any) -> None:
    encode = _encoder(smol_tokenizer)
    guide = RegexGuide(build_token_index(build_regex_from_schema(SCHEMA), smol_vocab))
    assert plan_jump(guide, [], smol_vocab.texts, encode, max_tokens=0) is None
    jump = plan_jump(guide, [], smol_vocab.texts, encode, max_tokens=2)
    assert jump is not None and jump.ids == encode('{"name":"')[:2]
    assert jump.text == '{"name'
    guide.advance_text(jump.text)
    assert guide.jump_forward() == '":"'


def test_text_the_guide_cannot_follow_is_not_jumped(tiny_vocab: TokenVocab, tiny_tokenizer: Any) -> None:
    # A special token spelled out in the pattern is encoded as that token, which has no text of its own.
    special = RegexGuide(build_token_index(r"<\|im_end\|>[ab]", tiny_vocab))
    assert special.jump_forward() == "<|im_end|>"
    assert plan_jump(special, [], tiny_vocab.texts, _encoder(tiny_tokenizer), 64) is None
    # A tokenizer that prepends a space (SentencePiece style) would desynchronize text and tokens.
    space = tiny_vocab.texts.index(" ")
    guide = RegexGuide(build_token_index("abc[de]", tiny_vocab))

    def adds_space(text: str) -> list[int]:
        return [space, *tiny_tokenizer.encode(text, add_special_tokens=False)]

    assert plan_jump(guide, [], tiny_vocab.texts, adds_space, 64) is None
    assert plan_jump(guide, [], tiny_vocab.texts, _encoder(tiny_tokenizer), 64) is not None


# Literal-heavy patterns: forced runs of several characters next to free choices.
_ATOMS = st.sampled_from(["the", "an", "in", '":"', r"\{", ", ", "x", "[ab]", "[0-9]", "(yes|no)", "[a-z]"])


def _patterns() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda p: f"({p[0]}|{p[1]})"),
            inner.map(lambda r: f"({r})?"),
            inner.map(lambda r: f"({r}){{0,3}}"),
        )

    return st.recursive(_ATOMS, extend, max_leaves=8)


def _decode_with_jumps(
    index: TokenIndex, vocab: TokenVocab, tokenizer: Any, rng: random.Random, max_tokens: int
) -> tuple[list[int], RegexGuide]:
    """Samples like the scheduler: a jump before the first token, then after every sampled token
    one with that token as the rewritable tail; random allowed tokens, then shortest paths to the end."""
    encode, dist = _encoder(tokenizer), distance_to_accept(index)
    guide, ids = RegexGuide(index), []

    def jump(tail: int) -> None:
        kept = len(ids) - tail
        planned = plan_jump(guide, ids[kept:], vocab.texts, encode, max_tokens - kept)
        if planned is not None:
            del ids[kept:]
            ids.extend(planned.ids)
            guide.advance_text(planned.text)

    jump(0)
    while not guide.is_finished() and len(ids) < max_tokens:
        if index.eos_allowed(guide.state) and rng.random() < 0.25:
            break
        allowed = index.allowed(guide.state)
        if len(ids) >= 20:
            nxt = index.next_states[index.offsets[guide.state] : index.offsets[guide.state + 1]]
            allowed = allowed[dist[nxt] < dist[guide.state]]
            if len(allowed) == 0:  # accepting: only EOS gets closer
                break
        token = int(allowed[rng.randrange(len(allowed))])
        guide.advance(token)
        ids.append(token)
        jump(1)
    return ids, guide


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=_patterns(), seed=st.integers(0, 2**32 - 1))
def test_decoding_with_jumps_fullmatches(
    pattern: str, seed: int, tiny_vocab: TokenVocab, tiny_tokenizer: Any
) -> None:
    index = build_token_index(pattern, tiny_vocab)
    rng = random.Random(seed)
    for _ in range(5):
        ids, guide = _decode_with_jumps(index, tiny_vocab, tiny_tokenizer, rng, max_tokens=200)
        text = "".join(tiny_vocab.texts[i] for i in ids)
        assert tiny_tokenizer.decode(ids) == text
        # The guide's state is the state of the output text, however it was tokenized.
        fresh = RegexGuide(index)
        fresh.resync(text)
        assert fresh.state == guide.state
        assert guide.is_accepting() and re.fullmatch(pattern, text), (pattern, text)
