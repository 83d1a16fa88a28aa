"""A request as the scheduler sees it, from arrival to its last token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixlm_runtime.constrained.grammar import RegexGuide
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.messages import GenerateReq
from radixlm_runtime.kvcache.radix_cache import TreeNode
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.step import TopLogprobs


@dataclass(eq=False)
class Req:
    uid: int  # unique per scheduler: keys the request's RNG in the executor
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Program session whose pin this request's whole sequence becomes when it ends (session.py).
    session_id: str | None = None

    # The prompt followed by every output token, appended in place (never rebuilt per step).
    token_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    # Prompt tokens served from the radix cache at first admission (what users are billed as cached).
    cached_tokens: int = -1
    # Constrained decoding state (regex / json_schema); its state follows the output, so it survives
    # retraction unchanged.
    guide: RegexGuide | None = None

    # KV state while the request holds resources.
    req_pool_idx: int | None = None
    # KV slots of token_ids[:len(kv_slots)]: the host copy of the request's table row. After
    # admission the cached prefix (prefix_len tokens) comes first; kv_len of them are computed.
    kv_slots: list[int] = field(default_factory=list)
    # Leading tokens whose slots the radix tree owns: the match found while waiting, then
    # everything published by cache_unfinished.
    prefix_len: int = 0
    last_node: TreeNode | None = None
    kv_len: int = 0  # tokens whose KV is in the pool
    table_synced: int = 0  # leading entries of kv_slots the executor's table row already holds

    # Logprob accumulators, filled as chunks and decode steps complete.
    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # What has been reported already (scheduler/output.py sends only what is new).
    sent_tokens: int = 0
    sent_input_logprobs: bool = False

    first_scheduled_time: float | None = None  # first admission; a retraction does not reset it
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.origin_input_ids)

    @classmethod
    def from_message(cls, m: GenerateReq, uid: int, seed: int) -> Req:
        """The one constructor: both entry points send a GenerateReq."""
        return cls(
            uid=uid,
            rid=m.rid,
            origin_input_ids=m.input_ids,
            sampling_params=m.sampling_params,
            seed=seed,
            return_logprob=m.return_logprob,
            logprob_start_len=m.logprob_start_len,
            top_logprobs_num=m.top_logprobs_num,
            session_id=m.session_id,
        )

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - len(self.origin_input_ids)

    @property
    def output_ids(self) -> list[int]:
        """A copy of the generated tokens: for reporting, not for the per-step path."""
        return self.token_ids[self.prompt_len :]

    @property
    def pending_len(self) -> int:
        """Tokens without KV yet: 1 for a decode, more after a jump-forward appended forced tokens
        (they are computed in the next step as one extend)."""
        return len(self.token_ids) - self.kv_len

    @property
    def is_constrained(self) -> bool:
        return self.sampling_params.regex is not None or self.sampling_params.json_schema is not None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < self.prompt_len

    def max_prefix_len(self) -> int:
        """How much of token_ids may come from the cache. At least one token is always recomputed
        (its logits give the next token); prompt logprobs need the positions from
        logprob_start_len - 1 on to be computed, not read from the cache."""
        limit = len(self.token_ids) - 1
        if self.wants_input_logprobs and self.output_len == 0:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - self.output_len
