"""The offline engine: the whole runtime in the caller's process, mirroring SGLang's `Engine`.

It sends the scheduler the same messages the HTTP server sends and formats the same outputs, so
the two entry points accept, run and answer requests identically.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from radixlm_runtime.constrained.checker import GrammarChecker
from radixlm_runtime.entrypoints.runtime import build_scheduler
from radixlm_runtime.io.limits import RequestLimits
from radixlm_runtime.io.messages import GenerateReq
from radixlm_runtime.io.outputs import OutputState, native_output
from radixlm_runtime.io.request_builder import RequestPolicy, build_requests, native_prompts
from radixlm_runtime.io.tokenizer import PromptEncoder, decode_output, eos_token_ids, load_tokenizer
from radixlm_runtime.models.config import generation_sampling_defaults
from radixlm_runtime.models.loader import resolve_model_path
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger, setup_logging

logger = get_logger(__name__)

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
ParamsArg = dict[str, Any] | list[dict[str, Any]] | None

# Steps that run nothing for this long, with requests pending, are a scheduling deadlock: the
# offline engine has no other input that could unblock it, so it raises instead of spinning.
STALL_LIMIT_S = 60.0


class Engine:
    """`Engine()` runs the embedded default model; keyword arguments are ServerArgs flags."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        setup_logging(self.server_args.log_level)
        t0 = time.perf_counter()
        self.model_dir = resolve_model_path(self.server_args.engine.model_path)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.sampling_defaults = generation_sampling_defaults(
            self.model_dir, self.server_args.engine.sampling_defaults
        )
        self.scheduler = build_scheduler(self.model_dir, self.server_args, self.tokenizer)
        self.runner = self.scheduler.runner
        info = self.scheduler.runner_info
        limits = RequestLimits(info.vocab_size, info.context_len, info.max_total_tokens)
        # The server's checks, bounds included (io/request_builder.py): the same input gets the
        # same answer offline and over HTTP.
        eos = eos_token_ids(self.tokenizer, [])
        self.policy = RequestPolicy.of(limits, eos, self.sampling_defaults, self.server_args.server)
        self.encode = PromptEncoder(self.tokenizer, info.context_len)
        self.grammars = GrammarChecker(self.server_args.scheduler.grammar_backend)
        logger.info("engine ready in %.2fs (model %s)", time.perf_counter() - t0, self.model_dir)

    # -- public API ---------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: ParamsArg = None,
        input_ids: InputIds = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        session_id: str | None = None,
        priority: int | list[int] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generates for one prompt (returns a dict, or a list of n dicts when n > 1) or a batch
        (returns a list, n outputs per prompt in order). Everything is validated before anything runs.
        The logprob arguments take one value for the batch or a list with one per prompt.

        With session_id, the KV of each finished sequence stays pinned for the session's next call
        (a program whose prompts extend each other) until close_session or the session timeout.
        priority (one for the batch or one per prompt) orders admission under
        enable_priority_scheduling."""
        messages, single = self._build_requests(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            session_id,
            priority,
        )
        states = self._submit(messages)
        self._run(states)
        outs = [self._output(states[m.rid], return_text_in_logprobs) for m in messages]
        return outs[0] if single and len(outs) == 1 else outs

    def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        session_id: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Yields {"text": cumulative text, "output_ids", "meta_info"} after every step that adds
        tokens: one, or several when jump-forward appends a constraint's forced text. Tokens once
        yielded are never changed, so output_ids only ever grows."""
        messages, _ = self._build_requests(
            prompt, sampling_params, input_ids, False, None, None, None, session_id, stream=True
        )
        if len(messages) != 1:
            raise ValueError("generate_stream takes one prompt with n == 1")
        states = self._submit(messages)
        state = states[messages[0].rid]
        while not state.finished:
            if state.req.rid in self._step(states):
                if state.finished:
                    self._drain()
                    _raise_if_refused(state)
                yield self._output(state, False)

    def flush_cache(self) -> bool:
        ok = self.scheduler.flush_cache()
        if not ok:
            logger.warning("flush_cache refused: requests are still running")
        return ok

    def close_session(self, session_id: str) -> bool:
        """Releases the session's pinned KV; False when no such session is open (never opened,
        closed already, or expired)."""
        return self.scheduler.close_session(session_id)

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": str(self.model_dir), **self.scheduler.info()}

    def shutdown(self) -> None:
        """Finishes the disk tier's writes and lets go of the runtime."""
        if self.scheduler is not None:
            self.scheduler.close()
        self.scheduler = None  # type: ignore[assignment]
        self.runner = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the request path ---------------------------------------------------------------------
    def _submit(self, messages: list[GenerateReq]) -> dict[str, OutputState]:
        states = {m.rid: OutputState(req=m) for m in messages}
        for m in messages:
            self.scheduler.submit(m)
        return states

    def _step(self, states: dict[str, OutputState]) -> set[str]:
        """Runs one scheduler step; returns the rids of the requests that progressed in it."""
        if not self.scheduler.has_work():
            raise RuntimeError("scheduler went idle with requests still pending (a runtime bug)")
        progressed: set[str] = set()
        for out in self.scheduler.step():
            state = states.get(out.rid)
            if state is not None:
                state.apply(out)
                progressed.add(out.rid)
        if self.scheduler.stalled_s() > STALL_LIMIT_S:
            info = self.scheduler.info()
            raise RuntimeError(
                f"no step ran for {STALL_LIMIT_S:.0f}s with {info['num_waiting']} requests waiting and "
                f"{info['free_tokens']} free KV tokens (a runtime bug)"
            )
        return progressed

    def _run(self, states: dict[str, OutputState]) -> None:
        """Steps until every request finished; a request the scheduler refused (a field at fault)
        raises its error, as the server answers it with a 400, after the others are aborted."""
        pending = set(states)
        refused: OutputState | None = None
        while pending:
            for rid in self._step(states):
                if not states[rid].finished:
                    continue
                pending.discard(rid)
                if refused is None and _refusal(states[rid]) is not None:
                    refused = states[rid]
                    for other in pending:
                        self.scheduler.abort(other)
        self._drain()
        if refused is not None:
            _raise_if_refused(refused)

    def _drain(self) -> None:
        """Under overlap scheduling the step launched last can serve no live request (its requests
        finished in the step before it): reads it back, so the engine is idle between calls, its
        KV and counters settled."""
        while self.scheduler.has_work() and not self.scheduler.num_live():
            self.scheduler.step()

    def _build_requests(
        self,
        prompt: Prompt,
        sampling_params: ParamsArg,
        input_ids: InputIds,
        return_logprob: bool | list[bool],
        logprob_start_len: int | list[int] | None,
        top_logprobs_num: int | list[int] | None,
        rid: str | list[str] | None,
        session_id: str | None,
        priority: int | list[int] | None = None,
        stream: bool = False,
    ) -> tuple[list[GenerateReq], bool]:
        """The scheduler messages of a generate call, n per prompt in order (io/request_builder.py)."""
        prompts, single = native_prompts(
            prompt,
            input_ids,
            sampling_params,
            rid,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            priority,
            session_id,
            self.encode,
            "prompt",
            stream=stream,
        )
        built = build_requests(prompts, self.policy, self.grammars.check)
        return [m for p in built for m in p.samples], single

    def _output(self, state: OutputState, text_in_logprobs: bool) -> dict[str, Any]:
        sp = state.req.sampling_params
        text = decode_output(
            self.tokenizer, state.output_ids, state.finished_reason, sp.skip_special_tokens, sp.no_stop_trim
        )
        return native_output(state, text, self.tokenizer, text_in_logprobs)


def _refusal(state: OutputState) -> ValueError | None:
    return state.finished_reason.refusal() if state.finished_reason is not None else None


def _raise_if_refused(state: OutputState) -> None:
    error = _refusal(state)
    if error is not None:
        raise error
