"""`priority` on /generate (one or one per prompt) and on /v1, as SGLang and vLLM accept it."""

from __future__ import annotations

import httpx
import pytest
from server_harness import HEADERS, Server, assert_no_leak, wait_idle


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    """Posts body, naming the served model on the /v1 endpoints (which check it)."""
    if path.startswith("/v1"):
        model = httpx.get(f"{server.url}/v1/models", headers=HEADERS).json()["data"][0]["id"]
        body = {"model": model, **body}
    return httpx.post(f"{server.url}{path}", json=body, headers=HEADERS, timeout=120)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "priority": 3}),
        ("/generate", {"text": ["Hi", "Yo"], "sampling_params": {"max_new_tokens": 2}, "priority": [1, -2]}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 5}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 0},
        ),
    ],
)
def test_priority_is_accepted(server: Server, path: str, body: dict) -> None:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "Hi", "priority": 2**40}),
        ("/generate", {"text": ["Hi", "Yo"], "priority": [1]}),
        ("/v1/completions", {"prompt": "Hi", "priority": -(2**40)}),
    ],
)
def test_bad_priority_is_a_400_naming_it(server: Server, path: str, body: dict) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert "priority" in r.text
    assert_no_leak(wait_idle(server))
