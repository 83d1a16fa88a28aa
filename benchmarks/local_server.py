"""A radixlm server on loopback for the benchmarks that talk HTTP: started as an operator would
(`python -m radixlm_runtime.launch_server`), ready once /health answers, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from common import child_env

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(extra: list[str], log_path: Path) -> Iterator[str]:
    """Starts `python -m radixlm_runtime.launch_server` on a free port, yields its URL once /health
    answers, and stops it with SIGTERM as an operator would."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "radixlm_runtime.launch_server",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, env=child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def flush(url: str) -> None:
    """Empties the radix cache; the server refuses while a finished request is still being released."""
    for _ in range(50):
        if httpx.post(f"{url}/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(0.1)
    raise RuntimeError("the server kept refusing /flush_cache")
