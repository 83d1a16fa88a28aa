"""Per-request sampling parameters, validated before anything runs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from radixlm_runtime.constrained.constraint import Constraint

_INT_FIELDS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "seed"}
# Every integer travels to the scheduler as msgpack, which holds 64 bits: larger values are refused
# here, naming their field, instead of failing to serialize. Seeds may be any int64 or uint64 (the
# sampler reduces them mod 2**64, as torch does); the other fields take the int64 range.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEED_MIN, SEED_MAX = INT64_MIN, 2**64 - 1
_FLOAT_FIELDS = {
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
# OpenAI's logit_bias limits: each bias in [-100, 100], at most 300 tokens.
LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_MAX_ENTRIES = 300


@dataclass
class SamplingParams:
    """Field names and defaults follow SGLang's `sampling_params` so requests port unchanged."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None  # a GBNF grammar (`root ::= ...`), as SGLang takes it
    n: int = 1
    seed: int | None = None
    # token id -> additive bias on its logit before sampling (OpenAI's and vLLM's logit_bias)
    logit_bias: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_dict(
        cls,
        params: dict[str, Any] | SamplingParams | None,
        vocab_size: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """Builds params from a user dict, naming the offending field on any error. `defaults` (the
        model's recommended values) fill the fields the dict leaves unset or null; a SamplingParams
        object is taken whole."""
        if isinstance(params, SamplingParams):
            return dataclasses.replace(params)
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
        if defaults:
            params = {**params, **{k: v for k, v in defaults.items() if params.get(k) is None}}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}; known fields are {sorted(known)}")
        kwargs: dict[str, Any] = {}
        for key, value in params.items():
            if value is None and key not in (
                "seed",
                "regex",
                "json_schema",
                "ebnf",
                "stop",
                "stop_token_ids",
                "logit_bias",
            ):
                continue
            kwargs[key] = _coerce(key, value)
        sp = cls(**kwargs)
        sp.validate(vocab_size)
        return sp

    def validate(self, vocab_size: int | None = None) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > max(self.max_new_tokens, 0):
            raise ValueError(
                f"sampling_params.min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling_params.min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"sampling_params.frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(
                f"sampling_params.presence_penalty must be in [-2, 2], got {self.presence_penalty}"
            )
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"sampling_params.repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.n < 1:
            raise ValueError(f"sampling_params.n must be >= 1, got {self.n}")
        try:
            Constraint.of(self.regex, self.json_schema, self.ebnf)
        except ValueError as e:
            raise ValueError(f"sampling_params: {e}") from None
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("sampling_params.stop must be a non-empty string or a list of non-empty strings")
        if len(self.logit_bias) > LOGIT_BIAS_MAX_ENTRIES:
            raise ValueError(
                f"sampling_params.logit_bias has {len(self.logit_bias)} entries; at most "
                f"{LOGIT_BIAS_MAX_ENTRIES} are allowed"
            )
        for tid, bias in self.logit_bias.items():
            if not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
                raise ValueError(
                    f"sampling_params.logit_bias[{tid}] must be in "
                    f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {bias}"
                )
        if vocab_size is not None:
            for tid in self.stop_token_ids:
                if not 0 <= tid < vocab_size:
                    raise ValueError(f"sampling_params.stop_token_ids: {tid} is outside [0, {vocab_size})")
            for tid in self.logit_bias:
                if not 0 <= tid < vocab_size:
                    raise ValueError(
                        f"sampling_params.logit_bias: token id {tid} is outside [0, {vocab_size})"
                    )

    def check_min_new_tokens(self, vocab_size: int, eos_ids: list[int]) -> None:
        """Refuses a min_new_tokens that no output can honour: when every token of the vocabulary
        stops the request (stop_token_ids, plus EOS unless ignored), banning stops until
        min_new_tokens would leave nothing to sample."""
        stops = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))
        if self.min_new_tokens > 0 and sum(0 <= t < vocab_size for t in stops) >= vocab_size:
            raise ValueError(
                f"sampling_params.min_new_tokens={self.min_new_tokens} cannot be honoured: every token "
                "of the vocabulary is a stop token (stop_token_ids / EOS)"
            )

    @property
    def constraint(self) -> Constraint | None:
        """The output constraint (regex, json_schema or ebnf), None when unconstrained."""
        return Constraint.of(self.regex, self.json_schema, self.ebnf)

    @property
    def is_constrained(self) -> bool:
        return self.regex is not None or self.json_schema is not None or self.ebnf is not None

    @property
    def has_penalties(self) -> bool:
        """Whether the next token depends on the tokens so far (frequency/presence/repetition)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _coerce(key: str, value: Any) -> Any:
    if key in _INT_FIELDS:
        if value is None and key == "seed":
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"sampling_params.{key} must be an integer, got {value!r}")
        if key == "seed" and not SEED_MIN <= value <= SEED_MAX:
            raise ValueError(f"sampling_params.seed must be in [-2**63, 2**64), got {value}")
        if key != "seed" and not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"sampling_params.{key} must be in the int64 range [-2**63, 2**63), got {value}")
        return value
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"sampling_params.{key} must be a number, got {value!r}")
        return float(value)
    if key in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise ValueError(f"sampling_params.{key} must be a boolean, got {value!r}")
        return value
    if key == "stop":
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
            return list(value)
        raise ValueError(f"sampling_params.stop must be a string or a list of strings, got {value!r}")
    if key == "stop_token_ids":
        if value is None:
            return []
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        if isinstance(value, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            return list(value)
        raise ValueError(f"sampling_params.stop_token_ids must be a list of integers, got {value!r}")
    if key == "logit_bias":
        return _coerce_logit_bias(value)
    if key in ("regex", "json_schema", "ebnf"):
        if value is None:
            return None
        if key == "json_schema" and isinstance(value, dict):
            import json

            return json.dumps(value)
        if not isinstance(value, str):
            raise ValueError(f"sampling_params.{key} must be a string, got {type(value).__name__}")
        return value
    raise AssertionError(key)


def _coerce_logit_bias(value: Any) -> dict[int, float]:
    """{token id: bias}; JSON object keys are strings, so "123" and 123 both name token 123."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"sampling_params.logit_bias must be an object of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        tid = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            tid = int(key)
        if tid is None:
            raise ValueError(f"sampling_params.logit_bias: key {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ValueError(f"sampling_params.logit_bias[{key}] must be a number, got {bias!r}")
        out[tid] = float(bias)
    return out
