"""A request's outputs as the scheduler reports them, and SGLang's native output format.

The scheduler reports each request's progress as `ReqOutput` deltas; the offline Engine and the
HTTP server both accumulate them in an `OutputState` and format the result with `native_output`,
so the two entry points cannot drift apart.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.messages import GenerateReq, ReqOutput
from radixlm_runtime.step import TopLogprobs

# What JSON outputs report for a -inf logprob (JSON has no infinities), as vLLM does.
MIN_LOGPROB = -9999.0


@dataclass(kw_only=True, eq=False)
class OutputState:
    """Everything received for one request so far; tokens once received never change."""

    req: GenerateReq
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Speculative decoding totals, as last reported (ReqOutput carries running totals).
    spec_verify_ct: int = 0
    spec_draft_token_num: int = 0
    spec_accept_token_num: int = 0

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def apply(self, o: ReqOutput) -> None:
        self.output_ids.extend(o.new_token_ids)
        self.prompt_tokens = o.prompt_tokens
        self.cached_tokens = o.cached_tokens
        self.spec_verify_ct = o.spec_verify_ct
        self.spec_draft_token_num = o.spec_draft_token_num
        self.spec_accept_token_num = o.spec_accept_token_num
        self.output_token_logprobs.extend(o.output_token_logprobs)
        self.output_top_logprobs.extend(o.output_top_logprobs)
        if o.input_token_logprobs is not None:
            self.input_token_logprobs = o.input_token_logprobs
            self.input_top_logprobs = o.input_top_logprobs or []
        if o.finished_reason is not None:
            self.finished_reason = o.finished_reason


def native_output(st: OutputState, text: str, tokenizer: Any, text_in_logprobs: bool) -> dict[str, Any]:
    """`{"text", "output_ids", "meta_info"}` as SGLang's /generate and Engine.generate return it."""
    meta: dict[str, Any] = {
        "id": st.req.rid,
        "prompt_tokens": st.prompt_tokens or len(st.req.input_ids),
        "completion_tokens": len(st.output_ids),
        "cached_tokens": st.cached_tokens,
        "finish_reason": st.finished_reason.to_json() if st.finished_reason else None,
        "e2e_latency": time.monotonic() - st.arrival,
    }
    if st.spec_verify_ct:
        meta.update(_spec_meta(st))
    if st.req.return_logprob:
        meta.update(_logprob_meta(st, tokenizer, text_in_logprobs))
    return {"text": text, "output_ids": list(st.output_ids), "meta_info": meta}


def _spec_meta(st: OutputState) -> dict[str, Any]:
    """SGLang's speculative decoding fields: accept_length is output tokens per verify forward."""
    drafted = st.spec_draft_token_num
    return {
        "spec_verify_ct": st.spec_verify_ct,
        "spec_draft_token_num": drafted,
        "spec_accept_token_num": st.spec_accept_token_num,
        "spec_accept_rate": st.spec_accept_token_num / drafted if drafted else 0.0,
        "spec_accept_length": len(st.output_ids) / st.spec_verify_ct,
    }


def _logprob_meta(st: OutputState, tokenizer: Any, with_text: bool) -> dict[str, Any]:
    """SGLang's logprob lists: [logprob, token_id, token text or None] per position."""

    def entry(lp: float | None, tid: int) -> list[Any]:
        return [json_logprob(lp), tid, tokenizer.decode([tid]) if with_text else None]

    prompt = st.req.input_ids
    start = st.req.logprob_start_len
    if not 0 <= start < len(prompt):
        start = len(prompt)
    return {
        "input_token_logprobs": [entry(lp, t) for lp, t in zip(st.input_token_logprobs, prompt[start:])],
        "input_top_logprobs": [
            None if top is None else [entry(lp, t) for lp, t in top] for top in st.input_top_logprobs
        ],
        "output_token_logprobs": [entry(lp, t) for lp, t in zip(st.output_token_logprobs, st.output_ids)],
        "output_top_logprobs": [[entry(lp, t) for lp, t in top] for top in st.output_top_logprobs],
    }


def json_logprob(lp: float | None) -> float | None:
    """JSON has no -inf: a token the model gives zero probability is reported as MIN_LOGPROB."""
    if lp is None:
        return None
    return lp if math.isfinite(lp) else MIN_LOGPROB
