"""The scheduler process's loop when steps run nothing (a stall): it must neither flood the HTTP
process with empty outputs (which starved its event loop: /server_info and SIGTERM went unanswered)
nor stay silent about it, in its log and in its health probes."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from radixlm_runtime.io import messages as msg
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.server import scheduler_process
from radixlm_runtime.server.scheduler_process import SchedulerProcess
from radixlm_runtime.server_args import ServerArgs


def test_a_stalled_step_sends_nothing_and_logs_once(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = zmq.Context()
    to_sched, from_sched = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    in_port = to_sched.bind_to_random_port("tcp://127.0.0.1")
    out_port = from_sched.bind_to_random_port("tcp://127.0.0.1")
    args = ServerArgs.from_kwargs(model_path=str(tiny_llama_dir), dtype="float32", max_total_tokens=256)
    proc = SchedulerProcess(args, tiny_llama_dir, f"tcp://127.0.0.1:{in_port}", f"tcp://127.0.0.1:{out_port}")
    try:
        proc.scheduler.submit(msg.GenerateReq("r", [1, 2, 3], SamplingParams(max_new_tokens=2)))
        # Admission that can never place the request: every step runs nothing.
        monkeypatch.setattr(proc.scheduler.admission, "schedule", lambda: [])
        monkeypatch.setattr(scheduler_process, "STALL_WARN_S", 0.0)
        # Attached to the module's logger itself: the package's logging setup (run by other tests)
        # stops propagation to the root logger caplog listens on.
        scheduler_process.logger.addHandler(caplog.handler)
        try:
            assert not any(proc._step() for _ in range(50))
        finally:
            scheduler_process.logger.removeHandler(caplog.handler)
        sent = []
        while from_sched.poll(200):
            sent.append(msg.decode_from_scheduler(from_sched.recv()))
        # One message for the waiting request's queue size, none for the 49 empty steps after it.
        assert [(type(m), m.outputs, m.num_waiting) for m in sent] == [(msg.BatchOut, [], 1)]
        # A stalled loop still answers health probes, and fails them (a supervisor restarts it).
        proc._handle(msg.HealthProbe(7))
        assert from_sched.poll(2000)
        answer = msg.decode_from_scheduler(from_sched.recv())
        assert isinstance(answer, msg.CallResult) and answer.call_id == 7 and not answer.ok
        assert answer.info["stalled_s"] > 0.0
        # Each record once, whether or not it also reached caplog through the root logger.
        stalls = list({id(r): r for r in caplog.records if "no step has run" in r.getMessage()}.values())
        assert len(stalls) == 1 and "1 waiting" in stalls[0].getMessage()
    finally:
        proc.close()
        to_sched.close(linger=0)
        from_sched.close(linger=0)
        ctx.term()
