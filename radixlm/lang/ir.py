"""The program IR: what `s += ...` appends. Each node is plain data, executed by the interpreter,
recorded by the tracer, or sent to a backend."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixlm_runtime.constrained.dtypes import regex_for_dtype

# gen() parameter -> runtime sampling_params field.
_GEN_TO_RUNTIME = {
    "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
}


@dataclass
class GenParams:
    """Sampling settings of one gen. None means "inherit": gen-level values override the program
    run's defaults (`f.run(temperature=...)`), which override SGLang's frontend defaults."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: type | str | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None  # a GBNF grammar, `root ::= ...`

    def merged_over(self, base: GenParams) -> GenParams:
        """self's set fields over base's."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(base, **{k: v for k, v in values.items() if v is not None})

    def to_runtime(self) -> dict[str, Any]:
        """The native /generate `sampling_params` dict (unset fields left to the server)."""
        out: dict[str, Any] = {}
        for name, key in _GEN_TO_RUNTIME.items():
            value = getattr(self, name)
            if value is not None and value != []:
                out[key] = [value] if name == "stop" and isinstance(value, str) else value
        if self.dtype is not None:
            out["regex"] = dtype_regex(self.dtype)
            # As SGLang does: a number ends at the first space or newline the model writes.
            if _DTYPES[self.dtype] in ("int", "float"):
                out["stop"] = [*out.get("stop", []), " ", "\n"]
        return out

    def logprob_fields(self) -> dict[str, Any]:
        """Top-level /generate logprob fields, when asked for."""
        out: dict[str, Any] = {}
        if self.return_logprob:
            out["return_logprob"] = True
            for name in ("logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
        return out


# The frontend defaults of SGLang's `f.run()`, so ported programs sample the same way.
RUN_DEFAULTS = GenParams(
    max_new_tokens=128,
    min_new_tokens=0,
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    min_p=0.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    ignore_eos=False,
)

_DTYPES: dict[Any, str] = {int: "int", "int": "int", float: "float", "float": "float"}
_DTYPES |= {str: "str", "str": "str", "string": "str", bool: "bool", "bool": "bool"}


def dtype_regex(dtype: type | str) -> str:
    kind = _DTYPES.get(dtype)
    if kind is None:
        raise ValueError(f"gen: dtype must be one of int, float, str, bool; got {dtype!r}")
    return regex_for_dtype({"int": int, "float": float, "str": str, "bool": bool}[kind])


class Expr:
    """Anything that can be appended to a program state; `+` chains expressions."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), self])


@dataclass(eq=False)
class ExprList(Expr):
    exprs: list[Expr]

    def __add__(self, other: Any) -> ExprList:
        return ExprList([*self.exprs, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), *self.exprs])


@dataclass(eq=False)
class ConstantText(Expr):
    text: str


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: GenParams
    # The reasoning parser (separate_reasoning's model_type) that splits its output: the answer goes
    # to `name`, the think block to `reasoning_name`.
    reasoning: str | None = None

    @property
    def reasoning_name(self) -> str:
        """The variable separate_reasoning puts the reasoning in (SGLang's name for it)."""
        return f"{self.name}_reasoning_content"


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Callable[..., Any]


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class ConcateAndAppend(Expr):
    """Appends each fork branch's text (since the fork) to the parent, in branch order."""

    states: list[Any]


@dataclass(eq=False)
class CommitLazy(Expr):
    """Sends the text so far to the backend as a zero-token request, so the KV exists before
    forks or parallel calls need it."""


@dataclass(eq=False)
class EndProgram(Expr):
    """Marks the end of a run: the executor releases the run's pinned KV once everything before it ran."""


def role_expr(role: str, content: Any = None) -> ExprList:
    """A chat turn: its begin marker, its content (if any), its end marker."""
    inner = [] if content is None else [to_expr(content)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return ConstantText(value)
    raise TypeError(
        f"cannot append a {type(value).__name__} to a program; use str(...) for text or a primitive "
        "such as gen()/select()"
    )


def flatten(expr: Expr) -> list[Expr]:
    if isinstance(expr, ExprList):
        return [leaf for e in expr.exprs for leaf in flatten(e)]
    return [expr]


def check_regex(regex: str | None) -> None:
    if regex is None:
        return
    if not isinstance(regex, str):
        raise ValueError(f"gen: regex must be a string, got {type(regex).__name__}")
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"gen: invalid regex {regex!r}: {e}") from e


def check_choices(name: str | None, choices: Sequence[str] | None, where: str) -> list[str]:
    if choices is None or isinstance(choices, str) or len(choices) == 0:
        raise ValueError(f"{where}({name!r}): choices must be a non-empty list of strings, got {choices!r}")
    bad = [c for c in choices if not isinstance(c, str)]
    if bad:
        raise ValueError(f"{where}({name!r}): every choice must be a string, got {bad[0]!r}")
    return list(choices)


@dataclass
class ChoiceDecision:
    """What a select decided, plus the per-choice scores behind it (its meta info)."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)
