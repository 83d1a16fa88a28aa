"""What the data-parallel server tests share: waiting for the router, a request, the replicas' state,
and the kill-a-replica check."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))


def generate(url: str, text: str) -> httpx.Response:
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    return httpx.post(f"{url}/generate", json={"text": text, "sampling_params": params}, timeout=120)


def answer_both_apis(url: str) -> None:
    """Native /generate (4 requests, so round robin reaches every replica twice) and OpenAI's
    /v1/completions through the official client."""
    for i in range(4):
        out = generate(url, f"hello {i}")
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 4
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    done = client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=3)
    assert done.usage.completion_tokens == 3


def replicas(url: str) -> list[dict]:
    return httpx.get(f"{url}/server_info", timeout=30).json()["replicas"]


def kill_one_and_see_it_back(url: str, pid: int, log: Path) -> None:
    """SIGKILL one replica's server: every request gets an answer, 200 from the live replica or a
    clean JSON error for the dead one, never a hang; the replica is started again and routed to."""
    os.kill(pid, signal.SIGKILL)
    answers = [generate(url, f"after the kill {i}") for i in range(4)]
    assert all(a.status_code in (200, 503) for a in answers), [a.text for a in answers]
    assert any(a.status_code == 200 for a in answers)
    assert all("error" in a.json() for a in answers if a.status_code != 200)
    deadline = time.monotonic() + 180
    while not all(r["healthy"] for r in replicas(url)):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    before = [r["routed"] for r in replicas(url)]
    for i in range(4):
        assert generate(url, f"back {i}").status_code == 200
    after = [r["routed"] for r in replicas(url)]
    assert all(a > b for a, b in zip(after, before)), (before, after)  # round robin reaches both
