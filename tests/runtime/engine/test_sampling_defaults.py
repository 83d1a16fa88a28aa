"""--sampling-defaults on the offline Engine: a model whose generation_config.json recommends top_k=1
(greedy whatever the temperature) samples greedily when a request leaves top_k unset, not when the
request sets it, and never under 'openai'."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import with_generation_config

import radixlm_runtime as rt

PROMPT = "the theater then an answer"
NEW = {"max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_generation_config(
        tiny_llama_dir, tmp_path_factory.mktemp("gen_config"), {"top_k": 1, "temperature": 1.3}
    )


def _engine(model_dir: Path, **kwargs: str) -> rt.Engine:
    return rt.Engine(
        str(model_dir),
        dtype="float32",
        max_total_tokens=2048,
        context_length=256,
        log_level="warning",
        **kwargs,
    )


def _sampled(engine: rt.Engine, params: dict) -> list[list[int]]:
    return [engine.generate(PROMPT, {**NEW, **params, "seed": s})["output_ids"] for s in range(4)]


def test_model_defaults_fill_unset_fields(model_dir: Path) -> None:
    engine = _engine(model_dir)
    try:
        assert engine.sampling_defaults == {"top_k": 1, "temperature": 1.3}
        greedy = engine.generate(PROMPT, {**NEW, "temperature": 0})["output_ids"]
        # top_k unset (or null): the model's 1, so every seed gives the greedy tokens.
        assert _sampled(engine, {}) == [greedy] * 4
        assert _sampled(engine, {"top_k": None}) == [greedy] * 4
        # The request's own top_k wins: the tiny model's flat logits then sample something else.
        assert any(out != greedy for out in _sampled(engine, {"top_k": -1}))
    finally:
        engine.shutdown()


def test_openai_mode_ignores_the_model(model_dir: Path) -> None:
    engine = _engine(model_dir, sampling_defaults="openai")
    try:
        assert engine.sampling_defaults == {}
        greedy = engine.generate(PROMPT, {**NEW, "temperature": 0})["output_ids"]
        assert any(out != greedy for out in _sampled(engine, {}))
    finally:
        engine.shutdown()


def test_unknown_mode_is_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="sampling_defaults must be one of"):
        _engine(model_dir, sampling_defaults="vllm")
