"""Request-body reading and response helpers shared by the native and the OpenAI endpoints."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from radixlm_runtime.server.errors import RequestError

T = TypeVar("T")

_AT_FIELD = re.compile(r"at `\$\.?([\w.\[\]]*)`")
_NAMED_FIELD = re.compile(r"(?:unknown|missing required) field `([^`]+)`")
# How often a non-streaming handler checks whether its client went away.
DISCONNECT_POLL_S = 0.5


async def read_body(request: Request, limit: int) -> bytes:
    """Reads the body, refusing it (413) as soon as it exceeds `limit` bytes."""
    too_big = RequestError(
        f"request body exceeds the limit of {limit} bytes (--max-request-bytes)",
        status=413,
        param="max_request_bytes",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def require_json(request: Request) -> None:
    """Refuses (415) a body not declared as JSON. A cross-site form or `fetch` may POST text/plain
    without a CORS preflight; requiring application/json means a browser must ask first."""
    media_type, _, params = request.headers.get("content-type", "").partition(";")
    charset = params.strip().lower().removeprefix("charset=").strip('"') if params.strip() else "utf-8"
    if media_type.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise RequestError(
            "Content-Type must be application/json (optionally with charset=utf-8), got "
            f"{request.headers.get('content-type')!r}",
            status=415,
            param="Content-Type",
            code="unsupported_media_type",
        )


async def parse_body(request: Request, limit: int, kind: type[T]) -> T:
    """Decodes a JSON body into a msgspec Struct; type errors and unknown or missing fields become
    400s naming the field, and a body that is not JSON text (including invalid UTF-8) a 400."""
    require_json(request)
    body = await read_body(request, limit)
    if not body.strip():
        raise RequestError("request body is empty; expected a JSON object")
    try:
        body.decode()  # JSON text is UTF-8, in the fields the request type skips too
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        named = _NAMED_FIELD.search(text)
        at = _AT_FIELD.search(text)
        param = named.group(1) if named else at.group(1) if at and at.group(1) else None
        raise RequestError(f"invalid request: {text}", param=param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def sse_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def sse_stream(request: Request, chunks: AsyncIterator[bytes]) -> Response:
    """Streams chunks as SSE, then [DONE]. The response starts only once the first chunk is ready,
    so a request refused before its first token (e.g. a regex its tokenizer cannot spell) still
    gets its 4xx status; a RequestError later becomes an error event."""
    step = asyncio.ensure_future(anext(chunks, None))
    try:
        first = await unless_disconnected(request, step)
    except BaseException:
        await asyncio.wait({step})  # a cancelled step first unwinds the stream, aborting its requests
        await chunks.aclose()  # type: ignore[attr-defined]
        raise

    async def rest() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first
                async for chunk in chunks:
                    yield chunk
        except RequestError as e:
            yield sse(e.body())
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        yield SSE_DONE

    return sse_response(rest())


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs work, cancelling it (which aborts its requests and frees their KV) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise RequestError("client disconnected", status=499)
    finally:
        task.cancel()
