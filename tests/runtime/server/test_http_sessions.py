"""Program sessions over HTTP on the shared server: session_id on /generate pins each call's whole
sequence for the next one, /close_session releases it, and bad session ids get a 400 naming the
field."""

from __future__ import annotations

import json
import uuid

import pytest
import requests
from server_harness import HEADERS, Server, assert_no_leak, wait_idle

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
SYSTEM = "You are a careful assistant. Answer each question in one short sentence.\n"


def post(url: str, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, headers=HEADERS, timeout=120, **kw)


def generate(url: str, body: dict) -> dict:
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def close(url: str, sid: str) -> bool:
    r = post(url, "/close_session", {"session_id": sid})
    assert r.status_code == 200, r.text
    return r.json()["success"]


def test_program_calls_rehit_their_history_until_closed(server: Server) -> None:
    sid = f"prog-{uuid.uuid4().hex}"
    text = SYSTEM + "Q: What is the capital of France?\nA:"
    first = generate(server.url, {"text": text, "sampling_params": GREEDY, "session_id": sid})
    info = wait_idle(server)
    assert info["num_sessions"] == 1
    # The whole sequence is pinned but its last sampled token, whose KV was never computed.
    assert info["pinned_tokens"] == first["meta_info"]["prompt_tokens"] + 12 - 1
    assert info["protected_tokens"] == info["pinned_tokens"]
    text += first["text"] + "\nQ: And of Italy?\nA:"
    second = generate(server.url, {"text": text, "sampling_params": GREEDY, "session_id": sid})
    assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"]
    assert wait_idle(server)["pinned_tokens"] >= second["meta_info"]["prompt_tokens"]
    assert close(server.url, sid) is True
    assert close(server.url, sid) is False
    assert_no_leak(wait_idle(server))


def test_streamed_batched_and_aborted_calls_pin_what_they_computed(server: Server) -> None:
    sid = f"prog-{uuid.uuid4().hex}"
    body = {"text": [SYSTEM + "Q: one", SYSTEM + "Q: two"], "sampling_params": GREEDY, "session_id": sid}
    outs = generate(server.url, body)
    assert len(outs) == 2 and wait_idle(server)["num_sessions"] == 1
    # An aborted call still leaves what it computed pinned (replacing the previous pin).
    rid = f"abort-{uuid.uuid4().hex}"
    long_body = {
        "text": SYSTEM + "Count to a thousand:",
        "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True},
        "session_id": sid,
        "rid": rid,
        "stream": True,
    }
    chunks = []
    with post(server.url, "/generate", long_body, stream=True) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: {"):
                continue
            chunks.append(json.loads(line[len("data: ") :]))
            if len(chunks) == 3:
                assert post(server.url, "/abort_request", {"rid": rid}).json()["success"] is True
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort"
    info = wait_idle(server)
    assert info["num_sessions"] == 1
    assert info["pinned_tokens"] >= final["prompt_tokens"] + len(chunks[2]["output_ids"]) - 1
    assert close(server.url, sid) is True
    assert_no_leak(wait_idle(server))


def test_flush_cache_drops_pins_but_keeps_the_session(server: Server) -> None:
    sid = f"prog-{uuid.uuid4().hex}"
    generate(server.url, {"text": SYSTEM + "Q: hi", "sampling_params": GREEDY, "session_id": sid})
    assert wait_idle(server)["pinned_tokens"] > 0
    r = post(server.url, "/flush_cache", {})
    assert r.status_code == 200 and r.json()["success"] is True
    info = server.info()
    assert info["pinned_tokens"] == 0 and info["cached_tokens_in_tree"] == 0 and info["num_sessions"] == 1
    assert close(server.url, sid) is True
    assert_no_leak(wait_idle(server))


BAD = [
    ("/generate", {"text": "Hi", "session_id": ""}),
    ("/generate", {"text": "Hi", "session_id": "x" * 257}),
    ("/generate", {"text": "Hi", "session_id": "line\nbreak"}),
    ("/generate", {"text": "Hi", "session_id": 7}),
    ("/close_session", {}),
    ("/close_session", {"session_id": ""}),
    ("/close_session", {"session_id": ["a"]}),
]


@pytest.mark.parametrize(("path", "body"), BAD, ids=[f"{p}-{json.dumps(b)[:40]}" for p, b in BAD])
def test_bad_session_id_is_400_naming_the_field(url: str, path: str, body: dict) -> None:
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "session_id" and "session_id" in err["message"], err
