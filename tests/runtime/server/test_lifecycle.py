"""Process lifecycle on dedicated servers: a full queue answers 503, SIGTERM stops everything with no
orphan, and a dead scheduler fails in-flight requests and takes the server down with a non-zero code."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
from server_harness import child_pids, launch_server, pid_alive

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


def start_stream(url: str, results: list) -> threading.Thread:
    """Consumes a long /generate stream in a thread, recording its lines or the exception it ended with."""

    def run() -> None:
        try:
            body = {"text": "Count slowly:", "sampling_params": LONG, "stream": True}
            with requests.post(f"{url}/generate", json=body, stream=True, timeout=60) as r:
                results.append(r.status_code)
                results.extend(line for line in r.iter_lines(decode_unicode=True) if line)
        except requests.RequestException as e:
            results.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_streaming(results: list, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(isinstance(x, str) for x in results) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(isinstance(x, str) for x in results), results


def test_full_queue_503_then_sigterm_leaves_no_child(tmp_path: Path) -> None:
    server = launch_server(tmp_path, "--max-queued-requests", "2", api_key=None)
    try:
        streams = [[], []]
        threads = [start_stream(server.url, res) for res in streams]
        for res in streams:
            wait_streaming(res)
        r = requests.post(f"{server.url}/generate", json={"text": "Hi"}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1" and "max_queued_requests" in r.json()["error"]["message"]
        children = child_pids(server.proc.pid)
        assert children, "the scheduler process should be a child of the server"
        t0 = time.monotonic()
        assert server.stop() == 0, server.log()
        assert time.monotonic() - t0 < 20
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        assert not any(pid_alive(c) for c in children)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_scheduler_death_fails_requests_and_exits_nonzero(tmp_path: Path) -> None:
    server = launch_server(tmp_path, api_key=None)
    try:
        sched_pid = server.info()["scheduler_pid"]
        assert sched_pid in child_pids(server.proc.pid)
        results: list = []
        thread = start_stream(server.url, results)
        wait_streaming(results)
        os.kill(sched_pid, signal.SIGKILL)
        saw_503 = False
        deadline = time.monotonic() + 15
        while server.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException):
                saw_503 |= requests.get(f"{server.url}/health", timeout=1).status_code == 503
            time.sleep(0.05)
        code = server.proc.wait(timeout=5)
        assert code != 0, server.log()
        assert saw_503, "/health never reported the dead scheduler"
        thread.join(10)
        assert not thread.is_alive()
        # The in-flight stream ended with an error chunk (or a cut connection), never a normal finish.
        lines = [x for x in results if isinstance(x, str)]
        errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {") and '"error"' in x]
        assert errors or isinstance(results[-1], Exception), results[-3:]
        assert not child_pids(server.proc.pid)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
