"""Runs the real server (`python -m radixlm_runtime.launch_server`) as a subprocess on the embedded
default model, and stops it the way an operator would: SIGTERM, then checks no child is left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from radixlm_runtime.utils.process import wait_healthy

API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOTAL_TOKENS = 20000
MAX_REQUEST_BYTES = 1 << 20
STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of pid, read from /proc (psutil is not a dependency)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, ...
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            children.append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below pid: children, their children, ..."""
    out, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path
    headers: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def info(self) -> dict:
        r = requests.get(f"{self.url}/server_info", headers=self.headers, timeout=60)
        r.raise_for_status()
        return r.json()

    def stop(self) -> int:
        """SIGTERMs the server; returns its exit code after checking every child process is gone."""
        children = child_pids(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(pid_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [c for c in children if pid_alive(c)]
        assert not left, f"child processes left behind: {left}\n{self.log()[-3000:]}"
        return code


def launch_server(tmp_path: Path, *extra: str, api_key: str | None = API_KEY) -> Server:
    port = free_port()
    # float32 on every device, so outputs compare with the offline engine's as on the CPU.
    args = [sys.executable, "-m", "radixlm_runtime.launch_server", "--port", str(port), "--dtype", "float32"]
    args += ["--max-total-tokens", str(MAX_TOTAL_TOKENS), "--log-level", "warning", *extra]
    if api_key:
        args += ["--api-key", api_key]
    log_path = tmp_path / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"}
        )
    server = Server(
        proc, f"http://127.0.0.1:{port}", log_path, {"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    try:
        wait_healthy(server.url, proc, STARTUP_TIMEOUT_S, log_path)
    except BaseException:
        server.stop()
        raise
    return server


def wait_idle(server: Server, timeout_s: float = 60.0) -> dict:
    """Polls /server_info until no request is running, waiting or tracked; returns the last info."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server.info()
        busy = (
            info["num_running"] or info["num_waiting"] or info["num_tracked"] or info["num_inflight_requests"]
        )
        if not busy or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def assert_no_leak(info: dict) -> None:
    assert info["num_running"] == 0 and info["num_waiting"] == 0, info
    assert info["protected_tokens"] == 0, info
    assert info["num_sessions"] == 0 and info["pinned_tokens"] == 0, info
    assert info["free_tokens"] + info["cached_tokens_in_tree"] == info["max_total_tokens"], info
