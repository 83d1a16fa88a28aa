"""Fuzzed request bodies for /generate and the OpenAI endpoints: whatever a client sends, the answer is
a 2xx or a 4xx, never a 5xx, and afterwards the server is healthy and its KV pool whole (every slot
free or cached, nothing locked, nothing left running)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import HEADERS, Server, assert_no_leak, launch_server, wait_idle

pytestmark = pytest.mark.slow

# Any JSON value: what a careless or hostile client may put in any field.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
# Valid requests stay tiny (the test is about validation, not decoding).
BUDGET = st.integers(0, 4)
SAMPLING = st.fixed_dictionaries(
    {"max_new_tokens": BUDGET},
    optional={
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(1, 50) | st.just(-1),
        "min_p": st.floats(0, 1),
        "min_new_tokens": st.integers(0, 2),
        "n": st.integers(1, 3),
        "seed": st.integers(0, 2**63),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
        "repetition_penalty": st.floats(0.5, 2),
        "frequency_penalty": st.floats(-2, 2),
        "ignore_eos": st.booleans(),
        "regex": st.sampled_from(["[ab]+", "\\d{2}", "(yes|no)"]),
        "json_schema": st.just('{"type": "integer"}'),
    },
)
GENERATE = st.fixed_dictionaries(
    {
        "text": st.text(min_size=1, max_size=30)
        | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3)
    },
    optional={
        "sampling_params": SAMPLING,
        "return_logprob": st.booleans(),
        "logprob_start_len": st.integers(-1, 2),
        "top_logprobs_num": st.integers(0, 5),
        "return_text_in_logprobs": st.booleans(),
        "stream": st.booleans(),
        "priority": st.integers(-5, 5),
    },
)
COMMON_V1 = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(0, 2**63),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stream": st.booleans(),
    "user": st.text(max_size=8),
    "presence_penalty": st.floats(-2, 2),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
}
COMPLETIONS = st.fixed_dictionaries(
    {
        "max_tokens": BUDGET,
        "prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 49151), min_size=1, max_size=6),
    },
    optional={"logprobs": st.integers(0, 5), "echo": st.booleans(), **COMMON_V1},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}
)
CHAT = st.fixed_dictionaries(
    {"max_tokens": BUDGET, "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), **COMMON_V1},
)
OTHER_FIELDS = ["model", "prompt", "messages", "text", "input_ids", "rid", "session_id", "tools", "suffix"]


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    """A valid body with up to two fields (top-level or in sampling_params) replaced or added as
    arbitrary JSON: each case is one plausible client mistake or attack, not pure noise."""
    body = draw(valid)
    nested = body.get("sampling_params")
    fields = [*body, *OTHER_FIELDS] + (
        [f"sampling_params.{k}" for k in [*nested, "max_new_tokens", "n", "top_k"]]
        if isinstance(nested, dict)
        else []
    )
    for path in draw(st.lists(st.sampled_from(sorted(set(fields))), max_size=2, unique=True)):
        value = draw(JSON)
        if path.startswith("sampling_params."):
            body["sampling_params"][path.split(".", 1)[1]] = value
        else:
            body[path] = value
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A short context keeps every accepted case cheap: a body that falls back to a default
    budget (128 new tokens) asks for more than the context and is refused instead of decoded."""
    srv = launch_server(tmp_path_factory.mktemp("fuzz"), "--context-length", "96")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _send(server: Server, path: str, body: dict[str, Any]) -> None:
    """Posts body (drains a stream) and checks the status class and the server's state after it."""
    with httpx.Client(headers=HEADERS, timeout=120) as client:
        with client.stream("POST", f"{server.url}{path}", content=json.dumps(body)) as r:
            content = b"".join(r.iter_bytes())
        assert r.status_code < 500, (path, body, r.status_code, content[:500])
        if r.status_code >= 400:
            assert "error" in json.loads(content), content[:500]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert_no_leak(wait_idle(server))


FUZZ = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@FUZZ
@given(body=mutated(GENERATE))
def test_generate_never_fails_the_server(server: Server, body: dict[str, Any]) -> None:
    _send(server, "/generate", body)


@FUZZ
@given(body=mutated(COMPLETIONS))
def test_completions_never_fail_the_server(server: Server, body: dict[str, Any]) -> None:
    _send(server, "/v1/completions", body)


@FUZZ
@given(body=mutated(CHAT))
def test_chat_never_fails_the_server(server: Server, body: dict[str, Any]) -> None:
    _send(server, "/v1/chat/completions", body)


# -- constraints ------------------------------------------------------------------------------
LEAF_SCHEMAS = st.sampled_from(
    [
        {"type": "integer"},
        {"type": "integer", "minimum": 0, "maximum": 9},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "string", "maxLength": 4},
        {"enum": ["a", 1, None]},
        {"const": "x"},
        {"$ref": "#/$defs/node"},  # the recursive definition below
    ]
)


def _node_schemas(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(st.from_regex(r"[a-z]{1,3}", fullmatch=True), children, min_size=1, max_size=4)
    return st.one_of(
        props.flatmap(
            lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
                lambda req: {"type": "object", "properties": p, "required": req}
            )
        ),
        st.tuples(children, st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1]}
        ),
        st.lists(children, min_size=1, max_size=3).map(lambda alts: {"anyOf": alts}),
    )


# Deep (nesting), wide (hundreds of optional properties) and recursive ($defs/node refers to itself,
# through a required property: no finite value; or an optional one) schemas.
SCHEMAS = st.one_of(
    st.recursive(LEAF_SCHEMAS, _node_schemas, max_leaves=8),
    st.integers(1, 800).map(lambda n: {"type": "object", "properties": {f"p{i}": {} for i in range(n)}}),
    st.integers(1, 60).map(
        lambda depth: json.loads('{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth)
    ),
).flatmap(
    lambda schema: st.sampled_from([[], ["next"]]).map(
        lambda required: (
            schema
            | {
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {"next": {"$ref": "#/$defs/node"}},
                        "required": required,
                    }
                }
            }
        )
    )
)
REGEXES = st.sampled_from(
    ["[a-z]{1,10}", "(yes|no)", r"\d+(\.\d+)?", "a*", "<think>[a-z]+", "(a|b)*c{2,4}", ""]
)
EBNFS = st.sampled_from(
    [
        'root ::= "yes" | "no"',
        'root ::= item+\nitem ::= [a-z] ","',
        'root ::= "(" root ")" | "x"',
        "root ::= undefined_rule",
        'root ::= ""',
    ]
)
CONSTRAINED = st.fixed_dictionaries(
    {"text": st.sampled_from(["JSON:", "Answer:", "My name is"])},
    optional={"stream": st.booleans()},
).flatmap(
    lambda body: st.one_of(
        SCHEMAS.map(lambda s: {"json_schema": json.dumps(s)}),
        REGEXES.map(lambda r: {"regex": r}),
        EBNFS.map(lambda e: {"ebnf": e}),
    ).flatmap(
        lambda constraint: st.fixed_dictionaries(
            {"max_new_tokens": st.integers(1, 12), "temperature": st.sampled_from([0.0, 1.0])}
        ).map(lambda sp: body | {"sampling_params": sp | constraint})
    )
)
CONSTRAINT_FUZZ = settings(FUZZ, max_examples=40)


def _post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """Posts body; (status, the JSON answer or the stream's events), after the server checks of _send."""
    with httpx.Client(headers=HEADERS, timeout=120) as client:
        r = client.post(f"{server.url}{path}", content=json.dumps(body))
    assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
    if body.get("stream") and r.status_code == 200:
        events = [
            line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
        answer: Any = [json.loads(e) for e in events]
    else:
        answer = r.json()
    if r.status_code >= 400:
        assert "error" in answer, answer
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert_no_leak(wait_idle(server))
    return r.status_code, answer


@CONSTRAINT_FUZZ
@given(body=CONSTRAINED)
def test_constrained_generate_is_never_an_empty_success(server: Server, body: dict[str, Any]) -> None:
    """A constraint is refused (4xx), or the output ends as an error finish, or it is a non-empty
    match: a JSON schema's output on a stop parses."""
    status, answer = _post(server, "/generate", body)
    if status != 200:
        return
    final = answer[-1] if isinstance(answer, list) else answer
    assert "error" not in final, final
    reason = final["meta_info"]["finish_reason"]
    sp = body["sampling_params"]
    if reason["type"] == "constraint_error":
        assert reason["message"].startswith(next(k for k in ("json_schema", "regex", "ebnf") if k in sp))
        return
    assert reason["type"] in ("stop", "length"), final
    if "json_schema" in sp:
        assert final["text"], (body, final)
        if reason["type"] == "stop":
            json.loads(final["text"])


TOOL_CHAT = st.fixed_dictionaries(
    {
        "messages": st.just([{"role": "user", "content": "Call f."}]),
        "max_tokens": st.integers(1, 24),
        "tool_choice": st.sampled_from(["required", "auto"]),
        "tools": SCHEMAS.map(
            lambda s: [{"type": "function", "function": {"name": "f", "parameters": s | {"type": "object"}}}]
        ),
    },
    optional={"stream": st.booleans(), "temperature": st.sampled_from([0.0, 1.0])},
)


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A context that holds the tools' listing in the prompt (max_tokens keeps the cases cheap)."""
    srv = launch_server(tmp_path_factory.mktemp("fuzz-tools"), "--context-length", "4096")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@settings(FUZZ, max_examples=25)
@given(body=TOOL_CHAT)
def test_tool_calls_are_never_an_empty_success(tools_server: Server, body: dict[str, Any]) -> None:
    """A forced call is made or refused: never finish tool_calls without a call."""
    status, answer = _post(tools_server, "/v1/chat/completions", body)
    if status != 200:
        return
    if isinstance(answer, list):  # streamed: an error event, or a finish_reason on the last choice chunk
        assert answer, body
        if any("error" in event for event in answer):
            return
        chunks = [c for event in answer for c in event["choices"]]
        finish = chunks[-1]["finish_reason"]
        calls = [d for c in chunks for d in c["delta"].get("tool_calls") or []]
    else:
        finish = answer["choices"][0]["finish_reason"]
        calls = answer["choices"][0]["message"].get("tool_calls") or []
    assert finish in ("tool_calls", "length", "stop"), (body, answer)
    if finish == "tool_calls" or body["tool_choice"] == "required" and finish != "length":
        assert calls, (body, answer)
