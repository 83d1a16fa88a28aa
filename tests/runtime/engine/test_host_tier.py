"""The host KV tier through the offline Engine (tiny random-init model): prefixes evicted from a small
pool come back from the host tier instead of being recomputed, with the same tokens as an engine
without a cache, and under --deterministic (where a cached prefix changes no bit) the same logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest

import radixlm_runtime as rt

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
# Twelve prompts of ~45 tokens sharing nothing past their first token: together ~3x the pool below.
PROMPTS = [f"document {i} " + "the theater then an answer abc " * 6 + f" question {i}" for i in range(12)]
POOL = 400


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[dict]:
    engine = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        disable_radix_cache=True,
        deterministic=True,
        max_total_tokens=4096,
        log_level="warning",
    )
    return engine.generate(PROMPTS, GREEDY, return_logprob=True)


def _engine(model_dir: Path, host_tokens: int, policy: str = "write_back") -> rt.Engine:
    return rt.Engine(
        str(model_dir),
        deterministic=True,
        kv_host_write_policy=policy,
        dtype="float32",
        max_total_tokens=POOL,
        kv_host_tokens=host_tokens,
        log_level="warning",
    )


def _twice(engine: rt.Engine) -> list[dict]:
    """Every prompt alone, then every prompt alone again: by the second round the pool has room
    for a few of them only."""
    for p in PROMPTS:
        engine.generate(p, GREEDY)
    return [engine.generate(p, GREEDY, return_logprob=True) for p in PROMPTS]


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_evicted_prefixes_come_back_from_the_host_tier(
    tiny_llama_dir: Path, reference: list[dict], policy: str
) -> None:
    engine = _engine(tiny_llama_dir, 4096, policy)
    outs = _twice(engine)
    for got, want in zip(outs, reference, strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
    info = engine.get_server_info()
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    # All but the last token of each prompt was cached somewhere; most of it only on the host.
    assert cached >= prompt_tokens - 2 * len(PROMPTS)
    assert info["host_hit_tokens"] > cached // 2
    assert info["host_loaded_tokens"] >= info["host_hit_tokens"]
    assert 0 < info["cached_tokens_on_host"] <= info["host_tier_tokens"] == 4096
    assert info["free_tokens"] + info["cached_tokens_in_tree"] == info["max_total_tokens"] == POOL
    if policy == "write_through":  # everything cached was copied when cached, the pool's too
        assert info["host_stored_tokens"] >= info["cached_tokens_on_host"] >= info["cached_tokens_in_tree"]


def test_without_the_host_tier_the_pool_alone_serves_few_hits(
    tiny_llama_dir: Path, reference: list[dict]
) -> None:
    outs = _twice(_engine(tiny_llama_dir, 0))
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference]
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) < prompt_tokens // 2


def test_a_host_tier_smaller_than_the_working_set_keeps_the_newest(
    tiny_llama_dir: Path, reference: list[dict]
) -> None:
    """With room for a few prompts on the host, the least recently used go: outputs stay exact and
    the accounting whole."""
    engine = _engine(tiny_llama_dir, 160)
    outs = _twice(engine)
    assert [o["output_ids"] for o in outs] == [r["output_ids"] for r in reference]
    info = engine.get_server_info()
    assert info["host_evicted_tokens"] > 0 and info["cached_tokens_on_host"] <= 160
    assert info["free_tokens"] + info["cached_tokens_in_tree"] == POOL


def test_host_tier_flags_are_validated() -> None:
    with pytest.raises(ValueError, match="kv_host_tokens"):
        rt.Engine(kv_host_tokens=-1)
    with pytest.raises(ValueError, match="kv_host_write_policy"):
        rt.Engine(kv_host_write_policy="sometimes")
