"""`radixlm-server --dp-size 2` (tiny random-init model): two replicas behind the router on one port,
both APIs answered, requests spread by the router, a replica killed is routed around and started
again, and SIGTERM leaves no process behind. The replicas on a Ray cluster: test_ray.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dp_helpers import answer_both_apis, kill_one_and_see_it_back, replicas
from server_harness import child_pids, descendants, free_port, pid_alive

from radixlm_runtime.router.replicas import replica_argv, replica_flags
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.process import wait_healthy


def test_replica_argv_drops_the_routers_own_flags() -> None:
    argv = ["--dp-size", "2", "--port=9", "--model-path", "m", "--host", "0.0.0.0", "--num-threads", "1"]
    assert replica_argv(argv) == ["--model-path", "m", "--num-threads", "1"]


def test_each_replica_gets_a_disk_tier_directory_of_its_own() -> None:
    argv = ["--dp-size", "2", "--kv-host-tokens", "64", "--kv-disk-dir", "/kv"]
    assert replica_argv(argv) == ["--kv-host-tokens", "64"]
    args = ServerArgs.from_kwargs(dp_size=2, kv_host_tokens=64, kv_disk_dir="/kv")
    assert [replica_flags(args, i) for i in range(2)] == [
        ["--kv-disk-dir", "/kv/replica-0"],
        ["--kv-disk-dir", "/kv/replica-1"],
    ]
    assert replica_flags(ServerArgs.from_kwargs(dp_size=2), 0) == []


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
        wait_healthy(url, proc, 180, log)
        answer_both_apis(url)
        assert all(r["healthy"] and r["routed"] >= 2 for r in replicas(url))
        kill_one_and_see_it_back(url, child_pids(proc.pid)[0], log)
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
