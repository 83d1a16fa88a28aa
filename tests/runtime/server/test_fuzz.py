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
