"""`radixlm-server --dp-size 2` (tiny random-init model): two replicas behind the router on one port,
both APIs answered, requests spread by the router, and SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_harness import descendants, free_port, pid_alive  # noqa: E402

from radixlm_runtime.router.replicas import replica_argv


def test_replica_argv_drops_the_routers_own_flags() -> None:
    argv = ["--dp-size", "2", "--port=9", "--model-path", "m", "--host", "0.0.0.0", "--num-threads", "1"]
    assert replica_argv(argv) == ["--model-path", "m", "--num-threads", "1"]


def test_dp_size_serves_two_replicas_behind_one_port(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "radixlm_runtime.launch_server", "--model-path", str(tiny_llama_dir)]
    args += ["--dp-size", "2", "--router-policy", "round_robin", "--port", str(port), "--num-threads", "1"]
    args += ["--dtype", "float32", "--max-total-tokens", "4096", "--log-level", "warning"]
    log = tmp_path / "dp.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        for i in range(4):
            out = httpx.post(
                f"{url}/generate", json={"text": f"hello {i}", "sampling_params": params}, timeout=120
            )
            assert out.status_code == 200 and len(out.json()["output_ids"]) == 4
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        done = client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=3)
        assert done.usage.completion_tokens == 3
        replicas = httpx.get(f"{url}/server_info", timeout=30).json()["replicas"]
        assert len(replicas) == 2 and all(r["healthy"] and r["routed"] >= 2 for r in replicas)
    finally:
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert code == 0, log.read_text()[-3000:]
    assert len(family) >= 4  # two replicas, each with its scheduler process
    assert not [p for p in family if pid_alive(p)], f"left behind\n{log.read_text()[-3000:]}"
