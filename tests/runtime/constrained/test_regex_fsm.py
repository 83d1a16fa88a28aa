"""Regex → token index: soundness of random walks, completeness on canonical tokenizations, no dead
ends, vocabulary text mapping, and clear errors for what a DFA cannot express."""

from __future__ import annotations

import random
import re
import time
from typing import Any

import numpy as np
import pytest
from constrained_helpers import distance_to_accept, random_walk, token_edges
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm_runtime.constrained.regex_fsm import (
    CompileTimeout,
    TokenVocab,
    build_token_index,
    compile_char_dfa,
    deadline_guard,
)

# A safe regex grammar: everything here means the same to Python's re and to interegular.
_ATOMS = st.sampled_from(
    ["a", "b", "c", "x", "0", "1", " ", "-", r"\.", '"', "[a-c0-9]", "[^a-z]", r"\d", "[xy ]"]
)


def _regexes() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda p: f"({p[0]}|{p[1]})"),
            inner.map(lambda r: f"({r})?"),
            inner.map(lambda r: f"({r})*"),
            inner.map(lambda r: f"({r})+"),
            st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(
                lambda p: f"({p[0]}){{{min(p[1], p[2])},{max(p[1], p[2])}}}"
            ),
        )

    return st.recursive(_ATOMS, extend, max_leaves=6)


def _sample_match(index: Any, rng: random.Random, max_len: int = 30) -> str | None:
    """A random string in the language using only characters the pattern names explicitly (so the tiny
    byte-level tokenizer spells each of them with whole-character tokens)."""
    dfa = index.dfa
    by_class: dict[int, list[str]] = {}
    for ch, cls in dfa.char_class.items():
        if ch.isascii() and ch.isprintable():
            by_class.setdefault(cls, []).append(ch)
    state, out = dfa.initial, []
    for _ in range(max_len):
        if dfa.accepting[state] and rng.random() < 0.3:
            break
        options = [(c, int(dfa.trans[state, c])) for c in by_class if dfa.trans[state, c] >= 0]
        if not options:
            break
        cls, state = options[rng.randrange(len(options))]
        out.append(rng.choice(by_class[cls]))
    return "".join(out) if dfa.accepting[state] else None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=_regexes(), seed=st.integers(0, 2**32 - 1))
def test_random_walks_match_the_regex(
    pattern: str, seed: int, tiny_vocab: TokenVocab, tiny_tokenizer: Any
) -> None:
    index = build_token_index(pattern, tiny_vocab)
    rng = random.Random(seed)
    for _ in range(15):
        ids = random_walk(index, rng)
        text = "".join(tiny_vocab.texts[i] for i in ids)
        assert re.fullmatch(pattern, text), (pattern, text)
        assert tiny_tokenizer.decode(ids) == text
    # No dead ends: every allowed token leads to a state from which acceptance is reachable.
    _, dst = token_edges(index)
    assert (distance_to_accept(index)[dst] < 1 << 30).all()
    # Completeness: the tokenizer's own spelling of a matching string is accepted token by token.
    for _ in range(5):
        text = _sample_match(index, rng)
        if text is None:
            continue
        state = index.initial_state
        for token in tiny_tokenizer.encode(text, add_special_tokens=False):
            state = index.next_state(state, token)
            assert state >= 0, (pattern, text)
        assert index.is_accepting(state)


def test_index_tables(tiny_vocab: TokenVocab) -> None:
    index = build_token_index(r"(ab|c)+", tiny_vocab)
    start = index.initial_state
    allowed_texts = sorted(tiny_vocab.texts[i] for i in index.allowed(start))
    assert allowed_texts == ["a", "c"]
    a_id = tiny_vocab.texts.index("a")
    after_a = index.next_state(start, a_id)
    assert not index.is_accepting(after_a) and not index.eos_allowed(after_a)
    after_ab = index.next_state(after_a, tiny_vocab.texts.index("b"))
    assert index.is_accepting(after_ab) and index.eos_allowed(after_ab)
    assert index.next_state(start, tiny_vocab.texts.index("b")) == -1
    assert index.next_state(start, tiny_vocab.eos_ids[0]) == -1  # EOS ends a request, it never moves
    mask = index.mask(after_ab, 300)
    assert mask.shape == (300,) and mask[list(tiny_vocab.eos_ids)].all() and int(mask.sum()) == 3
    assert index.mask(after_ab, 300) is mask  # cached per state


def test_multi_character_tokens_and_whole_pattern(tiny_vocab: TokenVocab) -> None:
    index = build_token_index(r"the( the)*", tiny_vocab)
    ids = {text: tiny_vocab.texts.index(text) for text in ("t", "he", " the", " t")}  # merges of the tiny BPE
    state = index.next_state(index.next_state(index.initial_state, ids["t"]), ids["he"])
    assert state >= 0 and index.is_accepting(state)
    loop = index.next_state(state, ids[" the"])
    assert index.is_accepting(loop) and index.next_state(loop, ids[" the"]) == loop
    assert index.next_state(index.next_state(loop, ids[" t"]), ids["he"]) == loop


def test_vocab_excludes_specials_and_partial_utf8(tiny_vocab: TokenVocab, tiny_tokenizer: Any) -> None:
    assert tiny_vocab.size == len(tiny_tokenizer)
    for special in tiny_tokenizer.all_special_ids:
        assert tiny_vocab.texts[special] is None
    continuation_byte = tiny_tokenizer.convert_tokens_to_ids("Ģ")  # byte 0x80 alone is not UTF-8
    assert tiny_vocab.texts[continuation_byte] is None
    assert tiny_vocab.texts[tiny_tokenizer.convert_tokens_to_ids("Ġthe")] == " the"
    # Special tokens never appear in an index, even for a pattern spelling their text.
    index = build_token_index(re.escape("<|im_end|>") + "?x", tiny_vocab)
    assert all(tiny_vocab.texts[i] is not None for i in index.token_ids)
    assert TokenVocab.from_tokenizer(tiny_tokenizer).fingerprint == tiny_vocab.fingerprint


def test_characters_outside_the_pattern_alphabet(tiny_vocab: TokenVocab) -> None:
    index = build_token_index(r'"[^"\n]*"', tiny_vocab)
    inside = index.next_state(index.initial_state, tiny_vocab.texts.index('"'))
    allowed = {tiny_vocab.texts[i] for i in index.allowed(inside)}
    assert {"~", "a", " the", "{", '"'} <= allowed and "\n" not in allowed
    assert all("\n" not in t and t.count('"') <= 1 for t in allowed)


def test_unreachable_with_this_vocabulary(tiny_vocab: TokenVocab) -> None:
    # é is two bytes; the tiny vocabulary has only the single-byte halves, which are never allowed.
    with pytest.raises(ValueError, match="regex: no token sequence"):
        build_token_index("é+", tiny_vocab)


def test_leading_and_trailing_anchors_are_accepted(tiny_vocab: TokenVocab) -> None:
    index = build_token_index(r"^ab\$$", tiny_vocab)
    assert index.forced_string(index.initial_state) == "ab$"


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("a(b", "regex: invalid regular expression"),
        ("[z-a]", "regex: invalid regular expression"),
        ("(?=a)a", "regex: unsupported construct: lookahead"),
        ("(?<!a)b", "regex: unsupported construct: negative lookahead/lookbehind"),
        (r"(a)\1", "regex: unsupported construct: backreference"),
        (r"a\bb", "regex: unsupported construct: anchor"),
        ("a^b", "regex: unsupported construct: anchor"),
        (r"\p{L}", "regex: invalid regular expression"),
        ("[^\\s\\S]", "regex: the pattern matches no string"),
    ],
)
def test_bad_patterns(pattern: str, message: str, tiny_vocab: TokenVocab) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_token_index(pattern, tiny_vocab)


def test_field_name_in_errors(tiny_vocab: TokenVocab) -> None:
    with pytest.raises(ValueError, match=r"^json_schema: unsupported construct"):
        build_token_index("(?=a)a", tiny_vocab, field_name="json_schema")


def test_state_limit() -> None:
    with pytest.raises(ValueError, match="regex: the automaton has .* states, over the limit 50"):
        compile_char_dfa("(a|b)*a(a|b){6}", max_states=50)


def test_time_limit(tiny_vocab: TokenVocab) -> None:
    # Subset construction of this pattern needs 2**15 states: far beyond a 0.2 s budget.
    with pytest.raises(CompileTimeout, match="regex: compiling took longer than the time limit"):
        build_token_index("(a|b)*a(a|b){14}", tiny_vocab, time_limit_s=0.2)


def test_deadline_guard_survives_a_generator_closed_past_the_deadline() -> None:
    """A generator released past the deadline is closed inside a finalizer, where an exception
    would be swallowed and Python would drop the trace function: the guard must still stop the
    next ordinary call (a lost guard let a 2**15-state subset construction run for minutes)."""

    def step() -> int:
        return 1

    with pytest.raises(CompileTimeout), deadline_guard(time.monotonic() + 0.05, "regex"):
        gen = (i for i in range(3))
        next(gen)
        time.sleep(0.1)
        del gen
        step()


def test_forced_string() -> None:
    dfa = compile_char_dfa(r'\{"name":"[a-z]+"(,"age":[0-9]+)?\}')
    assert dfa.forced_string(dfa.initial) == '{"name":"'
    inside = dfa.walk(dfa.initial, '{"name":"bo')
    assert dfa.forced_string(inside) is None  # a letter or the closing quote
    after_name = dfa.walk(dfa.initial, '{"name":"bob"')
    assert dfa.forced_string(after_name) is None  # "," or "}"
    after_comma = dfa.step(after_name, ",")
    assert dfa.forced_string(after_comma) == '"age":'
    assert dfa.forced_string(dfa.walk(dfa.initial, '{"name":"b"}')) is None  # accepting


def test_index_rows_are_consistent(tiny_vocab: TokenVocab) -> None:
    index = build_token_index(r"[0-9]{1,3}(\.[0-9]+)?", tiny_vocab)
    for state in range(index.num_states):
        for token, nxt in zip(
            index.allowed(state), index.next_states[index.offsets[state] : index.offsets[state + 1]]
        ):
            assert index.dfa.walk(state, tiny_vocab.texts[token]) == nxt
    digits = {str(d) for d in range(10)}
    assert {tiny_vocab.texts[t] for t in index.allowed(index.initial_state)} == digits
    assert np.all(np.diff(index.offsets) >= 0)
