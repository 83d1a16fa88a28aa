"""The OpenAI-compatible endpoints, driven by the official `openai` client."""

from __future__ import annotations

import enum
import json
import re

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field
from server_harness import HEADERS

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]


def test_models_list(client: openai.OpenAI, model: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_string_list_and_token_ids(client: openai.OpenAI, model: str, url: str) -> None:
    one = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert one.id.startswith("cmpl-") and one.object == "text_completion" and one.model == model
    choice = one.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert one.usage.completion_tokens == 8 and one.usage.total_tokens == one.usage.prompt_tokens + 8
    native = requests.post(
        f"{url}/generate",
        json={"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
        headers=HEADERS,
        timeout=60,
    ).json()
    assert choice.text == native["text"]
    many = client.completions.create(model=model, prompt=[PROMPT, "Hello"], max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == native["text"][
        : len(many.choices[0].text)
    ]
    ids = client.completions.create(model=model, prompt=native["output_ids"][:3], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3
    id_lists = client.completions.create(model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert len(id_lists.choices) == 2 and id_lists.usage.prompt_tokens == 5


def test_completion_echo_logprobs_n_stop(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == out.usage.prompt_tokens + 4
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[1] == len(lp.tokens[0])
    # The 2 best plus the actual token where it is not among them (vLLM's answer).
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    sampled = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=3
    )
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert sampled.usage.completion_tokens <= 24
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=["\n"])
    assert stopped.choices[0].finish_reason == "stop" and "\n" not in stopped.choices[0].text


def test_completion_stream(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_and_cached_tokens(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    assert first.id.startswith("chatcmpl-") and first.object == "chat.completion"
    msg = first.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert first.choices[0].finish_reason in ("stop", "length")
    again = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == msg.content
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= again.usage.prompt_tokens - 1 > 0


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == full.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy picks the top candidate
        assert bytes(item.bytes).decode(errors="replace") == item.token


def test_constrained_chat_completions(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "unit": {"type": "string", "maxLength": 10}},
        "required": ["answer", "unit"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=60, temperature=0, response_format=fmt
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=8, temperature=0, extra_body={"regex": "[0-9]+"}
    )
    assert re.fullmatch("[0-9]+", out.choices[0].message.content)
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"regex": "(Paris|Lyon)"}
    )
    assert out.choices[0].text in ("Paris", "Lyon") and out.choices[0].finish_reason == "stop"


def test_ebnf_extra_body(client: openai.OpenAI, model: str) -> None:
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ebnf": grammar}
    )
    assert re.fullmatch(r"The answer is [0-9]+\.", out.choices[0].message.content)
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ebnf": 'root ::= "Paris" | "Lyon"'},
    )
    assert out.choices[0].text in ("Paris", "Lyon") and out.choices[0].finish_reason == "stop"


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Reading(BaseModel):
    value: int = Field(ge=-100, le=100)
    unit: Unit


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    today: Reading
    tomorrow: Reading | None


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    """The SDK sends a strict json_schema ($defs, $ref, enum, anyOf with null) and parses the reply."""
    messages = [{"role": "user", "content": "Give the weather forecast for Paris as JSON."}]
    out = client.chat.completions.parse(
        model=model, messages=messages, max_tokens=120, temperature=0, response_format=Forecast
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and isinstance(parsed.today.unit, Unit)


def test_json_object_response_format(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a valid prefix of an object
        assert out.choices[0].message.content.startswith("{")


def test_bad_response_format_names_the_field(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, response_format=fmt)


def test_openai_errors_have_openai_shape(url: str) -> None:
    r = requests.post(
        f"{url}/v1/completions", json={"prompt": "x", "temperature": -1}, headers=HEADERS, timeout=10
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert (
        err["type"] == "invalid_request_error"
        and err["param"] == "temperature"
        and "temperature" in err["message"]
    )
    r = requests.post(
        f"{url}/v1/chat/completions", json={"messages": [], "max_tokens": 1}, headers=HEADERS, timeout=10
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = requests.get(f"{url}/v1/nothing-here", headers=HEADERS, timeout=10)
    assert r.status_code == 404 and "error" in r.json()
