"""The router's HTTP front: generation requests go to the replica `Router` chooses, streamed through
as they come; the rest go to any healthy replica, or to all of them (flush_cache).

A replica that cannot be reached is taken out at once (the request gets a 503 naming it, or, mid
stream, an error event) and put back when its /health answers again; a background task checks every
replica every --health-check-interval-s seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from radixlm_runtime.config import RouterConfig
from radixlm_runtime.router.policy import NoReplica, Replica, Router
from radixlm_runtime.utils.logging import get_logger

logger = get_logger("radixlm_runtime.router")

GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
# Headers passed on to a replica, and back from it.
FORWARDED = ("authorization", "content-type", "accept")
RETURNED = ("content-type", "retry-after", "cache-control")
HEALTH_TIMEOUT_S = 5.0


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def routing_text(path: str, body: dict[str, Any]) -> str:
    """The part of a request that the replica's cache keys on, as text: the prompt (the first of a
    batch), or the chat messages in order."""
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(
            f"{m.get('role')}\n{json.dumps(m.get('content'), ensure_ascii=False)}\n"
            for m in messages
            if isinstance(m, dict)
        )
    prompt = body.get("text" if path == "/generate" else "prompt")
    if prompt is None and path == "/generate":
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids
        return ",".join(map(str, prompt))
    return prompt if isinstance(prompt, str) else ""


class RouterMetrics:
    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        counter = partial(Counter, labelnames=["replica"], registry=self.registry)
        gauge = partial(Gauge, labelnames=["replica"], registry=self.registry)
        self.requests = counter("radixlm_router_requests", "Requests routed to each replica.")
        self.failed = counter(
            "radixlm_router_failed_requests",
            "Requests that could not reach their replica (taken out until healthy).",
        )
        self.in_flight = gauge("radixlm_router_in_flight", "Requests in flight at each replica.")
        self.healthy = gauge("radixlm_router_replica_healthy", "1 while the replica is routed to.")
        self.hit_rate = gauge(
            "radixlm_router_prefix_hit_rate",
            "Share of the text routed to each replica that its approximate tree already held.",
        )
        self.router = router

    def render(self) -> bytes:
        for r in self.router.replicas:
            self.in_flight.labels(r.url).set(r.in_flight)
            self.healthy.labels(r.url).set(int(r.healthy))
            self.hit_rate.labels(r.url).set(r.matched_chars / r.chars if r.chars else 0.0)
        return generate_latest(self.registry)


def create_router_app(config: RouterConfig) -> FastAPI:
    router = Router(config)
    metrics = RouterMetrics(router)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=None)
    )

    async def check(replica: Replica) -> None:
        try:
            ok = (await client.get(f"{replica.url}/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok != replica.healthy:
            logger.warning("replica %s is %s", replica.url, "back" if ok else "unhealthy: routed around")
        replica.healthy = ok

    async def health_loop() -> None:
        while True:
            await asyncio.gather(*(check(r) for r in router.replicas))
            await asyncio.sleep(config.health_check_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            await client.aclose()

    app = FastAPI(lifespan=lifespan)
    app.state.router = router

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Response:
        keyed = config.api_key and request.url.path != "/health"
        if keyed and request.headers.get("authorization") != f"Bearer {config.api_key}":
            return _error(401, "missing or wrong API key", "authentication_error")
        return await call_next(request)

    def unreachable(replica: Replica, e: Exception) -> str:
        replica.healthy = False
        replica.failed += 1
        metrics.failed.labels(replica.url).inc()
        logger.warning("replica %s unreachable (%s): routed around until healthy", replica.url, e)
        return f"replica {replica.url} is unreachable: {type(e).__name__}"

    async def forward(request: Request, replica: Replica, body: bytes, release: bool) -> Response:
        """Sends the request to `replica` and streams its answer back; `release`: the router
        counted it in flight there. A replica that cannot be reached answers 503."""
        try:
            resp = await send(request, replica, body)
        except httpx.HTTPError as e:
            if release:
                router.done(replica)
            return _error(503, unreachable(replica, e), "replica_unavailable")
        return relay(resp, replica, release)

    async def send(request: Request, replica: Replica, body: bytes) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        upstream = client.build_request(
            request.method, replica.url + request.url.path, content=body, headers=headers
        )
        return await client.send(upstream, stream=True)

    def relay(resp: httpx.Response, replica: Replica, release: bool) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                message = unreachable(replica, e)
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    yield f"data: {json.dumps({'error': {'message': message, 'code': 503}})}\n\n".encode()
            finally:
                await resp.aclose()
                if release:
                    router.done(replica)

        returned = {k: v for k, v in resp.headers.items() if k.lower() in RETURNED}
        return StreamingResponse(chunks(), status_code=resp.status_code, headers=returned)

    async def read_json(request: Request) -> tuple[bytes, dict[str, Any]] | JSONResponse:
        if int(request.headers.get("content-length") or 0) > config.max_request_bytes:
            return _error(413, f"body: larger than {config.max_request_bytes} bytes", "invalid_request_error")
        body = await request.body()
        if len(body) > config.max_request_bytes:
            return _error(413, f"body: larger than {config.max_request_bytes} bytes", "invalid_request_error")
        try:
            parsed = json.loads(body)
        except ValueError:
            return _error(400, "body: not valid JSON", "invalid_request_error")
        if not isinstance(parsed, dict):
            return _error(400, "body: must be a JSON object", "invalid_request_error")
        return body, parsed

    async def generate(request: Request) -> Response:
        """Routes a generation request. One whose replica refuses the connection never reached it,
        so it goes to the next choice (the replica is routed around until healthy); a failure after
        the request was sent is a 503, since the replica may have started on it."""
        read = await read_json(request)
        if isinstance(read, JSONResponse):
            return read
        body, parsed = read
        session = parsed.get("session_id")
        text = routing_text(request.url.path, parsed)
        while True:
            try:
                replica = router.choose(text, session if isinstance(session, str) else None)
            except NoReplica as e:
                return _error(503, str(e), "replica_unavailable")
            metrics.requests.labels(replica.url).inc()
            try:
                resp = await send(request, replica, body)
            except httpx.ConnectError as e:
                router.done(replica)
                unreachable(replica, e)
                continue
            except httpx.HTTPError as e:
                router.done(replica)
                return _error(503, unreachable(replica, e), "replica_unavailable")
            return relay(resp, replica, release=True)

    for path in GENERATE_PATHS:
        app.add_api_route(path, generate, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        live = len(router.healthy())
        return JSONResponse({"healthy_replicas": live}, status_code=200 if live else 503)

    @app.get("/server_info")
    async def server_info() -> Response:
        async def one(r: Replica) -> dict[str, Any]:
            info: dict[str, Any] = {
                "url": r.url,
                "healthy": r.healthy,
                "in_flight": r.in_flight,
                "routed": r.routed,
                "failed": r.failed,
                "prefix_hit_rate": r.matched_chars / r.chars if r.chars else 0.0,
            }
            if r.healthy:
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    info["server_info"] = (
                        await client.get(f"{r.url}/server_info", timeout=HEALTH_TIMEOUT_S)
                    ).json()
            return info

        replicas = await asyncio.gather(*(one(r) for r in router.replicas))
        return JSONResponse({"router_policy": config.router_policy, "replicas": list(replicas)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """Flushes every healthy replica and forgets what each was sent."""
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        live = router.healthy()
        answers = await asyncio.gather(
            *(client.post(f"{r.url}/flush_cache", headers=headers) for r in live), return_exceptions=True
        )
        ok = all(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers)
        for r in live:
            r.tree.reset()
        return JSONResponse({"flushed": ok, "replicas": len(live)}, status_code=200 if ok else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def anything_else(request: Request, path: str) -> Response:
        """Model info, tokenize, /v1/models...: any healthy replica answers (they serve one model)."""
        live = router.healthy()
        if not live:
            return _error(503, "no replica is healthy", "replica_unavailable")
        body = await request.body()
        if len(body) > config.max_request_bytes:
            return _error(413, f"body: larger than {config.max_request_bytes} bytes", "invalid_request_error")
        return await forward(request, min(live, key=lambda r: r.in_flight), body, release=False)

    return app
