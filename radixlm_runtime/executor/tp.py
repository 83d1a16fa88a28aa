"""Tensor parallelism (--tp-size N): rank 0, in the scheduler's process, is the `Executor`; ranks
1..N-1 are processes it starts, which only execute.

Each step rank 0 broadcasts the plan (msgspec/msgpack bytes on the group's gloo control channel, no
pickle), and then every rank runs the same `ModelRunner.launch` on it: the forward, whose collectives
meet because every rank makes them in the same order, and the sampler. Every rank samples rather than
rank 0 alone because that needs no more code and no more messages: the gathered logits are the same
bits on every rank, greedy picks and seeded draws (a pure function of seed and output index) are then
the same tokens, and under overlap scheduling (CUDA) each rank resolves the next plan's future tokens
from its own copy. Rank 0 alone answers the scheduler.

A rank that dies takes the rest down: rank 0 watches its workers' processes and, on one's exit, logs
it, kills the others and (in the server's scheduler process) exits non-zero, which the HTTP process's
watchdog turns into the server's exit; workers die with rank 0 (PR_SET_PDEATHSIG, and their
collectives fail once its sockets close).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from radixlm_runtime.config import EngineConfig
from radixlm_runtime.distributed.group import TPGroup
from radixlm_runtime.executor.model_runner import ModelRunner, resolve_device
from radixlm_runtime.executor.step_io import StepOutputs
from radixlm_runtime.step import StepPlan, StepResult
from radixlm_runtime.utils.logging import get_logger, setup_logging
from radixlm_runtime.utils.process import die_with_parent

logger = get_logger(__name__)

# How long close() waits for the workers to leave after the stop message before killing them.
STOP_TIMEOUT_S = 10.0


def _encode_extra(obj: Any) -> Any:
    """A constraint's allowed-token bitmask (numpy int32) goes as its bytes."""
    if isinstance(obj, np.ndarray):
        return obj.astype("<i4", copy=False).tobytes()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot send {type(obj).__name__} in a step plan")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_extra)
_DECODER = msgspec.msgpack.Decoder(StepPlan)


def encode_plan(plan: StepPlan) -> bytes:
    return _ENCODER.encode(plan)


def decode_plan(data: bytes) -> StepPlan:
    plan = _DECODER.decode(data)
    for item in plan.items:
        for spec in item.samples:
            if isinstance(spec.allowed, bytes):
                spec.allowed = np.frombuffer(spec.allowed, dtype="<i4").astype(np.int32)
    return plan


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """A rank's own config: its GPU (cuda:rank), or on CPU its share of the cores by default."""
    if resolve_device(config.device).type == "cuda":
        return dataclasses.replace(config, device=f"cuda:{rank}")
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // config.tp_size)
    return dataclasses.replace(config, num_threads=threads)


def _die_with_parent(parent: int) -> None:
    """The kernel kills this worker when rank 0 dies, however it dies (elsewhere than Linux the
    collectives fail once rank 0 is gone)."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(1)


def run_worker(
    rank: int,
    port: int,
    model_dir: Path,
    config: EngineConfig,
    max_step_tokens: int,
    log_level: str,
    parent: int,
) -> None:
    """Process entry of ranks 1..N-1: builds its part of the model, then runs each plan rank 0 sends
    until the stop message (an empty one)."""
    _die_with_parent(parent)
    # Ctrl-C and a supervisor's SIGTERM to the process group are rank 0's to act on (it stops us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(log_level)
    try:
        store = TPGroup.connect_store(port, config.tp_size)
        group = TPGroup.join(rank, config.tp_size, store, resolve_device(config.device))
        runner = ModelRunner(model_dir, config, max_step_tokens, group)
        logger.info("tensor-parallel rank %d/%d ready", rank, config.tp_size)
        while data := group.recv_bytes():
            try:
                runner.run(decode_plan(data))
            except Exception:  # as on rank 0, whose scheduler aborts the step's requests and goes on
                logger.exception("tensor-parallel rank %d: step failed", rank)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)


class TensorParallelExecutor:
    """Rank 0 of --tp-size ranks, as the scheduler's `Executor`. exit_on_rank_death: exit the process
    (status 1) when a worker dies (the server's scheduler process); otherwise later steps raise."""

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        max_step_tokens: int,
        log_level: str = "info",
        exit_on_rank_death: bool = False,
    ) -> None:
        if resolve_device(config.device).type == "cuda" and torch.cuda.device_count() < config.tp_size:
            raise ValueError(
                f"tp_size {config.tp_size} needs one GPU a rank; {torch.cuda.device_count()} are visible"
            )
        self.store = TPGroup.open_store(config.tp_size)
        ctx = mp.get_context("spawn")
        self.workers = [
            ctx.Process(
                target=run_worker,
                args=(
                    rank,
                    self.store.port,
                    model_dir,
                    rank_config(config, rank),
                    max_step_tokens,
                    log_level,
                    os.getpid(),
                ),
                name=f"radixlm-tp{rank}",
            )
            for rank in range(1, config.tp_size)
        ]
        for worker in self.workers:
            worker.start()
        self.exit_on_rank_death = exit_on_rank_death
        self.failure: str | None = None
        self._closing = False
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="radixlm-tp-monitor", daemon=True).start()
        try:
            device = resolve_device(rank_config(config, 0).device)
            self.group = TPGroup.join(0, config.tp_size, self.store, device)
            self.runner = ModelRunner(model_dir, rank_config(config, 0), max_step_tokens, self.group)
        except BaseException:
            self._closing = True
            self._kill_workers()
            raise
        self.info = self.runner.info
        logger.info(
            "tensor parallelism: %d ranks (%s), worker pids %s",
            config.tp_size,
            self.group.group.name(),
            [w.pid for w in self.workers],
        )

    def _watch(self) -> None:
        """Waits for any worker to exit; unless we are closing, that is a failure of the whole group."""
        dead = multiprocessing.connection.wait([w.sentinel for w in self.workers])
        if self._closing:
            return
        worker = next(w for w in self.workers if w.sentinel in dead)
        worker.join(1)
        self.failure = (
            f"tensor-parallel rank {self.workers.index(worker) + 1} (pid {worker.pid}) exited with code "
            f"{worker.exitcode}; stopping the other ranks"
        )
        logger.error(self.failure)
        self._kill_workers()
        if self.exit_on_rank_death:
            logging.shutdown()
            os._exit(1)

    def _kill_workers(self) -> None:
        for worker in self.workers:
            if worker.is_alive():
                worker.kill()
        for worker in self.workers:
            worker.join()

    # -- the Executor protocol ---------------------------------------------------------------
    def launch(self, plan: StepPlan) -> StepOutputs:
        if self.failure is not None:
            raise RuntimeError(self.failure)
        self.group.send_bytes(encode_plan(plan))
        return self.runner.launch(plan)

    def collect(self, handle: StepOutputs) -> StepResult:
        return self.runner.collect(handle)

    def run(self, plan: StepPlan) -> StepResult:
        return self.collect(self.launch(plan))

    def close(self) -> None:
        """Stops the workers (the stop message, then by force) and leaves the group; idempotent."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        if self.failure is None and all(w.is_alive() for w in self.workers):
            self.group.send_bytes(b"")
            for worker in self.workers:
                worker.join(STOP_TIMEOUT_S)
        self._kill_workers()
