"""A tensor-parallel rank that dies takes the server down: a clear log line, a non-zero exit, and no
process of the server left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from server_harness import child_pids, descendants, launch_server, pid_alive


def _is_rank(pid: int) -> bool:
    """A tensor-parallel rank: a multiprocessing spawn child of the scheduler."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_exits_server_nonzero_with_nothing_left(
    victim: int, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """Rank 1 (a worker; rank 0 logs it and exits) or rank 0 (the scheduler process; the worker dies
    with it)."""
    server = launch_server(tmp_path, "--model-path", str(tiny_llama_dir), "--tp-size", "2", api_key=None)
    try:
        scheduler = server.info()["scheduler_pid"]
        ranks = [pid for pid in child_pids(scheduler) if _is_rank(pid)]
        assert len(ranks) == 1, ranks
        everything = descendants(server.proc.pid)
        assert scheduler in everything and ranks[0] in everything
        os.kill(ranks[0] if victim else scheduler, signal.SIGKILL)
        code = server.proc.wait(timeout=60)
        assert code != 0, server.log()
        if victim:
            assert f"tensor-parallel rank 1 (pid {ranks[0]}) exited with code -9" in server.log()
        deadline = time.monotonic() + 10  # an orphan is killed at once, but reaped a moment later
        while any(pid_alive(pid) for pid in everything) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()) for pid in everything if pid_alive(pid)]
        assert not left, f"processes left behind: {left}\n{server.log()[-3000:]}"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
