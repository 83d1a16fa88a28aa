"""The FastAPI app: SGLang's native endpoints, the OpenAI-compatible ones, auth and error handling."""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from radixlm_runtime.io import outputs
from radixlm_runtime.io.inputs import check_session_id
from radixlm_runtime.io.messages import GenerateReq, ProgramCall
from radixlm_runtime.io.request_builder import PromptArgs, PromptRequest, native_prompts
from radixlm_runtime.server import dashboard
from radixlm_runtime.server import http_utils as hu
from radixlm_runtime.server.drain import Drain, DrainGate
from radixlm_runtime.server.errors import RequestError
from radixlm_runtime.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixlm_runtime.server.openai_api import build_openai_router
from radixlm_runtime.server.tokenize_api import build_tokenize_router
from radixlm_runtime.server.tokenizer_manager import (
    RequestState,
    TokenizerManager,
    gather_cancelling,
    merge_streams,
    new_rid,
)
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

# Endpoints that answer without an API key: load balancers probe them.
PUBLIC_PATHS = frozenset({"/health"})
# The dashboard's page and files load without the key; its feeds need it (server/dashboard.py).
PUBLIC_PATHS |= dashboard.PUBLIC_PATHS


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of POST /generate (SGLang's GenerateReqInput). Prompt fields are checked by hand because
    they take a single prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    # One value for the batch, or a list with one per prompt.
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # A program session: the KV of each finished sequence stays pinned for the session's next call.
    session_id: str | None = None
    # One for the batch or one per prompt; orders admission under --enable-priority-scheduling.
    priority: int | list[int] | None = None
    # radixlm's extension: the program call graph node this request is (the dashboard's programs view).
    program_call: ProgramCall | None = None


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    rid: str


class CloseSessionRequest(msgspec.Struct, forbid_unknown_fields=True):
    session_id: str


class ApiKeyMiddleware:
    """Requires 'Authorization: Bearer <key>' on every path but PUBLIC_PATHS. Plain ASGI rather than
    BaseHTTPMiddleware, so streaming responses and client-disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = RequestError(
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    status=401,
                    code="invalid_api_key",
                )
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(tm: TokenizerManager, model_name: str) -> FastAPI:
    """The app; app.state.drain is what a graceful shutdown runs (server/drain.py)."""
    args = tm.args.server
    app = FastAPI(title="radixlm server", docs_url=None, redoc_url=None, openapi_url=None)

    if args.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    # Outermost: while draining, every request is refused before anything else runs.
    app.state.drain = Drain()
    app.add_middleware(DrainGate, drain=app.state.drain)

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(RequestError(str(err.detail), status=err.status_code).body(), err.status_code)

    @app.exception_handler(ClientDisconnect)
    async def on_client_disconnect(request: Request, _: ClientDisconnect) -> Response:
        """The client hung up while sending its body: nobody is left to answer, nothing ran."""
        logger.debug("client disconnected while sending its request to %s", request.url.path)
        tm.metrics.disconnected_before_admission()
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, err: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s", request.url.path)
        return JSONResponse(RequestError(f"internal error: {err}", status=500).body(), status_code=500)

    # -- health and info ----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if tm.dead:
            return JSONResponse(RequestError("scheduler process died", status=503).body(), status_code=503)
        await tm.probe()
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        probe = PromptArgs(tm.tokenize("Hi"), {"max_new_tokens": 1}, rid=f"health-{new_rid()}")
        (built,) = await tm.run_cpu(tm.build, [probe])
        state = await tm.run(built.samples[0])
        if state.finished_reason is not None and state.finished_reason.kind == "abort":
            raise RequestError("health generation was aborted", status=503)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": str(tm.model_dir),
            "tokenizer_path": str(tm.model_dir),
            "served_model_name": model_name,
            "is_generation": True,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        info = await tm.server_info()
        return info | {
            "served_model_name": model_name,
            "num_inflight_requests": len(tm.states),
            "max_queued_requests": args.max_queued_requests,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        # The KV figures come from the scheduler process; a scrape while it cannot answer still
        # gets every metric this process keeps (and the KV ones as last seen).
        with contextlib.suppress(Exception):
            tm.metrics.kv.observe(await tm.server_info())
        return Response(tm.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        if not await tm.flush_cache():
            raise RequestError("cannot flush the cache while requests are running; retry when idle")
        return {"success": True}

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await hu.parse_body(request, args.max_request_bytes, AbortRequest)
        return {"success": tm.abort(body.rid)}

    @app.post("/close_session")
    async def close_session(request: Request) -> dict[str, Any]:
        """Releases a session's pinned KV. Like /abort_request, an unknown (or already closed or
        expired) session_id is no error: the answer is {"success": false}."""
        body = await hu.parse_body(request, args.max_request_bytes, CloseSessionRequest)
        _check_session_id(body.session_id)
        return {"success": await tm.close_session(body.session_id)}

    # -- generation ---------------------------------------------------------------------------
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await hu.parse_body(request, args.max_request_bytes, GenerateRequest)
        built, single = await _build(tm, body)
        jobs = [(prompt.rid, req) for prompt in built for req in prompt.samples]
        tm.check_capacity(len(jobs))
        single = single and len(jobs) == 1
        fmt = lambda st: native_output(tm, st, body.return_text_in_logprobs)
        if body.stream:
            return await hu.sse_stream(request, _native_stream(tm, jobs, single, fmt))
        runs = gather_cancelling([tm.run(req, base) for base, req in jobs])
        states = await hu.unless_disconnected(request, runs)
        outs = [fmt(st) for st in states]
        return JSONResponse(outs[0] if single else outs)

    app.include_router(build_openai_router(tm, model_name))
    app.include_router(build_tokenize_router(tm, model_name))
    dashboard.mount_dashboard(app, tm, model_name)
    return app


def _check_session_id(session_id: str) -> None:
    try:
        check_session_id(session_id)
    except ValueError as e:
        raise RequestError(str(e), param="session_id") from None


async def _build(tm: TokenizerManager, body: GenerateRequest) -> tuple[list[PromptRequest], bool]:
    """Tokenizes and checks every prompt of a /generate body (io/request_builder.py) before anything
    is sent, on the tokenizer threads."""

    def build() -> tuple[list[PromptRequest], bool]:
        prompts, single = native_prompts(
            body.text,
            body.input_ids,
            body.sampling_params,
            body.rid,
            body.return_logprob,
            body.logprob_start_len,
            body.top_logprobs_num,
            body.priority,
            body.session_id,
            partial(tm.tokenize, field="text"),
            "text",
            body.program_call,
            body.stream,
        )
        return tm.build(prompts), single

    try:
        return await tm.run_cpu(build)
    except ValueError as e:
        raise hu.invalid(e) from None


async def _native_stream(
    tm: TokenizerManager, jobs: list[tuple[str, GenerateReq]], single: bool, fmt: Any
) -> AsyncIterator[bytes]:
    """SSE chunks with the cumulative text of one request (plus "index" when several run)."""
    done: set[int] = set()
    streams = [tm.generate(req, True, base) for base, req in jobs]
    async with contextlib.aclosing(merge_streams(streams)) as merged:
        async for idx, st in merged:
            if idx in done:
                continue
            if st.finished:
                done.add(idx)
            out = fmt(st)
            if not single:
                out["index"] = idx
            yield hu.sse(out)


def native_output(tm: TokenizerManager, st: RequestState, text_in_logprobs: bool) -> dict[str, Any]:
    return outputs.native_output(st, st.text, tm.tokenizer, text_in_logprobs)
