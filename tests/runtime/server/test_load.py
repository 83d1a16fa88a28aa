"""256 concurrent clients: shared prefixes, streaming, and clients that hang up midway. Every request
must end as asked, and afterwards the KV pool must be whole again (no leaked or pinned slot)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from server_harness import HEADERS, Server, assert_no_leak, wait_idle

pytestmark = pytest.mark.slow

NUM_REQUESTS = 256
PREFIXES = [
    "You are a helpful assistant. Answer briefly and precisely. " * 3,
    "Translate the following English sentence into French, keeping the tone: " * 2,
    "Q: What is the sum of two and three? A: five. Q: What is four times two? A: eight. " * 2,
    "",
]


async def one_request(client: httpx.AsyncClient, url: str, i: int, rng: random.Random) -> str:
    prompt = PREFIXES[i % len(PREFIXES)] + f"Item {i}: tell me about number {rng.randint(0, 10**6)}."
    params = {"max_new_tokens": rng.randint(8, 16), "temperature": rng.choice([0.0, 0.7]), "seed": i}
    kind = ("plain", "stream", "cancel")[i % 3]
    if kind == "plain":
        r = await client.post(f"{url}/generate", json={"text": prompt, "sampling_params": params})
        assert r.status_code == 200, r.text
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] in ("length", "stop") and meta["completion_tokens"] >= 1
        return kind
    body = {"text": prompt, "sampling_params": params | {"ignore_eos": kind == "cancel"}, "stream": True}
    if kind == "cancel":
        body["sampling_params"]["max_new_tokens"] = 200
    async with client.stream("POST", f"{url}/generate", json=body) as r:
        assert r.status_code == 200
        events = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            events += 1
            if kind == "cancel" and events == 2:
                return "cancelled"  # leaving the block closes the connection mid-stream
        assert kind == "stream" and events >= 1 and chunk["meta_info"]["finish_reason"] is not None
    return kind


def test_concurrent_mixed_load_leaks_nothing(server: Server) -> None:
    rng = random.Random(0)

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 8, max_keepalive_connections=NUM_REQUESTS + 8)
        async with httpx.AsyncClient(headers=HEADERS, timeout=180, limits=limits) as client:
            return await asyncio.gather(
                *(one_request(client, server.url, i, rng) for i in range(NUM_REQUESTS))
            )

    generated_before = wait_idle(server)["generated_tokens"]
    kinds = asyncio.run(run())
    assert kinds.count("cancelled") == sum(1 for i in range(NUM_REQUESTS) if i % 3 == 2)
    assert kinds.count("plain") + kinds.count("stream") + kinds.count("cancelled") == NUM_REQUESTS
    info = wait_idle(server)
    assert_no_leak(info)
    assert info["num_inflight_requests"] == 0 and info["num_tracked"] == 0
    # The shared prefixes were reused, and the hung-up streams did not run to their 200 tokens
    # (had they, the cancelled requests alone would have generated 200 tokens each).
    assert info["cached_tokens"] > 0
    num_cancelled = kinds.count("cancelled")
    assert info["generated_tokens"] - generated_before < num_cancelled * 200 // 2
