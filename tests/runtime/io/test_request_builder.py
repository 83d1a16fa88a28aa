"""One request builder (io/request_builder.py) behind every entry point: the same bad input gets the
same error from the offline Engine (a ValueError), native /generate and OpenAI's /v1 (a 400 whose
JSON error names the field, under the OpenAI request's names on /v1), each run against a real
server on loopback and an Engine on the same tiny random-init model with the same limits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from runtime.server.server_harness import API_KEY, HEADERS, Server, assert_no_leak, launch_server, wait_idle

import radixlm_runtime as rt
from radixlm_runtime.config import ServerConfig
from radixlm_runtime.constrained.constraint import MAX_JSON_DEPTH, Constraint
from radixlm_runtime.io.inputs import LogprobArgs
from radixlm_runtime.io.limits import InvalidRequest, RequestLimits
from radixlm_runtime.io.request_builder import PromptArgs, RequestPolicy, build_requests, native_prompts

PROMPT = "the theater then an answer"
CONTEXT_LEN = 256
MAX_TOTAL_TOKENS = 20000  # the harness's --max-total-tokens
VOCAB = 300  # the tiny model's


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@dataclass(frozen=True)
class Case:
    """One bad input, in the native API's shape (`sampling_params`, and `args`: other top-level
    arguments) and in the OpenAI request's (`openai`: the body's extra fields, sent to
    /v1/completions, or to /v1/chat/completions when `chat`). `param` is the field the native error
    names, `openai_param` the one /v1 names; `words` must be in the message; `code`, when set, is
    the error code both HTTP APIs give."""

    name: str
    sampling_params: dict[str, Any]
    openai: dict[str, Any]
    param: str | None
    openai_param: str | None
    words: str
    args: dict[str, Any] = field(default_factory=dict)
    chat: bool = False
    code: str | None = None


DEEP = nested_schema(MAX_JSON_DEPTH)  # 2 levels per step: past the limit
BAD_SCHEMA = {"type": "array", "uniqueItems": True}
STOPS = [f"s{i}" for i in range(65)]  # one past --max-stop-strings
CASES = [
    Case("negative temperature", {"temperature": -0.5}, {"temperature": -0.5},
         "sampling_params.temperature", "temperature", "temperature must be >= 0"),
    Case("top_p zero", {"top_p": 0}, {"top_p": 0}, "sampling_params.top_p", "top_p",
         "top_p must be in (0, 1]"),
    Case("top_k zero", {"top_k": 0}, {"top_k": 0}, "sampling_params.top_k", "top_k", "top_k must be -1"),
    Case("n past --max-n", {"n": 129}, {"n": 129}, "sampling_params.n", "n", "(--max-n)"),
    Case("too many stop strings", {"stop": STOPS}, {"stop": STOPS}, "sampling_params.stop", "stop",
         "--max-stop-strings"),
    Case("stop token id outside the vocabulary", {"stop_token_ids": [VOCAB]}, {"stop_token_ids": [VOCAB]},
         "sampling_params.stop_token_ids", "stop_token_ids", f"outside [0, {VOCAB})"),
    Case("max_new_tokens past the context", {"max_new_tokens": CONTEXT_LEN}, {"max_tokens": CONTEXT_LEN},
         "max_new_tokens", "max_tokens", f"exceeds the context length {CONTEXT_LEN}"),
    # Checked on the server only before the builder: every token a stop token, so no output can
    # reach min_new_tokens.
    Case("min_new_tokens no output can honour",
         {"min_new_tokens": 2, "stop_token_ids": list(range(VOCAB)), "max_new_tokens": 4},
         {"min_tokens": 2, "stop_token_ids": list(range(VOCAB)), "max_tokens": 4},
         "sampling_params.min_new_tokens", "min_tokens", "cannot be honoured"),
    # The constrained minimum length: found by the scheduler from the compiled grammar, and a
    # ValueError from the Engine as a 400 over HTTP (the Engine used to answer a silent abort).
    Case("budget below the constraint's shortest output", {"regex": "[a-z]{12}", "max_new_tokens": 2},
         {"regex": "[a-z]{12}", "max_tokens": 2}, "max_new_tokens", "max_tokens",
         "2 is fewer than the"),
    Case("invalid regex", {"regex": "([a-z"}, {"regex": "([a-z"}, "regex", "regex", "regex"),
    Case("two constraints", {"regex": "a", "ebnf": 'root ::= "a"'}, {"regex": "a", "ebnf": 'root ::= "a"'},
         "sampling_params", None, "only one of regex, json_schema and ebnf"),
    Case("unsupported schema keyword", {"json_schema": json.dumps(BAD_SCHEMA)},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
         "json_schema", "response_format", "unsupported keyword 'uniqueItems'", chat=True),
    Case("schema nested too deep", {"json_schema": json.dumps(DEEP)},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}},
         "json_schema", "response_format", f"{MAX_JSON_DEPTH} levels", chat=True, code="json_too_deep"),
    Case("priority out of range", {}, {"priority": 2**40}, "priority", "priority",
         "priority must be an integer", args={"priority": 2**40}),
    Case("top logprobs past --max-logprobs", {}, {"logprobs": 21}, "top_logprobs_num", "logprobs",
         "(--max-logprobs)", args={"return_logprob": True, "top_logprobs_num": 21}),
    Case("prompt longer than the context", {}, {"prompt": "ab " * 400}, "text", "prompt",
         f"longer than the context length {CONTEXT_LEN}", args={"text": "ab " * 400}),
    # Refused by its length in characters before it is tokenized, offline too (was server-only).
    Case("prompt text no tokenization can fit", {}, {"prompt": "x" * 200_000}, "text", "prompt",
         f"200000 characters cannot fit the context length {CONTEXT_LEN}", args={"text": "x" * 200_000},
         code="context_length_exceeded"),
]  # fmt: skip


def openai_message(native: str) -> str:
    """The native message under the OpenAI request's names, as the /v1 endpoints word it."""
    message = native.removeprefix("sampling_params: ").replace("sampling_params.", "")
    renamed = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs_num": "logprobs"}
    for name, openai_name in renamed.items():
        message = message.replace(name, openai_name)
    return message


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[rt.Engine]:
    with rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        context_length=CONTEXT_LEN,
        max_total_tokens=MAX_TOTAL_TOKENS,
        log_level="warning",
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch_server(
        tmp_path_factory.mktemp("request_builder"),
        *("--model-path", str(tiny_llama_dir), "--context-length", str(CONTEXT_LEN)),
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def engine_error(engine: rt.Engine, case: Case) -> ValueError:
    args = dict(case.args)
    prompt = args.pop("text", PROMPT)
    before = engine.scheduler.stats.num_requests
    with pytest.raises(ValueError) as e:
        engine.generate(prompt, case.sampling_params, **args)
    # Refused before it ran, or (the constrained minimum length) when its grammar compiled.
    assert engine.scheduler.stats.num_requests - before <= 1
    assert not engine.scheduler.has_work()
    return e.value


def native_error(server: Server, case: Case) -> dict[str, Any]:
    body = {"text": PROMPT, "sampling_params": case.sampling_params} | case.args
    r = httpx.post(f"{server.url}/generate", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def openai_error(client: openai.OpenAI, case: Case) -> dict[str, Any]:
    """The error of the OpenAI request, sent with the official client (non-standard fields in its
    extra_body, as SGLang's and vLLM's users send them)."""
    known = {"max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "prompt", "response_format"}
    fields = {k: v for k, v in case.openai.items() if k in known}
    extra = {k: v for k, v in case.openai.items() if k not in known}
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        if case.chat:
            messages = [{"role": "user", "content": PROMPT}]
            client.chat.completions.create(model=model, messages=messages, extra_body=extra, **fields)
        else:
            fields.setdefault("prompt", PROMPT)
            client.completions.create(model=model, extra_body=extra, **fields)
    assert e.value.status_code == 400
    return e.value.body  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_same_bad_input_same_error_everywhere(
    engine: rt.Engine, server: Server, client: openai.OpenAI, case: Case
) -> None:
    offline = engine_error(engine, case)
    native = native_error(server, case)
    v1 = openai_error(client, case)
    assert case.words in str(offline), offline
    if "text" not in case.args:
        assert native["message"] == str(offline)
    assert native["param"] == case.param and case.words in native["message"], native
    # The Engine's prompt argument is `prompt`, /generate's `text`.
    offline_param = "prompt" if case.param == "text" else case.param
    assert getattr(offline, "param", offline_param) == offline_param
    assert v1["param"] == case.openai_param, v1
    if case.code == "json_too_deep":  # on /v1 the body's own nesting guard answers first
        assert case.words in v1["message"], v1
    elif case.chat and case.openai_param == "response_format":
        assert v1["message"] == "response_format." + openai_message(native["message"])
    elif "text" not in case.args:
        assert v1["message"] == openai_message(native["message"]), v1
    if case.code is not None:
        assert native["code"] == v1["code"] == case.code
    assert native["type"] == v1["type"] == "invalid_request_error"


@pytest.mark.slow
def test_nothing_leaks_after_the_bad_inputs(engine: rt.Engine, server: Server) -> None:
    """Refused requests leave both runtimes whole and serving."""
    ok = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert len(engine.generate(PROMPT, ok)["output_ids"]) == 3
    r = httpx.post(f"{server.url}/generate", json={"text": PROMPT, "sampling_params": ok}, headers=HEADERS)
    assert r.status_code == 200 and r.json()["output_ids"] == engine.generate(PROMPT, ok)["output_ids"]
    assert_no_leak(wait_idle(server))


# -- the builder alone --------------------------------------------------------------------------
POLICY = RequestPolicy.of(RequestLimits(VOCAB, CONTEXT_LEN, 4096), [0], {}, ServerConfig())


def grammar_of(constraint: Constraint) -> str:
    return f"checked {constraint.kind}"


def test_samples_share_the_prompt_and_differ_in_rid_and_seed() -> None:
    """n samples: rid `rid-i` and seed + i (so a seeded request gives the same n outputs from every
    entry point), each with n == 1, the prompt's checked grammar and its logprob arguments."""
    lp = LogprobArgs(True, 1, 2)
    params = {"n": 3, "seed": 7, "regex": "[ab]+", "max_new_tokens": 8}
    (built,) = build_requests([PromptArgs([1, 2, 3], params, "r", lp, 5, "s1")], POLICY, grammar_of)
    assert built.rid == "r" and built.params.n == 3
    assert [m.rid for m in built.samples] == ["r-0", "r-1", "r-2"]
    assert [m.seed for m in built.samples] == [7, 8, 9]
    for m in built.samples:
        assert m.sampling_params.n == 1 and m.grammar == "checked regex" and m.input_ids == [1, 2, 3]
        assert (m.return_logprob, m.logprob_start_len, m.top_logprobs_num) == (True, 1, 2)
        assert (m.priority, m.session_id) == (5, "s1")
    (one,) = build_requests([PromptArgs([1], {"max_new_tokens": 1}, "x")], POLICY, grammar_of)
    assert [m.rid for m in one.samples] == ["x"] and one.samples[0].grammar is None
    assert not one.samples[0].stream  # unless the entry point streams the response
    (streamed,) = build_requests([PromptArgs([1], {"n": 2}, stream=True)], POLICY, grammar_of)
    assert [m.stream for m in streamed.samples] == [True, True]


def test_one_bad_prompt_refuses_the_batch_and_checks_nothing_twice() -> None:
    checked: list[Constraint] = []

    def spy(constraint: Constraint) -> str:
        checked.append(constraint)
        return grammar_of(constraint)

    prompts, single = native_prompts(
        ["a", "b"], None, [{"regex": "a"}, {"temperature": -1}], None, False, None, None, None, None,
        lambda t: [ord(t)], "text",
    )  # fmt: skip
    assert not single and [p.input_ids for p in prompts] == [[97], [98]]
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        build_requests(prompts, POLICY, spy)
    assert checked == [Constraint("regex", "a")]


def test_a_rid_given_twice_is_refused() -> None:
    prompts = [PromptArgs([1], None, "same"), PromptArgs([2], None, "same")]
    with pytest.raises(InvalidRequest, match="rid: 'same' is given to more than one request") as e:
        build_requests(prompts, POLICY, grammar_of)
    assert e.value.param == "rid"


def test_a_refused_constraint_names_its_field() -> None:
    def refuse(constraint: Constraint) -> str:
        raise constraint.error("nope")

    with pytest.raises(InvalidRequest, match=r"^sampling_params\.ebnf: nope$") as e:
        build_requests([PromptArgs([1], {"ebnf": "root ::= x"})], POLICY, refuse)
    assert e.value.param == "ebnf"
