"""Constraint validation runs off the HTTP process's event loop, on a worker thread: while one
request's regex / JSON schema / EBNF is being checked, the server keeps serving other requests.
Runs the real HTTP app and scheduler process in this process's event loop (tiny model), with the
validation held until the test releases it."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import httpx
import pytest

import radixlm_runtime.constrained.checker as constraint_checks
from radixlm_runtime.constrained.constraint import Constraint
from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.server.http_server import create_app
from radixlm_runtime.server.tokenizer_manager import TokenizerManager
from radixlm_runtime.server_args import ServerArgs

SLOW_REGEX = "(ab|ba){1,3}"
HOLD_S = 20.0


def test_slow_constraint_check_does_not_block_other_requests(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = threading.Event(), threading.Event()
    real_check = constraint_checks.check_constraint

    def held_check(backend: str, constraint: Constraint) -> str:
        """Blocks the checking thread itself, as a slow native check would."""
        if constraint.text == SLOW_REGEX:
            started.set()
            release.wait(HOLD_S)
        return real_check(backend, constraint)

    monkeypatch.setattr(constraint_checks, "check_constraint", held_check)
    args = ServerArgs.from_kwargs(model_path=str(tiny_llama_dir), max_total_tokens=2048, log_level="warning")
    tm = TokenizerManager(args, tiny_llama_dir, load_tokenizer(tiny_llama_dir))
    tm.start_scheduler()

    async def scenario() -> None:
        tm.start_background(lambda: None)
        transport = httpx.ASGITransport(app=create_app(tm, "tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            constrained = asyncio.create_task(
                client.post(
                    "/generate",
                    json={"text": "ab", "sampling_params": {"regex": SLOW_REGEX, "max_new_tokens": 8}},
                )
            )
            assert await asyncio.to_thread(started.wait, HOLD_S)
            # The constrained request is stuck in its validation; others go through meanwhile.
            plain_body = {"text": "ab", "sampling_params": {"max_new_tokens": 4}}
            plain = await client.post("/generate", json=plain_body)
            health = await client.get("/health")
            assert plain.status_code == 200 and plain.json()["meta_info"]["completion_tokens"] == 4
            assert health.status_code == 200
            assert not constrained.done()
            release.set()
            done = await constrained
            assert done.status_code == 200, done.text
            assert re.fullmatch(SLOW_REGEX, done.json()["text"])
            # A bad constraint is still refused with a 400 naming its field.
            bad = await client.post("/generate", json={"text": "ab", "sampling_params": {"regex": "(["}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "regex"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        tm.shutdown()
