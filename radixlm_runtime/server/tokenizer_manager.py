"""The HTTP process's side of the runtime: validate and tokenize requests, hand them to the
scheduler process, and turn its per-step token outputs back into (streamed) text.

Every request gets an asyncio queue that the one receive loop wakes whenever the scheduler reports
progress, so thousands of concurrent requests cost one socket reader, not one thread each.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from radixlm_runtime.constrained.checker import GrammarChecker
from radixlm_runtime.io import messages as msg
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.limits import InvalidRequest, RequestLimits
from radixlm_runtime.io.outputs import OutputState
from radixlm_runtime.io.request_builder import PromptArgs, PromptRequest, RequestPolicy, build_requests
from radixlm_runtime.io.stop_holdback import StopHoldback
from radixlm_runtime.io.tokenizer import PromptEncoder, decode_output, eos_token_ids, load_tokenizer
from radixlm_runtime.models.config import generation_sampling_defaults
from radixlm_runtime.server.errors import RequestError
from radixlm_runtime.server.http_utils import invalid
from radixlm_runtime.server.metrics import ServerMetrics
from radixlm_runtime.server.scheduler_process import run_scheduler_process
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)
T = TypeVar("T")

# How often the watchdog checks that the scheduler process is alive.
WATCHDOG_INTERVAL_S = 0.5
# How long the server keeps answering (503) after the scheduler died, before it exits.
DEATH_EXIT_DELAY_S = 1.0
# How long a control call (flush, server info) may wait for the scheduler to finish its step.
CALL_TIMEOUT_S = 60.0
# A scheduler loop that does not answer a probe within this long (one step at most) is hung.
HEALTH_PROBE_TIMEOUT_S = 10.0
# Suggested client back-off when the queue is full.
RETRY_AFTER_S = 1
# Threads that tokenize, render chat templates and detokenize off the event loop. HF fast
# tokenizers release the GIL while encoding, so large prompts run in parallel with serving.
TOKENIZER_THREADS = 8
# Threads that check new constraints: they bound the CPU a burst of bad constraints can take from
# serving (constrained/checker.py).
CONSTRAINT_CHECK_THREADS = 2
# How the drain (server/drain.py) ends the requests still running at --shutdown-timeout.
DRAIN_ABORT = FinishReason.abort("the server is shutting down (--shutdown-timeout passed)")


class SchedulerDied(RuntimeError):
    pass


class IncrementalDetokenizer:
    """Decodes a growing token list into text a chunk at a time. Each decode starts a few tokens back
    so merges and multi-byte characters spanning tokens render as in a full decode, and text ending in
    an incomplete character (U+FFFD) is held back until the next token completes it."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def update(self, ids: list[int]) -> str:
        decode = lambda part: self.tokenizer.decode(part, skip_special_tokens=self.skip_special_tokens)
        prefix_text = decode(ids[self.prefix_offset : self.read_offset])
        new_text = decode(ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
        return self.text


@dataclass(eq=False)
class RequestState(OutputState):
    """A request's accumulated outputs, updated by the receive loop, read by its handler."""

    base_rid: str  # the rid its n samples share (/abort_request takes either)
    stream: bool
    detok: IncrementalDetokenizer
    holdback: StopHoldback
    wake: asyncio.Queue[Exception | None] = field(default_factory=asyncio.Queue)
    text: str = ""  # streamed so far; the final, stop-trimmed text once finished
    last_token_time: float | None = None
    queue_time_seen: bool = False

    @property
    def rid(self) -> str:
        return self.req.rid


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, model_dir: Path, tokenizer: Any | None = None) -> None:
        """tokenizer None: loaded by start_scheduler while the scheduler process starts (in parallel:
        most of both is imports)."""
        self.args = server_args
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.sampling_defaults = generation_sampling_defaults(model_dir, server_args.engine.sampling_defaults)
        self.metrics = ServerMetrics()
        self.states: dict[str, RequestState] = {}
        self.ready: msg.Ready | None = None
        self.dead = False
        # Set by abort_all at shutdown: no request starts after it.
        self.closed = False
        self._cpu = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        # Text -> prompt ids with the context's character bound, once the scheduler is ready.
        self._encoder: PromptEncoder | None = None
        # When the scheduler last showed progress (a step's outputs, or work sent to an idle loop).
        self.last_progress = time.monotonic()
        self.constraints = GrammarChecker(server_args.scheduler.grammar_backend, CONSTRAINT_CHECK_THREADS)
        # What requests are checked against (io/request_builder.py), once the scheduler is ready.
        self.policy: RequestPolicy | None = None
        self._calls: dict[int, asyncio.Future[msg.CallResult]] = {}
        self._call_ids = itertools.count()
        self._ipc_dir = tempfile.mkdtemp(prefix="radixlm-")
        to_sched = f"ipc://{self._ipc_dir}/to_scheduler"
        from_sched = f"ipc://{self._ipc_dir}/from_scheduler"
        # Sends use a plain socket so that an abort can go out from a cancelled handler's `finally`
        # without awaiting; receives use the asyncio socket.
        self._ctx = zmq.Context()
        self._send_sock = self._ctx.socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.SNDHWM, 0)
        self._send_sock.bind(to_sched)
        self._actx = zmq.asyncio.Context()
        self._recv_sock = self._actx.socket(zmq.PULL)
        self._recv_sock.bind(from_sched)
        self.proc = mp.get_context("spawn").Process(
            target=run_scheduler_process,
            args=(server_args, model_dir, to_sched, from_sched),
            name="radixlm-scheduler",
            daemon=False,
        )
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ----------------------------------------------------------------------------
    def start_scheduler(self, timeout_s: float = 600.0) -> msg.Ready:
        """Starts the scheduler process and blocks until it reports the model loaded."""
        self.proc.start()
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_dir)
        sync_recv = zmq.Socket.shadow(self._recv_sock.underlying)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sync_recv.poll(200):
                ready = msg.decode_from_scheduler(sync_recv.recv())
                if not isinstance(ready, msg.Ready):
                    raise RuntimeError(f"scheduler sent {type(ready).__name__} before Ready")
                self.ready = ready
                limits = RequestLimits(ready.vocab_size, ready.context_length, ready.max_total_tokens)
                eos = eos_token_ids(self.tokenizer, [])
                self.policy = RequestPolicy.of(limits, eos, self.sampling_defaults, self.args.server)
                self._encoder = PromptEncoder(self.tokenizer, ready.context_length)
                return ready
            if not self.proc.is_alive():
                raise RuntimeError(f"scheduler process exited with code {self.proc.exitcode} while loading")
        raise TimeoutError(f"scheduler not ready after {timeout_s:.0f}s")

    def start_background(self, on_scheduler_death: Callable[[], None]) -> None:
        """Starts the receive loop and the watchdog; must run inside the server's event loop."""
        self._tasks = [
            asyncio.create_task(self._recv_loop()),
            asyncio.create_task(self._watchdog(on_scheduler_death)),
        ]
        self.constraints.warm_up()

    def shutdown(self) -> None:
        """Stops the scheduler process (politely, then by force) and releases the sockets."""
        for task in self._tasks:
            task.cancel()
        self.constraints.shutdown()
        self._cpu.shutdown(wait=False, cancel_futures=True)
        if self.proc.is_alive():
            self._send(msg.Shutdown(), quiet=True)
            self.proc.join(5)
        if self.proc.is_alive():  # it ignores SIGTERM (see run_scheduler_process)
            self.proc.kill()
            self.proc.join()
        self._send_sock.close(linger=0)
        self._recv_sock.close(linger=0)
        self._ctx.term()
        self._actx.term()
        for name in ("to_scheduler", "from_scheduler"):
            Path(self._ipc_dir, name).unlink(missing_ok=True)
        os.rmdir(self._ipc_dir)

    def _send(self, message: msg.ToScheduler, quiet: bool = False) -> None:
        """Never blocks: a PUSH socket with no connected peer (the scheduler died, or has not
        connected) would block the event loop, and with it the watchdog that notices the death."""
        try:
            self._send_sock.send(msg.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            if not quiet:
                raise RequestError("the scheduler process is not accepting requests", status=503) from None

    async def _watchdog(self, on_death: Callable[[], None]) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        self.dead = True
        logger.error("scheduler process died (exit code %s); failing in-flight requests", self.proc.exitcode)
        err = SchedulerDied("the scheduler process died")
        for state in list(self.states.values()):
            state.wake.put_nowait(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        # Keep answering a moment longer: in-flight handlers deliver their errors and health probes
        # see 503 before the listening socket closes.
        await asyncio.sleep(DEATH_EXIT_DELAY_S)
        on_death()

    async def _recv_loop(self) -> None:
        while True:
            out = msg.decode_from_scheduler(await self._recv_sock.recv())
            if isinstance(out, msg.BatchOut):
                self.last_progress = time.monotonic()
                self.metrics.num_running.set(out.num_running)
                self.metrics.num_waiting.set(out.num_waiting)
                now = time.monotonic()
                for o in out.outputs:
                    state = self.states.get(o.rid)
                    if state is not None and not state.finished:  # abort_all may have ended it
                        self._apply(state, o, now)
            elif isinstance(out, msg.CallResult):
                fut = self._calls.pop(out.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(out)

    def _apply(self, state: RequestState, o: msg.ReqOutput, now: float) -> None:
        m = self.metrics
        if o.queue_time is not None and not state.queue_time_seen:
            state.queue_time_seen = True
            m.queue_time.observe(o.queue_time)
        if o.new_token_ids:
            since_last = None if state.last_token_time is None else now - state.last_token_time
            m.tokens_out(len(o.new_token_ids), now - state.arrival, since_last)
            state.last_token_time = now
        state.apply(o)
        if o.finished_reason is not None:
            m.request_ended(o.finished_reason.kind, o.prompt_tokens, o.cached_tokens, now - state.arrival)
            if o.spec_verify_ct:
                m.speculation_ended(o.spec_verify_ct, o.spec_draft_token_num, o.spec_accept_token_num)
        state.wake.put_nowait(None)

    # -- validation and tokenization ----------------------------------------------------------
    async def run_cpu(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs fn (tokenizing, rendering a chat template) on the tokenizer threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, lambda: fn(*args, **kwargs))

    def tokenize(self, text: str, field: str = "prompt") -> list[int]:
        """A prompt's ids; a text too long to fit the context is refused (400 naming field) first."""
        assert self._encoder is not None
        try:
            return self._encoder(text, field)
        except InvalidRequest as e:
            raise invalid(e) from None

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat template's prompt; `tools` (OpenAI's tool objects) go to a template that takes them,
        `template_kwargs` are further variables for it (e.g. enable_thinking)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise RequestError("this model's tokenizer has no chat template", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
        except Exception as e:  # the template itself rejects the conversation (e.g. role order)
            raise RequestError(f"messages: the chat template rejected them: {e}", param="messages") from None
        assert self._encoder is not None
        try:
            self._encoder.check_chars(text, "messages")
        except InvalidRequest as e:
            raise invalid(e) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build(self, prompts: list[PromptArgs]) -> list[PromptRequest]:
        """The prompts' scheduler messages, every check applied (io/request_builder.py). Runs on
        the tokenizer threads (run_cpu): it may wait for a constraint check."""
        assert self.policy is not None
        return build_requests(prompts, self.policy, self.constraints.check)

    def check_capacity(self, num_requests: int) -> None:
        if self.dead:
            raise RequestError("the scheduler process died; the server is shutting down", status=503)
        if self.closed:
            raise RequestError("the server is shutting down", status=503, code="shutting_down")
        if len(self.states) + num_requests > self.args.server.max_queued_requests:
            self.metrics.rejected.inc()
            raise RequestError(
                f"server busy: {len(self.states)} requests in flight (max_queued_requests="
                f"{self.args.server.max_queued_requests}); retry later",
                status=503,
                code="server_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    async def generate(
        self, req: msg.GenerateReq, stream: bool, base_rid: str | None = None
    ) -> AsyncIterator[RequestState]:
        """Runs one sample (a message of io/request_builder.py; base_rid: the rid its prompt's
        samples share). When streaming, yields the state whenever new text is out (state.text is
        cumulative); always yields the finished state last. Leaving the iteration early (client
        gone, cancellation) aborts the request so its KV is freed."""
        sp = req.sampling_params
        rid = req.rid
        if rid in self.states:
            raise RequestError(f"rid {rid!r} is already in flight", param="rid")
        self.check_capacity(1)
        detok = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens)
        holdback = StopHoldback(sp.stop if stream else [])
        state = RequestState(base_rid or rid, stream, detok, holdback, req=req)
        if not self.states:
            self.last_progress = time.monotonic()
        self.states[rid] = state
        self.metrics.requests.inc()
        self.metrics.num_inflight.set(len(self.states))
        try:
            self._send(req)
            while True:
                err = await state.wake.get()
                while err is None and not state.wake.empty():
                    err = state.wake.get_nowait()
                if err is not None:
                    raise RequestError(f"request {rid} failed: {err}", status=503)
                if state.finished:
                    self._forget(rid)
                    _raise_if_refused(state.finished_reason)
                    state.text = decode_output(
                        self.tokenizer,
                        state.output_ids,
                        state.finished_reason,
                        sp.skip_special_tokens,
                        sp.no_stop_trim,
                    )
                    yield state
                    return
                if stream:
                    full = state.detok.update(state.output_ids)
                    text = full[: len(full) - state.holdback.update(full)]
                    if len(text) > len(state.text):
                        state.text = text
                        yield state
        finally:
            self._forget(rid)
            if not state.finished and not self.dead:
                self._send(msg.AbortReq(rid), quiet=True)

    def _forget(self, rid: str) -> None:
        """Stops tracking rid. A request abandoned unfinished (client gone, error) counts as an abort
        here: the scheduler's later report of its abort finds no state and is dropped."""
        state = self.states.pop(rid, None)
        self.metrics.num_inflight.set(len(self.states))
        if state is not None and not state.finished:
            prompt = state.prompt_tokens or len(state.req.input_ids)
            elapsed = time.monotonic() - state.arrival
            self.metrics.request_ended("abort", prompt, state.cached_tokens, elapsed)

    async def run(self, req: msg.GenerateReq, base_rid: str | None = None) -> RequestState:
        """Runs one sample to completion."""
        async with contextlib.aclosing(self.generate(req, False, base_rid)) as states:
            async for state in states:
                return state
        raise AssertionError("generate ended without a final state")

    def abort_all(self) -> int:
        """Ends every running request now with DRAIN_ABORT, as if the scheduler had reported it, so
        each handler still writes its final output; the scheduler is told to drop them. Returns how
        many were ended. No request starts afterwards."""
        self.closed = True
        now = time.monotonic()
        running = [st for st in self.states.values() if not st.finished]
        for st in running:
            self._send(msg.AbortReq(st.rid), quiet=True)
            prompt = st.prompt_tokens or len(st.req.input_ids)
            ended = msg.ReqOutput(st.rid, [], DRAIN_ABORT, prompt, len(st.output_ids), st.cached_tokens)
            self._apply(st, ended, now)
        return len(running)

    def abort(self, rid: str) -> bool:
        """Aborts rid, or all n samples sent under rid; False when nothing by that id is in flight."""
        hits = [s.rid for s in self.states.values() if rid in (s.rid, s.base_rid)]
        for r in hits:
            self._send(msg.AbortReq(r), quiet=True)
        return bool(hits)

    async def call(
        self, make: Callable[[int], msg.ToScheduler], timeout_s: float = CALL_TIMEOUT_S
    ) -> msg.CallResult:
        """Sends a control message and waits for the scheduler's reply to it."""
        if self.dead:
            raise RequestError("the scheduler process died", status=503)
        call_id = next(self._call_ids)
        fut: asyncio.Future[msg.CallResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(make(call_id))
            return await asyncio.wait_for(fut, timeout_s)
        except SchedulerDied as e:
            raise RequestError(str(e), status=503) from None
        except asyncio.TimeoutError:
            raise RequestError("the scheduler did not answer in time", status=503) from None
        finally:
            self._calls.pop(call_id, None)

    async def probe(self) -> None:
        """Raises (503) unless the scheduler loop itself answers, not merely its process exists.
        While requests run, the loop answers a probe only between steps (a long prefill step takes
        seconds), so then a step's outputs or the start of its work within the probe timeout count
        as the answer; a scheduler hung longer than that is probed, and fails it. So does a loop that
        answers but has run no step for a while with work waiting (scheduler_process.STALL_WARN_S)."""
        if self.states and time.monotonic() - self.last_progress < HEALTH_PROBE_TIMEOUT_S:
            return
        answer = await self.call(lambda i: msg.HealthProbe(i), HEALTH_PROBE_TIMEOUT_S)
        if not answer.ok:
            stalled = answer.info.get("stalled_s", 0.0)
            raise RequestError(
                f"the scheduler has run no step for {stalled:.0f}s with work waiting", status=503
            )

    async def server_info(self) -> dict[str, Any]:
        return (await self.call(lambda i: msg.ServerInfoReq(i))).info

    async def flush_cache(self) -> bool:
        return (await self.call(lambda i: msg.FlushCacheReq(i))).ok

    async def close_session(self, session_id: str) -> bool:
        """Releases the session's pinned KV; False when no such session is open."""
        return (await self.call(lambda i: msg.CloseSessionReq(i, session_id))).ok


def _raise_if_refused(reason: FinishReason | None) -> None:
    """An abort the scheduler blames on a request field (e.g. a regex that no token sequence of this
    tokenizer can spell) is the request's error: a 400 naming the field, not an empty answer."""
    error = reason.refusal() if reason is not None else None
    if error is not None:
        raise RequestError(str(error), param=error.param)


async def gather_cancelling(awaitables: list[Awaitable[Any]]) -> list[Any]:
    """asyncio.gather that cancels the siblings when one fails (or when the caller is cancelled),
    so no sub-request keeps running without a consumer."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleaves several streams (of request states, or tool-calling turns) as (stream index,
    item), in arrival order."""
    queue: asyncio.Queue[tuple[int, T | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(it) as states:  # type: ignore[type-var]
                async for state in states:
                    await queue.put((i, state))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def new_rid() -> str:
    return uuid.uuid4().hex
