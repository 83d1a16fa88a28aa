"""The router as its own process in front of two real servers (tiny random-init model) on loopback:
the native and OpenAI APIs through it, cache-aware placement seen in the replicas' own cache counters,
the API key, and a replica killed then restarted: its stream in flight ends with an error naming it,
new requests go to the other replica meanwhile, and it rejoins."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import Server, child_pids, free_port, pid_alive

from radixlm_runtime.utils.process import wait_healthy

KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFIX = "You are the assistant of tenant seven. Answer in one short line. " * 4
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def replica(tmp_path: Path, model_dir: Path, port: int | None = None) -> Server:
    """A radixlm server on the tiny model, on `port` (a free one by default)."""
    port = port or free_port()
    args = [sys.executable, "-m", "radixlm_runtime.launch_server", "--model-path", str(model_dir)]
    args += ["--port", str(port), "--dtype", "float32", "--max-total-tokens", "4096", "--api-key", KEY]
    args += ["--log-level", "warning"]
    log = tmp_path / f"replica-{port}-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    server = Server(proc, f"http://127.0.0.1:{port}", log, AUTH)
    wait_healthy(server.url, proc, 180, log)
    return server


class Router:
    def __init__(self, tmp_path: Path, urls: list[str]) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp_path / "router.log"
        args = [sys.executable, "-m", "radixlm_runtime.router", "--worker-urls", *urls]
        args += ["--port", self.url.rsplit(":", 1)[1], "--api-key", KEY, "--health-check-interval-s", "0.5"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
        wait_healthy(self.url, self.proc, 180, self.log)

    def info(self) -> dict:
        return httpx.get(f"{self.url}/server_info", headers=AUTH, timeout=30).json()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
) -> Iterator[tuple[Router, list[Server]]]:
    tmp = tmp_path_factory.mktemp("router")
    servers = [replica(tmp, tiny_llama_dir) for _ in range(2)]
    router = Router(tmp, [s.url for s in servers])
    yield router, servers
    assert router.stop() == 0, router.log.read_text()[-3000:]
    for s in servers:
        if s.proc.poll() is None:
            s.stop()


def generate(router: Router, text: str, **extra: object) -> httpx.Response:
    body = {"text": text, "sampling_params": GREEDY, **extra}
    return httpx.post(f"{router.url}/generate", json=body, headers=AUTH, timeout=120)


def test_both_apis_answer_through_the_router(cluster: tuple[Router, list[Server]]) -> None:
    router, servers = cluster
    out = generate(router, PREFIX + "hello")
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 6
    with httpx.stream(
        "POST",
        f"{router.url}/generate",
        json={"text": "hi", "sampling_params": GREEDY, "stream": True},
        headers=AUTH,
    ) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert resp.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 2
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt=PREFIX + "hi", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4
    assert httpx.post(f"{router.url}/generate", json={"text": "x"}, timeout=30).status_code == 401
    assert httpx.post(f"{router.url}/generate", content=b"{", headers=AUTH, timeout=30).status_code == 400
    bad = httpx.post(
        f"{router.url}/generate", json={"text": "x", "sampling_params": {"top_p": 7}}, headers=AUTH
    )
    assert bad.status_code == 400 and "top_p" in bad.text  # the replica's own 400, passed through


def test_a_shared_prefix_stays_on_one_replica(cluster: tuple[Router, list[Server]]) -> None:
    router, servers = cluster
    before = [s.info()["cached_tokens"] for s in servers]
    routed_before = [r["routed"] for r in router.info()["replicas"]]
    for i in range(6):
        assert generate(router, PREFIX + f"question number {i}?").status_code == 200
    routed = [r["routed"] - b for r, b in zip(router.info()["replicas"], routed_before, strict=True)]
    assert sorted(routed) == [0, 6]
    home = routed.index(6)
    # The replica's own radix cache served the prefix to the five requests after the first.
    assert servers[home].info()["cached_tokens"] - before[home] >= 5 * 40


def test_a_dead_replica_is_routed_around_and_rejoins(
    cluster: tuple[Router, list[Server]], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    router, servers = cluster
    # A stream in flight on a replica when it dies ends with an error event naming it, not a hang.
    body = {"text": "who streams", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{router.url}/generate", json=body, headers=AUTH, timeout=60) as stream:
        assert stream.status_code == 200, stream.read()
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # it is running
        home_url = next(r["url"] for r in router.info()["replicas"] if r["in_flight"] == 1)
        victim = next(s for s in servers if s.url == home_url)
        children = child_pids(victim.proc.pid)
        victim.proc.kill()
        victim.proc.wait(timeout=30)
        for c in children:
            if pid_alive(c):
                os.kill(c, signal.SIGKILL)
        last = [line for line in lines if line.startswith("data:")][-1]
    assert "unreachable" in last and home_url in last, last
    # A new request that finds the dead replica's port closed never reached it: the router sends
    # it to the other replica instead of answering 503.
    assert generate(router, PREFIX + "who again").status_code == 200
    for i in range(4):  # the other replica serves everything meanwhile
        assert generate(router, PREFIX + f"still there {i}").status_code == 200
    states = {r["url"]: r["healthy"] for r in router.info()["replicas"]}
    assert states[home_url] is False and sum(states.values()) == 1
    port = int(home_url.rsplit(":", 1)[1])
    servers[servers.index(victim)] = replica(tmp_path, tiny_llama_dir, port)
    deadline = time.monotonic() + 30
    while not all(r["healthy"] for r in router.info()["replicas"]):
        assert time.monotonic() < deadline, "the restarted replica did not rejoin"
        time.sleep(0.3)
    metrics = httpx.get(f"{router.url}/metrics", headers=AUTH, timeout=30).text
    assert f'radixlm_router_replica_healthy{{replica="{home_url}"}} 1.0' in metrics
