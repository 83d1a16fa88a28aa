"""ModelConfig parsing: real and tiny checkpoints, legacy vs. transformers 5 RoPE keys, and bad configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixlm_runtime.models.config import ModelConfig, RopeSpec, generation_sampling_defaults


def _llama_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config


def test_smollm2_from_converted_dir(default_model_dir: Path) -> None:
    config = ModelConfig.from_dir(default_model_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (576, 1536, 49152)
    assert config.tie_word_embeddings
    assert config.rope_theta == 100000.0
    assert config.rope_scaling is None
    assert config.max_position_embeddings == 8192
    assert not config.attention_bias
    assert config.bos_token_id == 1
    assert config.eos_token_ids == [2]
    assert config.rms_norm_eps == pytest.approx(1e-5)


def test_tiny_llama_dir(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_llama_dir)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (300, 64, 128)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.max_position_embeddings == 512
    assert not config.tie_word_embeddings
    assert not config.attention_bias
    assert config.sliding_window is None
    assert config.rope_scaling is None
    assert config.rope_theta == 10000.0
    assert config.eos_token_ids == [2]
    assert config.torch_dtype == "float32"


def test_tiny_qwen2_dir(tiny_qwen2_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_qwen2_dir)
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.sliding_window is None  # use_sliding_window is false
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)


def test_legacy_llama3_rope_scaling() -> None:
    config = ModelConfig.from_hf_config(
        _llama_config(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config.head_dim == 128
    assert config.eos_token_ids == [128001, 128008, 128009]
    assert config.torch_dtype == "bfloat16"


def test_legacy_linear_rope_scaling_with_old_type_key() -> None:
    config = ModelConfig.from_hf_config(_llama_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.rope_theta == 10000.0


def test_rope_parameters_dict_of_transformers_5() -> None:
    config = ModelConfig.from_hf_config(
        _llama_config(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6})
    )
    assert config.rope_theta == 1e6
    assert config.rope_scaling == {"rope_type": "dynamic", "factor": 4.0}


def test_default_rope_type_means_no_scaling() -> None:
    config = ModelConfig.from_hf_config(_llama_config(rope_scaling={"rope_type": "default"}, rope_theta=5e5))
    assert config.rope_scaling is None
    assert config.rope_theta == 5e5


def test_unknown_or_incomplete_rope_scaling_is_rejected() -> None:
    with pytest.raises(ValueError, match="long_factor"):
        ModelConfig.from_hf_config(
            _llama_config(rope_scaling={"rope_type": "longrope", "short_factor": [1.0]})
        )
    with pytest.raises(ValueError, match="su"):
        ModelConfig.from_hf_config(_llama_config(rope_scaling={"rope_type": "su", "factor": 2.0}))
    with pytest.raises(ValueError, match="low_freq_factor"):
        ModelConfig.from_hf_config(_llama_config(rope_scaling={"rope_type": "llama3", "factor": 8.0}))


def test_unsupported_architecture_names_it_and_lists_supported() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as excinfo:
        ModelConfig.from_hf_config(_llama_config(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    message = str(excinfo.value)
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert name in message
    with pytest.raises(ValueError, match="gpt2"):
        ModelConfig.from_hf_config(_llama_config(architectures=None, model_type="gpt2"))


def test_architecture_inferred_from_model_type() -> None:
    config = ModelConfig.from_hf_config(_llama_config(architectures=None, model_type="qwen2"))
    assert config.architecture == "Qwen2ForCausalLM"


def test_rope_parameters_per_layer_type_and_legacy_local_base() -> None:
    """Gemma 3: transformers 5 nests rope parameters per layer type; older configs name the local
    layers' base `rope_local_base_freq`. Both give each layer type its table."""
    nested = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    config = ModelConfig.from_hf_config(_llama_config(rope_parameters=nested))
    assert config.rope_for("full_attention") == RopeSpec(1e6, {"rope_type": "linear", "factor": 8.0})
    assert config.rope_for("sliding_attention") == RopeSpec(1e4, None)
    legacy = ModelConfig.from_hf_config(_llama_config(rope_theta=1e6, rope_local_base_freq=1e4))
    assert legacy.rope_for("sliding_attention") == RopeSpec(1e4, None)
    assert legacy.rope_for("full_attention") == RopeSpec(1e6, None)


def test_partial_rotary_is_refused() -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf_config(_llama_config(partial_rotary_factor=0.5))


def test_mistral_sliding_window_and_explicit_head_dim() -> None:
    config = ModelConfig.from_hf_config(
        _llama_config(
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            hidden_size=5120,
            num_attention_heads=32,
            head_dim=128,
            sliding_window=4096,
            torch_dtype="torch.bfloat16",
        )
    )
    assert config.architecture == "MistralForCausalLM"
    assert config.head_dim == 128  # not 5120 // 32
    assert config.sliding_window == 4096
    assert config.torch_dtype == "bfloat16"


def test_missing_kv_heads_defaults_to_mha() -> None:
    raw = _llama_config()
    del raw["num_key_value_heads"]
    assert ModelConfig.from_hf_config(raw).num_kv_heads == 32


def test_missing_required_field_is_named() -> None:
    raw = _llama_config()
    del raw["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_config(raw)


def test_from_dir_merges_generation_config_eos(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_llama_config(eos_token_id=128001)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    config = ModelConfig.from_dir(tmp_path)
    assert config.eos_token_ids == [128001, 128009]
    assert config.bos_token_id == 128000


def test_from_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_generation_sampling_defaults(tmp_path: Path) -> None:
    assert generation_sampling_defaults(tmp_path) == {}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "min_p": None,
                "eos_token_id": 1,
            }
        )
    )
    assert generation_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_sampling_defaults(tmp_path, "openai") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match=r"generation_config.json: .*top_p"):
        generation_sampling_defaults(tmp_path)
