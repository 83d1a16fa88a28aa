"""Jump-forward decoding in the scheduler, on the tiny random-init model: outputs stay valid with it
on and off, take fewer forward passes with it on, keep the radix tree's KV true to its token ids, and
survive chunked prefill, retraction, stop strings, max_new_tokens and streaming."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from scheduler_helpers import assert_no_leak

import radixlm_runtime as rt

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 12},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "city", "member", "tags", "role"],
    "additionalProperties": False,
}
# 40-50 tokens each, so a 16-token budget prefills them in chunks.
PROMPTS = [f"{i}: the theater then an answer, " * 2 for i in range(6)]
PARAMS = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 150}


def _engine(model_dir: Path, **kwargs: Any) -> rt.Engine:
    flags = {"dtype": "float32", "max_total_tokens": 8192, "context_length": 512, "log_level": "warning"}
    return rt.Engine(str(model_dir), **(flags | kwargs))


def _assert_valid(outs: list[dict]) -> None:
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


@pytest.fixture(scope="module")
def off(tiny_llama_dir: Path) -> tuple[rt.Engine, list[dict]]:
    engine = _engine(tiny_llama_dir, disable_jump_forward=True)
    return engine, engine.generate(PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def on(tiny_llama_dir: Path) -> tuple[rt.Engine, list[dict]]:
    engine = _engine(tiny_llama_dir)
    return engine, engine.generate(PROMPTS, PARAMS)


def test_valid_either_way_with_fewer_forward_passes(
    on: tuple[rt.Engine, list[dict]], off: tuple[rt.Engine, list[dict]]
) -> None:
    (engine_on, outs_on), (engine_off, outs_off) = on, off
    _assert_valid(outs_on)
    _assert_valid(outs_off)
    info_on, info_off = engine_on.get_server_info(), engine_off.get_server_info()
    assert info_off["jump_forwards"] == info_off["jump_forward_tokens"] == 0
    assert info_on["jump_forwards"] > 0
    assert info_on["forward_passes"] < info_off["forward_passes"]
    assert info_on["generated_tokens"] < info_off["generated_tokens"]
    # Every output token was either sampled or appended by a jump.
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs_on)
    assert completion == info_on["generated_tokens"] + info_on["jump_forward_tokens"]
    assert all(len(o["output_ids"]) <= PARAMS["max_new_tokens"] for o in outs_on)
    assert_no_leak(engine_on)
    assert_no_leak(engine_off)


def test_same_output_where_decoding_chose_canonical_tokens(
    on: tuple[rt.Engine, list[dict]], off: tuple[rt.Engine, list[dict]]
) -> None:
    """Jump-forward feeds the model the tokenizer's own tokens for forced text; where decoding token
    by token happened to pick exactly those, the model saw the same context and greedy agrees."""
    tokenizer = on[0].tokenizer
    canonical = 0
    for a, b in zip(on[1], off[1]):
        assert a["output_ids"] == tokenizer.encode(a["text"], add_special_tokens=False)
        if b["output_ids"] == tokenizer.encode(b["text"], add_special_tokens=False):
            canonical += 1
            assert a["output_ids"] == b["output_ids"]
    assert canonical > 0


def test_tree_kv_matches_a_plain_prefill(tiny_llama_dir: Path, on: tuple[rt.Engine, list[dict]]) -> None:
    """What jumped requests left in the radix tree is the KV of exactly those token ids: it equals
    the KV a fresh engine computes for the same ids in one prefill. Rerunning a prompt hits it."""
    engine, outs = on
    prompt = engine.tokenizer.encode(PROMPTS[0])
    ids = prompt + outs[0]["output_ids"]
    slots, _ = engine.scheduler.cache.tree.match_prefix(ids)
    # All but the final jump's tokens, which the request finished without computing.
    assert len(prompt) < len(slots) < len(ids)

    fresh = _engine(tiny_llama_dir, disable_jump_forward=True)
    fresh.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    fresh_slots, _ = fresh.scheduler.cache.tree.match_prefix(ids)
    n = len(slots)
    for k, k_fresh in zip(engine.runner.kv_pool.k_buffers, fresh.runner.kv_pool.k_buffers):
        torch.testing.assert_close(k[slots], k_fresh[fresh_slots[:n]], atol=1e-4, rtol=1e-4)

    again = engine.generate(PROMPTS[0], PARAMS)
    assert again["output_ids"] == outs[0]["output_ids"]
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"]
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunked_prefill_size": 16},
        {"max_total_tokens": 200, "new_token_ratio": 0.1},
        {"disable_radix_cache": True},
    ],
    ids=["chunked-prefill", "retraction", "no-radix-cache"],
)
def test_scheduling_does_not_change_outputs(
    tiny_llama_dir: Path, on: tuple[rt.Engine, list[dict]], kwargs: dict[str, Any]
) -> None:
    engine = _engine(tiny_llama_dir, **kwargs)
    outs = engine.generate(PROMPTS, PARAMS)
    info = engine.get_server_info()
    assert info["jump_forwards"] > 0
    if "max_total_tokens" in kwargs:
        # 6 requests of ~45 + up to 150 tokens in a 200-token pool: decode must retract.
        assert info["num_retractions"] > 0
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in on[1]]
    assert_no_leak(engine)


LITERAL = "the theater then an answer"


def test_forced_tokens_count_against_max_new_tokens(on: tuple[rt.Engine, list[dict]]) -> None:
    """A budget below the forced text is refused up front; one that holds it exactly is spent on it."""
    engine = on[0]
    params = {"regex": f"[xy]{LITERAL}", "temperature": 0}
    need = len(engine.tokenizer.encode("x" + LITERAL, add_special_tokens=False))
    with pytest.raises(ValueError, match="^max_new_tokens: 6 is fewer than"):
        engine.generate("abc", params | {"max_new_tokens": 6})
    out = engine.generate("abc", params | {"max_new_tokens": need + 1})
    assert re.fullmatch(f"[xy]{LITERAL}", out["text"]) and len(out["output_ids"]) <= need + 1
    assert_no_leak(engine)


def test_fully_forced_output_needs_no_forward(on: tuple[rt.Engine, list[dict]]) -> None:
    engine = on[0]
    before = engine.get_server_info()["forward_passes"]
    out = engine.generate("abc", {"regex": LITERAL, "max_new_tokens": 64})
    assert out["text"] == LITERAL
    assert out["output_ids"] == engine.tokenizer.encode(LITERAL, add_special_tokens=False)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}
    assert engine.get_server_info()["forward_passes"] == before
    assert_no_leak(engine)


def test_logprob_requests_do_not_jump(on: tuple[rt.Engine, list[dict]]) -> None:
    engine = on[0]
    before = engine.get_server_info()["jump_forwards"]
    out = engine.generate(PROMPTS[0], PARAMS, return_logprob=True)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert engine.get_server_info()["jump_forwards"] == before
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


def test_stop_string_inside_forced_text(
    on: tuple[rt.Engine, list[dict]], off: tuple[rt.Engine, list[dict]]
) -> None:
    """A jump never skips past a stop string: the request stops where token-by-token decoding does."""
    params = {"regex": f"[xy]{{1,3}} {LITERAL}", "stop": ["then"], "temperature": 0, "max_new_tokens": 40}
    out_on, out_off = on[0].generate("abc", params), off[0].generate("abc", params)
    assert out_on["text"] == out_off["text"]
    assert out_on["text"].endswith("theater ")
    assert out_on["meta_info"]["finish_reason"] == {"type": "stop", "matched": "then"}


def test_streamed_tokens_are_never_rewritten(on: tuple[rt.Engine, list[dict]]) -> None:
    """Retokenization only touches the token sampled in the same step, before it is reported, so each
    streamed chunk extends the previous one (what the HTTP server's incremental protocol relies on)."""
    engine = on[0]
    seen: list[int] = []
    grew_by_more_than_one = False
    for chunk in engine.generate_stream(PROMPTS[1], PARAMS):
        ids = chunk["output_ids"]
        assert ids[: len(seen)] == seen
        grew_by_more_than_one |= len(ids) - len(seen) > 1
        seen = ids
    assert grew_by_more_than_one
    assert seen == on[1][1]["output_ids"]
