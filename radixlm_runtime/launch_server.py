"""Starts the HTTP server: `python -m radixlm_runtime.launch_server [flags]` or `radixlm-server [flags]`.

Two processes: this one (FastAPI + tokenizer manager) and the scheduler process (model + KV cache).
This process owns the scheduler's lifetime: on SIGINT/SIGTERM it drains (server/drain.py), then stops
it and exits 0; it exits non-zero when the scheduler dies, so a supervisor restarts the pair instead
of talking to a half-dead server.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType

import uvicorn

from radixlm_runtime.models.loader import default_model_path, resolve_model_path
from radixlm_runtime.router.replicas import serve_data_parallel
from radixlm_runtime.server.http_server import create_app
from radixlm_runtime.server.tokenizer_manager import TokenizerManager
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger, setup_logging

logger = get_logger("radixlm_runtime.launch_server")

# Seconds uvicorn waits for open connections once the drain is over, before closing them.
GRACEFUL_SHUTDOWN_S = 3


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM/SIGINT drains before uvicorn shuts down; a second
    signal (or one before the server started) shuts down at once, as uvicorn does."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or not self.started:
            super().handle_exit(sig, frame)
            return
        # A signal handler interrupts the loop at any point: start the drain from the loop itself.
        asyncio.get_running_loop().call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        async def drain_then_exit() -> None:
            try:
                await self._drain()
            finally:
                uvicorn.Server.handle_exit(self, sig, None)

        if self._drain_task is None:
            self._drain_task = asyncio.create_task(drain_then_exit())


def _stop_on_signal(signum: int, _frame: FrameType | None) -> None:
    """Turns SIGTERM/SIGINT into SystemExit so `finally` blocks stop the scheduler process. uvicorn
    handles the signal itself while serving and re-raises it once it has shut down, landing here."""
    raise SystemExit(0)


def served_model_name(args: ServerArgs) -> str:
    if args.server.served_model_name:
        return args.server.served_model_name
    return Path(args.engine.model_path or default_model_path()).name.removesuffix(".gguf")


async def _serve(tm: TokenizerManager, args: ServerArgs) -> int:
    app = create_app(tm, served_model_name(args))
    config = uvicorn.Config(
        app,
        host=args.server.host,
        port=args.server.port,
        loop="asyncio",
        log_level="warning" if args.log_level == "info" else args.log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = DrainingServer(config, lambda: app.state.drain.run(tm, args.server.shutdown_timeout))
    exit_code = 0

    def on_scheduler_death() -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        logger.info("radixlm server ready at http://%s:%d", args.server.host, args.server.port)

    tm.start_background(on_scheduler_death)
    announcer = asyncio.create_task(announce())
    await server.serve()
    announcer.cancel()
    return exit_code


def launch(args: ServerArgs) -> int:
    """Runs the server until a signal (exit code 0) or the scheduler's death (exit code 1)."""
    setup_logging(args.log_level)
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGINT, _stop_on_signal)
    model_dir = resolve_model_path(args.engine.model_path)
    tm = TokenizerManager(args, model_dir)
    try:
        ready = tm.start_scheduler()
        logger.info("scheduler process %d ready (KV pool %d tokens)", ready.pid, ready.max_total_tokens)
        return asyncio.run(_serve(tm, args))
    finally:
        # A second signal must not interrupt the clean-up and leave the scheduler behind.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        tm.shutdown()
        logger.info("server stopped")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="radixlm-server",
        description="Serve a model over HTTP with SGLang's native API and an OpenAI-compatible API.",
    )
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
    try:
        if args.server.dp_size > 1 or args.server.ray_address is not None:
            setup_logging(args.log_level)
            signal.signal(signal.SIGTERM, _stop_on_signal)
            signal.signal(signal.SIGINT, _stop_on_signal)
            code = serve_data_parallel(args, sys.argv[1:] if argv is None else argv)
        else:
            code = launch(args)
    except SystemExit as e:  # a signal, or uvicorn failing to bind
        code = e.code if isinstance(e.code, int) else 1
    # Everything is shut down by now; skip the interpreter's final garbage collection of the
    # model-sized object graph, which takes seconds and would delay a supervisor's restart.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
