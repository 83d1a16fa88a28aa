"""`radixlm-server --dp-size N`: N replicas of the server behind the router on the server's
--host/--port, in this process.

Each replica is a `python -m radixlm_runtime.launch_server` process with the command line given
here, but for this process's own flags (--dp-size, --host, --port, --ray-address), on a port of its
own; with --kv-disk-dir, replica i gets `DIR/replica-<i>` (a disk tier serves one server, and replica
i finds its own after a restart). A `ReplicaProcess` supervises one: a replica that dies is started
again on the same port (the router routes around it meanwhile and takes it back once /health
answers), and it is stopped the way an operator stops a server (SIGTERM, which drains it) after the
router has stopped taking requests. Without --ray-address the replicas run here on loopback ports;
with it, on a Ray cluster (router/ray_replicas.py).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import uvicorn

from radixlm_runtime.config import RouterConfig
from radixlm_runtime.router.app import create_router_app
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger
from radixlm_runtime.utils.process import die_with_parent, wait_healthy

logger = get_logger("radixlm_runtime.router.replicas")

STARTUP_TIMEOUT_S = 600.0
# Flags of this process alone, with their values.
OWN_FLAGS = ("--dp-size", "--host", "--port", "--ray-address", "--kv-disk-dir")
# A replica that keeps dying is started again at most this often.
RESTART_BACKOFF_S = 2.0


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


def _drain_with_parent() -> None:
    """In the replica, before exec: SIGTERM (a drain) when the thread that started it exits, so a
    supervisor killed without its own cleanup (kill -9, a Ray actor killed) leaves no server behind."""
    die_with_parent(signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ReplicaProcess:
    """One replica server process on host:port, started again whenever it exits until `stop`."""

    def __init__(self, argv: list[str], host: str, port: int, shutdown_timeout: float) -> None:
        self.cmd = [sys.executable, "-m", "radixlm_runtime.launch_server", *argv, "--host", host]
        self.cmd += ["--port", str(port)]
        self.url = f"http://{host}:{port}"
        self.shutdown_timeout = shutdown_timeout
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.proc = self._spawn()
        self._watch = threading.Thread(target=self._supervise, name=f"replica {self.url}", daemon=True)

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, preexec_fn=_drain_with_parent)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_healthy(self) -> None:
        """Returns once /health answers 200; raises when the process exits or never gets there.
        Supervision starts after it: a replica that cannot start is an error, not a restart loop."""
        wait_healthy(self.url, self.proc, STARTUP_TIMEOUT_S, what="replica")
        self._watch.start()

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            code = self.proc.wait()
            if self._stopping.is_set():
                return
            logger.error("replica %s exited with code %s; starting it again", self.url, code)
            self._stopping.wait(RESTART_BACKOFF_S)
            with self._lock:
                if self._stopping.is_set():
                    return
                self.proc = self._spawn()
                self.restarts += 1

    def terminate(self) -> None:
        """Asks the replica to drain and exit (SIGTERM); it is not started again after this."""
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        """The exit code, killing the process if its drain outlasts its shutdown timeout."""
        try:
            return self.proc.wait(timeout=self.shutdown_timeout + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class ReplicaSet(Protocol):
    """Where the replicas run: started before the router serves, stopped after."""

    def start(self) -> list[str]:
        """Starts every replica; returns their base URLs once all are healthy."""
        ...

    def stop(self) -> None: ...


class LocalReplicas:
    """The replicas as processes of this machine, on loopback ports."""

    def __init__(self, args: ServerArgs, argv: list[str]) -> None:
        self.args, self.argv = args, replica_argv(argv)
        self.replicas: list[ReplicaProcess] = []

    def start(self) -> list[str]:
        timeout = self.args.server.shutdown_timeout
        for i in range(self.args.server.dp_size):
            argv = [*self.argv, *replica_flags(self.args, i)]
            self.replicas.append(ReplicaProcess(argv, "127.0.0.1", free_port(), timeout))
        for replica in self.replicas:
            replica.wait_healthy()
        return [r.url for r in self.replicas]

    def stop(self) -> None:
        for replica in self.replicas:  # every replica drains at once
            replica.terminate()
        for replica in self.replicas:
            replica.wait()


def serve_data_parallel(args: ServerArgs, argv: list[str]) -> int:
    """Starts the replicas, serves the router until SIGTERM/SIGINT, then stops the replicas. Returns
    0, or 1 when a replica failed to start."""
    server = args.server
    make: Callable[[ServerArgs, list[str]], ReplicaSet] = LocalReplicas
    if server.ray_address is not None:
        from radixlm_runtime.router.ray_replicas import RayReplicas

        make = RayReplicas
    try:
        replicas = make(args, argv)
    except RuntimeError as e:  # Ray not installed
        logger.error("%s", e)
        return 1
    try:
        urls = replicas.start()
        config = RouterConfig(
            worker_urls=tuple(urls),
            host=server.host,
            port=server.port,
            router_policy=server.router_policy,
            api_key=server.api_key,
            max_request_bytes=server.max_request_bytes,
            log_level=args.log_level,
        )
        where = f"http://{server.host}:{server.port}"
        logger.info("%d replicas up (%s); router on %s", len(urls), ", ".join(urls), where)
        uvicorn.run(create_router_app(config), host=server.host, port=server.port, log_level="warning")
        return 0
    except (RuntimeError, TimeoutError) as e:
        logger.error("%s", e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the replicas' drain must not be cut short
        replicas.stop()
