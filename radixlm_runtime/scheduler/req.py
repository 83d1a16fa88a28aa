"""A request as the scheduler sees it, from arrival to its last token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm_runtime.constrained.grammar import RegexGuide
from radixlm_runtime.kvcache.radix_cache import TreeNode
from radixlm_runtime.sampling.params import SamplingParams

LogprobEntry = tuple[float, int]


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Program session whose pin this request's whole sequence becomes when it ends (session.py).
    session_id: str | None = None

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict[str, Any] | None = None
    # Prompt tokens served from the radix cache at first admission (what users are billed as cached).
    cached_tokens: int = -1
    # Constrained decoding state (regex / json_schema); its state follows output_ids, so it survives
    # retraction unchanged.
    guide: RegexGuide | None = None

    # KV state while the request holds resources.
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    # Tokens of fill_ids whose KV is in the pool (req_to_token[req_pool_idx, :kv_len]).
    kv_len: int = 0

    # Logprob accumulators, filled as chunks and decode steps complete.
    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)

    first_token_time: float | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request needs: the prompt plus everything generated so far."""
        return self.origin_input_ids + self.output_ids

    @property
    def pending_len(self) -> int:
        """Tokens of fill_ids without KV yet: 1 for a decode, more after a jump-forward appended
        forced tokens (they are computed in the next step as one extend)."""
        return self.prompt_len + len(self.output_ids) - self.kv_len

    @property
    def is_constrained(self) -> bool:
        return self.sampling_params.regex is not None or self.sampling_params.json_schema is not None

    @property
    def prompt_len(self) -> int:
        return len(self.origin_input_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < self.prompt_len

    def max_prefix_len(self) -> int:
        """How much of fill_ids may come from the cache. At least one token is always recomputed
        (its logits give the next token); prompt logprobs need the positions from
        logprob_start_len - 1 on to be computed, not read from the cache."""
        limit = len(self.fill_ids) - 1
        if self.wants_input_logprobs and not self.output_ids:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - len(self.output_ids)
