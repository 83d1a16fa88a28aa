"""Wires the runtime below the tokenizer, as both the offline Engine and the server's scheduler
process run it: the model executor, and the scheduler that drives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixlm_runtime.executor.model_runner import ModelRunner
from radixlm_runtime.executor.tp import TensorParallelExecutor
from radixlm_runtime.io.tokenizer import eos_token_ids
from radixlm_runtime.scheduler.scheduler import Scheduler
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.step import Executor


def build_executor(model_dir: Path, args: ServerArgs, exit_on_rank_death: bool = False) -> Executor:
    """The model executor: one process, or rank 0 of --tp-size ranks (see executor/tp.py for
    exit_on_rank_death)."""
    budget = args.scheduler.chunked_prefill_size
    if args.engine.tp_size > 1:
        return TensorParallelExecutor(model_dir, args.engine, budget, args.log_level, exit_on_rank_death)
    return ModelRunner(model_dir, args.engine, budget)


def build_scheduler(
    model_dir: Path, args: ServerArgs, tokenizer: Any, exit_on_rank_death: bool = False
) -> Scheduler:
    runner = build_executor(model_dir, args, exit_on_rank_death)
    eos = frozenset(eos_token_ids(tokenizer, list(runner.info.eos_token_ids)))
    return Scheduler(runner, args.scheduler, tokenizer, eos)
