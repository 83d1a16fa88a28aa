"""A request as the scheduler sees it, from arrival to its last token."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from radixlm_runtime.constrained.backend import Guide
from radixlm_runtime.io.finish import FinishReason
from radixlm_runtime.io.messages import GenerateReq, ProgramCall
from radixlm_runtime.kvcache.radix_cache import TreeNode
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.step import TopLogprobs


@dataclass(eq=False)
class Req:
    """The scheduler's state of one request. What the client asked for is `message`, as the request
    builder made it (io/request_builder.py), read through the properties below: the request's
    fields are declared once, in GenerateReq."""

    message: GenerateReq
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)

    # The prompt followed by every output token, appended in place (never rebuilt per step).
    token_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    # Prompt tokens served from the radix cache at first admission (what users are billed as cached).
    cached_tokens: int = -1
    # Constrained decoding state (regex / json_schema / ebnf); its state follows the output, so it
    # survives retraction unchanged.
    guide: Guide | None = None
    # Tokens of the shortest output the constraint admits (found when it compiled; 0: unknown).
    shortest_output: int = 0

    # KV state while the request holds resources.
    req_pool_idx: int | None = None
    # KV slots of token_ids[:len(kv_slots)]: the host copy of the request's table row. After
    # admission the cached prefix (prefix_len tokens) comes first; kv_len of them are computed.
    kv_slots: list[int] = field(default_factory=list)
    # Leading tokens whose slots the radix tree owns: the match found while waiting, then
    # everything published by cache_unfinished.
    prefix_len: int = 0
    last_node: TreeNode | None = None
    load_len: int = 0  # of the match while waiting: trailing tokens not on the device (host or disk)
    disk_len: int = 0  # of those, the trailing ones on the disk tier only
    prefetch_waits: int = 0  # steps it waited for that part to be read ahead (admission.py)
    kv_len: int = 0  # tokens whose KV is in the pool
    # With window slots: its own tokens before this have had theirs freed (CacheManager.trim_windows).
    window_from: int = 0
    table_synced: int = 0  # leading entries of kv_slots the executor's table row already holds

    # With return_logprob: each token's logprob (NaN: unknown) and its position's top alternatives
    # (None: unknown), aligned with token_ids. Filled from the radix tree, prefill chunks and decode
    # steps; what the request computes joins the tree with its KV.
    token_logprobs: list[float] | None = None
    token_top: list[TopLogprobs | None] | None = None
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # What has been reported already (scheduler/output.py sends only what is new).
    sent_tokens: int = 0
    sent_input_logprobs: bool = False

    # Speculative decoding (SGLang's meta_info names): decode steps that verified a draft, draft
    # tokens proposed, and those accepted (emitted without a forward of their own).
    spec_verify_ct: int = 0
    spec_draft_token_num: int = 0
    spec_accept_token_num: int = 0

    first_scheduled_time: float | None = None  # first admission; a retraction does not reset it
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.origin_input_ids)
        if self.return_logprob:
            self.token_logprobs = [math.nan] * len(self.token_ids)
            self.token_top = [None] * len(self.token_ids)

    # -- what the client asked for (GenerateReq) ---------------------------------------------
    @property
    def rid(self) -> str:
        return self.message.rid

    @property
    def origin_input_ids(self) -> list[int]:
        return self.message.input_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self.message.sampling_params

    @property
    def return_logprob(self) -> bool:
        return self.message.return_logprob

    @property
    def logprob_start_len(self) -> int:
        return self.message.logprob_start_len

    @property
    def top_logprobs_num(self) -> int:
        return self.message.top_logprobs_num

    @property
    def session_id(self) -> str | None:
        """Program session whose pin this request's whole sequence becomes when it ends (session.py)."""
        return self.message.session_id

    @property
    def stream(self) -> bool:
        """Its tokens are streamed to the client, who sees every gap between steps."""
        return self.message.stream

    @property
    def priority(self) -> int:
        return self.message.priority

    @property
    def grammar(self) -> str | None:
        """The constraint's grammar as the front end checked it, for the compile."""
        return self.message.grammar

    @property
    def program_call(self) -> ProgramCall | None:
        """For the dashboard's programs view."""
        return self.message.program_call

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
        return self.sampling_params.is_constrained

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < self.prompt_len

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still to be produced (they are, with the first prefill)."""
        return self.wants_input_logprobs and self.output_len == 0

    def max_prefix_len(self) -> int:
        """How much of token_ids may come from the cache: at least one token is always recomputed
        (its logits give the next token). Prompt logprobs may limit it further (logprob_limit)."""
        return len(self.token_ids) - 1

    def logprob_limit(self, matched: int) -> int:
        """How much of a `matched`-token cached prefix the request may use when it needs prompt
        logprobs: every prompt position it reports from the first recomputed one on is computed
        (row p - 1 gives token p), so each earlier one it reports must be known already."""
        first = max(self.logprob_start_len, 1)
        if first > matched:
            return matched
        for p in range(first, matched):
            if not self._knows(p):
                return p - 1
        return matched - 1

    def _knows(self, p: int) -> bool:
        assert self.token_logprobs is not None and self.token_top is not None
        if math.isnan(self.token_logprobs[p]):
            return False
        top = self.token_top[p]
        return not self.top_logprobs_num or (top is not None and len(top) >= self.top_logprobs_num)

    def learn_logprobs(self, logprobs: list[float], top: list[TopLogprobs | None]) -> None:
        """Takes known values of the reported positions among token_ids[:len(logprobs)] (from the
        radix tree) where the request does not know them yet."""
        assert self.token_logprobs is not None and self.token_top is not None
        mine, my_top = self.token_logprobs, self.token_top
        for p in range(max(self.logprob_start_len, 1), len(logprobs)):
            if math.isnan(mine[p]):
                mine[p] = logprobs[p]
            t = top[p]
            if t is not None and len(t) > len(my_top[p] or ()):
                my_top[p] = t

    def record_logprob(self, pos: int, logprob: float, top: TopLogprobs | None) -> None:
        """A computed logprob of token_ids[pos] (pos == len(token_logprobs) appends a new token's)."""
        assert self.token_logprobs is not None and self.token_top is not None
        if pos == len(self.token_logprobs):
            self.token_logprobs.append(logprob)
            self.token_top.append(top)
        else:
            self.token_logprobs[pos] = logprob
            self.token_top[pos] = top

    def input_logprobs(self) -> tuple[list[float | None], list[TopLogprobs | None]]:
        """Prompt logprobs from logprob_start_len on (SGLang's input_token_logprobs and
        input_top_logprobs): the first prompt token has none."""
        if not self.wants_input_logprobs:
            return [], []
        assert self.token_logprobs is not None and self.token_top is not None
        span = range(self.logprob_start_len, self.prompt_len)
        values = [None if p == 0 else self.token_logprobs[p] for p in span]
        k = self.top_logprobs_num
        tops = [None if p == 0 or (t := self.token_top[p]) is None else t[:k] for p in span] if k else []
        return values, tops

    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - self.output_len
