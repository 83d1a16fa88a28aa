"""Grammar-engine failures are errors, never empty successes, on the real server (default model):
a constraint the engine gives up on before generation is a 400 naming the field that carried it; one
it gives up on mid-generation ends as a `constraint_error` finish that /generate reports and the
OpenAI API turns into an error. Also: a small constrained budget is spent by the model, not by the
shortest completion."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from server_harness import HEADERS, Server, assert_no_leak, wait_idle

from radixlm_runtime.io.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

# llguidance's Earley row for an object with this many optional properties exceeds its limit
# (ParserTooComplex: 4 items a property, 2,000 at most) as soon as the object opens; 600 keep a tool's
# listing in the prompt within the context.
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
# Only an infinitely nested value satisfies it.
ENDLESS = {
    "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    "$ref": "#/$defs/n",
}
# The engine has no trouble until the model opens the object: that happens mid-generation.
NUMBER_OR_WIDE = {"anyOf": [{"type": "integer"}, WIDE]}


def generate(url: str, sampling: dict[str, Any], stream: bool = False) -> requests.Response:
    body = {"text": "JSON:", "sampling_params": {"max_new_tokens": 16, "temperature": 0} | sampling}
    return requests.post(f"{url}/generate", json=body | {"stream": stream}, headers=HEADERS, timeout=120)


@pytest.fixture(scope="module")
def brace_bias(default_model_dir: Path) -> dict[str, float]:
    """logit_bias that makes the model open a JSON object (the '{' and '{"' tokens)."""
    tokenizer = load_tokenizer(default_model_dir)
    ids = {tokenizer.encode(text, add_special_tokens=False)[0] for text in ("{", '{"')}
    return {str(i): 100.0 for i in ids}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize(
    ("schema", "words"), [(WIDE, "gave up"), (ENDLESS, "no finite value")], ids=["wide", "endless"]
)
def test_schema_the_engine_gives_up_on_is_a_400(url: str, stream: bool, schema: dict, words: str) -> None:
    r = generate(url, {"json_schema": json.dumps(schema)}, stream=stream)
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"].endswith("json_schema") and words in error["message"], error


def test_openai_response_format_the_engine_gives_up_on_is_a_400(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": WIDE}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "JSON"}], response_format=fmt, max_tokens=16
        )
    assert e.value.body["param"] == "response_format" and "gave up" in e.value.body["message"], e.value.body


@pytest.mark.parametrize(("schema", "param"), [(WIDE, "tools"), (ENDLESS, "tools[0].function.parameters")])
def test_required_tool_call_the_engine_gives_up_on_is_a_400(
    client: openai.OpenAI, model: str, schema: dict, param: str
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema | {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Call f."}],
            tools=[tool],
            tool_choice="required",
            max_tokens=32,
        )
    assert e.value.body["param"] == param, e.value.body


def test_mid_generation_failure_is_a_constraint_error_finish(
    server: Server, client: openai.OpenAI, model: str, brace_bias: dict[str, float]
) -> None:
    bias = brace_bias
    r = generate(server.url, {"json_schema": json.dumps(NUMBER_OR_WIDE), "logit_bias": bias})
    assert r.status_code == 200, r.text[:500]
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "constraint_error" and reason["message"].startswith("json_schema: "), reason
    assert "Parser" in reason["message"], reason
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBER_OR_WIDE}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            out = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "JSON"}],
                response_format=fmt,
                logit_bias=bias,
                max_tokens=16,
                temperature=0,
                stream=stream,
            )
            list(out) if stream else None
        assert e.value.body["param"] == "response_format", e.value.body
        assert e.value.body["code"] == "constraint_error", e.value.body
    assert_no_leak(wait_idle(server))


def test_small_regex_budget_is_spent_by_the_model(url: str) -> None:
    """max_new_tokens 4 under [a-z]{1,10}: the model writes up to 4 tokens of the regex; before, the
    shortest completion ("a") was forced at once and the model never ran."""
    body = {
        "text": "My name is",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "regex": "[a-z]{1,10}"},
    }
    out = requests.post(f"{url}/generate", json=body, headers=HEADERS, timeout=120).json()
    assert re.fullmatch("[a-z]{1,10}", out["text"]), out
    assert out["meta_info"]["completion_tokens"] > 1, out
    free = body | {"sampling_params": {"max_new_tokens": 1, "temperature": 0, "regex": "[a-z]{1,10}"}}
    first = requests.post(f"{url}/generate", json=free, headers=HEADERS, timeout=120).json()
    assert out["text"].startswith(first["text"]), (out, first)
