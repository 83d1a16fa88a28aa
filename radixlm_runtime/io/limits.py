"""Length and vocabulary limits every request is checked against before it runs, shared by the
offline Engine and the HTTP server so both refuse exactly the same inputs."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm_runtime.sampling.params import SamplingParams


class InvalidRequest(ValueError):
    """A ValueError that also names the offending field (`param`) and, where a client may branch on
    it, an error code (`code`), for HTTP error bodies."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_len: int
    pool_size: int

    def check(
        self, ids: list[int], sp: SamplingParams, logprob_start_len: int, field: str = "prompt"
    ) -> None:
        if not ids:
            raise InvalidRequest(f"{field} is empty: give at least one token", field)
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"input_ids: token ids must be in [0, {vocab})", "input_ids")
        ctx = self.context_len
        if len(ids) >= ctx:
            raise InvalidRequest(f"{field} is {len(ids)} tokens, longer than the context length {ctx}", field)
        if len(ids) + sp.max_new_tokens > ctx:
            raise InvalidRequest(
                f"sampling_params.max_new_tokens={sp.max_new_tokens} with a {len(ids)}-token prompt "
                f"exceeds the context length {ctx}",
                "max_new_tokens",
            )
        if len(ids) + sp.max_new_tokens > self.pool_size:
            raise InvalidRequest(
                f"sampling_params.max_new_tokens: prompt ({len(ids)}) + max_new_tokens "
                f"({sp.max_new_tokens}) exceeds the KV cache pool ({self.pool_size} tokens)",
                "max_new_tokens",
            )
        # As in SGLang, a start at the prompt's end is valid and asks for no prompt logprobs.
        if not -1 <= logprob_start_len <= len(ids):
            raise InvalidRequest(
                f"logprob_start_len must be in [-1, {len(ids)}], got {logprob_start_len}", "logprob_start_len"
            )
