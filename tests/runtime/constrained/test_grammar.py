"""RegexGuide: masks for the sampler, advancing, finishing, jump-forward and re-syncing from text."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import numpy as np
import pytest
import torch

from radixlm_runtime.constrained.grammar import RegexGuide
from radixlm_runtime.constrained.json_schema import build_regex_from_schema
from radixlm_runtime.constrained.regex_fsm import TokenVocab, build_token_index
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.sampling.sampler import Sampler, SamplingBatchInfo, build_vocab_mask

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_jump_forward_emits_fixed_keys(tiny_vocab: TokenVocab, tiny_tokenizer: Any) -> None:
    guide = RegexGuide(build_token_index(build_regex_from_schema(SCHEMA), tiny_vocab))
    assert guide.jump_forward() == '{"name":"'
    guide.advance_text('{"name":"')
    assert guide.jump_forward() is None  # any character or the closing quote
    for token in tiny_tokenizer.encode('Al"', add_special_tokens=False):
        guide.advance(token)
    assert guide.jump_forward() == ',"age":'
    guide.advance_text(',"age":')
    # The runtime may retokenize the boundary; the state only depends on the text so far.
    other = RegexGuide(guide.index)
    other.resync('{"name":"Al","age":')
    assert other.state == guide.state
    with pytest.raises(ValueError, match="not allowed"):
        other.advance_text("x")


def test_eos_only_in_accepting_states_and_finishing(tiny_vocab: TokenVocab) -> None:
    eos = tiny_vocab.eos_ids[0]
    a = tiny_vocab.texts.index("a")
    guide = RegexGuide(build_token_index("a+", tiny_vocab))
    assert not guide.allowed_mask(300)[eos]
    guide.advance(a)
    mask = guide.allowed_mask(300)
    assert mask[eos] and mask[a] and not guide.is_finished()
    guide.advance(eos)
    assert guide.is_finished() and not guide.allowed_mask(300).any()

    fixed = RegexGuide(build_token_index("ab", tiny_vocab))
    with pytest.raises(ValueError, match="not allowed"):
        fixed.advance(eos)
    fixed.advance_text("ab")
    assert fixed.is_finished() and fixed.is_accepting()  # complete, and nothing may follow


def test_copy_is_independent(tiny_vocab: TokenVocab) -> None:
    guide = RegexGuide(build_token_index("[ab]+", tiny_vocab))
    twin = guide.copy()
    twin.advance(tiny_vocab.texts.index("a"))
    assert guide.state == guide.index.initial_state and twin.state != guide.state


def test_batch_mask_drives_the_sampler(tiny_vocab: TokenVocab) -> None:
    vocab_size = 300  # the tiny model's padded vocabulary
    index = build_token_index(build_regex_from_schema(SCHEMA), tiny_vocab)
    guides: list[RegexGuide | None] = [RegexGuide(index), None, RegexGuide(index)]
    assert build_vocab_mask([None, None], vocab_size) is None
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    sampler, rng = Sampler(seed=0), torch.Generator().manual_seed(0)
    texts = ["", "", ""]
    for _ in range(200):
        if all(g is None or g.is_finished() for g in guides):
            break
        info = SamplingBatchInfo.build(params, [None] * 3, None, vocab_size)
        allowed = [None if g is None else g.allowed_mask(vocab_size) for g in guides]
        info.vocab_mask = build_vocab_mask(allowed, vocab_size)
        assert info.vocab_mask.shape == (3, vocab_size) and info.vocab_mask[1].all()
        # Logits that favour EOS and quotes end the documents quickly; the mask keeps them valid.
        logits = torch.randn(3, vocab_size, generator=rng)
        logits[:, [tiny_vocab.eos_ids[0], tiny_vocab.texts.index('"'), tiny_vocab.texts.index("}")]] += 6
        next_ids = sampler(logits, info).next_token_ids.tolist()
        for row, guide in enumerate(guides):
            if guide is not None and not guide.is_finished():
                guide.advance(next_ids[row])
                texts[row] += tiny_vocab.texts[next_ids[row]] or ""
    for row in (0, 2):
        assert guides[row].is_finished()
        assert set(json.loads(texts[row])) == {"name", "age"}


def test_random_documents_through_the_guide(tiny_vocab: TokenVocab) -> None:
    index = build_token_index(r"(yes|no)( [0-9]{1,2})?", tiny_vocab)
    rng = random.Random(1)
    for _ in range(30):
        guide, text = RegexGuide(index), ""
        while not guide.is_finished():
            allowed = np.flatnonzero(guide.allowed_mask(300)).tolist()
            token = rng.choice(allowed)
            guide.advance(token)
            text += tiny_vocab.texts[token] or ""  # EOS contributes no text
        assert guide.is_accepting()
        assert re.fullmatch(r"(yes|no)( [0-9]{1,2})?", text)


def test_rollback_takes_back_advanced_tokens(tiny_vocab: TokenVocab, tiny_tokenizer: Any) -> None:
    guide = RegexGuide(build_token_index("ab+c", tiny_vocab))
    start = guide.state
    tokens = tiny_tokenizer.encode("abbc", add_special_tokens=False)
    masks = []
    for token in tokens:
        masks.append(guide.allowed_mask(300).copy())
        guide.advance(token)
    assert guide.is_accepting()
    guide.rollback(2)
    assert np.array_equal(guide.allowed_mask(300), masks[-2])
    for token in tokens[-2:]:
        guide.advance(token)
    assert guide.is_accepting()
    eos = next(iter(guide.index.eos_ids))
    guide.advance(eos)
    assert guide.terminated
    guide.rollback(1)  # EOS taken back: the constraint is live again
    assert not guide.terminated and guide.is_accepting()
    guide.rollback(len(tokens))
    assert guide.state == start
    with pytest.raises(ValueError, match="num_tokens"):
        guide.rollback(1)


def test_rollback_stops_at_consumed_text(tiny_vocab: TokenVocab, tiny_tokenizer: Any) -> None:
    guide = RegexGuide(build_token_index(build_regex_from_schema(SCHEMA), tiny_vocab))
    guide.advance_text('{"name":"')
    after_text = guide.state
    tokens = tiny_tokenizer.encode("Al", add_special_tokens=False)
    for token in tokens:
        guide.advance(token)
    with pytest.raises(ValueError, match="num_tokens"):
        guide.rollback(len(tokens) + 1)  # the forced text is not a token to take back
    guide.rollback(len(tokens))
    assert guide.state == after_text
