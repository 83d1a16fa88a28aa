"""/tokenize and /detokenize (also under /v1), in the request and response shapes of both vLLM and
SGLang, so either's clients (token counting, prompt budgeting) work unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixlm_runtime.server import http_utils as hu
from radixlm_runtime.server.errors import RequestError
from radixlm_runtime.server.openai_api import ChatMessage, model_checker, render_chat_prompt
from radixlm_runtime.server.tokenizer_manager import TokenizerManager
from radixlm_runtime.server.tool_calls import parse_tool_request


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's fields; `prompt` may also be a list of prompts (SGLang's batch form)."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # with messages: rendered as /v1/chat/completions renders them
    # Default: True for a prompt, False for messages (the chat template writes the special tokens).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # with messages: as /v1/chat/completions takes it
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[Any] = []  # token ids, or lists of them (SGLang's batch form); checked by hand
    # SGLang's field; the default keeps special tokens, so detokenize(tokenize(x)) shows the whole
    # prompt as vLLM answers it.
    skip_special_tokens: bool = False


def build_tokenize_router(tm: TokenizerManager, model_name: str) -> APIRouter:
    router = APIRouter()
    limit = tm.args.server.max_request_bytes
    check_model = model_checker(tm, model_name)

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        """{"tokens", "count", "max_model_len"} (+ "token_strs"); lists of them for a list of prompts."""
        body = await hu.parse_body(request, limit, TokenizeRequest)
        check_model(body.model)
        return await tm.run_cpu(_json_response, _tokenize_output, tm, body)

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(request: Request) -> Response:
        """The text under both vLLM's key ("prompt") and SGLang's ("text")."""
        body = await hu.parse_body(request, limit, DetokenizeRequest)
        check_model(body.model)
        return await tm.run_cpu(_json_response, _detokenize_output, tm, body)

    return router


def _json_response(make: Callable[..., dict[str, Any]], *args: Any) -> Response:
    """make(*args) encoded as the response, on the tokenizer threads: a million token ids take the
    event loop's encoder a second."""
    return Response(msgspec.json.encode(make(*args)), media_type="application/json")


def _tokenize_output(tm: TokenizerManager, body: TokenizeRequest) -> dict[str, Any]:
    """/tokenize's answer; runs on the tokenizer threads."""
    id_lists, single = _tokenize(tm, body)
    assert tm.ready is not None
    out: dict[str, Any] = {
        "tokens": id_lists[0] if single else id_lists,
        "count": len(id_lists[0]) if single else [len(ids) for ids in id_lists],
        "max_model_len": tm.ready.context_length,
    }
    if body.return_token_strs:
        strs = [tm.tokenizer.convert_ids_to_tokens(ids) for ids in id_lists]
        out["token_strs"] = strs[0] if single else strs
    return out


def _detokenize_output(tm: TokenizerManager, body: DetokenizeRequest) -> dict[str, Any]:
    """/detokenize's answer; runs on the tokenizer threads."""
    id_lists, single = _id_lists(body.tokens)
    vocab = len(tm.tokenizer)
    bad = [t for ids in id_lists for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    texts = [tm.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in id_lists]
    text: str | list[str] = texts[0] if single else texts
    return {"prompt": text, "text": text}


def _tokenize(tm: TokenizerManager, body: TokenizeRequest) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt (or of the rendered conversation), and whether there was one."""
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give exactly one of prompt and messages", param="prompt")
    for name in ("tools", "chat_template_kwargs"):
        if getattr(body, name) is not None and body.messages is None:
            raise RequestError(f"{name}: only used to render messages", param=name)
    if body.messages is not None:
        plan = parse_tool_request(body.tools, None, None, None, None)
        ids = render_chat_prompt(
            tm, body.messages, plan, body.add_generation_prompt, body.chat_template_kwargs
        )
        if body.add_special_tokens:
            ids = tm.tokenizer.build_inputs_with_special_tokens(ids)
        return [ids], True
    add_special = body.add_special_tokens is not False
    prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt or [])
    return [tm.tokenizer.encode(p, add_special_tokens=add_special) for p in prompts], isinstance(
        body.prompt, str
    )


def _id_lists(tokens: list[Any]) -> tuple[list[list[int]], bool]:
    """Detokenize's `tokens`: a list of ids, or a list of such lists."""
    is_id = lambda t: isinstance(t, int) and not isinstance(t, bool)
    if all(is_id(t) for t in tokens):
        return [tokens], True
    if all(isinstance(ids, list) and all(is_id(t) for t in ids) for ids in tokens):
        return tokens, False
    raise RequestError("tokens must be a list of token ids or a list of such lists", param="tokens")
