"""Shared fixtures: the embedded default model, tiny random-init Llama / Qwen2 model directories, and
one radixlm server (started through the language's own `Runtime`) for the language, backend and
example tests, and the test device (RADIXLM_TEST_DEVICE, tests/device_helpers.py).

The tiny directories are complete Hugging Face checkpoints (config, safetensors, tokenizer with a chat
template), so both transformers and the runtime can load them in well under a second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# First: it sets the environment torch and Triton read when they start (see device_helpers).
from device_helpers import TEST_DEVICE, check_test_device  # isort: skip

import pytest
import torch

import radixlm as sgl
from radixlm_runtime.models.loader import resolve_model_path

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("Ġ", "a"),
]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_MODEL_KWARGS = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def build_tiny_tokenizer():
    """Byte-level BPE over 256 bytes, a few merges and ChatML specials (ids 0-2, like SmolLM2): ~270 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TINY_SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    for left, right in TINY_MERGES:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=TINY_MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(TINY_SPECIAL_TOKENS)
    assert len(vocab) <= TINY_MODEL_KWARGS["vocab_size"]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


# Qwen3's template in short: a think block opens the assistant turn when thinking is off.
QWEN3_CHAT_TEMPLATE = (
    TINY_CHAT_TEMPLATE.removesuffix("{% endif %}")
    + "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    + "{% endif %}{% endif %}"
)


def build_tiny_model_dir(out_dir: Path, model_type: str) -> Path:
    """Saves a seeded random-init tiny model of model_type ("llama", "qwen2" or "qwen3") plus the tiny
    tokenizer (for qwen3 with `<think>` / `</think>` as special tokens and a Qwen3-style template)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    config_cls, model_cls, extra = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    }[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY_MODEL_KWARGS, **extra))
    model.save_pretrained(out_dir)
    tokenizer = build_tiny_tokenizer()
    if model_type == "qwen3":
        tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    assert len(tokenizer) <= TINY_MODEL_KWARGS["vocab_size"]
    tokenizer.save_pretrained(out_dir)
    return out_dir


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
