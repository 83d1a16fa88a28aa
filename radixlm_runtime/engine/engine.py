"""The offline engine: the whole runtime in the caller's process, mirroring SGLang's `Engine`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from radixlm_runtime.constrained import validate_constraint
from radixlm_runtime.engine.inputs import logprob_args, per_prompt, prompt_ids
from radixlm_runtime.engine.tokenizer import decode_output, encode_prompt, load_tokenizer
from radixlm_runtime.models.loader import resolve_model_path
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.scheduler.req import Req
from radixlm_runtime.scheduler.scheduler import Scheduler
from radixlm_runtime.scheduler.session import check_session_id
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger, setup_logging

logger = get_logger(__name__)

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
ParamsArg = dict[str, Any] | list[dict[str, Any]] | None


class Engine:
    """`Engine()` runs the embedded default model; keyword arguments are ServerArgs fields."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        setup_logging(self.server_args.log_level)
        t0 = time.perf_counter()
        self.model_dir = resolve_model_path(self.server_args.model_path)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.scheduler = Scheduler.build(self.model_dir, self.server_args, self.tokenizer)
        self.runner = self.scheduler.runner
        self.limits = self.scheduler.limits
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
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generates for one prompt (returns a dict, or a list of n dicts when n > 1) or a batch
        (returns a list, n outputs per prompt in order). Everything is validated before anything runs.
        The logprob arguments take one value for the batch or a list with one per prompt.

        With session_id, the KV of each finished sequence stays pinned for the session's next call
        (a program whose prompts extend each other) until close_session or the session timeout."""
        reqs, single = self._build_requests(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            session_id,
        )
        for req in reqs:
            self.scheduler.add_request(req)
        pending = {req.rid for req in reqs}
        while pending:
            for req in self._step():
                if req.finished:
                    pending.discard(req.rid)
        outs = [self._output(req, return_text_in_logprobs) for req in reqs]
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
        reqs, _ = self._build_requests(
            prompt, sampling_params, input_ids, False, None, None, None, session_id
        )
        if len(reqs) != 1:
            raise ValueError("generate_stream takes one prompt with n == 1")
        req = reqs[0]
        self.scheduler.add_request(req)
        while not req.finished:
            if any(r is req for r in self._step()):
                yield self._output(req, False)

    def _step(self) -> list[Req]:
        if not self.scheduler.has_work():
            raise RuntimeError("scheduler went idle with requests still pending (a runtime bug)")
        return self.scheduler.step()

    def flush_cache(self) -> bool:
        ok = self.scheduler.flush_cache()
        if not ok:
            logger.warning("flush_cache refused: requests are still running")
        return ok

    def close_session(self, session_id: str) -> bool:
        """Releases the session's pinned KV; False when no such session is open (never opened,
        closed already, or expired)."""
        check_session_id(session_id)
        return self.scheduler.cache.sessions.close(session_id)

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": str(self.model_dir), **self.scheduler.info()}

    def shutdown(self) -> None:
        self.scheduler = None  # type: ignore[assignment]
        self.runner = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- request building ---------------------------------------------------------------------
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
    ) -> tuple[list[Req], bool]:
        if session_id is not None:
            check_session_id(session_id)
        tokenize = lambda t: encode_prompt(self.tokenizer, t)
        id_lists, single, _ = prompt_ids(prompt, input_ids, tokenize, "prompt")
        n = len(id_lists)
        params_list = per_prompt(sampling_params, n, "sampling_params")
        rids = per_prompt(rid, n, "rid")
        logprobs = logprob_args(return_logprob, logprob_start_len, top_logprobs_num, n)

        reqs: list[Req] = []
        for ids, raw, base_rid, lp in zip(id_lists, params_list, rids, logprobs):
            sp = SamplingParams.from_dict(raw, self.runner.config.vocab_size)
            if sp.regex is not None or sp.json_schema is not None:
                try:
                    validate_constraint(sp.regex, sp.json_schema)
                except ValueError as e:
                    raise ValueError(f"sampling_params.{e}") from None
            self.limits.check(ids, sp, lp.logprob_start_len)
            base = base_rid or uuid.uuid4().hex
            for i in range(sp.n):
                seed = sp.seed + i if sp.seed is not None else None
                reqs.append(
                    Req(
                        rid=base if sp.n == 1 else f"{base}-{i}",
                        origin_input_ids=list(ids),
                        sampling_params=sp,
                        return_logprob=lp.return_logprob,
                        logprob_start_len=lp.logprob_start_len,
                        top_logprobs_num=lp.top_logprobs_num,
                        generator=self.scheduler.new_generator(seed),
                        session_id=session_id,
                    )
                )
        return reqs, single

    # -- outputs ------------------------------------------------------------------------------
    def _output(self, req: Req, text_in_logprobs: bool) -> dict[str, Any]:
        sp = req.sampling_params
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": req.prompt_len,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": max(req.cached_tokens, 0),
            "finish_reason": req.finished_reason,
            "e2e_latency": time.monotonic() - req.arrival_time,
        }
        if req.return_logprob:
            meta.update(self._logprob_meta(req, text_in_logprobs))
        return {
            "text": decode_output(
                self.tokenizer, req.output_ids, req.finished_reason, sp.skip_special_tokens, sp.no_stop_trim
            ),
            "output_ids": list(req.output_ids),
            "meta_info": meta,
        }

    def _logprob_meta(self, req: Req, text: bool) -> dict[str, Any]:
        def tok_text(tid: int) -> str | None:
            return self.tokenizer.decode([tid]) if text else None

        start = max(req.logprob_start_len, 0) if req.wants_input_logprobs else req.prompt_len
        in_ids = req.origin_input_ids[start:]
        return {
            "input_token_logprobs": [(lp, t, tok_text(t)) for lp, t in zip(req.input_token_logprobs, in_ids)],
            "input_top_logprobs": [
                None if top is None else [(lp, t, tok_text(t)) for lp, t in top]
                for top in req.input_top_logprobs
            ],
            "output_token_logprobs": [
                (lp, t, tok_text(t)) for lp, t in zip(req.output_token_logprobs, req.output_ids)
            ],
            "output_top_logprobs": [
                [(lp, t, tok_text(t)) for lp, t in top] for top in req.output_top_logprobs
            ],
        }
