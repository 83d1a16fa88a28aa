"""Every kind of bad request gets a 4xx with an OpenAI-shaped JSON error naming the field; never a
500, never a hang; and the server keeps serving afterwards."""

from __future__ import annotations

import json

import pytest
import requests
from server_harness import HEADERS, MAX_REQUEST_BYTES, assert_no_leak, wait_idle

from radixlm_runtime.server.http_utils import MAX_JSON_DEPTH, nesting_exceeds

pytestmark = pytest.mark.slow

LONG_TEXT = "hello " * 9000  # ~9000 tokens: longer than the 8192-token context
OK = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}


def sp(**params) -> dict:
    return {"text": "Hi", "sampling_params": params}


# (name, path, body (dict, or raw bytes), expected status, word the error message must contain)
CASES = [
    ("malformed json", "/generate", b'{"text": "Hi",', 400, "JSON"),
    ("not an object", "/generate", b"[1, 2]", 400, "object"),
    ("empty body", "/generate", b"", 400, "empty"),
    ("wrong type", "/generate", sp(temperature="hot"), 400, "temperature"),
    ("wrong top-level type", "/generate", OK | {"stream": "yes"}, 400, "stream"),
    ("unknown field", "/generate", OK | {"bogus_field": 1}, 400, "bogus_field"),
    ("unknown sampling field", "/generate", sp(temprature=0), 400, "temprature"),
    ("no prompt", "/generate", {"sampling_params": {}}, 400, "text"),
    ("empty prompt", "/generate", {"text": ""}, 400, "empty"),
    ("empty input_ids", "/generate", {"input_ids": []}, 400, "input_ids"),
    ("token id out of vocab", "/generate", {"input_ids": [10**9]}, 400, "input_ids"),
    ("prompt longer than context", "/generate", {"text": LONG_TEXT}, 400, "context length"),
    ("max_new_tokens past context", "/generate", sp(max_new_tokens=100000), 400, "max_new_tokens"),
    ("negative temperature", "/generate", sp(temperature=-0.5), 400, "temperature"),
    ("top_p zero", "/generate", sp(top_p=0), 400, "top_p"),
    ("top_k zero", "/generate", sp(top_k=0), 400, "top_k"),
    ("n zero", "/generate", sp(n=0), 400, "n must"),
    ("invalid regex", "/generate", sp(regex="([a-z"), 400, "regex"),
    ("unsupported regex construct", "/generate", sp(regex="a(?=b)"), 400, "regex"),
    ("unsatisfiable json schema", "/generate", sp(json_schema="false"), 400, "json_schema"),
    ("invalid json schema json", "/generate", sp(json_schema="{not json"), 400, "json_schema"),
    ("invalid json schema", "/generate", sp(json_schema='{"type": 12}'), 400, "json_schema"),
    (
        "regex and json_schema",
        "/generate",
        sp(regex="a", json_schema="{}"),
        400,
        "only one of regex, json_schema",
    ),
    ("invalid ebnf", "/generate", sp(ebnf="root ::= undefined"), 400, "sampling_params.ebnf"),
    (
        "unsupported schema keyword",
        "/generate",
        sp(json_schema={"type": "array", "uniqueItems": True}),
        400,
        "unsupported keyword 'uniqueItems'",
    ),
    ("logprob_start_len too big", "/generate", OK | {"logprob_start_len": 50}, 400, "logprob_start_len"),
    (
        "logprob list of the wrong length",
        "/generate",
        {"text": ["Hi", "Hello"], "return_logprob": True, "logprob_start_len": [0, 1, 2]},
        400,
        "logprob_start_len",
    ),
    ("oversize body", "/generate", {"text": "x" * (MAX_REQUEST_BYTES + 10)}, 413, "max-request-bytes"),
    ("abort without rid", "/abort_request", {}, 400, "rid"),
    ("completions wrong type", "/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("completions bad prompt", "/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions unknown field", "/v1/completions", {"prompt": "Hi", "best_of_all": 2}, 400, "best_of_all"),
    ("completions long prompt", "/v1/completions", {"prompt": LONG_TEXT}, 400, "context length"),
    ("completions top_p zero", "/v1/completions", {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ("chat no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    (
        "chat bad schema",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
        },
        400,
        "json_schema",
    ),
    (
        "chat invalid ebnf",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "ebnf": "root ::= ("},
        400,
        "ebnf",
    ),
    (
        "chat response_format with an unsupported keyword",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "iri"}},
            },
        },
        400,
        "response_format.json_schema: unsupported format 'iri'",
    ),
    (
        "chat invalid regex",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "regex": "("},
        400,
        "regex",
    ),
    (
        "chat top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "word"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(url: str, name: str, path: str, body: dict | bytes, status: int, word: str) -> None:
    kw = (
        {"data": body, "headers": HEADERS | {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body, "headers": HEADERS}
    )
    r = requests.post(f"{url}{path}", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert word.lower() in err["message"].lower(), err


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}])
def test_api_key_required(url: str, headers: dict) -> None:
    for method, path in [
        ("post", "/generate"),
        ("get", "/server_info"),
        ("get", "/v1/models"),
        ("get", "/metrics"),
    ]:
        r = requests.request(method, f"{url}{path}", json=OK, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_server_still_serves_after_bad_inputs(server) -> None:
    r = requests.post(f"{server.url}/generate", json=OK, headers=HEADERS, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
    assert_no_leak(wait_idle(server))


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_arrays(levels: int) -> str:
    return "[" * levels + "]" * levels


CHAT_MSG = [{"role": "user", "content": "x"}]
DEEP_SCHEMA = nested_schema(100)  # ~5 KB; schema validation recursed past Python's stack (500)
# (path, raw JSON body, the field the error must name)
DEEP_BODIES = [
    (
        "/generate",
        json.dumps({"text": "Hi", "sampling_params": {"json_schema": json.dumps(DEEP_SCHEMA)}}),
        "json_schema",
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "messages": CHAT_MSG,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": DEEP_SCHEMA},
                },
            }
        ),
        "response_format",
    ),
    ("/v1/completions", '{"prompt": ' + nested_arrays(100) + "}", "prompt"),
    # 10^4 levels: past the JSON decoder's own recursion bound.
    (
        "/generate",
        '{"text": "Hi", "sampling_params": {"x": ' + nested_arrays(10**4) + "}}",
        "sampling_params",
    ),
    ("/generate", '{"text": "Hi", "input_ids": ' + nested_arrays(100) + "}", "input_ids"),
    ("/v1/chat/completions", '{"messages": ' + nested_arrays(10**4) + "}", "messages"),
    ("/tokenize", '{"prompt": "Hi", "tools": ' + nested_arrays(10**4) + "}", "tools"),
    ("/abort_request", '{"rid": ' + nested_arrays(100) + "}", "rid"),
]


@pytest.mark.parametrize(("path", "data", "param"), DEEP_BODIES, ids=[f"{p}-{f}" for p, _, f in DEEP_BODIES])
def test_deep_nesting_is_refused_naming_the_field(url: str, path: str, data: str, param: str) -> None:
    """Any endpoint, any field: JSON nested past MAX_JSON_DEPTH is a 400 naming the field, never a
    500 from a recursion limit."""
    r = requests.post(
        f"{url}{path}", data=data, headers=HEADERS | {"Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "json_too_deep", err
    assert f"{MAX_JSON_DEPTH} levels" in err["message"], err


def test_nesting_at_the_limit_is_accepted(url: str) -> None:
    """A schema whose JSON text nests exactly MAX_JSON_DEPTH levels runs as before."""
    schema = nested_schema((MAX_JSON_DEPTH - 2) // 2)
    assert 1 + 2 * ((MAX_JSON_DEPTH - 2) // 2) <= MAX_JSON_DEPTH
    body = {"text": "Hi", "sampling_params": {"json_schema": json.dumps(schema), "max_new_tokens": 200}}
    r = requests.post(f"{url}/generate", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text


def test_nesting_check_counts_levels() -> None:
    assert not nesting_exceeds({"a": [1, {"b": []}]}, 4)
    assert nesting_exceeds({"a": [1, {"b": []}]}, 3)
    assert not nesting_exceeds("x", 0) and nesting_exceeds([], 0)
