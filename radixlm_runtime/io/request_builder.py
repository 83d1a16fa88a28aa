"""One request builder for every entry point.

The offline Engine (`Engine.generate`), SGLang's native `/generate` and OpenAI's `/v1/completions`
and `/v1/chat/completions` each map their own argument shapes onto `PromptArgs` (a prompt's token
ids plus SGLang-named arguments; OpenAI's after its field mapping) and call `build_requests`, which
runs every check in one order and returns the scheduler's `GenerateReq` messages. So all entry
points refuse the same inputs with the same message: a ValueError whose text starts with the field
(an `InvalidRequest` also carries it as `param`), which the HTTP layers answer with a 400.

Checks that need the compiled grammar and the vocabulary (the shortest output a constraint admits)
run in the scheduler; every entry point turns its refusal into the same error (io/finish.py
`FinishReason.refusal`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixlm_runtime.config import ServerConfig
from radixlm_runtime.constrained.constraint import Constraint, SchemaTooDeep
from radixlm_runtime.io.inputs import (
    LogprobArgs,
    check_priority,
    check_session_id,
    logprob_args,
    per_prompt,
    prompt_ids,
)
from radixlm_runtime.io.limits import InvalidRequest, RequestLimits
from radixlm_runtime.io.messages import GenerateReq, ProgramCall, sample_request
from radixlm_runtime.sampling.params import SamplingParams

# A constraint -> its checked grammar (constrained/checker.py GrammarChecker.check).
CheckGrammar = Callable[[Constraint], str]


@dataclass(frozen=True)
class RequestPolicy:
    """What every request is checked against: the model's limits, its recommended sampling
    defaults (generation_config.json), and the operator's bounds on what one request may cost."""

    limits: RequestLimits
    eos_ids: tuple[int, ...]
    sampling_defaults: dict[str, Any]
    # --max-n, --max-logprobs, --max-stop-strings, --max-stop-length (config.py ServerConfig)
    max_n: int
    max_logprobs: int
    max_stop_strings: int
    max_stop_length: int

    @classmethod
    def of(
        cls,
        limits: RequestLimits,
        eos_ids: list[int],
        sampling_defaults: dict[str, Any],
        server: ServerConfig,
    ) -> RequestPolicy:
        return cls(
            limits,
            tuple(eos_ids),
            sampling_defaults,
            server.max_n,
            server.max_logprobs,
            server.max_stop_strings,
            server.max_stop_length,
        )


@dataclass(frozen=True)
class PromptArgs:
    """One prompt's request, whichever entry point it came from: its token ids and its arguments
    under SGLang's names, still unchecked. prompt_field names the field the prompt came from
    ("text", "prompt", "messages" or "input_ids") in the errors about it."""

    input_ids: list[int]
    sampling_params: dict[str, Any] | SamplingParams | None = None
    rid: str | None = None
    logprob: LogprobArgs = LogprobArgs()
    priority: Any = None
    session_id: str | None = None
    prompt_field: str = "prompt"
    program_call: ProgramCall | None = None
    stream: bool = False  # the response is streamed (GenerateReq.stream)


@dataclass(frozen=True)
class PromptRequest:
    """One checked prompt as the scheduler messages of its n samples (sample i: rid `rid-i` and
    seed + i when n > 1); the entry point runs them and answers under `rid`."""

    rid: str
    params: SamplingParams  # the request's own, n included
    samples: list[GenerateReq]


def native_prompts(
    text: Any,
    input_ids: Any,
    sampling_params: Any,
    rid: Any,
    return_logprob: Any,
    logprob_start_len: Any,
    top_logprobs_num: Any,
    priority: Any,
    session_id: Any,
    tokenize: Callable[[str], list[int]],
    text_field: str,
    program_call: ProgramCall | None = None,
    stream: bool = False,
) -> tuple[list[PromptArgs], bool]:
    """SGLang's GenerateReqInput (the Engine's arguments and the /generate body; the prompt is
    `prompt` in one, `text` in the other) as one PromptArgs per prompt, and whether a single prompt
    was given: every other argument is one value for the batch or a list with one per prompt."""
    id_lists, single, prompt_field = prompt_ids(text, input_ids, tokenize, text_field)
    n = len(id_lists)
    params = per_prompt(sampling_params, n, "sampling_params")
    rids = per_prompt(rid, n, "rid")
    priorities = per_prompt(priority, n, "priority")
    logprobs = logprob_args(return_logprob, logprob_start_len, top_logprobs_num, n)
    prompts = [
        PromptArgs(ids, sp, r, lp, prio, session_id, prompt_field, program_call, stream)
        for ids, sp, r, lp, prio in zip(id_lists, params, rids, logprobs, priorities)
    ]
    return prompts, single


def build_requests(
    prompts: list[PromptArgs], policy: RequestPolicy, check_grammar: CheckGrammar
) -> list[PromptRequest]:
    """Every prompt as scheduler messages; nothing is built unless every prompt passes every check.
    check_grammar parses and checks a constraint once and returns the grammar the scheduler
    compiles (on the server it waits for a bounded pool, so call this off the event loop)."""
    built = [_build(p, policy, check_grammar) for p in prompts]
    seen: set[str] = set()
    for prompt in built:
        for m in prompt.samples:
            if m.rid in seen:
                raise InvalidRequest(f"rid: {m.rid!r} is given to more than one request", "rid")
            seen.add(m.rid)
    return built


def _build(p: PromptArgs, policy: RequestPolicy, check_grammar: CheckGrammar) -> PromptRequest:
    priority = check_priority(p.priority)
    if p.session_id is not None:
        check_session_id(p.session_id)
    lp = p.logprob
    if not 0 <= lp.top_logprobs_num <= policy.max_logprobs:
        raise InvalidRequest(
            f"top_logprobs_num must be in [0, {policy.max_logprobs}] (--max-logprobs), got "
            f"{lp.top_logprobs_num}",
            "top_logprobs_num",
        )
    sp = sampling_params(p.sampling_params, policy)
    grammar = _checked_grammar(sp.constraint, check_grammar)
    policy.limits.check(p.input_ids, sp, lp.logprob_start_len, p.prompt_field)
    rid = p.rid or uuid.uuid4().hex
    samples = [
        sample_request(
            rid,
            i,
            p.input_ids,
            sp,
            lp.return_logprob,
            lp.logprob_start_len,
            lp.top_logprobs_num,
            p.session_id,
            priority,
            grammar,
            p.program_call,
            p.stream,
        )
        for i in range(sp.n)
    ]
    return PromptRequest(rid, sp, samples)


def sampling_params(raw: dict[str, Any] | SamplingParams | None, policy: RequestPolicy) -> SamplingParams:
    """SamplingParams from a user dict (the model's defaults filling what it leaves unset), within
    the operator's bounds, checked before any per-sample or per-token work is done for it."""
    sp = SamplingParams.from_dict(
        _drop_empty_stop_regex(raw), policy.limits.vocab_size, policy.sampling_defaults
    )
    sp.check_min_new_tokens(policy.limits.vocab_size, list(policy.eos_ids))
    if sp.n > policy.max_n:
        raise InvalidRequest(
            f"sampling_params.n must be in [1, {policy.max_n}] (--max-n), got {sp.n}", "sampling_params.n"
        )
    if len(sp.stop) > policy.max_stop_strings:
        raise InvalidRequest(
            f"sampling_params.stop: at most {policy.max_stop_strings} stop strings (--max-stop-strings), "
            f"got {len(sp.stop)}",
            "sampling_params.stop",
        )
    longest = max(map(len, sp.stop), default=0)
    if longest > policy.max_stop_length:
        raise InvalidRequest(
            f"sampling_params.stop: stop strings may be at most {policy.max_stop_length} characters "
            f"(--max-stop-length), got one of {longest}",
            "sampling_params.stop",
        )
    return sp


def _checked_grammar(constraint: Constraint | None, check_grammar: CheckGrammar) -> str | None:
    """The constraint's checked grammar (None when unconstrained); a refusal names the field."""
    if constraint is None:
        return None
    try:
        return check_grammar(constraint)
    except SchemaTooDeep as e:
        raise InvalidRequest(str(e), constraint.kind, code="json_too_deep") from None
    except ValueError as e:
        raise InvalidRequest(f"sampling_params.{e}", constraint.kind) from None


def _drop_empty_stop_regex(raw: Any) -> Any:
    """SGLang's stop_regex is not implemented here. SGLang's frontend client sends it, empty, with
    every call, so an empty one is accepted (it asks for nothing); a set one is refused rather than
    silently ignored."""
    if not isinstance(raw, dict) or "stop_regex" not in raw:
        return raw
    if raw["stop_regex"]:
        raise InvalidRequest(
            "sampling_params.stop_regex is not supported by this server; use stop strings or a regex "
            "constraint",
            "sampling_params.stop_regex",
        )
    return {k: v for k, v in raw.items() if k != "stop_regex"}
