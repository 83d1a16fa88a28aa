"""SamplingParams validation: bad input is a ValueError that names the offending field."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from radixlm_runtime.sampling.params import SamplingParams


def names(field: str) -> str:
    """Regex matching the field name as a whole word, so "n" doesn't match "min_new_tokens"."""
    return rf"(?<![\w]){re.escape(field)}(?![\w])"


BAD_INPUTS: list[tuple[dict[str, Any], str]] = [
    ({"temprature": 0.5}, "temprature"),
    ({"max_tokens": 5, "top_p": 0.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"n": 0}, "n"),
    # wrong types
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": [0.5]}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"max_new_tokens": "10"}, "max_new_tokens"),
    ({"seed": 1.5}, "seed"),
    ({"n": 2.0}, "n"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 1.0}, "stop_token_ids"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"regex": 5}, "regex"),
    ({"json_schema": ["not", "a", "schema"]}, "json_schema"),
    # mutually exclusive constraints
    ({"regex": "a+", "json_schema": "{}"}, "regex"),
    ({"regex": "a+", "json_schema": {"type": "string"}}, "json_schema"),
]


@pytest.mark.parametrize(
    ("params", "field"), BAD_INPUTS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_INPUTS)]
)
def test_bad_input_is_a_value_error_naming_the_field(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=names(field)):
        SamplingParams.from_dict(params)


@pytest.mark.parametrize("params", [[("temperature", 1.0)], "temperature=1", 3])
def test_non_dict_is_rejected(params: object) -> None:
    with pytest.raises(ValueError, match="sampling_params"):
        SamplingParams.from_dict(params)  # type: ignore[arg-type]


def test_stop_token_ids_checked_against_vocab() -> None:
    sp = SamplingParams.from_dict({"stop_token_ids": [3, 100]})
    sp.validate(vocab_size=200)
    with pytest.raises(ValueError, match=names("stop_token_ids")):
        sp.validate(vocab_size=50)


def test_logit_bias_keys_are_token_ids_checked_against_vocab() -> None:
    sp = SamplingParams.from_dict({"logit_bias": {"3": 100, 7: -100, "12": 0.5}})
    assert sp.logit_bias == {3: 100.0, 7: -100.0, 12: 0.5}
    sp.validate(vocab_size=20)
    with pytest.raises(ValueError, match=names("logit_bias")):
        sp.validate(vocab_size=10)
    assert SamplingParams.from_dict({"logit_bias": None}).logit_bias == {}


def test_defaults_and_none() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict({}) == SamplingParams()
    # None for a non-nullable field means "use the default", as OpenAI-style clients send it.
    sp = SamplingParams.from_dict({"temperature": None, "top_k": None, "seed": None, "stop": None})
    assert sp == SamplingParams()


def test_model_defaults_fill_only_unset_fields() -> None:
    model = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    sp = SamplingParams.from_dict({"temperature": 0.2, "top_p": None}, defaults=model)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.2, 0.95, 20)
    assert SamplingParams.from_dict(None, defaults=model).top_k == 20
    # The caller's dict is left as it was.
    raw = {"max_new_tokens": 3}
    SamplingParams.from_dict(raw, defaults=model)
    assert raw == {"max_new_tokens": 3}


def test_coercions() -> None:
    sp = SamplingParams.from_dict(
        {"temperature": 1, "stop": "\n", "stop_token_ids": 7, "json_schema": {"type": "object"}, "seed": -3}
    )
    assert sp.temperature == 1.0 and isinstance(sp.temperature, float)
    assert sp.stop == ["\n"]
    assert sp.stop_token_ids == [7]
    assert json.loads(sp.json_schema or "") == {"type": "object"}
    assert sp.seed == -3


def test_boundaries_are_accepted() -> None:
    sp = SamplingParams.from_dict(
        {
            "temperature": 0,
            "top_p": 1.0,
            "top_k": 1,
            "min_p": 1.0,
            "frequency_penalty": -2,
            "presence_penalty": 2,
            "repetition_penalty": 2,
            "max_new_tokens": 0,
            "min_new_tokens": 0,
        }
    )
    assert sp.is_greedy
    assert SamplingParams.from_dict({"top_k": -1, "top_p": 1e-9}).top_k == -1


def test_greedy_detection() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1, temperature=0.8).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_from_params_instance_is_a_copy() -> None:
    original = SamplingParams(temperature=0.3)
    copy = SamplingParams.from_dict(original)
    assert copy == original and copy is not original
