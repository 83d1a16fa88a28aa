"""Tokenizing, rendering chat templates and decoding large bodies run off the event loop, on a
server that accepts 8 MiB bodies: /health keeps answering while they run, and a prompt that cannot
fit the context is refused before it is tokenized."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest
import requests
from server_harness import HEADERS, Server, launch_server

pytestmark = pytest.mark.slow

BIG_BODY_BYTES = 8 << 20
TEXT_5MB = "hello world, this is text " * 200_000


@pytest.fixture(scope="module")
def big_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch_server(tmp_path_factory.mktemp("big_bodies"), "--max-request-bytes", str(BIG_BODY_BYTES))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def chat_body(num_messages: int) -> bytes:
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": "hello there"} for i in range(num_messages)]
    return json.dumps({"messages": messages, "max_tokens": 1}).encode()


def test_health_answers_while_tokenizing_megabytes(big_server: Server) -> None:
    """4 x /tokenize of 5 MB and a chat of 10^5 messages at once (each seconds of CPU): 90% of the
    /health probes meanwhile answer within 200 ms (the rest allows for a 2-core machine's noise)."""
    tokenize_body = json.dumps({"prompt": TEXT_5MB}).encode()

    async def scenario() -> None:
        headers = HEADERS | {"Content-Type": "application/json"}
        async with httpx.AsyncClient(base_url=big_server.url, headers=headers, timeout=600) as c:
            work = [asyncio.create_task(c.post("/tokenize", content=tokenize_body)) for _ in range(4)]
            work.append(asyncio.create_task(c.post("/v1/chat/completions", content=chat_body(10**5))))
            probes = []
            while not all(t.done() for t in work):
                t0 = time.perf_counter()
                assert (await c.get("/health")).status_code == 200
                probes.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
            assert len(probes) >= 10, probes
            assert statistics.quantiles(probes, n=10)[-1] < 0.2, sorted(probes)[-20:]
            counts = set()
            for t in work[:4]:
                r = t.result()
                assert r.status_code == 200, r.text[:300]
                out = r.json()
                assert out["count"] == len(out["tokens"]) > 10**6
                counts.add(out["count"])
            assert len(counts) == 1
            chat = work[4].result()
            assert chat.status_code == 400, chat.text[:300]
            assert chat.json()["error"]["param"] == "messages"

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": "x " * 1_500_000}, "text"),
        ("/generate", {"text": ["Hi", "x " * 1_500_000]}, "text"),
        ("/v1/completions", {"prompt": "x " * 1_500_000}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 1_500_000}]}, "messages"),
    ],
)
def test_prompt_that_cannot_fit_is_refused_before_tokenizing(
    big_server: Server, path: str, body: dict, param: str
) -> None:
    """3 M characters cannot fit an 8192-token context (no token of this tokenizer spells more than
    81 characters): a 400 naming the field, with no tokenization first."""
    r = requests.post(f"{big_server.url}{path}", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "context_length_exceeded", err
    assert "context length 8192" in err["message"]
