"""Tiny random-init Hugging Face checkpoints (config, safetensors, a byte-level BPE tokenizer with a
chat template) that both transformers and the runtime load in well under a second; shared by the
fixtures in conftest.py and the tests that build their own variants."""

from __future__ import annotations

from pathlib import Path

import torch

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


def with_generation_config(model_dir: Path, out_dir: Path, values: dict) -> Path:
    """A copy of model_dir (its files linked) whose generation_config.json also recommends `values`."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.name != "generation_config.json":
            (out_dir / path.name).symlink_to(path.resolve())
    source = model_dir / "generation_config.json"
    config = json.loads(source.read_text()) if source.is_file() else {}
    (out_dir / "generation_config.json").write_text(json.dumps(config | values))
    return out_dir
