"""`radixlm-server --dp-size N`: N replicas of the server, each its own process pair on a loopback
port of its own, behind the router on the server's --host/--port, in this process.

Each replica is started as `python -m radixlm_runtime.launch_server` with the command line given
here, but for --dp-size, --host and --port (and --kv-disk-dir, which each replica gets a subdirectory
of, `replica-<i>`: a disk tier serves one server, and replica i finds its own after a restart); it
is stopped the way an operator stops a server
(SIGTERM, which drains it), after the router has stopped taking requests.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvicorn

from radixlm_runtime.config import RouterConfig
from radixlm_runtime.router.app import create_router_app
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger

logger = get_logger("radixlm_runtime.router.replicas")

STARTUP_TIMEOUT_S = 600.0
# Flags of this process alone, with their values.
OWN_FLAGS = ("--dp-size", "--host", "--port", "--kv-disk-dir")


def replica_argv(argv: list[str]) -> list[str]:
    """The command line without this process's own flags (`--flag value` and `--flag=value`)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in OWN_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{f}=" for f in OWN_FLAGS)):
            out.append(arg)
    return out


def replica_flags(args: ServerArgs, index: int) -> list[str]:
    """The flags replica `index` gets of its own beside the shared command line."""
    disk_dir = args.engine.kv_disk_dir
    return [] if disk_dir is None else ["--kv-disk-dir", str(Path(disk_dir) / f"replica-{index}")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica {url} exited with code {proc.returncode} while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"replica {url} not healthy after {STARTUP_TIMEOUT_S:.0f}s")


def serve_data_parallel(args: ServerArgs, argv: list[str]) -> int:
    """Starts the replicas, serves the router until SIGTERM/SIGINT, then stops the replicas. Returns
    0, or 1 when a replica failed to start."""
    server = args.server
    child = [
        sys.executable,
        "-m",
        "radixlm_runtime.launch_server",
        *replica_argv(argv),
        "--host",
        "127.0.0.1",
    ]
    procs: list[subprocess.Popen] = []
    urls: list[str] = []
    try:
        for i in range(server.dp_size):
            port = _free_port()
            procs.append(subprocess.Popen([*child, *replica_flags(args, i), "--port", str(port)]))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            _wait_healthy(url, proc)
        config = RouterConfig(
            worker_urls=tuple(urls),
            host=server.host,
            port=server.port,
            router_policy=server.router_policy,
            api_key=server.api_key,
            max_request_bytes=server.max_request_bytes,
            log_level=args.log_level,
        )
        logger.info(
            "%d replicas up (%s); router on http://%s:%d",
            len(urls),
            ", ".join(urls),
            server.host,
            server.port,
        )
        uvicorn.run(create_router_app(config), host=server.host, port=server.port, log_level="warning")
        return 0
    except (RuntimeError, TimeoutError) as e:
        logger.error("%s", e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the replicas' drain must not be cut short
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=server.shutdown_timeout + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
