"""Process lifecycle on dedicated servers: a full queue answers 503, SIGTERM drains (new requests get
503, running ones finish or end with finish reason abort, every stream with its final event and
[DONE]) and stops everything with no orphan, and a dead scheduler fails in-flight requests and takes
the server down with a non-zero code."""

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
from server_harness import Server, child_pids, launch_server, pid_alive

pytestmark = pytest.mark.slow

LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}


def native_stream(params: dict) -> tuple[str, dict]:
    return "/generate", {"text": "Count slowly:", "sampling_params": params, "stream": True}


def chat_stream(params: dict) -> tuple[str, dict]:
    messages = [{"role": "user", "content": "Count slowly."}]
    body = {"messages": messages, "max_tokens": params["max_new_tokens"], "stream": True}
    return "/v1/chat/completions", body | {"ignore_eos": params["ignore_eos"]}


def start_stream(url: str, results: list, request: tuple[str, dict] | None = None) -> threading.Thread:
    """Consumes a stream (by default a long /generate one) in a thread, recording its status and
    lines or the exception it ended with."""
    path, body = request or native_stream(LONG)

    def run() -> None:
        try:
            with requests.post(f"{url}{path}", json=body, stream=True, timeout=60) as r:
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


def wait_in_flight(server: Server, n: int, timeout_s: float = 120) -> None:
    """Waits until the server tracks n requests (each sent to the scheduler, streaming or queued)."""
    deadline = time.monotonic() + timeout_s
    while server.info()["num_inflight_requests"] < n:
        assert time.monotonic() < deadline, server.info()
        time.sleep(0.05)


def final_event(lines: list) -> dict:
    """The last data event of a complete SSE stream: it must end with [DONE]."""
    assert lines[0] == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    return json.loads(lines[-2].removeprefix("data: "))


def finish_type(event: dict) -> str:
    """A native event's finish reason type, or an OpenAI chunk's finish_reason."""
    if "meta_info" in event:
        return event["meta_info"]["finish_reason"]["type"]
    return event["choices"][0]["finish_reason"]


def test_full_queue_503_then_sigterm_leaves_no_child(tmp_path: Path) -> None:
    server = launch_server(tmp_path, "--max-queued-requests", "2", "--shutdown-timeout", "1", api_key=None)
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


def test_sigterm_ends_twenty_streams_cleanly(tmp_path: Path) -> None:
    """20 streams (native and OpenAI) outlast --shutdown-timeout: once SIGTERM arrives new requests
    get 503, and at the timeout every stream (one still waiting for its first token too) gets a
    final event with finish reason abort and [DONE]; the server exits 0, the scheduler process with
    it, without a traceback in its log."""
    server = launch_server(tmp_path, "--shutdown-timeout", "3", api_key=None)
    try:
        children = child_pids(server.proc.pid)
        # Long enough to outlast the timeout, short enough that all 20 fit the KV pool at once.
        params = LONG | {"max_new_tokens": 800}
        streams: list[list] = [[] for _ in range(20)]
        kinds = [native_stream(params) if i % 2 else chat_stream(params) for i in range(20)]
        threads = [start_stream(server.url, res, kind) for res, kind in zip(streams, kinds)]
        wait_in_flight(server, 20)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        while requests.get(f"{server.url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "the server kept admitting after SIGTERM"
            time.sleep(0.05)
        r = requests.post(f"{server.url}/generate", json={"text": "Hi"}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert server.proc.wait(timeout=60) == 0, server.log()[-3000:]
        for t in threads:
            t.join(10)
        assert [finish_type(final_event(res)) for res in streams] == ["abort"] * 20
        deadline = time.monotonic() + 10  # the resource tracker follows its parent shortly
        while any(pid_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children and not any(pid_alive(c) for c in children)
        assert "Traceback" not in server.log(), server.log()[-3000:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_sigterm_lets_running_streams_finish(tmp_path: Path) -> None:
    """Within --shutdown-timeout the running streams end as they would have (finish reason length),
    and the server exits 0 as soon as they have."""
    server = launch_server(tmp_path, "--shutdown-timeout", "300", api_key=None)
    try:
        short = {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}
        streams: list[list] = [[] for _ in range(4)]
        kinds = [native_stream(short), chat_stream(short)] * 2
        threads = [start_stream(server.url, res, kind) for res, kind in zip(streams, kinds)]
        wait_in_flight(server, 4)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=300) == 0, server.log()[-3000:]
        for t in threads:
            t.join(10)
        assert [finish_type(final_event(res)) for res in streams] == ["length"] * 4
        assert "Traceback" not in server.log(), server.log()[-3000:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
