"""Graceful shutdown. On SIGTERM the server stops admitting (every new request gets 503), lets the
running ones finish for up to --shutdown-timeout seconds, then ends those left with finish reason
abort, so every client still gets a complete response (a stream's final event and [DONE]); only
then does uvicorn close the connections and the scheduler process stop."""

from __future__ import annotations

import asyncio
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from radixlm_runtime.server.errors import RequestError
from radixlm_runtime.server.tokenizer_manager import TokenizerManager
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

# How long the responses ended by the drain get to write their last events.
FLUSH_S = 5.0
POLL_S = 0.05


class Drain:
    """The HTTP requests in flight, and whether the server is draining."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0

    async def run(self, tm: TokenizerManager, timeout_s: float) -> None:
        """Stops admitting, waits up to timeout_s for the requests in flight, then ends the rest."""
        self.draining = True
        logger.info(
            "shutting down: new requests get 503; waiting up to %.0fs for %d in flight (--shutdown-timeout)",
            timeout_s,
            self.active,
        )
        if await self._idle_within(timeout_s):
            return
        ended = tm.abort_all()
        logger.warning("--shutdown-timeout passed: ended %d running requests with finish reason abort", ended)
        if not await self._idle_within(FLUSH_S):
            logger.warning("%d requests still open after the drain; closing them", self.active)

    async def _idle_within(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return not self.active


class DrainGate:
    """ASGI middleware: counts the HTTP requests in flight (a stream until its last byte) and, once
    draining, answers new ones 503 with Connection: close, /health included."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            err = RequestError(
                "the server is shutting down",
                status=503,
                code="shutting_down",
                headers={"Connection": "close"},
            )
            await JSONResponse(err.body(), status_code=503, headers=err.headers)(scope, receive, send)
            return
        self.drain.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.active -= 1
