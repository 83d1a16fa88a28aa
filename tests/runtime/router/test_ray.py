"""`radixlm-server --ray-address ADDR --dp-size 2` on a local two-node Ray cluster (a head and a
second node process on this machine's own address, as Ray picks it, one CPU each, so each replica's
placement group lands on a node of its own), the tiny random-init model: both APIs answered through
the router; one replica's server killed: requests keep getting answers, and Ray's actor starts it
again; SIGTERM drains and takes the replicas, actors and placement groups off the cluster, leaving
no server process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dp_helpers import answer_both_apis, kill_one_and_see_it_back, replicas
from server_harness import free_port, pid_alive

from radixlm_runtime.utils.process import wait_healthy

pytestmark = pytest.mark.slow


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        reason = "the Ray tests need the ray extra: pip install -e '.[ray]' (make test installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return ray


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    _ray()
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    yield c
    c.shutdown()


def servers_of(model_dir: Path) -> list[int]:
    """Pids of the radixlm servers of this model (the replicas), from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"radixlm_runtime.launch_server" in argv and str(model_dir).encode() in argv:
            pids.append(int(entry.name))
    return [p for p in pids if pid_alive(p)]


def server_on_port(model_dir: Path, port: int) -> int:
    for pid in servers_of(model_dir):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[argv.index(b"--port") + 1] == str(port).encode():
            return pid
    raise AssertionError(f"no replica server on port {port}")


def test_two_replicas_on_a_two_node_ray_cluster(cluster: Any, tiny_llama_dir: Path, tmp_path: Path) -> None:
    ray = _ray()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "radixlm_runtime.launch_server", "--model-path", str(tiny_llama_dir)]
    args += ["--ray-address", cluster.address, "--dp-size", "2", "--router-policy", "round_robin"]
    args += ["--port", str(port), "--num-threads", "1", "--dtype", "float32", "--max-total-tokens", "4096"]
    args += ["--log-level", "warning"]
    log = tmp_path / "ray.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    try:
        wait_healthy(url, proc, 300, log)
        # One placement group per replica, each on a node of its own (one CPU per node).
        ray.init(address=cluster.address, logging_level="WARNING")
        groups = [g for g in ray.util.placement_group_table().values() if g["name"].startswith("radixlm-")]
        assert len(groups) == 2 and all(g["state"] == "CREATED" for g in groups), groups
        assert len({node for g in groups for node in g["bundles_to_node_id"].values()}) == 2, groups

        answer_both_apis(url)
        serving = replicas(url)
        assert all(r["healthy"] and r["routed"] >= 2 for r in serving)

        victim = server_on_port(tiny_llama_dir, int(serving[0]["url"].rsplit(":", 1)[1]))
        kill_one_and_see_it_back(url, victim, log)
        assert victim not in servers_of(tiny_llama_dir)  # started again: a new process
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=180)
    assert code == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + 30
    while servers_of(tiny_llama_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not servers_of(tiny_llama_dir), f"left behind\n{log.read_text()[-3000:]}"
    groups = [g for g in ray.util.placement_group_table().values() if g["name"].startswith("radixlm-")]
    assert all(g["state"] == "REMOVED" for g in groups), groups
    ray.shutdown()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)
