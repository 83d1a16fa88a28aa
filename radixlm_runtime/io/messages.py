"""Everything that crosses the zmq sockets between the HTTP process and the scheduler process.

Messages are msgspec Structs encoded with msgpack: typed, fast, and never pickle, so a peer can
only ever send data, not code. Requests and replies are tagged unions so one socket carries all kinds.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import msgspec

from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.step import TopLogprobs

# -- HTTP process -> scheduler ------------------------------------------------------------------
ProgramId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ProgramCall(msgspec.Struct, forbid_unknown_fields=True):
    """Where a request sits in the call graph of the @function program run that sent it, as the
    frontend traced it: the run, this call's id in it, the call it follows (the one before it in
    its stream, or, first in a forked branch, the call the fork came after) and the variable or
    primitive it serves. radixlm's extension of the native API; the dashboard draws the graph."""

    run: ProgramId
    call: ProgramId
    parent: ProgramId | None = None
    name: Annotated[str, msgspec.Meta(max_length=256)] = ""


class GenerateReq(msgspec.Struct, tag="generate"):
    """One tokenized, validated request (one of n samples): what both the HTTP server and the
    offline Engine send the scheduler, which builds its Req from it."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int | None = None  # this sample's seed (the params' seed + its index), None: none given
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    session_id: str | None = None
    priority: int = 0  # used with --enable-priority-scheduling
    # The constraint's grammar as the request builder checked it (constrained/backend.py
    # check_constraint): text, so it crosses the socket as data, and the scheduler compiles it
    # without parsing the constraint again. None: unconstrained, or sent unchecked (checked there).
    grammar: str | None = None
    program_call: ProgramCall | None = None
    # The client reads the tokens as they come (a streamed response): the gaps between its steps are
    # seen, so a prefill beside it is paced (scheduler/step_budget.py); otherwise only the end is.
    stream: bool = False


def sample_request(
    rid: str,
    index: int,
    input_ids: list[int],
    params: SamplingParams,
    return_logprob: bool = False,
    logprob_start_len: int = -1,
    top_logprobs_num: int = 0,
    session_id: str | None = None,
    priority: int = 0,
    grammar: str | None = None,
    program_call: ProgramCall | None = None,
    stream: bool = False,
) -> GenerateReq:
    """Sample `index` of a prompt's n as a scheduler request: rid `rid-index` and seed `seed + index`
    when n > 1, so a seeded request gives the same n outputs whichever entry point sent it."""
    n = params.n
    return GenerateReq(
        rid=rid if n == 1 else f"{rid}-{index}",
        input_ids=input_ids,
        sampling_params=dataclasses.replace(params, n=1),
        # Reduced as the sampler reduces seeds, so seed + index stays a 64-bit value on the wire.
        seed=None if params.seed is None else (params.seed + index) % 2**64,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        session_id=session_id,
        priority=priority,
        grammar=grammar,
        program_call=program_call,
        stream=stream,
    )


class AbortReq(msgspec.Struct, tag="abort"):
    rid: str


class FlushCacheReq(msgspec.Struct, tag="flush_cache"):
    call_id: int


class ServerInfoReq(msgspec.Struct, tag="server_info"):
    call_id: int


class CloseSessionReq(msgspec.Struct, tag="close_session"):
    """Answered with ok=False when no such session is open."""

    call_id: int
    session_id: str


class HealthProbe(msgspec.Struct, tag="health_probe"):
    """Answered as soon as the loop sees it, proving the scheduler loop is alive, not just its process."""

    call_id: int


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class DashboardReq(msgspec.Struct, tag="dashboard"):
    """A bounded snapshot for the dashboard (server/dashboard_snapshot.py), answered in a
    CallResult's info: view "tree" (the radix tree, breadth first), "node" (one node's path and the
    requests whose prompts contain it), "requests" (live and recent requests) or "request" (one,
    with its whole prompt). text_tokens bounds the token ids sent per node or prompt (0: none,
    for --dashboard-redact)."""

    call_id: int
    view: Literal["tree", "node", "requests", "request"]
    max_nodes: int = 2000
    max_depth: int = 64
    text_tokens: int = 32
    max_recent: int = 100
    node_id: int = -1
    rid: str = ""


ToScheduler = (
    GenerateReq
    | AbortReq
    | FlushCacheReq
    | ServerInfoReq
    | CloseSessionReq
    | HealthProbe
    | DashboardReq
    | Shutdown
)


# -- scheduler -> HTTP process ------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    """Sent once the model is loaded; carries what the HTTP side needs to validate requests."""

    pid: int
    model_path: str
    context_length: int
    max_total_tokens: int
    vocab_size: int


class ReqOutput(msgspec.Struct):
    """What one request gained in one step. Token and logprob lists hold only the new entries
    (several tokens after a jump-forward; tokens already sent never change, so the receiver only
    appends); input logprobs come once, with the request's first output."""

    rid: str
    new_token_ids: list[int]
    finished_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[float] = []
    output_top_logprobs: list[TopLogprobs] = []
    input_token_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None
    # Seconds from the scheduler receiving the request to its first scheduled step; None until then.
    queue_time: float | None = None
    # Speculative decoding totals so far (scheduler/speculative.py); all 0 when it never drafted.
    spec_verify_ct: int = 0
    spec_draft_token_num: int = 0
    spec_accept_token_num: int = 0


class BatchOut(msgspec.Struct, tag="batch"):
    """All request outputs of one scheduler step plus the queue sizes after it (for /metrics)."""

    outputs: list[ReqOutput]
    num_running: int
    num_waiting: int


class CallResult(msgspec.Struct, tag="call_result"):
    """Reply to a FlushCacheReq, ServerInfoReq, CloseSessionReq, HealthProbe or DashboardReq with the
    same call_id."""

    call_id: int
    ok: bool
    info: dict[str, Any] = {}


FromScheduler = Ready | BatchOut | CallResult

_encoder = msgspec.msgpack.Encoder()
_to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
_from_scheduler = msgspec.msgpack.Decoder(FromScheduler)


def encode(msg: ToScheduler | FromScheduler) -> bytes:
    return _encoder.encode(msg)


def decode_to_scheduler(data: bytes) -> ToScheduler:
    return _to_scheduler.decode(data)


def decode_from_scheduler(data: bytes) -> FromScheduler:
    return _from_scheduler.decode(data)
