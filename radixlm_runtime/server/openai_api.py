"""OpenAI-compatible endpoints (/v1/models, /v1/completions, /v1/chat/completions).

Requests are mapped onto SGLang's names (messages through the chat template, max_tokens as
max_new_tokens, response_format as a json_schema, ...) and built by the same request builder as
the native API (io/request_builder.py); only the request and response shapes differ, so both APIs
validate and schedule identically. Errors name the OpenAI request's fields (`_openai_names`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixlm_runtime.constrained.constraint import Constraint
from radixlm_runtime.io.inputs import LogprobArgs
from radixlm_runtime.io.messages import GenerateReq
from radixlm_runtime.io.outputs import json_logprob
from radixlm_runtime.io.request_builder import PromptArgs, PromptRequest
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.server import http_utils as hu
from radixlm_runtime.server import tool_calls as tc
from radixlm_runtime.server.errors import RequestError
from radixlm_runtime.server.reasoning import ReasoningParser, split_reasoning
from radixlm_runtime.server.tokenizer_manager import (
    DRAIN_ABORT,
    RequestState,
    TokenizerManager,
    gather_cancelling,
    merge_streams,
)

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# OpenAI field -> SamplingParams field, for fields passed through unchanged.
_PASSTHROUGH = {
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
    "regex": "regex",  # SGLang's extensions
    "ebnf": "ebnf",
}
# response_format {"type": "json_object"}: any JSON object, as a schema for the json_schema constraint.
JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})
_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    # Ignored: it asks for random padding against length side channels; without it the chunks are
    # the same text.
    include_obfuscation: bool | None = None


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True):
    """Fields shared by both endpoints (OpenAI's plus SGLang's extensions). `user` is ignored: it
    only tags the request for OpenAI's abuse monitoring."""

    model: str | None = None
    # vLLM's and SGLang's extension: orders admission under --enable-priority-scheduling.
    priority: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stop_token_ids: list[int] | None = None
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[Any] = ""
    logprobs: int | None = None
    echo: bool | None = None
    # Refused unless they ask for nothing: insertion and server-side ranking are not implemented.
    suffix: str | None = None
    best_of: int | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """A message as OpenAI defines it, so an SDK's `message.model_dump()` can be sent back."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # ignored: citations of a web search, not prompt text
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An answer of --reasoning-parser sent back: handed to the template, which may replay or drop it.
    reasoning_content: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    # Ignored (README, "API"): none of them changes the tokens generated here.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # Tool calling (tool_calls.py); the deprecated functions / function_call are refused unless they
    # ask for nothing.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's and SGLang's extension: variables for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused unless they ask for nothing (_check_unsupported_chat_fields).
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


@dataclass
class _Job:
    """One choice: sample `index` of a prompt (`req`, sent under the prompt's `base_rid`); `choice`
    is its index in the response."""

    req: GenerateReq
    base_rid: str
    index: int
    choice: int
    prompt_text: str = ""


def model_checker(tm: TokenizerManager, model_name: str) -> Callable[[str | None], None]:
    """Checks a request's `model`: the served name, or omitted, unless --allow-any-model-name."""

    def check(requested: str | None) -> None:
        if requested is None or requested == model_name or tm.args.server.allow_any_model_name:
            return
        raise model_not_found(requested)

    return check


def model_not_found(requested: str) -> RequestError:
    """OpenAI's answer to an unknown model: 404, type invalid_request_error, code model_not_found."""
    return RequestError(
        f"The model {requested!r} does not exist",
        status=404,
        param="model",
        code="model_not_found",
        kind="invalid_request_error",
    )


def build_openai_router(tm: TokenizerManager, model_name: str) -> APIRouter:
    router = APIRouter(prefix="/v1")
    limit = tm.args.server.max_request_bytes
    check_model = model_checker(tm, model_name)

    @router.get("/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "radixlm"}
        return {"object": "list", "data": [card | {"root": str(tm.model_dir), "max_model_len": _ctx(tm)}]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise model_not_found(model_id)
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "radixlm"}

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        body = await hu.parse_body(request, limit, CompletionRequest)
        _check_common(body)
        check_model(body.model)
        _check_unsupported_completion_fields(body)
        id_lists = await tm.run_cpu(_completion_prompts, tm, body.prompt)
        want_lp = body.logprobs is not None
        # echo with logprobs scores the prompt too: its logprobs from the first token on.
        lp = LogprobArgs(want_lp, 0 if body.echo and want_lp else -1, body.logprobs or 0)
        raw = _sampling_params(body, 16 if body.max_tokens is None else body.max_tokens)
        prompts = [
            PromptArgs(ids, raw, logprob=lp, priority=body.priority, stream=bool(body.stream))
            for ids in id_lists
        ]
        built = await _build(tm, prompts, "logprobs")
        tm.check_capacity(sum(len(p.samples) for p in built))
        jobs: list[_Job] = []
        for prompt in built:
            prompt_text = tm.tokenizer.decode(prompt.samples[0].input_ids) if body.echo else ""
            first = len(jobs)
            jobs.extend(
                _Job(req, prompt.rid, i, first + i, prompt_text) for i, req in enumerate(prompt.samples)
            )
        resp_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": resp_id, "object": "text_completion", "created": created, "model": model_name}
        fmt_lp = lambda job, st, start: _completion_logprobs(tm, job, st, start)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await hu.sse_stream(
                request, _stream(tm, jobs, base, include_usage, _completion_chunk(fmt_lp, want_lp))
            )
        states = await _run_all(request, tm, jobs)
        choices = [
            {
                "index": job.choice,
                "text": job.prompt_text + st.text,
                "logprobs": fmt_lp(job, st, 0) if want_lp else None,
                "finish_reason": _finish_reason(st),
            }
            for job, st in zip(jobs, states)
        ]
        return JSONResponse(base | {"choices": choices, "usage": _usage(jobs, states)})

    @router.post("/chat/completions")
    async def chat(request: Request) -> Response:
        body = await hu.parse_body(request, limit, ChatRequest)
        _check_common(body)
        check_model(body.model)
        _check_unsupported_chat_fields(body)
        plan = tc.parse_tool_request(
            body.tools, body.tool_choice, body.parallel_tool_calls, body.functions, body.function_call
        )
        if plan is not None and plan.calls:
            formatted = body.response_format is not None and body.response_format.type != "text"
            tc.check_compatible(
                plan, bool(body.logprobs), formatted, body.regex is not None, body.ebnf is not None
            )
        ids = await tm.run_cpu(
            render_chat_prompt, tm, body.messages, plan, template_kwargs=body.chat_template_kwargs
        )
        want_lp = bool(body.logprobs)
        if body.top_logprobs is not None and not want_lp:
            raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI's default: until end of sequence or the context fills up
            max_tokens = max(_max_total(tm) - len(ids), 0)
        raw = _sampling_params(body, max_tokens, _response_format_schema(body.response_format))
        lp = LogprobArgs(want_lp, -1, body.top_logprobs or 0)
        prompt = PromptArgs(
            ids, raw, logprob=lp, priority=body.priority, prompt_field="messages", stream=bool(body.stream)
        )
        (built,) = await _build(tm, [prompt], "top_logprobs")
        tm.check_capacity(len(built.samples))
        resp_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": resp_id, "object": "chat.completion", "created": created, "model": model_name}
        if plan is not None and plan.calls:
            await _check_call_schemas(tm, plan)
            loops = [_tool_loop(tm, plan, req) for req in built.samples]
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            if body.stream:
                chunk_base = base | {"object": "chat.completion.chunk"}
                return await hu.sse_stream(request, _tool_stream(loops, chunk_base, include_usage))
            outs = await hu.unless_disconnected(request, gather_cancelling([_final(lp) for lp in loops]))
            choices = [
                {"index": i, "message": out.message(), "logprobs": None, "finish_reason": out.finish_reason}
                for i, out in enumerate(outs)
            ]
            return JSONResponse(base | {"choices": choices, "usage": _tool_usage(outs)})
        jobs = [_Job(req, built.rid, i, i) for i, req in enumerate(built.samples)]
        fmt_lp = lambda st, start: _chat_logprobs(tm, st, start)
        reasoning = tm.args.server.reasoning_parser
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunk_base = base | {"object": "chat.completion.chunk"}
            make_chunk = _chat_chunk(fmt_lp, want_lp, reasoning)
            return await hu.sse_stream(request, _stream(tm, jobs, chunk_base, include_usage, make_chunk))
        states = await _run_all(request, tm, jobs)
        choices = [
            {
                "index": job.choice,
                "message": {"role": "assistant"} | _message_text(st.text, reasoning),
                "logprobs": fmt_lp(st, 0) if want_lp else None,
                "finish_reason": _finish_reason(st),
            }
            for job, st in zip(jobs, states)
        ]
        return JSONResponse(base | {"choices": choices, "usage": _usage(jobs, states)})

    return router


# -- request mapping --------------------------------------------------------------------------
def _ctx(tm: TokenizerManager) -> int:
    assert tm.ready is not None
    return tm.ready.context_length


def _max_total(tm: TokenizerManager) -> int:
    """Most tokens one sequence (prompt + output) may hold."""
    assert tm.ready is not None
    return min(tm.ready.context_length, tm.ready.max_total_tokens)


def _completion_prompts(tm: TokenizerManager, prompt: str | list[Any]) -> list[list[int]]:
    """OpenAI's four prompt forms: a string, strings, token ids, or lists of token ids."""
    is_id = lambda t: isinstance(t, int) and not isinstance(t, bool)
    if isinstance(prompt, str):
        lists = [tm.tokenize(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        lists = [tm.tokenize(p) for p in prompt]
    elif prompt and all(is_id(t) for t in prompt):
        lists = [list(prompt)]
    elif prompt and all(isinstance(p, list) and all(is_id(t) for t in p) for p in prompt):
        lists = [list(p) for p in prompt]
    else:
        raise RequestError(
            "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
            param="prompt",
        )
    return lists


def _sampling_params(
    body: _SamplingFields, max_tokens: int, json_schema: str | None = None
) -> dict[str, Any]:
    """The request's sampling fields under SGLang's names, for the request builder."""
    raw: dict[str, Any] = {"max_new_tokens": max_tokens}
    for src, dst in _PASSTHROUGH.items():
        value = getattr(body, src)
        if value is not None:
            raw[dst] = value
    if json_schema is not None:
        raw["json_schema"] = json_schema
    return raw


async def _build(tm: TokenizerManager, prompts: list[PromptArgs], logprobs_field: str) -> list[PromptRequest]:
    """The prompts' scheduler messages (io/request_builder.py); a refusal names the OpenAI field,
    `logprobs_field` the one that carried top_logprobs_num."""
    try:
        return await tm.run_cpu(tm.build, prompts)
    except ValueError as e:
        raise _openai_names(hu.invalid(e), logprobs_field=logprobs_field) from None


def _openai_names(
    err: RequestError, schema_field: str = "response_format", logprobs_field: str = "logprobs"
) -> RequestError:
    """Rewrites the native field names in a validation error into the OpenAI request's names; a
    refused json_schema is the `schema_field` that carried it (a tool call's: tools), and
    top_logprobs_num the `logprobs_field` (completions' logprobs, chat's top_logprobs)."""
    renamed = _RENAMED | {"top_logprobs_num": logprobs_field}
    # OpenAI's sampling fields are top-level: an error about the native sampling_params as a whole
    # (e.g. two constraints) names no field.
    param = (err.param or "").removeprefix("sampling_params").removeprefix(".")
    param = renamed.get(param, param)
    message = err.message.removeprefix("sampling_params: ").replace("sampling_params.", "")
    for native, openai in renamed.items():
        message = message.replace(native, openai)
    if param == "json_schema":
        # response_format carries the schema in its json_schema; a tool's is its parameters.
        where = "response_format.json_schema" if schema_field == "response_format" else schema_field
        param, message = schema_field, f"{where}: {message.removeprefix('json_schema: ')}"
    return RequestError(message, err.status, param or None, err.code, err.headers)


def _check_common(body: _SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options is only allowed when stream is true", param="stream_options")


def _check_unsupported_completion_fields(body: CompletionRequest) -> None:
    """OpenAI fields that would change the answer if ignored are refused unless they ask for nothing."""
    if body.suffix:
        raise RequestError("suffix (text insertion) is not supported by this server", param="suffix")
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of != n:
        raise RequestError(
            f"best_of must equal n ({n}): this server does not rank extra samples, got {body.best_of}",
            param="best_of",
        )


def _check_unsupported_chat_fields(body: ChatRequest) -> None:
    """Audio and web search are not implemented: a request that asks for them gets a 400 naming the
    field instead of an answer that silently lacks them."""
    if body.modalities is not None and any(m != "text" for m in body.modalities):
        raise RequestError("modalities: only 'text' output is supported", param="modalities")
    if body.audio is not None:
        raise RequestError("audio: audio output is not supported by this server", param="audio")
    if body.web_search_options is not None:
        raise RequestError(
            "web_search_options: web search is not supported by this server", param="web_search_options"
        )


def render_chat_prompt(
    tm: TokenizerManager,
    messages: list[ChatMessage],
    plan: tc.ToolPlan | None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids: the messages (and tools) through the chat template, in the model's
    own tool format where its template takes tools, else in the Hermes format (tool_calls.py).
    template_kwargs (the request's chat_template_kwargs) are variables the template reads."""
    template = getattr(tm.tokenizer, "chat_template", None)
    native = _takes_tools(template if isinstance(template, str) else None)
    msgs, tools = tc.template_input(chat_template_messages(messages), plan, native)
    if template_kwargs:
        _check_template_kwargs(tm, template_kwargs)
    return tm.render_chat(msgs, add_generation_prompt, tools, template_kwargs)


def _check_template_kwargs(tm: TokenizerManager, kwargs: dict[str, Any]) -> None:
    """Refuses names that apply_chat_template takes as its own arguments (tokenize, tools, ...): they
    would change how the prompt is rendered instead of reaching the template."""
    params = inspect.signature(tm.tokenizer.apply_chat_template).parameters.values()
    own = {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
    clash = sorted(set(kwargs) & own)
    if clash:
        raise RequestError(
            f"chat_template_kwargs: {clash} are arguments of the renderer, not template variables",
            param="chat_template_kwargs",
        )


@functools.lru_cache(maxsize=8)
def _takes_tools(template: str | None) -> bool:
    return tc.template_takes_tools(template)


def chat_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as OpenAI shapes them, checked, with text content: role and content, plus
    tool_calls (a deprecated function_call becomes one), tool_call_id and a result's name."""
    if not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    return [_chat_message(i, m) for i, m in enumerate(messages)]


def _chat_message(i: int, m: ChatMessage) -> dict[str, Any]:
    where = f"messages[{i}]"
    if m.role not in CHAT_ROLES:
        raise RequestError(f"{where}.role must be one of {sorted(CHAT_ROLES)}", param=f"{where}.role")
    if m.audio is not None:
        raise RequestError(f"{where}.audio: audio is not supported by this server", param=f"{where}.audio")
    if m.role == "tool" and not m.tool_call_id:
        raise RequestError(
            f"{where}.tool_call_id is required for a tool message", param=f"{where}.tool_call_id"
        )
    content = _text_content(m.content, where)
    if not content and m.refusal:
        content = m.refusal
    calls = list(m.tool_calls or [])
    if m.function_call is not None:
        calls.append(ToolCall(id=f"call_{i}", function=m.function_call))
    out: dict[str, Any] = {"role": m.role, "content": content}
    if calls:
        out["tool_calls"] = [msgspec.to_builtins(c) for c in calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None and m.role in ("tool", "function"):
        out["name"] = m.name
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    return out


def _text_content(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A message's text: a string, or text (and an assistant's refusal) parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        kind = part.get("type")
        text = part.get(kind) if kind in ("text", "refusal") else None
        if not isinstance(text, str):
            raise RequestError(f"{where}.content: only text parts are supported", param=f"{where}.content")
        texts.append(text)
    return "".join(texts)


def _response_format_schema(fmt: ResponseFormat | None) -> str | None:
    """The json_schema constraint that response_format asks for (None for plain text); the request
    builder checks it, and its errors name response_format (`_openai_names`)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT_SCHEMA
    spec = fmt.json_schema or {}
    if not isinstance(spec.get("schema"), dict):
        raise RequestError(
            "response_format.json_schema.schema must be a JSON Schema object", param="response_format"
        )
    return json.dumps(spec["schema"])


# -- running ----------------------------------------------------------------------------------
async def _run_all(request: Request, tm: TokenizerManager, jobs: list[_Job]) -> list[RequestState]:
    try:
        runs = gather_cancelling([tm.run(j.req, j.base_rid) for j in jobs])
        return await hu.unless_disconnected(request, runs)
    except RequestError as e:  # refused by the scheduler, e.g. a budget below the schema's shortest output
        raise _openai_names(e) from None


ChunkFn = Callable[[_Job, RequestState, int, int], dict[str, Any]]


async def _stream(
    tm: TokenizerManager, jobs: list[_Job], base: dict[str, Any], include_usage: bool, make_choice: ChunkFn
) -> AsyncIterator[bytes]:
    """SSE chunks carrying each choice's new text (a delta, as OpenAI streams), then usage."""
    sent_text = [0] * len(jobs)
    sent_tokens = [0] * len(jobs)
    finals: dict[int, RequestState] = {}
    usage_field = {"usage": None} if include_usage else {}
    streams = [tm.generate(j.req, True, j.base_rid) for j in jobs]
    async with contextlib.aclosing(merge_streams(streams)) as merged:
        try:
            async for i, st in merged:
                if i in finals or (not st.finished and len(st.output_ids) == sent_tokens[i]):
                    continue
                choice = make_choice(jobs[i], st, sent_text[i], sent_tokens[i])
                sent_text[i], sent_tokens[i] = len(st.text), len(st.output_ids)
                if st.finished:
                    finals[i] = st
                yield hu.sse(base | {"choices": [choice]} | usage_field)
        except RequestError as e:
            raise _openai_names(e) from None
    if include_usage:
        states = [finals[i] for i in range(len(jobs))]
        yield hu.sse(base | {"choices": [], "usage": _usage(jobs, states)})


def _completion_chunk(fmt_lp: Callable[[_Job, RequestState, int], dict[str, Any]], want_lp: bool) -> ChunkFn:
    def make(job: _Job, st: RequestState, text_from: int, tokens_from: int) -> dict[str, Any]:
        echo = job.prompt_text if tokens_from == 0 and text_from == 0 else ""
        return {
            "index": job.choice,
            "text": echo + st.text[text_from:],
            "logprobs": fmt_lp(job, st, tokens_from) if want_lp else None,
            "finish_reason": _finish_reason(st) if st.finished else None,
        }

    return make


def _chat_chunk(
    fmt_lp: Callable[[RequestState, int], dict[str, Any]], want_lp: bool, reasoning: str | None
) -> ChunkFn:
    """Chat chunks; under a reasoning parser each delta carries the new text's reasoning_content and
    content, whichever it has (a tag cut by the chunk's end waits for the next chunk)."""
    parsers: dict[int, ReasoningParser] = {}

    def make(job: _Job, st: RequestState, text_from: int, tokens_from: int) -> dict[str, Any]:
        text = st.text[text_from:]
        delta: dict[str, Any] = {"content": text}
        if reasoning is not None:
            if job.choice not in parsers:
                parsers[job.choice] = ReasoningParser(reasoning)
            split = parsers[job.choice].feed(text, final=st.finished)
            delta = {
                k: v for k, v in (("reasoning_content", split.reasoning), ("content", split.content)) if v
            }
        if tokens_from == 0 and text_from == 0:
            delta = {"role": "assistant"} | delta
        return {
            "index": job.choice,
            "delta": delta,
            "logprobs": fmt_lp(st, tokens_from) if want_lp else None,
            "finish_reason": _finish_reason(st) if st.finished else None,
        }

    return make


async def _check_call_schemas(tm: TokenizerManager, plan: tc.ToolPlan) -> None:
    """Refuses (400, naming the tool) parameters the constraint engine cannot enforce, before any
    phase runs."""
    checks = [
        (tc.call_schema([t]), f"tools[{i}].function.parameters")
        for i, t in enumerate(plan.tools)
        if t in plan.callable
    ]
    if len(plan.callable) > 1:
        checks.append((tc.call_schema(plan.callable), "tools"))
    for schema, param in checks:
        try:
            await tm.run_cpu(tm.constraints.check, Constraint("json_schema", json.dumps(schema)))
        except ValueError as e:
            raise RequestError(f"{param}: {e}", param=param) from None


def _tool_loop(tm: TokenizerManager, plan: tc.ToolPlan, req: GenerateReq) -> tc.ToolCallLoop:
    """One choice of a tool-calling turn (the sample `req`); its phases run with the sample's seed,
    as an ordinary choice would. A phase's call schema was checked by `_check_call_schemas`: its
    checked grammar comes from the checker's memory, so the scheduler does not parse it again."""

    async def run_phase(ids: list[int], params: SamplingParams) -> AsyncIterator[RequestState]:
        constraint = params.constraint
        try:
            grammar = None if constraint is None else await tm.run_cpu(tm.constraints.check, constraint)
        except ValueError as e:  # checked already by _check_call_schemas: remembered, not parsed
            raise RequestError(f"tools: {e}", param="tools") from None
        phase = msgspec.structs.replace(
            req, rid=uuid.uuid4().hex, input_ids=ids, sampling_params=params, grammar=grammar
        )
        try:
            async with contextlib.aclosing(tm.generate(phase, True)) as states:
                async for st in states:
                    _finish_reason(
                        st, drained=None, schema_field="tools"
                    )  # an aborted phase fails the request
                    yield st
        except RequestError as e:
            raise _openai_names(e, schema_field="tools") from None

    encode = lambda text: tm.tokenizer.encode(text, add_special_tokens=False)
    return tc.ToolCallLoop(
        plan,
        req.input_ids,
        req.sampling_params,
        encode,
        run_phase,
        _max_total(tm),
        tm.args.server.max_tool_calls,
    )


async def _final(loop: tc.ToolCallLoop) -> tc.ChoiceOutput:
    """Runs a tool-calling choice to its end."""
    outputs = [out async for out in loop.run()]
    return outputs[-1]


async def _tool_stream(
    loops: list[tc.ToolCallLoop], base: dict[str, Any], include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE chunks of tool-calling choices: content and call deltas as OpenAI streams them."""
    builders = [tc.DeltaBuilder() for _ in loops]
    finished: set[int] = set()
    usage_field = {"usage": None} if include_usage else {}
    async with contextlib.aclosing(merge_streams([lp.run() for lp in loops])) as merged:
        async for i, out in merged:
            # Queued items of one choice are the same object: it may already be further on.
            if i in finished:
                continue
            deltas = builders[i].deltas(out)
            if out.finish_reason is not None:
                finished.add(i)
                deltas.append({})
            for j, delta in enumerate(deltas):
                last = out.finish_reason is not None and j == len(deltas) - 1
                choice = {"index": i, "delta": delta, "logprobs": None}
                choice["finish_reason"] = out.finish_reason if last else None
                yield hu.sse(base | {"choices": [choice]} | usage_field)
    if include_usage:
        yield hu.sse(base | {"choices": [], "usage": _tool_usage([lp.out for lp in loops])})


def _tool_usage(outs: list[tc.ChoiceOutput]) -> dict[str, Any]:
    """Prompt tokens once (every phase's prompt past the first is the turn so far), generated tokens
    of every phase of every choice."""
    return _usage_dict(outs[0].prompt_tokens, outs[0].cached_tokens, sum(o.completion_tokens for o in outs))


# -- response pieces --------------------------------------------------------------------------
def _message_text(text: str, reasoning: str | None) -> dict[str, str | None]:
    """A message's content; under a reasoning parser also its reasoning_content, each null when
    empty (an output cut off inside the think block has reasoning and no content)."""
    if reasoning is None:
        return {"content": text}
    split = split_reasoning(reasoning, text)
    return {"reasoning_content": split.reasoning or None, "content": split.content or None}


def _finish_reason(
    st: RequestState, drained: str | None = "abort", schema_field: str = "response_format"
) -> str | None:
    """OpenAI's finish reasons are stop, length, content_filter and tool_calls: an aborted choice, or
    one whose constraint the grammar engine failed on (a 400 naming `schema_field` for a json_schema),
    fails the response (an error body, or an error event in a stream) instead of reporting one. A
    choice the shutdown drain ended finishes as `drained` ("abort", as SGLang and vLLM name it)."""
    reason = st.finished_reason
    if reason is None:
        return None
    if reason == DRAIN_ABORT and drained is not None:
        return drained
    if reason.kind == "abort":
        raise RequestError(f"the request was aborted: {reason.message}", status=500, code="request_aborted")
    if reason.kind == "constraint_error":
        # The grammar engine failed on the constraint mid-generation: the output is no answer.
        error = RequestError(
            reason.message or "constraint error", param=reason.param, code="constraint_error"
        )
        raise _openai_names(error, schema_field)
    return reason.kind


def _usage(jobs: list[_Job], states: list[RequestState]) -> dict[str, Any]:
    """Prompt (and cached) tokens count once per prompt, completion tokens once per choice."""
    firsts = [st for job, st in zip(jobs, states) if job.index == 0]
    completion = sum(len(st.output_ids) for st in states)
    return _usage_dict(
        sum(st.prompt_tokens for st in firsts), sum(st.cached_tokens for st in firsts), completion
    )


def _usage_dict(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_text(tm: TokenizerManager, tid: int) -> str:
    return tm.tokenizer.decode([tid])


def _completion_logprobs(tm: TokenizerManager, job: _Job, st: RequestState, start: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs (tokens / token_logprobs / top_logprobs / text_offset),
    for output tokens from `start` on, preceded by the prompt's when echoing."""
    entries: list[tuple[int, float | None, list[tuple[float, int]] | None]] = []
    if job.prompt_text:
        tops = st.input_top_logprobs or [None] * len(job.req.input_ids)
        entries.extend(zip(job.req.input_ids, st.input_token_logprobs, tops))
    first = len(entries) + start if start else 0
    out_tops = st.output_top_logprobs or [None] * len(st.output_ids)
    entries.extend(zip(st.output_ids, st.output_token_logprobs, out_tops))
    tokens = [_token_text(tm, tid) for tid, _, _ in entries]
    offsets = list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]
    entries, tokens, offsets = entries[first:], tokens[first:], offsets[first:]
    tops_out = []
    for tid, lp, top in entries:
        alternatives = _with_sampled(tid, lp, top or [])
        tops_out.append(
            {_token_text(tm, t): json_logprob(v) for v, t in alternatives} if alternatives else None
        )
    return {
        "tokens": tokens,
        "token_logprobs": [json_logprob(lp) for _, lp, _ in entries],
        "top_logprobs": tops_out,
        "text_offset": offsets,
    }


def _with_sampled(tid: int, lp: float | None, top: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The top alternatives plus the chosen token where it is not among them (so k + 1 entries), as
    vLLM answers; a position without a logprob (the first prompt token) has none."""
    if lp is None or any(t == tid for _, t in top):
        return top
    return [*top, (lp, tid)]


def _chat_logprobs(tm: TokenizerManager, st: RequestState, start: int) -> dict[str, Any]:
    def item(tid: int, lp: float) -> dict[str, Any]:
        text = _token_text(tm, tid)
        return {"token": text, "logprob": json_logprob(lp), "bytes": list(text.encode())}

    tops = st.output_top_logprobs or [[] for _ in st.output_ids]
    # top_logprobs 0 asks for no alternatives (OpenAI answers []); otherwise the chosen token is
    # always among them.
    content = [
        item(tid, lp)
        | {"top_logprobs": [item(t, tlp) for tlp, t in (_with_sampled(tid, lp, top) if top else [])]}
        for tid, lp, top in list(zip(st.output_ids, st.output_token_logprobs, tops))[start:]
    ]
    return {"content": content}
