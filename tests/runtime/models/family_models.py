"""Tiny random-init checkpoints of every registered family, built with transformers from configs of the
real models' shape (GQA, windows, soft-caps, q/k norms, rotary variants), for the equivalence tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tiny_models import TINY_MODEL_KWARGS, build_tiny_tokenizer

WINDOW = 16
_GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh"}
_SLIDING, _FULL = "sliding_attention", "full_attention"

# family -> (transformers config class, model class, config kwargs beyond TINY_MODEL_KWARGS)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW, "head_dim": 16}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **_GEMMA,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **_GEMMA,
            "num_hidden_layers": 3,
            "sliding_window": WINDOW,
            "layer_types": [_SLIDING, _FULL, _SLIDING],
            "rope_parameters": {
                _SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                _FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            },
            "tie_word_embeddings": True,
        },
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "sliding_window": WINDOW,
            "original_max_position_embeddings": 256,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
            },
            "pad_token_id": 0,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": None},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "norm_topk_prob": False},
    ),
}
SLIDING_FAMILIES = ("mistral", "qwen2", "gemma2", "gemma3", "phi3")


def build_family_dir(out_dir: Path, family: str) -> Path:
    """Saves a seeded tiny `family` model whose norms, biases and q/k norms are perturbed from their
    initial ones (ones / zeros would hide a norm convention or a missing bias), plus the tokenizer."""
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**TINY_MODEL_KWARGS, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out_dir)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir
