"""tool_calls.py without a server: request validation, the prompt in the Hermes format and through a
template that takes tools, the call schema, parsing, stream deltas, and the phases of a turn driven by
a scripted phase runner (so the `auto` path through phase 2 runs deterministically)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from radixlm_runtime.config import GRAMMAR_BACKENDS
from radixlm_runtime.constrained.backend import check_constraint
from radixlm_runtime.constrained.constraint import Constraint
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.server import tool_calls as tc
from radixlm_runtime.server.errors import RequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"$ref": "#/$defs/num"},
                "b": {"$ref": "#/$defs/num", "default": {"$ref": "#/data"}},
            },
            "required": ["a", "b"],
            "$defs": {"num": {"type": "integer"}},
        },
    },
}

DEEP = '{"type":"object","properties":{"a":' * 400 + "{}" + "}}" * 400


def plan(choice: Any = None, tools: list[Any] | None = None, parallel: bool | None = None) -> tc.ToolPlan:
    parsed = tc.parse_tool_request([WEATHER, ADD] if tools is None else tools, choice, parallel, None, None)
    assert parsed is not None
    return parsed


# -- validation --------------------------------------------------------------------------------
def test_tool_choice_modes() -> None:
    assert plan().mode == "auto"
    assert plan("required").mode == "required" and plan("required").callable == plan().tools
    named = plan({"type": "function", "function": {"name": "add"}})
    assert named.mode == "required" and [t.name for t in named.callable] == ["add"]
    assert plan("none").calls is False
    assert plan(parallel=False).parallel is False
    assert tc.parse_tool_request(None, "none", None, None, "auto") is None
    assert tc.parse_tool_request([], "auto", None, None, None) is None


def test_default_parameters_are_an_empty_object() -> None:
    tool = plan(tools=[{"type": "function", "function": {"name": "now"}}]).tools[0]
    assert tool.parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("tools", "choice", "functions", "function_call", "param"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, None, "tool_choice"),
        ([WEATHER], "sometimes", None, None, "tool_choice"),
        ([WEATHER], {"type": "function"}, None, None, "tool_choice"),
        (None, "required", None, None, "tool_choice"),
        (
            [{"type": "function", "function": {"description": "no name"}}],
            None,
            None,
            None,
            "tools[0].function.name",
        ),
        (
            [{"type": "function", "function": {"name": "has space"}}],
            None,
            None,
            None,
            "tools[0].function.name",
        ),
        ([{"type": "code_interpreter"}], None, None, None, "tools[0].type"),
        (["add"], None, None, None, "tools[0]"),
        ([{"type": "function"}], None, None, None, "tools[0].function"),
        ([{"type": "function", "function": {"name": "f", "x": 1}}], None, None, None, "tools[0].function.x"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            None,
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            None,
            None,
            None,
            "tools[0].function.parameters",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
                }
            ],
            None,
            None,
            None,
            "tools[0].function.parameters",
        ),
        ([WEATHER, WEATHER], None, None, None, "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": json.loads(DEEP)}}],
            None,
            None,
            None,
            "tools[0].function.parameters",
        ),
        (None, None, [{"name": "f"}], None, "functions"),
        (None, None, None, {"name": "f"}, "function_call"),
    ],
)
def test_bad_tool_requests_name_the_field(
    tools: Any, choice: Any, functions: Any, function_call: Any, param: str
) -> None:
    with pytest.raises(RequestError) as e:
        tc.parse_tool_request(tools, choice, None, functions, function_call)
    assert e.value.param == param, e.value.message


def test_fields_that_cannot_apply_to_calls_are_refused() -> None:
    with pytest.raises(RequestError) as e:
        tc.check_compatible(plan(), False, True, False, False)
    assert e.value.param == "response_format"
    with pytest.raises(RequestError) as e:
        tc.check_compatible(plan(), False, False, False, True)
    assert e.value.param == "ebnf"
    tc.check_compatible(plan(), False, False, False, False)


# -- prompt ------------------------------------------------------------------------------------
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and 2+2?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":2}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "4"},
]


def test_hermes_prompt_lists_tools_and_renders_calls_and_results() -> None:
    messages, tools = tc.template_input(HISTORY, plan(), native=False)
    assert tools is None
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in system and "<tools>" in system and "</tools>" in system
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name":"get_weather","arguments":{"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"add","arguments":{"a":2,"b":2}}\n</tool_call>',
    }
    # Consecutive results share one user turn, as Qwen2.5's template renders them.
    assert messages[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n4\n</tool_response>",
    }
    assert len(messages) == 4


def test_tools_get_their_own_system_turn_and_none_leaves_them_out() -> None:
    user = [{"role": "user", "content": "hi"}]
    messages, _ = tc.template_input(user, plan(), native=False)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("# Tools")
    assert tc.template_input(user, plan("none"), native=False)[0] == user


QWEN_LIKE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% endfor %}"
)


def test_a_template_that_takes_tools_renders_them_itself() -> None:
    assert tc.template_takes_tools(QWEN_LIKE)
    assert not tc.template_takes_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    messages, tools = tc.template_input(HISTORY, plan(), native=True)
    assert tools == [WEATHER, ADD]
    # Arguments go to the template as objects, as transformers documents for tool-calling templates.
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[3] == HISTORY[3]


def test_native_template_renders_through_transformers(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tokenizer.chat_template = QWEN_LIKE
    messages, tools = tc.template_input(HISTORY, plan(), native=True)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '"name": "get_weather"' in text and '[add {"a": 2, "b": 2}]' in text and "<tool>4" in text


# -- schema and parsing ------------------------------------------------------------------------
def test_call_schema_accepts_exactly_valid_calls_with_rebased_refs() -> None:
    one = tc.call_schema(plan({"type": "function", "function": {"name": "add"}}).callable)
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": "x", "b": 2}}, one)
    both = tc.call_schema(plan().tools)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, both)
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, both)
    for bad in (
        {"name": "add", "arguments": {"city": "Oslo", "unit": "c"}},
        {"name": "zap", "arguments": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, both)
    arguments = both["$defs"]["call_1"]["properties"]["arguments"]["properties"]
    assert arguments["a"] == {"$ref": "#/$defs/call_1/properties/arguments/$defs/num"}
    assert arguments["b"]["default"] == {"$ref": "#/data"}  # data, not a reference


@pytest.mark.parametrize("backend", GRAMMAR_BACKENDS)
def test_call_schema_is_accepted_by_the_constraint_engine(backend: str) -> None:
    check_constraint(backend, Constraint("json_schema", json.dumps(tc.call_schema(plan().tools))))


@pytest.mark.parametrize(
    ("text", "final", "expected"),
    [
        ('{"name":"add","arguments":{"a":1,"b":2}}', True, ("add", '{"a":1,"b":2}')),
        ('{"name":"add","arguments":{"a":1,"b":2}}', False, ("add", '{"a":1,"b":2}')),
        ('{"name":"add","arguments":{"a":1,"b":2}', False, ("add", '{"a":1,"b":2')),
        ('{"name":"add","arguments":{"a":1', False, ("add", '{"a":1')),
        ('{"name":"ad', False, (None, "")),
        ('{ "name": "add", "arguments": {"a": 1} }', True, ("add", '{"a": 1}')),
        ('{"arguments":{"a":1},"name":"add"}', True, ("add", '{"a": 1}')),
    ],
)
def test_split_call(text: str, final: bool, expected: tuple[str | None, str]) -> None:
    assert tc.split_call(text, final) == expected


# -- the phases of a turn ----------------------------------------------------------------------
@dataclass
class FakeState:
    text: str
    output_ids: list[int]
    finished_reason: FinishReason | None = None
    cached_tokens: int = 0


@dataclass
class ScriptedRunner:
    """Answers each phase with the next scripted (text, finish reason), streamed a few characters
    at a time, and records what each phase asked for."""

    script: list[tuple[str, FinishReason]]
    calls: list[tuple[list[int], SamplingParams]] = field(default_factory=list)

    async def __call__(self, ids: list[int], params: SamplingParams) -> AsyncIterator[FakeState]:
        self.calls.append((ids, params))
        text, reason = self.script.pop(0)
        for end in range(3, len(text), 3):
            yield FakeState(text[:end], list(range(end)))
        yield FakeState(text, list(range(len(text))), reason, cached_tokens=2)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


PROMPT = [1, 2, 3]
STOP, LENGTH = FinishReason.stop(None), FinishReason.by_length(0)
ADD_CALL = '{"name":"add","arguments":{"a":1,"b":2}}'


def run_turn(p: tc.ToolPlan, script: list[tuple[str, FinishReason]], max_tokens: int = 500) -> tuple:
    runner = ScriptedRunner(script)
    params = SamplingParams(max_new_tokens=max_tokens, stop=["END"], temperature=0)
    loop = tc.ToolCallLoop(p, PROMPT, params, encode, runner, 4096, max_calls=3)

    async def collect() -> list[tuple[tc.ChoiceOutput, list[dict[str, Any]]]]:
        builder = tc.DeltaBuilder()
        return [(out, builder.deltas(out)) async for out in loop.run()]

    steps = asyncio.run(collect())
    return steps[-1][0], [d for _, ds in steps for d in ds], runner.calls


def reassemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """What an OpenAI client builds from the deltas."""
    content, calls = None, []
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        for c in d.get("tool_calls", []):
            if c["index"] == len(calls):
                calls.append({"id": c["id"], "type": c["type"], "function": dict(c["function"])})
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def test_auto_opens_a_call_then_phase_two_is_constrained() -> None:
    p = plan()
    out, deltas, phases = run_turn(
        p, [("Let me add.\n", FinishReason.stop(tc.CALL_OPEN)), (ADD_CALL, STOP), ("", STOP)]
    )
    free, call, decide = phases
    assert free[0] == PROMPT and free[1].stop == ["END", tc.CALL_OPEN] and free[1].json_schema is None
    # Phase 2 continues the same prompt + the text + the tag, under the call's schema.
    assert call[0] == PROMPT + encode("Let me add.\n<tool_call>\n")
    assert json.loads(call[1].json_schema) == tc.call_schema(p.tools) and call[1].stop == []
    assert decide[0] == PROMPT + encode(f"Let me add.\n<tool_call>\n{ADD_CALL}\n</tool_call>")
    assert decide[1].regex == tc.NEXT_CALL_REGEX
    assert out.finish_reason == "tool_calls"
    message = out.message()
    assert message["content"] == "Let me add.\n"
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "add", "arguments": '{"a":1,"b":2}'}]
    assert message["tool_calls"][0]["id"].startswith("call_")
    assert reassemble(deltas) == message
    assert deltas[0]["role"] == "assistant"
    # The token budget spans the phases: each gets what the earlier ones left.
    assert call[1].max_new_tokens == 500 - len("Let me add.\n")
    assert out.completion_tokens == len("Let me add.\n") + len(ADD_CALL) and out.prompt_tokens == 3


def test_auto_without_a_call_is_a_text_answer() -> None:
    out, deltas, phases = run_turn(plan(), [("Paris is sunny.", STOP)])
    assert len(phases) == 1 and out.finish_reason == "stop"
    assert out.message() == {"role": "assistant", "content": "Paris is sunny."}
    assert reassemble(deltas) == out.message()


def test_required_makes_parallel_calls_until_the_model_ends_its_turn() -> None:
    second = '{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}'
    out, deltas, phases = run_turn(
        plan("required"), [(ADD_CALL, STOP), ("\n<tool_call>", STOP), (second, STOP), ("", STOP)]
    )
    assert phases[0][0] == PROMPT + encode("<tool_call>\n")
    assert phases[2][0] == PROMPT + encode(f"<tool_call>\n{ADD_CALL}\n</tool_call>\n<tool_call>\n")
    message = out.message()
    assert message["content"] is None and out.finish_reason == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["add", "get_weather"]
    assert reassemble(deltas) == message
    first_deltas = [d for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [d["tool_calls"][0]["function"]["arguments"] for d in first_deltas] == ["", ""]


def test_a_named_function_or_no_parallel_calls_make_one_call() -> None:
    named = plan({"type": "function", "function": {"name": "add"}})
    for p in (named, plan("required", parallel=False)):
        out, _, phases = run_turn(p, [(ADD_CALL, STOP)])
        assert len(phases) == 1 and len(out.message()["tool_calls"]) == 1
    assert json.loads(run_turn(named, [(ADD_CALL, STOP)])[2][0][1].json_schema)["properties"]["name"] == {
        "const": "add"
    }


def test_calls_stop_at_max_calls() -> None:
    again = ("\n<tool_call>", STOP)
    out, _, _ = run_turn(
        plan("required"), [(ADD_CALL, STOP), again, (ADD_CALL, STOP), again, (ADD_CALL, STOP)]
    )
    assert len(out.calls) == 3 and out.finish_reason == "tool_calls"


def test_a_call_cut_by_max_tokens_finishes_with_length() -> None:
    out, deltas, _ = run_turn(plan("required"), [('{"name":"add","arguments":{"a":1', LENGTH)])
    assert out.finish_reason == "length"
    assert out.message()["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a":1'}
    assert reassemble(deltas) == out.message()
    # Cut before its name: no call at all.
    out, _, _ = run_turn(plan("required"), [('{"na', LENGTH)])
    assert out.message() == {"role": "assistant", "content": ""} and out.finish_reason == "length"


def test_no_budget_left_for_the_call() -> None:
    out, _, phases = run_turn(plan(), [("abcd", FinishReason.stop(tc.CALL_OPEN))], max_tokens=4)
    assert len(phases) == 1 and out.finish_reason == "length" and out.calls == []
