"""Shared fixtures: the embedded default model, tiny random-init Llama / Qwen2 model directories, and
one radixlm server (started through the language's own `Runtime`) for the language, backend and
example tests, and the test device (RADIXLM_TEST_DEVICE, tests/device_helpers.py).

The tiny directories are complete Hugging Face checkpoints (config, safetensors, tokenizer with a chat
template), so both transformers and the runtime can load them in well under a second.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# First: it sets the environment torch and Triton read when they start (see device_helpers).
from device_helpers import TEST_DEVICE, check_test_device  # isort: skip

import pytest
import torch
from tiny_models import build_tiny_model_dir

import radixlm as sgl
from radixlm_runtime.models.loader import resolve_model_path


def pytest_configure(config: pytest.Config) -> None:
    check_test_device()


@pytest.fixture(scope="session")
def test_device() -> torch.device:
    """The device of RADIXLM_TEST_DEVICE, where tests put the tensors they hand to device kernels."""
    return torch.device(TEST_DEVICE)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2 GGUF converted into the normal cache (converted once, then reused)."""
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init LlamaForCausalLM (vocab 300, hidden 64, 2 layers, 4 q / 2 kv heads).

    Tests that compare its outputs build its engines with dtype="float32" on every device: its
    logits are nearly flat, so greedy tokens only repeat across batch shapes at that precision."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes as tiny_llama_dir but a Qwen2ForCausalLM, whose q/k/v projections carry biases."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init Qwen3ForCausalLM (per-head q/k norms) whose tokenizer has `<think>` and
    `</think>` and a chat template that honours enable_thinking, for the reasoning parser."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def runtime() -> Iterator[sgl.Runtime]:
    """A real server on the default model, on a free loopback port; float32 on every device, so its
    answers compare with transformers' float32 ones as on the CPU."""
    rt = sgl.Runtime(dtype="float32", max_total_tokens=20000, log_level="warning")
    yield rt
    rt.shutdown()


@pytest.fixture
def backend(runtime: sgl.Runtime) -> sgl.RuntimeEndpoint:
    return runtime.endpoint


def score_prompt(engine: Any, ids: list[int], start: int = 0, top: int = 0) -> dict:
    """meta_info of a zero-token request for ids' prompt logprobs from position start on."""
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=top,
    )
    return out["meta_info"]


@pytest.fixture
def prompt_logprobs() -> Callable[..., dict]:
    """Scores a prompt through Engine.generate (shared by the engine and scheduler tests)."""
    return score_prompt


@pytest.fixture
def runtime_caplog(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> pytest.LogCaptureFixture:
    """caplog for the runtime's loggers: once an engine has set up logging they stop propagating to
    pytest's handler (utils/logging.py), so this test lets them through again."""
    monkeypatch.setattr(logging.getLogger("radixlm_runtime"), "propagate", True)
    caplog.set_level(logging.INFO, logger="radixlm_runtime")
    return caplog
