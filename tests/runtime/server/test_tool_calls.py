"""Tool calling and structured output with the official `openai` client against a real server on the
default model: forced calls (required, a named function) and `auto`, streamed and not, arguments
valid under their schema, a tool result fed back, `chat.completions.parse` with a pydantic model,
and bad tool requests refused with a 400 naming the field."""

from __future__ import annotations

import enum
import json
from typing import Any

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field
from server_harness import HEADERS

pytestmark = pytest.mark.slow

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers and return their sum",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"$ref": "#/$defs/unit"},
            },
            "required": ["city", "unit"],
            "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        },
    },
}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [
    {"role": "system", "content": "You are a helpful assistant. Use the tools to answer."},
    {"role": "user", "content": "What is 2 + 3? Call the add tool."},
]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


def create(client: openai.OpenAI, model: str, **kw: Any) -> Any:
    return client.chat.completions.create(model=model, **({"messages": ASK, "temperature": 0} | kw))


def streamed(client: openai.OpenAI, model: str, **kw: Any) -> tuple[dict[str, Any], str, Any, list[Any]]:
    """(message rebuilt from the deltas, finish_reason, usage, the call deltas as sent)."""
    content: str | None = None
    calls: list[dict[str, Any]] = []
    call_deltas, finish, usage = [], None, None
    for chunk in create(client, model, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for d in delta.tool_calls or []:
                call_deltas.append(d)
                if d.index == len(calls):
                    calls.append({"id": d.id, "type": d.type, "function": d.function.model_dump()})
                else:
                    calls[d.index]["function"]["arguments"] += d.function.arguments
            finish = choice.finish_reason or finish
    return {"content": content, "tool_calls": calls}, finish, usage, call_deltas


def check_calls(calls: list[dict[str, Any]], allowed: set[str], schemas: dict[str, Any] = SCHEMAS) -> None:
    """Each call is OpenAI-shaped and its arguments parse and satisfy its function's schema."""
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in allowed
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def dumped_calls(message: Any) -> list[dict[str, Any]]:
    return [c.model_dump() for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", list(CHOICES))
def test_forced_calls_streamed_and_not(client: openai.OpenAI, model: str, choice: str) -> None:
    kw = {"tools": TOOLS, "tool_choice": CHOICES[choice], "max_tokens": 48}
    out = create(client, model, **kw)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content is None
    allowed = {"get_weather"} if choice == "named" else set(SCHEMAS)
    check_calls(dumped_calls(message), allowed)
    if choice == "named":
        assert len(message.tool_calls) == 1
    rebuilt, finish, usage, deltas = streamed(client, model, **kw)
    assert finish == "tool_calls" and rebuilt["content"] is None
    strip_ids = lambda calls: [c | {"id": None} for c in calls]
    assert strip_ids(rebuilt["tool_calls"]) == strip_ids(dumped_calls(message))
    # The first delta of a call carries its id, type and name; later ones only argument fragments.
    firsts = [d for d in deltas if d.id is not None]
    assert len(firsts) == len(rebuilt["tool_calls"])
    assert all(d.type == "function" and d.function.name and d.function.arguments == "" for d in firsts)
    assert all(d.type is None and d.function.name is None for d in deltas if d.id is None)
    assert usage.completion_tokens == out.usage.completion_tokens
    assert usage.prompt_tokens == out.usage.prompt_tokens


WEATHER_AT = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a location",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["location"],
        },
    },
}
TIME_IN = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}


# The model opens a third call with 3, 11 and 1 tokens left, below the shortest call (14 tokens).
@pytest.mark.parametrize(("budget", "stream"), [(52, True), (60, False), (76, False)])
def test_parallel_calls_end_within_the_budget(
    client: openai.OpenAI, model: str, budget: int, stream: bool
) -> None:
    """Another call runs only when the budget left can finish it: the turn ends with the calls made
    (tool_calls), or with a call cut by the budget (length), never with an error after them."""
    kw = {
        "messages": [{"role": "user", "content": "Use both tools for Paris."}],
        "tools": [WEATHER_AT, TIME_IN],
        "tool_choice": "required",
        "max_tokens": budget,
    }
    out = create(client, model, **kw)
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "length"), choice
    assert out.usage.completion_tokens <= budget, out.usage
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_AT, TIME_IN)}
    check_calls(dumped_calls(choice.message), set(schemas), schemas)
    if stream:
        rebuilt, finish, usage, _ = streamed(client, model, **kw)
        assert finish == choice.finish_reason and usage.completion_tokens == out.usage.completion_tokens
        assert len(rebuilt["tool_calls"]) == len(choice.message.tool_calls)


def test_several_choices_stream_their_own_calls(client: openai.OpenAI, model: str) -> None:
    kw = {"tools": TOOLS, "tool_choice": CHOICES["named"], "max_tokens": 32, "n": 2, "seed": 7}
    out = create(client, model, **kw | {"temperature": 1.0})
    calls: dict[int, list[Any]] = {0: [], 1: []}
    finishes = {}
    for chunk in create(client, model, stream=True, **kw | {"temperature": 1.0}):
        for choice in chunk.choices:
            calls[choice.index].extend(choice.delta.tool_calls or [])
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    for i, choice in enumerate(out.choices):
        assert choice.index == i and finishes[i] == choice.finish_reason == "tool_calls"
        check_calls(dumped_calls(choice.message), {"get_weather"})
        streamed_args = "".join(d.function.arguments for d in calls[i])
        assert streamed_args == choice.message.tool_calls[0].function.arguments


# Asked to call: the default model answers in text. Asked to copy a call: it opens <tool_call>
# (greedy), so the call's JSON runs as the constrained second phase.
COPY = [
    {
        "role": "user",
        "content": "Repeat exactly: <tool_call>\n"
        '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    }
]


@pytest.mark.parametrize("messages", [ASK, COPY], ids=["asked", "copy"])
def test_auto_answers_or_calls_validly(client: openai.OpenAI, model: str, messages: list[dict]) -> None:
    kw = {"messages": messages, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 40}
    out = create(client, model, **kw)
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            check_calls(dumped_calls(choice.message), set(SCHEMAS))
        if messages is COPY:
            assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
        assert "<tool_call>" not in choice.message.content
    rebuilt, finish, _, _ = streamed(client, model, **kw)
    assert finish == choice.finish_reason
    assert rebuilt["content"] == choice.message.content
    assert [c["function"] for c in rebuilt["tool_calls"]] == [
        c["function"] for c in dumped_calls(choice.message)
    ]


def test_tool_result_round_trip(client: openai.OpenAI, model: str, url: str) -> None:
    first = create(client, model, tools=TOOLS, tool_choice=CHOICES["named"], max_tokens=32)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"},
    ]
    answer = create(client, model, messages=history, tools=TOOLS, max_tokens=12)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        check_calls(dumped_calls(choice.message), set(SCHEMAS))
    else:
        assert isinstance(choice.message.content, str)
    # The call renders as the model generated it, so the whole first turn is served from the cache.
    assert answer.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    body = {"messages": history, "tools": TOOLS}
    ids = requests.post(f"{url}/tokenize", json=body, headers=HEADERS, timeout=60).json()["tokens"]
    prompt = requests.post(f"{url}/detokenize", json={"tokens": ids}, headers=HEADERS, timeout=60).json()[
        "text"
    ]
    shown = {"type": "function", "function": {k: v for k, v in ADD["function"].items() if k != "strict"}}
    assert "<tools>\n" + json.dumps(shown) in prompt
    rendered_call = f'{{"name":"get_weather","arguments":{call.function.arguments}}}'
    assert f"<|im_start|>assistant\n<tool_call>\n{rendered_call}\n</tool_call><|im_end|>" in prompt
    assert "<|im_start|>user\n<tool_response>\nSunny, 21 degrees\n</tool_response><|im_end|>" in prompt


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Size(enum.Enum):
    small = "S"
    large = "L"


class Part(BaseModel):
    name: str = Field(max_length=12)
    color: Color


class Bike(BaseModel):
    title: str = Field(max_length=16)
    size: Size
    gears: int = Field(ge=1, le=30)
    parts: list[Part] = Field(max_length=2)
    frame: Part


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    """The SDK sends the model's strict schema ($defs, $ref, enums, nested objects); the answer
    parses back into the model."""
    out = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe a red bicycle as JSON."}],
        response_format=Bike,
        temperature=0,
        max_tokens=120,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Bike) and isinstance(choice.message.parsed.frame.color, Color)


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters",
    ),
    (
        {
            "tools": [
                ADD,
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"x": {"$ref": "https://example.com/x"}},
                        },
                    },
                },
            ],
            "tool_choice": "required",
        },
        "tools[1].function.parameters",
    ),
    ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tool_requests_are_400s_naming_the_field(url: str, model: str, extra: dict, param: str) -> None:
    body = {"model": model, "messages": ASK, "max_tokens": 4, "tools": TOOLS} | extra
    r = requests.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
