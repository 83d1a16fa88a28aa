"""Scheduler counters, reported by /server_info and Engine.get_server_info."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_requests: int = 0
    finished_requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    forward_passes: int = 0
    # Requests whose prompt was prefilled ahead of the remaining chunks of a longer one.
    interleaved_prefills: int = 0
    # Jump-forward: jumps made, and output tokens they added without a decode step.
    jump_forwards: int = 0
    jump_forward_tokens: int = 0
    # Constrained requests whose budget ran out, completed with the shortest valid completion.
    budget_completions: int = 0
    # Speculative decoding: verify forwards of requests, draft tokens proposed and accepted.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
