"""Model hyper-parameters read straight from a Hugging Face `config.json`.

The runtime runs its own model code, so it reads the config as plain JSON rather than through
`transformers.AutoConfig`: that keeps start-up cheap and gives one normalized view of the fields that were
renamed across transformers versions (`rope_scaling`/`rope_theta` vs. `rope_parameters`, per layer type
or not, `torch_dtype` vs. `dtype`, an int or a list for `eos_token_id`). Fields only one family reads
stay in `raw`, read by that family's module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Extra keys each RoPE scaling type needs besides `rope_type` itself.
_ROPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}
# A layer's attention kind, as transformers' `layer_types` names it.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table's parameters: base and scaling (None for plain RoPE), without `rope_theta`."""

    theta: float
    scaling: dict[str, Any] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """What the runtime's own model code needs, read from config.json."""

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
    # The config's `attention_bias` (a family may bias its projections regardless: Qwen2's q/k/v).
    attention_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    model_type: str | None = None
    hidden_act: str = "silu"
    # Per layer "full_attention" / "sliding_attention" as the config lists them; None where it lists
    # none (the family then decides from its own legacy fields).
    layer_types: tuple[str, ...] | None = None
    # The rotary table of each layer type that has its own (Gemma 3's local layers); the others use
    # rope_theta / rope_scaling.
    rope_by_layer_type: dict[str, RopeSpec] = field(default_factory=dict)
    # The whole config.json, for the fields one family alone reads.
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def rope_for(self, layer_type: str) -> RopeSpec:
        return self.rope_by_layer_type.get(layer_type) or RopeSpec(self.rope_theta, self.rope_scaling)

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
        from radixlm_runtime.models.registry import resolve_architecture

        architecture = resolve_architecture(hf_config.get("architectures") or [], hf_config.get("model_type"))
        num_heads = _required_int(hf_config, "num_attention_heads")
        hidden_size = _required_int(hf_config, "hidden_size")
        num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
        head_dim = hf_config.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling, rope_by_layer_type = _ropes(hf_config)
        # Qwen2/3 keep a window in their configs that only `use_sliding_window` turns on.
        sliding_window = (
            None if hf_config.get("use_sliding_window") is False else hf_config.get("sliding_window")
        )
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
            attention_bias=bool(hf_config.get("attention_bias", False)),
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            bos_token_id=int(bos_token_id) if bos_token_id is not None else None,
            eos_token_ids=eos_token_ids,
            torch_dtype=_dtype_name(hf_config.get("torch_dtype") or hf_config.get("dtype")),
            model_type=hf_config.get("model_type"),
            hidden_act=str(hf_config.get("hidden_activation") or hf_config.get("hidden_act") or "silu"),
            layer_types=tuple(hf_config["layer_types"]) if hf_config.get("layer_types") else None,
            rope_by_layer_type=rope_by_layer_type,
            raw=hf_config,
        )


# The sampling fields a generation_config.json may recommend, under the names SamplingParams uses.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_sampling_defaults(model_dir: Path | str, mode: str = "model") -> dict[str, Any]:
    """The defaults of every request's unset sampling fields under `--sampling-defaults mode`: for
    "model", the values the model's generation_config.json recommends (Qwen3: temperature 0.6, top_p
    0.95, top_k 20); empty for "openai", or where the model has no such file or sets none of them."""
    path = Path(model_dir) / "generation_config.json"
    if mode == "openai" or not path.is_file():
        return {}
    from radixlm_runtime.sampling.params import SamplingParams

    config = _read_json(path)
    defaults = {key: config[key] for key in SAMPLING_DEFAULT_FIELDS if config.get(key) is not None}
    try:
        SamplingParams.from_dict(defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (or start with --sampling-defaults openai)") from None
    return defaults


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _required_int(hf_config: dict[str, Any], key: str) -> int:
    value = hf_config.get(key)
    if value is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return int(value)


def _ropes(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, dict[str, RopeSpec]]:
    """(rope_theta, rope_scaling) of the full-attention layers, and the tables of layer types that
    have their own: transformers 5 nests `rope_parameters` per layer type where they differ (Gemma 3);
    older configs give local layers `rope_local_base_freq`."""
    params = hf_config.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        specs = {kind: RopeSpec(*_rope(hf_config, dict(p))) for kind, p in params.items()}
        full = specs.pop(FULL_ATTENTION, None) or RopeSpec(_DEFAULT_ROPE_THETA)
        return full.theta, full.scaling, specs
    theta, scaling = _rope(hf_config, dict(params))
    local = hf_config.get("rope_local_base_freq")
    return theta, scaling, ({SLIDING_ATTENTION: RopeSpec(float(local))} if local else {})


def _rope(hf_config: dict[str, Any], params: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Returns (rope_theta, rope_scaling) from either transformers 5's `rope_parameters` or the old keys."""
    legacy_scaling = hf_config.get("rope_scaling") or {}
    if not params:
        params = dict(legacy_scaling)
    theta = params.pop("rope_theta", None) or hf_config.get("rope_theta") or _DEFAULT_ROPE_THETA
    partial = params.pop("partial_rotary_factor", None) or hf_config.get("partial_rotary_factor") or 1.0
    if float(partial) != 1.0:
        raise ValueError(
            f"partial_rotary_factor {partial} is not supported (rotary over the whole head only)"
        )
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type not in _ROPE_REQUIRED_KEYS:
        supported = ", ".join(["default", *_ROPE_REQUIRED_KEYS])
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {supported}")
    if rope_type == "longrope" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = hf_config.get("original_max_position_embeddings")
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
