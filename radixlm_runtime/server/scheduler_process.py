"""The scheduler process: owns the model, the KV cache and the Scheduler, and runs the step loop.

It talks to the HTTP process over two zmq sockets only (PULL for requests, PUSH for outputs), so a
slow HTTP client never stalls a forward step and a crash here cannot corrupt the HTTP process.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from radixlm_runtime.entrypoints.runtime import build_scheduler
from radixlm_runtime.io import messages as msg
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.tokenizer import load_tokenizer
from radixlm_runtime.server import dashboard_snapshot
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger, setup_logging

logger = get_logger(__name__)

# How long an idle loop blocks on the socket before checking that its parent is still alive.
IDLE_POLL_MS = 500
# How long a loop whose last step ran nothing (all its work waiting on something) blocks on the
# socket before trying again, instead of spinning and flooding the HTTP process.
STALLED_POLL_MS = 5
# After this long with work but no step run, the loop logs what it waits on (once per stall) and
# fails health probes, so that a supervisor restarts a scheduler that has stopped making progress.
STALL_WARN_S = 30.0


class SchedulerProcess:
    def __init__(self, server_args: ServerArgs, model_dir: Path, in_addr: str, out_addr: str) -> None:
        self.args = server_args
        self.model_dir = model_dir
        # A tensor-parallel rank that dies ends this process (status 1), and with it the server.
        self.scheduler = build_scheduler(
            model_dir, server_args, load_tokenizer(model_dir), exit_on_rank_death=True
        )
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(in_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(out_addr)
        self.parent_pid = os.getppid()
        self.running = True
        # The queue sizes last sent; whether the current stall was logged.
        self._sent_sizes = (0, 0)
        self._stall_logged = False
        # What the dashboard's snapshots read; None with --disable-dashboard.
        self.request_log = None if server_args.server.disable_dashboard else dashboard_snapshot.RequestLog()

    def send(self, message: msg.FromScheduler) -> None:
        self.push.send(msg.encode(message))

    def serve(self) -> None:
        self.send(
            msg.Ready(
                pid=os.getpid(),
                model_path=str(self.model_dir),
                context_length=self.scheduler.runner_info.context_len,
                max_total_tokens=self.scheduler.runner_info.max_total_tokens,
                vocab_size=self.scheduler.runner_info.vocab_size,
            )
        )
        while self.running:
            if os.getppid() != self.parent_pid:  # killed without a Shutdown: nobody reads our outputs
                logger.warning("the HTTP process is gone; scheduler exiting")
                return
            if not self.scheduler.has_work():
                self._drain(IDLE_POLL_MS)
                continue
            self._drain(0)
            if self.scheduler.has_work() and not self._step():
                self._drain(STALLED_POLL_MS)  # nothing could run: wait for input, never spin

    def _stalled_s(self) -> float | None:
        """For how long steps have run nothing while work waits, once past STALL_WARN_S; else None."""
        stalled = self.scheduler.stalled_s()
        return stalled if stalled > STALL_WARN_S else None

    # -- inputs -------------------------------------------------------------------------------
    def _drain(self, wait_ms: int) -> None:
        """Handles every message queued, after waiting up to wait_ms for the first."""
        if wait_ms and not self.pull.poll(wait_ms):
            return
        while self.running:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(msg.decode_to_scheduler(data))

    def _handle(self, m: msg.ToScheduler) -> None:
        if isinstance(m, msg.GenerateReq):
            self._add(m)
        elif isinstance(m, msg.AbortReq):
            self.scheduler.abort(m.rid)
        elif isinstance(m, msg.FlushCacheReq):
            self.send(msg.CallResult(m.call_id, self.scheduler.flush_cache()))
        elif isinstance(m, msg.ServerInfoReq):
            self.send(msg.CallResult(m.call_id, True, self.server_info()))
        elif isinstance(m, msg.CloseSessionReq):
            self.send(msg.CallResult(m.call_id, self.scheduler.close_session(m.session_id)))
        elif isinstance(m, msg.HealthProbe):
            stalled = self._stalled_s()
            self.send(msg.CallResult(m.call_id, stalled is None, {"stalled_s": stalled or 0.0}))
        elif isinstance(m, msg.DashboardReq):
            self._dashboard(m)
        elif isinstance(m, msg.Shutdown):
            self.running = False

    def _add(self, m: msg.GenerateReq) -> None:
        try:
            req = self.scheduler.submit(m)
        except Exception as e:  # a bad request fails alone; the loop goes on
            logger.exception("rejecting request %s", m.rid)
            failed = FinishReason.abort(f"invalid request: {e}")
            self.send(msg.BatchOut([msg.ReqOutput(m.rid, [], failed, len(m.input_ids), 0, 0)], 0, 0))
            return
        if self.request_log is not None:
            self.request_log.submitted(req)

    def _dashboard(self, m: msg.DashboardReq) -> None:
        if self.request_log is None:
            self.send(msg.CallResult(m.call_id, False, {"error": "the dashboard is disabled"}))
            return
        snapshot = dashboard_snapshot.answer(self.scheduler, self.request_log, m)
        self.send(msg.CallResult(m.call_id, True, snapshot))

    # -- step and outputs ---------------------------------------------------------------------
    def _step(self) -> bool:
        """Runs one scheduler step and sends what it produced (after every forward: the HTTP process
        reads each as a sign of life); False when it ran nothing."""
        outputs = self.scheduler.step()
        ran = self.scheduler.idle_since is None
        sizes = self.scheduler.queue_sizes()
        if ran or sizes != self._sent_sizes:
            self.send(msg.BatchOut(outputs, *sizes))
            self._sent_sizes = sizes
        if self.request_log is not None:
            self.request_log.ended(outputs)
        if ran:
            self._stall_logged = False
            return True
        stalled = self._stalled_s()
        if stalled is not None and not self._stall_logged:
            self._stall_logged = True
            info = self.scheduler.info()
            logger.warning(
                "no step has run for %.0fs: %d waiting, %d running, %d compiling, %d free KV tokens, "
                "%d evictable, %d pinned by sessions (/health answers 503 until one runs)",
                stalled,
                info["num_waiting"],
                info["num_running"],
                len(self.scheduler.constraints),
                info["free_tokens"],
                info["evictable_tokens"],
                info["pinned_tokens"],
            )
        return False

    def server_info(self) -> dict[str, Any]:
        return {
            "scheduler_pid": os.getpid(),
            "model_path": str(self.model_dir),
            "num_tracked": self.scheduler.num_live(),
            "num_compiling": len(self.scheduler.constraints),
            **self.scheduler.info(),
        }

    def close(self) -> None:
        self.scheduler.close()
        self.pull.close(linger=0)
        self.push.close(linger=1000)
        self.ctx.term()


def run_scheduler_process(server_args: ServerArgs, model_dir: Path, in_addr: str, out_addr: str) -> None:
    """Process entry point. Exits non-zero on any error not tied to one request, so the HTTP
    process's watchdog notices and shuts the server down instead of serving a broken engine."""
    # Ctrl-C (and a supervisor's SIGTERM to the whole group) reach this process too; the HTTP
    # process decides when it stops, after draining its requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(server_args.log_level)
    t0 = time.perf_counter()
    try:
        proc = SchedulerProcess(server_args, model_dir, in_addr, out_addr)
        logger.info("scheduler ready in %.2fs", time.perf_counter() - t0)
        proc.serve()
    except Exception:
        logger.exception("scheduler process failed")
        sys.exit(1)
    proc.close()
