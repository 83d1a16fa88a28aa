"""Checks shared by the scheduler tests."""

from __future__ import annotations

import radixlm_runtime as rt


def assert_no_leak(engine: rt.Engine) -> None:
    """Every KV slot is free or held by the radix tree, nothing is locked, no request is left."""
    runner = engine.runner
    tree = engine.scheduler.cache.tree
    held = tree.total_size() if tree is not None else 0
    assert runner.allocator.available_size() + held == runner.max_total_tokens
    if tree is not None:
        assert tree.protected_size() == 0
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.max_reqs
    assert not engine.scheduler.has_work()
