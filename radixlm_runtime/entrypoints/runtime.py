"""Wires the runtime below the tokenizer, as both the offline Engine and the server's scheduler
process run it: the model executor, and the scheduler that drives it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixlm_runtime.executor.model_runner import ModelRunner
from radixlm_runtime.io.tokenizer import eos_token_ids
from radixlm_runtime.scheduler.scheduler import Scheduler
from radixlm_runtime.server_args import ServerArgs


def build_scheduler(model_dir: Path, args: ServerArgs, tokenizer: Any) -> Scheduler:
    runner = ModelRunner(model_dir, args.engine, args.scheduler.chunked_prefill_size)
    eos = frozenset(eos_token_ids(tokenizer, list(runner.info.eos_token_ids)))
    return Scheduler(runner, args.scheduler, tokenizer, eos)
