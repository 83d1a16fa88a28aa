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

from radixlm_runtime.constrained.constraint import MAX_JSON_DEPTH, nesting_exceeds
from radixlm_runtime.io.limits import InvalidRequest
from radixlm_runtime.server.errors import RequestError

T = TypeVar("T")

_AT_FIELD = re.compile(r"at `\$\.?([\w.\[\]]*)`")
_NAMED_FIELD = re.compile(r"(?:unknown|missing required) field `([^`]+)`")
# How often a non-streaming handler checks whether its client went away.
DISCONNECT_POLL_S = 0.5
# Bodies larger than this are decoded on a worker thread, so the event loop keeps serving.
INLINE_DECODE_BYTES = 256 * 1024
# A JSON string (optionally a key, with its colon) or a bracket: the tokens that matter for nesting.
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"\s*:?|[\[\]{}]')


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
    400s naming the field, a body that is not JSON text (including invalid UTF-8) a 400, and one
    nested deeper than MAX_JSON_DEPTH a 400 naming the top-level field that holds the nesting."""
    require_json(request)
    body = await read_body(request, limit)
    if not body.strip():
        raise RequestError("request body is empty; expected a JSON object")
    if len(body) > INLINE_DECODE_BYTES:
        return await asyncio.to_thread(decode_body, body, kind)
    return decode_body(body, kind)


def decode_body(body: bytes, kind: type[T]) -> T:
    """parse_body's decoding and checks, after the body is read. The nesting is checked on the
    parsed JSON first, before the request type's validation walks it."""
    try:
        body.decode()  # JSON text is UTF-8, in the fields the request type skips too
        parsed = msgspec.json.decode(body)
    except RecursionError:  # the decoder's own bound, far past MAX_JSON_DEPTH
        raise too_deep(_key_too_deep(body)) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}") from None
    fields = parsed.items() if isinstance(parsed, dict) else [(None, parsed)]
    for name, value in fields:
        if nesting_exceeds(value, MAX_JSON_DEPTH - (name is not None)):
            raise too_deep(name)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        named = _NAMED_FIELD.search(text)
        at = _AT_FIELD.search(text)
        param = named.group(1) if named else at.group(1) if at and at.group(1) else None
        raise RequestError(f"invalid request: {text}", param=param) from None


def invalid(err: ValueError) -> RequestError:
    """A request builder's ValueError (io/request_builder.py) as the 400 the HTTP layers answer:
    an InvalidRequest names its field and code, any other names the field its message starts with."""
    if isinstance(err, InvalidRequest):
        return RequestError(str(err), param=err.param, code=err.code)
    return RequestError.from_value_error(err)


def too_deep(param: str | None) -> RequestError:
    where = f"{param}: " if param else ""
    return RequestError(
        f"{where}JSON nested deeper than the limit of {MAX_JSON_DEPTH} levels of objects and arrays",
        param=param,
        code="json_too_deep",
    )


def _key_too_deep(body: bytes) -> str | None:
    """The top-level key under which body nests past MAX_JSON_DEPTH (None if the body is not an
    object): a scan of its strings and brackets, for bodies too deep for the decoder itself."""
    depth, key = 0, None
    for m in _JSON_TOKEN.finditer(body):
        token = m.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return key
        elif token in (b"]", b"}"):
            depth -= 1
        elif depth == 1 and token.endswith(b":"):
            key = msgspec.json.decode(token[:-1].rstrip())
    return key


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
