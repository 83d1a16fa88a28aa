"""Runtime: a local radixlm server in a subprocess, used as a backend. It listens on a free loopback
port and stops on shutdown() or when the Python process exits."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixlm.backend.runtime_endpoint import RuntimeEndpoint
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.process import wait_healthy


def _die_with_parent() -> Callable[[], None] | None:
    """On Linux, a preexec hook asking the kernel to SIGTERM the server when this process dies, so a
    killed program (where atexit never runs) leaves no server behind."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runtime:
    """`Runtime(model_path=..., max_total_tokens=...)` takes the server's flags (ServerArgs fields)."""

    def __init__(self, startup_timeout_s: float = 600.0, **server_flags: Any) -> None:
        server_flags.setdefault("port", _free_port())
        args = ServerArgs.from_kwargs(**server_flags)
        self.url = f"http://{args.server.host}:{args.server.port}"
        cmd = [sys.executable, "-m", "radixlm_runtime.launch_server"]
        for name, value in server_flags.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                cmd += [flag] if value else []
            elif value is not None:
                cmd += [flag, str(value)]
        self._log = tempfile.NamedTemporaryFile(prefix="radixlm-server-", suffix=".log", delete=False)  # noqa: SIM115 (lives as long as the server)
        self.log_path = self._log.name
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent()
        )
        atexit.register(self.shutdown)
        try:
            wait_healthy(self.url, self.process, startup_timeout_s, Path(self.log_path), "radixlm server")
            self.endpoint = RuntimeEndpoint(self.url, api_key=args.server.api_key)
        except BaseException:
            self.shutdown()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def shutdown(self) -> None:
        """SIGTERM (the server stops its scheduler process itself), then SIGKILL if it hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()
            os.unlink(self.log_path)
        atexit.unregister(self.shutdown)

    # Backend calls pass through to the endpoint, so a Runtime works wherever a backend does.
    def __getattr__(self, name: str) -> Any:
        if name == "endpoint":
            raise AttributeError(name)
        return getattr(self.endpoint, name)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
