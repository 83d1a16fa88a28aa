"""Model hyper-parameters read straight from a Hugging Face `config.json`.

The runtime runs its own Llama-family model code, so it reads the config as plain JSON rather than through
`transformers.AutoConfig`: that keeps start-up cheap and gives one normalized view of the fields that were
renamed across transformers versions (`rope_scaling`/`rope_theta` vs. `rope_parameters`, `torch_dtype` vs.
`dtype`, an int or a list for `eos_token_id`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architecture name -> the `model_type` that implies it when `architectures` is missing (GGUF exports).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

# Extra keys each RoPE scaling type needs besides `rope_type` itself.
_ROPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}

_DEFAULT_ROPE_THETA = 10000.0


@dataclass
class ModelConfig:
    """What the runtime's own Llama-family model code needs, read from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; otherwise {"rope_type": "linear"|"dynamic"|"llama3"|"yarn", "factor": ..., ...}
    # without `rope_theta` (that lives in its own field).
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # q/k/v projections carry biases (always for Qwen2; for Llama `attention_bias` also biases o_proj).
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> ModelConfig:
        """Reads config.json and, when present, merges generation_config.json's stop tokens."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json; expected a Hugging Face model dir")
        hf_config = _read_json(config_path)
        generation_path = model_dir / "generation_config.json"
        generation_config = _read_json(generation_path) if generation_path.is_file() else None
        return cls.from_hf_config(hf_config, generation_config=generation_config)

    @classmethod
    def from_hf_config(
        cls, hf_config: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Normalizes a config.json dict; raises ValueError for unsupported models or missing fields."""
        architecture = _architecture(hf_config)
        num_heads = _required_int(hf_config, "num_attention_heads")
        hidden_size = _required_int(hf_config, "hidden_size")
        num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
        head_dim = hf_config.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _rope(hf_config)
        if architecture == "Qwen2ForCausalLM":
            attention_bias = True
            sliding_window = hf_config.get("sliding_window") if hf_config.get("use_sliding_window") else None
        else:
            attention_bias = bool(hf_config.get("attention_bias", False))
            sliding_window = hf_config.get("sliding_window")
        generation_config = generation_config or {}
        bos_token_id = hf_config.get("bos_token_id")
        if bos_token_id is None:
            bos_token_id = generation_config.get("bos_token_id")
        eos_token_ids = _merge_ids(hf_config.get("eos_token_id"), generation_config.get("eos_token_id"))
        return cls(
            architecture=architecture,
            vocab_size=_required_int(hf_config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_required_int(hf_config, "intermediate_size"),
            num_layers=_required_int(hf_config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            bos_token_id=int(bos_token_id) if bos_token_id is not None else None,
            eos_token_ids=eos_token_ids,
            torch_dtype=_dtype_name(hf_config.get("torch_dtype") or hf_config.get("dtype")),
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _architecture(hf_config: dict[str, Any]) -> str:
    """Picks the architecture, inferring it from `model_type` when `architectures` is absent."""
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    architectures = hf_config.get("architectures") or []
    if architectures:
        for name in architectures:
            if name in SUPPORTED_ARCHITECTURES:
                return name
        raise ValueError(f"unsupported architecture {', '.join(architectures)}; supported: {supported}")
    model_type = hf_config.get("model_type")
    for name, implied_type in SUPPORTED_ARCHITECTURES.items():
        if model_type == implied_type:
            return name
    raise ValueError(f"unsupported architecture (model_type {model_type!r}); supported: {supported}")


def _required_int(hf_config: dict[str, Any], key: str) -> int:
    value = hf_config.get(key)
    if value is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return int(value)


def _rope(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Returns (rope_theta, rope_scaling) from either transformers 5's `rope_parameters` or the old keys."""
    params = dict(hf_config.get("rope_parameters") or {})
    legacy_scaling = hf_config.get("rope_scaling") or {}
    if not params:
        params = dict(legacy_scaling)
    theta = params.pop("rope_theta", None) or hf_config.get("rope_theta") or _DEFAULT_ROPE_THETA
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type not in _ROPE_REQUIRED_KEYS:
        supported = ", ".join(["default", *_ROPE_REQUIRED_KEYS])
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {supported}")
    missing = [key for key in _ROPE_REQUIRED_KEYS[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} is missing {', '.join(missing)}")
    return float(theta), {"rope_type": rope_type, **params}


def _merge_ids(*values: int | list[int] | None) -> list[int]:
    """Flattens int-or-list token ids, keeping first-seen order and dropping duplicates."""
    merged: list[int] = []
    for value in values:
        if value is None:
            continue
        for token_id in value if isinstance(value, list) else [value]:
            if int(token_id) not in merged:
                merged.append(int(token_id))
    return merged


def _dtype_name(value: Any) -> str | None:
    """Normalizes "torch.bfloat16" / "bfloat16" to "bfloat16"."""
    if value is None:
        return None
    return str(value).removeprefix("torch.")
