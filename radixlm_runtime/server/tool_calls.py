"""Tool calling on /v1/chat/completions: the request's tools and tool_choice, the call format in the
prompt, the constraint that makes a call's arguments satisfy its function's schema, and the parsing
and streaming of the calls the model makes.

The call format is Hermes / Qwen2.5's: tools listed in the system prompt inside `<tools>...</tools>`,
each call written as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, results fed
back in a user turn inside `<tool_response>...</tool_response>`. A chat template that takes `tools`
itself renders the tools and the history its own way; the calls are still read in this format.

A choice runs as a few requests ("phases") over one growing prompt, so the radix cache makes every
phase's shared prefix free: under `auto`, free text with `<tool_call>` as a stop string; when the
model opened a call (or the call is forced), the call's JSON under a JSON-schema constraint; after a
call (when parallel calls are allowed), a choice constrained to either end the turn or open the
next call. Only the engine's `json_schema` and `regex` constraints are used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import jinja2
import jinja2.meta
import jsonschema

from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.server.errors import RequestError

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# After a call: end the turn (EOS), or open the next call.
NEXT_CALL_REGEX = r"(\n<tool_call>)?"
# The field a call refused for its budget names (the budget left is below the call's shortest output).
BUDGET_FIELD = "max_tokens"
# OpenAI's rule for function names.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_MODES = ("none", "auto", "required")
# Keywords whose values are JSON data, not schemas: a "$ref" inside them is not a reference.
_LITERALS = {"const", "enum", "default", "examples"}
# The start of a call's JSON up to its arguments' value, whitespace-tolerant so that a constraint
# engine with flexible whitespace parses the same way.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}?\s*$")
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None
    strict: bool | None = None

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request holds it (what the prompt and a model's template show)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tools: which exist, whether and which the model must call."""

    tools: tuple[Tool, ...]
    mode: Literal["none", "auto", "required"]
    forced: str | None = None  # the function tool_choice names (mode "required")
    parallel: bool = True

    @property
    def calls(self) -> bool:
        return self.mode != "none"

    @property
    def callable(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.forced is None or t.name == self.forced)


def parse_tool_request(
    tools: list[Any] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    functions: list[Any] | None,
    function_call: str | dict[str, Any] | None,
) -> ToolPlan | None:
    """The request's tool plan (None without tools); a 400 naming the field for anything invalid."""
    if functions:
        raise RequestError(
            "functions is deprecated and not supported by this server; send tools instead",
            param="functions",
        )
    if function_call not in (None, "none", "auto"):
        raise RequestError(
            "function_call is deprecated and not supported by this server; send tool_choice instead",
            param="function_call",
        )
    parsed = tuple(_parse_tool(i, t) for i, t in enumerate(tools or []))
    names = [t.name for t in parsed]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise RequestError(
                f"tools[{i}].function.name: {name!r} is defined twice", param=f"tools[{i}].function.name"
            )
    mode, forced = _parse_choice(tool_choice, names)
    if not parsed:
        if mode == "required":
            raise RequestError("tool_choice requires tools to be given", param="tool_choice")
        return None
    return ToolPlan(parsed, mode, forced, parallel_tool_calls is not False)


def _parse_tool(i: int, tool: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise RequestError(f"{where} must be an object", param=where)
    if tool.get("type") != "function":
        raise RequestError(
            f"{where}.type must be 'function' (the only tool type served), got {tool.get('type')!r}",
            param=f"{where}.type",
        )
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        raise RequestError(f"{where}: unknown field {extra[0]!r}", param=f"{where}.{extra[0]}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise RequestError(f"{where}.function must be an object", param=f"{where}.function")
    extra = sorted(set(fn) - _FUNCTION_KEYS)
    if extra:
        raise RequestError(
            f"{where}.function: unknown field {extra[0]!r}", param=f"{where}.function.{extra[0]}"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(
            f"{where}.function.name is required: 1 to 64 letters, digits, '_' or '-', got {name!r}",
            param=f"{where}.function.name",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(
            f"{where}.function.description must be a string", param=f"{where}.function.description"
        )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    _check_parameters(parameters, f"{where}.function.parameters")
    return Tool(name, parameters, description, strict)


def _check_parameters(parameters: Any, where: str) -> None:
    """A function's arguments are a JSON object: its parameters must be a valid JSON Schema of type
    object, as OpenAI requires."""
    if not isinstance(parameters, dict):
        raise RequestError(f"{where} must be a JSON Schema object", param=where)
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as e:
        raise RequestError(f"{where} is not a valid JSON Schema: {e.message}", param=where) from None
    except RecursionError:
        raise RequestError(f"{where} is nested too deeply", param=where) from None
    if parameters.get("type") != "object":
        raise RequestError(
            f"{where} must be a JSON Schema of type 'object', got type {parameters.get('type')!r}",
            param=where,
        )


def _parse_choice(choice: str | dict[str, Any] | None, names: list[str]) -> tuple[Any, str | None]:
    """(mode, forced function name) of tool_choice; OpenAI's default is auto with tools, else none."""
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in _MODES:
            raise RequestError(
                f"tool_choice must be one of {list(_MODES)} or a function, got {choice!r}",
                param="tool_choice",
            )
        return choice, None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError(
            'tool_choice must be {"type": "function", "function": {"name": ...}} to name a function',
            param="tool_choice",
        )
    if name not in names:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return "required", name


def check_compatible(plan: ToolPlan, logprobs: bool, response_format: bool, regex: bool, ebnf: bool) -> None:
    """Fields that cannot apply to a turn that may be tool calls are refused rather than ignored."""
    asked_for = (
        (logprobs, "logprobs"),
        (response_format, "response_format"),
        (regex, "regex"),
        (ebnf, "ebnf"),
    )
    for asked, name in asked_for:
        if asked:
            raise RequestError(
                f"{name} cannot be combined with tool calling; send tool_choice 'none' or leave {name} out",
                param=name,
            )


# -- prompt ------------------------------------------------------------------------------------
def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable, i.e. renders tool definitions itself."""
    if not chat_template:
        return False
    try:
        ast = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def template_input(
    messages: list[dict[str, Any]], plan: ToolPlan | None, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to give the chat template. A template that takes tools (`native`) gets
    them, and past calls' arguments as objects (as transformers documents); any other gets the
    Hermes format as text. Under tool_choice none the tools are left out of the prompt."""
    tools = [t.as_openai() for t in plan.tools] if plan is not None and plan.calls else None
    if native:
        return [_native_message(m) for m in messages], tools
    out = _hermes_messages(messages)
    if tools:
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _native_message(m: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" not in m:
        return m
    calls = []
    for call in m["tool_calls"]:
        fn = call["function"]
        calls.append(call | {"function": fn | {"arguments": _arguments_value(fn["arguments"])}})
    return m | {"tool_calls": calls}


def _arguments_value(arguments: str) -> Any:
    """A past call's arguments as a JSON value (the raw string when they are not JSON)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def call_text(name: str, arguments: str) -> str:
    """A call's JSON as the constraint lays it out, so a past call the client sends back renders as
    the model generated it and the radix cache still holds it."""
    value = _arguments_value(arguments)
    args = arguments if not isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return f'{{"name":{json.dumps(name, ensure_ascii=False)},"arguments":{args}}}'


def _hermes_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Past calls appended to the assistant's turn as `<tool_call>` blocks; tool (and function)
    results as a user turn of `<tool_response>` blocks, consecutive results in one turn."""
    out: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user turn that consecutive results go into
    for m in messages:
        if m["role"] in ("tool", "function"):
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results is None:
                results = {"role": "user", "content": block}
                out.append(results)
            else:
                results["content"] += "\n" + block
            continue
        results = None
        texts = [m["content"]] if m["content"] else []
        texts.extend(
            f"{CALL_OPEN}\n{call_text(c['function']['name'], c['function']['arguments'])}\n{CALL_CLOSE}"
            for c in m.get("tool_calls") or []
        )
        out.append({"role": m["role"], "content": "\n".join(texts)})
    return out


# -- constraint --------------------------------------------------------------------------------
def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """JSON schema of one call to any of `tools`: {"name": const, "arguments": its parameters}, an
    anyOf over the tools when there are several. Local `$ref`s are rebased onto where the
    parameters now sit; several tools' calls sit under `$defs` (not in the anyOf array) so that
    every rebased pointer runs through object keys only, which every grammar engine resolves."""
    if len(tools) == 1:
        return _one_call(tools[0], "#/properties/arguments")
    return {
        "anyOf": [{"$ref": f"#/$defs/call_{i}"} for i in range(len(tools))],
        "$defs": {
            f"call_{i}": _one_call(t, f"#/$defs/call_{i}/properties/arguments") for i, t in enumerate(tools)
        },
    }


def _one_call(tool: Tool, at: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": _rebase_refs(tool.parameters, at)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rebase_refs(node: Any, at: str) -> Any:
    if isinstance(node, list):
        return [_rebase_refs(v, at) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _LITERALS else _rebase_refs(v, at) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = at + ref[1:]
    return out


# -- parsing -----------------------------------------------------------------------------------
def split_call(text: str, final: bool) -> tuple[str | None, str]:
    """(name, arguments) of a call's JSON text. While the call is still generating, the name is
    None until it is complete and the arguments hold back a trailing closing brace (it may be the
    call's own); once `final`, that brace is dropped. The arguments are the generated text itself, so
    streamed fragments join up to exactly the non-streamed value."""
    head = _CALL_HEAD.match(text)
    if head is None:
        if final:
            return _parsed_call(text)
        return None, ""
    name = json.loads(head.group(1))
    rest = text[head.end() :]
    return name, rest[: _CALL_TAIL.search(rest).start()]  # type: ignore[union-attr]


def _parsed_call(text: str) -> tuple[str | None, str]:
    """A finished call the head pattern misses (e.g. a constraint engine that orders keys otherwise)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None, text
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, text
    return value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False)


# -- running -----------------------------------------------------------------------------------
class PhaseState(Protocol):
    """What the loop reads of a running request (the tokenizer manager's RequestState)."""

    text: str
    output_ids: list[int]
    finished_reason: FinishReason | None
    cached_tokens: int


# Runs one phase: its prompt ids and params -> the request's states (the final one last).
PhaseRunner = Callable[[list[int], SamplingParams], AsyncIterator[PhaseState]]


@dataclass
class CallOutput:
    id: str
    text: str = ""  # the call's JSON as generated so far
    finished: bool = False

    def parts(self) -> tuple[str | None, str]:
        return split_call(self.text, self.finished)


@dataclass
class ChoiceOutput:
    """One choice's turn so far: text before any call, the calls, and the token counts."""

    content: str = ""
    calls: list[CallOutput] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length or tool_calls, once the turn ended
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def named_calls(self) -> list[tuple[CallOutput, tuple[str, str]]]:
        """The calls whose name is out (a call cut off by max_tokens before its name is dropped),
        with their (name, arguments)."""
        parts = [(c, c.parts()) for c in self.calls]
        return [(c, (name, args)) for c, (name, args) in parts if name is not None]

    def message(self) -> dict[str, Any]:
        """The non-streamed message; content is null when the turn is only calls, as OpenAI answers."""
        calls = self.named_calls()
        content = None if calls and not self.content.strip() else self.content
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": name, "arguments": args}}
                for c, (name, args) in calls
            ]
        return msg


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallLoop:
    """Runs one choice of a tool-calling turn as phases over one prompt (module docstring)."""

    def __init__(
        self,
        plan: ToolPlan,
        prompt_ids: list[int],
        params: SamplingParams,
        encode: Callable[[str], list[int]],
        run_phase: PhaseRunner,
        max_total_tokens: int,
        max_calls: int,
    ) -> None:
        self.plan = plan
        self.prompt_ids = prompt_ids
        self.params = params
        self.encode = encode
        self.run_phase = run_phase
        self.max_total_tokens = max_total_tokens
        self.max_calls = 1 if plan.forced is not None or not plan.parallel else max_calls
        self.schema = json.dumps(call_schema(plan.callable))
        self.out = ChoiceOutput()
        self._first = True

    async def run(self) -> AsyncIterator[ChoiceOutput]:
        """Yields the choice's output whenever it grew; the last one has its finish_reason."""
        out = self.out
        turn = ""  # the assistant's text so far, as the next phase's prompt continues it
        if self.plan.mode == "auto":
            free = dataclasses.replace(self.params, stop=[*self.params.stop, CALL_OPEN])
            async for st in self._phase([], free):
                out.content = st.text
                if st.finished_reason is None:
                    yield out
            reason = st.finished_reason
            if reason is None or reason.matched != CALL_OPEN:
                out.finish_reason = _finish_kind(reason)
                yield out
                return
            out.content = out.content.split(CALL_OPEN, 1)[0]
            turn = out.content
        turn += CALL_OPEN
        constrained = dataclasses.replace(
            self.params,
            stop=[],
            min_new_tokens=0,
            ignore_eos=False,
            no_stop_trim=False,
            regex=None,
            ebnf=None,
        )
        with_schema = dataclasses.replace(constrained, json_schema=self.schema)
        next_call = dataclasses.replace(constrained, regex=NEXT_CALL_REGEX)
        # The output object is shared with the consumer: its finish_reason is set only at the end.
        finish = "tool_calls"
        while True:
            turn += "\n"
            if self._budget(self.encode(turn)) == 0:
                finish = "tool_calls" if out.calls else "length"
                break
            call = CallOutput(new_call_id())
            out.calls.append(call)
            try:
                async for st in self._phase(self.encode(turn), with_schema):
                    call.text = st.text
                    call.finished = st.finished_reason is not None and st.finished_reason.kind == "stop"
                    yield out
            except RequestError as e:
                # Refused before it ran: the budget left is below the shortest call. After calls or
                # text the turn ends with what it has; a turn that would be empty is the request's 400.
                out.calls.pop()
                if e.param != BUDGET_FIELD or not (out.calls or out.content.strip()):
                    raise
                finish = "tool_calls" if out.calls else "length"
                break
            if not call.finished:
                finish = _finish_kind(st.finished_reason)
                break
            turn += f"{call.text}\n{CALL_CLOSE}"
            if len(out.calls) >= self.max_calls or self._budget(self.encode(turn)) == 0:
                break
            decided = [st async for st in self._phase(self.encode(turn), next_call)][-1]
            if CALL_OPEN not in decided.text:
                break
            turn += decided.text
        out.finish_reason = finish
        yield out

    def _budget(self, continuation: list[int]) -> int:
        """Tokens left to generate: what max_tokens leaves, within the context."""
        left = self.params.max_new_tokens - self.out.completion_tokens
        return max(min(left, self.max_total_tokens - len(self.prompt_ids) - len(continuation)), 0)

    async def _phase(self, continuation: list[int], params: SamplingParams) -> AsyncIterator[PhaseState]:
        """Runs one phase on the prompt plus `continuation`, counting its tokens into the output."""
        params = dataclasses.replace(params, max_new_tokens=self._budget(continuation))
        if not self._first:
            params = dataclasses.replace(params, min_new_tokens=0)
        st: PhaseState | None = None
        states = self.run_phase(self.prompt_ids + continuation, params)
        async with contextlib.aclosing(states) as states:  # type: ignore[type-var]
            async for st in states:
                yield st
        assert st is not None, "a phase ended without a final state"
        if self._first:  # the messages are the prompt; tags the server writes count nowhere
            self.out.prompt_tokens = len(self.prompt_ids)
            self.out.cached_tokens = min(st.cached_tokens, len(self.prompt_ids))
            self._first = False
        self.out.completion_tokens += len(st.output_ids)


def _finish_kind(reason: FinishReason | None) -> str:
    """The phase's finish reason as OpenAI names it (the phase runner raises on an abort)."""
    return "length" if reason is not None and reason.kind == "length" else "stop"


# -- streaming ---------------------------------------------------------------------------------
@dataclass
class DeltaBuilder:
    """Turns a choice's growing output into OpenAI's stream deltas: content text, then per call a
    first delta with its id, type and name, and later ones with fragments of its arguments."""

    content_sent: int = 0
    role_sent: bool = False
    calls_sent: list[int] = field(default_factory=list)  # per call: characters of arguments sent

    def deltas(self, out: ChoiceOutput) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        content = out.content
        # Leading blank text is held until it turns out to be content: before a call it is none.
        shown = content.strip() or (out.finish_reason is not None and not out.calls)
        if shown and len(content) > self.content_sent:
            deltas.append({"content": content[self.content_sent :]})
            self.content_sent = len(content)
        for i, (call, (name, arguments)) in enumerate(out.named_calls()):
            if i == len(self.calls_sent):
                self.calls_sent.append(0)
                fn = {"name": name, "arguments": ""}
                deltas.append(
                    {"tool_calls": [{"index": i, "id": call.id, "type": "function", "function": fn}]}
                )
            if len(arguments) > self.calls_sent[i]:
                fragment = arguments[self.calls_sent[i] :]
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]})
                self.calls_sent[i] = len(arguments)
        if deltas and not self.role_sent:
            deltas[0] = {"role": "assistant"} | deltas[0]
            self.role_sent = True
        return deltas
