"""The primitives programs are written with; names and signatures follow SGLang's frontend."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from radixlm.lang import ir
from radixlm.lang.choices import ChoicesMethod, token_length_normalized
from radixlm.lang.function import Function, resolve_backend
from radixlm_runtime.server.reasoning import check_parser_name


def function(func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: `@function` or `@function(num_api_spec_tokens=N)`."""
    if num_api_spec_tokens is not None and (
        not isinstance(num_api_spec_tokens, int) or num_api_spec_tokens < 1
    ):
        raise ValueError(f"function: num_api_spec_tokens must be a positive int, got {num_api_spec_tokens!r}")
    if func is not None:
        return Function(func, num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    ebnf: str | None = None,
) -> ir.Expr:
    """Generates text into variable `name`. With `choices`, it is a select."""
    if choices is not None:
        if regex is not None or json_schema is not None or ebnf is not None or dtype is not None:
            raise ValueError(
                f"gen({name!r}): choices cannot be combined with regex, json_schema, ebnf or dtype"
            )
        return select(name, choices, 0.0 if temperature is None else temperature, choices_method)
    constraints = [
        k
        for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf), ("dtype", dtype))
        if v is not None
    ]
    if len(constraints) > 1:
        raise ValueError(
            f"gen({name!r}): give at most one of regex, json_schema, ebnf, dtype; got {constraints}"
        )
    if ebnf is not None and not isinstance(ebnf, str):
        raise ValueError(f"gen({name!r}): ebnf must be a string, got {type(ebnf).__name__}")
    ir.check_regex(regex)
    if dtype is not None:
        ir.dtype_regex(dtype)
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    return ir.Gen(
        name,
        ir.GenParams(
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            ignore_eos=ignore_eos,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            dtype=dtype,
            regex=regex,
            json_schema=json_schema,
            ebnf=ebnf,
        ),
    )


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> ir.Expr:
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> ir.Expr:
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod | None = None,
) -> ir.Select:
    """Appends the choice the model scores highest (by prompt logprobs of each choice)."""
    choices = ir.check_choices(name, choices, "select")
    if temperature < 0:
        raise ValueError(f"select({name!r}): temperature must be >= 0, got {temperature}")
    return ir.Select(name, choices, temperature, choices_method or token_length_normalized)


def separate_reasoning(expr: Any, model_type: str) -> ir.ExprList:
    """Splits a reasoning model's think block out of every gen in expr (SGLang's primitive): after
    it, s[name] holds the answer and s[name + "_reasoning_content"] the reasoning. The reasoning stays
    out of the program's text, so later calls see the answer only, as chat templates of reasoning
    models replay past turns. model_type is a --reasoning-parser name ('qwen3', 'deepseek-r1')."""
    try:
        check_parser_name(model_type)
    except ValueError as e:
        raise ValueError(f"separate_reasoning: model_type: {e}") from None
    exprs = ir.flatten(ir.to_expr(expr))
    for e in exprs:
        if isinstance(e, ir.Select):
            raise ValueError(
                f"separate_reasoning: select({e.name!r}) picks a fixed text; only gen output has reasoning"
            )
        if isinstance(e, ir.Gen) and e.name is None:
            raise ValueError("separate_reasoning: the gen needs a name to hold its answer and reasoning")
    if not any(isinstance(e, ir.Gen) for e in exprs):
        raise ValueError(f"separate_reasoning: expects a gen (or expressions with gens), got {expr!r}")
    return ir.ExprList(
        [dataclasses.replace(e, reasoning=model_type) if isinstance(e, ir.Gen) else e for e in exprs]
    )


def image(path: str) -> ir.Expr:
    raise ValueError("image inputs are not supported by this model: radixlm serves text-only models")


def video(path: str, num_frames: int) -> ir.Expr:
    raise ValueError("video inputs are not supported: radixlm's models are text-only")


def system(expr: Any = None) -> ir.ExprList:
    return ir.role_expr("system", expr)


def user(expr: Any = None) -> ir.ExprList:
    return ir.role_expr("user", expr)


def assistant(expr: Any = None) -> ir.ExprList:
    return ir.role_expr("assistant", expr)


def system_begin() -> ir.RoleBegin:
    return ir.RoleBegin("system")


def system_end() -> ir.RoleEnd:
    return ir.RoleEnd("system")


def user_begin() -> ir.RoleBegin:
    return ir.RoleBegin("user")


def user_end() -> ir.RoleEnd:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.RoleBegin:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.RoleEnd:
    return ir.RoleEnd("assistant")


def flush_cache(backend: Any = None) -> bool:
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()
