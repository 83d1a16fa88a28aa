"""Checks and builders shared by the scheduler tests."""

from __future__ import annotations

from typing import Any

import radixlm_runtime as rt
from radixlm_runtime.io.messages import GenerateReq
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.scheduler.req import Req


def message(
    rid: str,
    ids: list[int],
    params: dict[str, Any] | None = None,
    session_id: str | None = None,
    priority: int = 0,
) -> GenerateReq:
    """A scheduler request as both entry points send one."""
    return GenerateReq(
        rid, list(ids), SamplingParams.from_dict(params), session_id=session_id, priority=priority
    )


def make_req(
    rid: str,
    ids: list[int],
    params: dict[str, Any] | None = None,
    session_id: str | None = None,
    priority: int = 0,
) -> Req:
    """A Req built the way the scheduler builds one, for tests of its parts."""
    return Req(message(rid, ids, params, session_id, priority), seed=0)


def assert_no_leak(engine: rt.Engine) -> None:
    """Every KV slot is free or held by the radix tree, nothing is locked, no request is left."""
    sched = engine.scheduler
    tree = sched.cache.tree
    held = tree.total_size() if tree is not None else 0
    assert sched.cache.allocator.available_size() + held == sched.runner_info.max_total_tokens
    if tree is not None:
        assert tree.protected_size() == 0
    assert sched.cache.rows.available_size() == sched.cache.rows.max_reqs
    assert not sched.has_work()
