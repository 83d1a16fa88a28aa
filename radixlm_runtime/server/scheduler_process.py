"""The scheduler process: owns the model, the KV cache and the Scheduler, and runs the step loop.

It talks to the HTTP process over two zmq sockets only (PULL for requests, PUSH for outputs), so a
slow HTTP client never stalls a forward step and a crash here cannot corrupt the HTTP process.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from radixlm_runtime.engine.tokenizer import load_tokenizer
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.scheduler import Scheduler
from radixlm_runtime.server import messages as msg
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger, setup_logging

logger = get_logger(__name__)

# How long an idle loop blocks on the socket before checking that its parent is still alive.
IDLE_POLL_MS = 500


@dataclass
class _Tracked:
    """A live request and how much of it the HTTP side has already been sent."""

    req: Req
    sent_tokens: int = 0
    sent_input_logprobs: bool = False


class SchedulerProcess:
    def __init__(self, server_args: ServerArgs, model_dir: Path, in_addr: str, out_addr: str) -> None:
        self.args = server_args
        self.model_dir = model_dir
        self.scheduler = Scheduler.build(model_dir, server_args, load_tokenizer(model_dir))
        self.runner = self.scheduler.runner
        self.tracked: dict[str, _Tracked] = {}
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(in_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(out_addr)
        self.parent_pid = os.getppid()
        self.running = True

    def send(self, message: msg.FromScheduler) -> None:
        self.push.send(msg.encode(message))

    def serve(self) -> None:
        self.send(
            msg.Ready(
                pid=os.getpid(),
                model_path=str(self.model_dir),
                context_length=self.runner.context_len,
                max_total_tokens=self.runner.max_total_tokens,
                vocab_size=self.runner.config.vocab_size,
            )
        )
        while self.running:
            self._drain(block=not self.scheduler.has_work())
            if self.scheduler.has_work():
                self._step()
            elif os.getppid() != self.parent_pid:
                logger.warning("the HTTP process is gone; scheduler exiting")
                return

    # -- inputs -------------------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        if block and not self.pull.poll(IDLE_POLL_MS):
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
            if m.rid in self.tracked:
                self.scheduler.abort(m.rid)
        elif isinstance(m, msg.FlushCacheReq):
            self.send(msg.CallResult(m.call_id, self.scheduler.flush_cache()))
        elif isinstance(m, msg.ServerInfoReq):
            self.send(msg.CallResult(m.call_id, True, self.server_info()))
        elif isinstance(m, msg.CloseSessionReq):
            self.send(msg.CallResult(m.call_id, self.scheduler.cache.sessions.close(m.session_id)))
        elif isinstance(m, msg.HealthProbe):
            self.send(msg.CallResult(m.call_id, True))
        elif isinstance(m, msg.Shutdown):
            self.running = False

    def _add(self, m: msg.GenerateReq) -> None:
        try:
            sp = SamplingParams.from_dict(m.sampling_params)
            req = Req(
                rid=m.rid,
                origin_input_ids=m.input_ids,
                sampling_params=sp,
                return_logprob=m.return_logprob,
                logprob_start_len=m.logprob_start_len,
                top_logprobs_num=m.top_logprobs_num,
                generator=self.scheduler.new_generator(m.seed),
                session_id=m.session_id,
            )
        except Exception as e:  # a bad request fails alone; the loop goes on
            logger.exception("rejecting request %s", m.rid)
            failed = {"type": "abort", "message": f"invalid request: {e}"}
            self.send(msg.BatchOut([msg.ReqOutput(m.rid, [], failed, len(m.input_ids), 0, 0)], 0, 0))
            return
        self.tracked[m.rid] = _Tracked(req)
        self.scheduler.add_request(req)

    # -- step and outputs ---------------------------------------------------------------------
    def _step(self) -> None:
        updated = self.scheduler.step()
        outputs = [self._output(req) for req in updated if req.rid in self.tracked]
        self.send(msg.BatchOut(outputs, len(self.scheduler.running), len(self.scheduler.waiting)))

    def _output(self, req: Req) -> msg.ReqOutput:
        t = self.tracked[req.rid]
        if req.finished:
            del self.tracked[req.rid]
        start = t.sent_tokens
        t.sent_tokens = len(req.output_ids)
        out = msg.ReqOutput(
            rid=req.rid,
            new_token_ids=req.output_ids[start:],
            finished_reason=req.finished_reason,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=max(req.cached_tokens, 0),
        )
        if req.return_logprob:
            out.output_token_logprobs = req.output_token_logprobs[start:]
            out.output_top_logprobs = req.output_top_logprobs[start:]
            if not t.sent_input_logprobs:
                t.sent_input_logprobs = True
                out.input_token_logprobs = req.input_token_logprobs
                out.input_top_logprobs = req.input_top_logprobs
        return out

    def server_info(self) -> dict[str, Any]:
        return {
            "scheduler_pid": os.getpid(),
            "model_path": str(self.model_dir),
            "num_tracked": len(self.tracked),
            **self.scheduler.info(),
        }

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=1000)
        self.ctx.term()


def run_scheduler_process(server_args: ServerArgs, model_dir: Path, in_addr: str, out_addr: str) -> None:
    """Process entry point. Exits non-zero on any error not tied to one request, so the HTTP
    process's watchdog notices and shuts the server down instead of serving a broken engine."""
    # Ctrl-C reaches the whole process group; the HTTP process decides when this one stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
