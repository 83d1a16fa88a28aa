"""Scheduler behaviour on a tiny random-init model: continuous batching, chunked prefill,
retraction under a tiny KV pool, policies and aborts. Greedy outputs must not depend on any of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from scheduler_helpers import assert_no_leak, make_req, message

import radixlm_runtime as rt
from radixlm_runtime.kvcache.allocator import TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache
from radixlm_runtime.scheduler.policy import SchedulePolicy
from radixlm_runtime.scheduler.req import Req

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def _prompts(n: int) -> list[list[int]]:
    """Prompts sharing 40-56 leading tokens, enough for the scheduler to prefill them once."""
    shared = [(7 * i) % 250 + 3 for i in range(56)]
    return [shared[: 40 + (i % 3) * 8] + [(11 * i + j) % 250 + 3 for j in range(6 + i % 5)] for i in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    engine = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=8192, log_level="warning")
    return [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in _prompts(12)]


def test_batched_equals_one_by_one(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    engine = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=8192, log_level="warning")
    outs = engine.generate(input_ids=_prompts(12), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert_no_leak(engine)


def test_retraction_under_tiny_kv_pool(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    # 12 requests needing up to ~106 tokens each share a 160-token pool: decode must retract.
    engine = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=160, log_level="warning")
    outs = engine.generate(input_ids=_prompts(12), sampling_params=GREEDY)
    assert engine.scheduler.stats.num_retractions > 0
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert_no_leak(engine)


def test_seeded_sampling_survives_retraction(tiny_llama_dir: Path) -> None:
    """A seeded request's draws are numbered by output token, not kept as RNG state: retracted and
    recomputed, and batched with others, it samples the same tokens as alone in a roomy pool
    (--deterministic, so the recomputed KV has the same bits and top_p's sort the same order)."""
    params = [
        {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 40, "ignore_eos": True, "seed": s}
        for s in range(12)
    ]

    def engine(max_total_tokens: int) -> rt.Engine:
        return rt.Engine(
            str(tiny_llama_dir),
            dtype="float32",
            max_total_tokens=max_total_tokens,
            deterministic=True,
            log_level="warning",
        )

    roomy = engine(8192)
    alone = [
        roomy.generate(input_ids=p, sampling_params=q)["output_ids"] for p, q in zip(_prompts(12), params)
    ]
    assert len({tuple(o) for o in alone}) == 12
    tight = engine(160)
    outs = tight.generate(input_ids=_prompts(12), sampling_params=params)
    assert tight.scheduler.stats.num_retractions > 0
    assert [o["output_ids"] for o in outs] == alone
    assert_no_leak(tight)


def test_retraction_without_radix_cache(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    engine = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        max_total_tokens=160,
        disable_radix_cache=True,
        log_level="warning",
    )
    outs = engine.generate(input_ids=_prompts(12), sampling_params=GREEDY)
    assert engine.scheduler.stats.num_retractions > 0
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    assert_no_leak(engine)


def test_prompt_only_request_runs_no_forward_without_a_cache(tiny_llama_dir: Path) -> None:
    """With the radix cache disabled, `select`'s warm-up (max_new_tokens 0, no logprobs) has no
    observable result: it ends at once, reporting its prompt. With logprobs asked, or with a cache
    to fill, the prompt is computed."""
    off = rt.Engine(str(tiny_llama_dir), dtype="float32", disable_radix_cache=True, log_level="warning")
    prompt = _prompts(1)[0]
    out = off.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})
    assert off.scheduler.stats.forward_passes == 0
    assert out["output_ids"] == []
    assert out["meta_info"]["prompt_tokens"] == len(prompt)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = off.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    assert off.scheduler.stats.forward_passes > 0
    assert len(scored["meta_info"]["input_token_logprobs"]) == len(prompt)
    assert_no_leak(off)
    on = rt.Engine(str(tiny_llama_dir), dtype="float32", log_level="warning")
    on.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})
    assert on.scheduler.stats.forward_passes > 0
    assert on.scheduler.cache.tree.total_size() >= len(prompt) - 1


def test_chunked_prefill_matches(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    engine = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        max_total_tokens=8192,
        chunked_prefill_size=16,
        log_level="warning",
    )
    outs = engine.generate(input_ids=_prompts(12), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert_no_leak(engine)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_policies_agree(tiny_llama_dir: Path, reference: list[list[int]], policy: str) -> None:
    engine = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        max_total_tokens=8192,
        schedule_policy=policy,
        log_level="warning",
    )
    outs = engine.generate(input_ids=_prompts(12), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    assert_no_leak(engine)


def test_requests_join_running_batch(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    """Continuous batching: a request arriving mid-decode joins the next step, and the long
    prompt's chunks run alongside the decodes without changing anyone's output."""
    engine = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        max_total_tokens=8192,
        chunked_prefill_size=24,
        prefill_step_target_ms=0,  # chunks of exactly 24 tokens, however fast the machine is
        # Counts steps: a step's results are read in it (overlap reads them a step later, the CUDA
        # default; tests/runtime/scheduler/test_overlap.py covers it).
        disable_overlap_schedule=True,
        log_level="warning",
    )
    sched = engine.scheduler
    prompts = _prompts(12)
    msgs = [message(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    reqs = [sched.submit(msgs[0])]
    steps = 0
    while len(reqs[0].output_ids) < 2:
        sched.step()
        steps += 1
    # A 46-token prompt under a 24-token budget: two prefill chunks, then one decode.
    assert steps == 3 and sched.admission.running == [reqs[0]]
    reqs += [sched.submit(m) for m in msgs[1:]]
    sched.step()
    # The decode kept going in the same step the newcomers started prefilling.
    assert len(reqs[0].output_ids) == 3
    assert any(r.kv_len > 0 for r in reqs[1:])
    while sched.has_work():
        sched.step()
    assert [r.output_ids for r in reqs] == reference
    assert_no_leak(engine)


def test_abort_frees_resources(tiny_llama_dir: Path, reference: list[list[int]]) -> None:
    engine = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        max_total_tokens=8192,
        disable_overlap_schedule=True,  # as above
        log_level="warning",
    )
    sched = engine.scheduler
    reqs = [sched.submit(message(f"r{i}", p, GREEDY)) for i, p in enumerate(_prompts(4))]
    sched.step()
    sched.step()
    sched.abort("r1")
    finished = sched.step()
    assert [o.rid for o in finished if o.finished_reason is not None] == ["r1"]
    assert reqs[1].finished_reason is not None and reqs[1].finished_reason.kind == "abort"
    while sched.has_work():
        sched.step()
    assert [r.output_ids for i, r in enumerate(reqs) if i != 1] == [reference[i] for i in (0, 2, 3)]
    assert_no_leak(engine)


def test_finished_requests_leave_kv_in_tree(tiny_llama_dir: Path) -> None:
    engine = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=8192, log_level="warning")
    prompt = _prompts(1)[0]
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    again = engine.generate(input_ids=prompt + first["output_ids"][:10], sampling_params=GREEDY)
    # The prompt and the first generated tokens were all cached by the first request.
    assert again["meta_info"]["cached_tokens"] == len(prompt) + 9
    assert engine.flush_cache()
    assert engine.scheduler.cache.tree.total_size() == 0
    assert_no_leak(engine)


def _req(rid: str, ids: list[int]) -> Req:
    return make_req(rid, ids)


def test_lpm_orders_by_cached_prefix() -> None:
    alloc = TokenAllocator(64)
    tree = RadixCache(alloc)
    tree.insert([1, 2, 3, 4, 5, 6], alloc.alloc(6))
    waiting = [_req("none", [9, 9, 9]), _req("short", [1, 2, 7, 7]), _req("long", [1, 2, 3, 4, 5, 8])]
    ordered = SchedulePolicy("lpm", tree).order(waiting)
    assert [r.rid for r in ordered] == ["long", "short", "none"]
    assert [r.prefix_len for r in ordered] == [5, 2, 0]
    assert [r.rid for r in SchedulePolicy("fcfs", tree).order(waiting)] == ["none", "short", "long"]


def test_lpm_weighs_a_prefix_by_the_tier_it_comes_from() -> None:
    """Equal cached prefixes: one in the pool goes first, then one on the host tier (a copy back),
    then one on disk only (a file read, then that copy), then nothing cached (recomputed)."""
    alloc, host, disk = TokenAllocator(64), TokenAllocator(4), TokenAllocator(64)
    tree = RadixCache(alloc, host, disk_allocator=disk)
    for first in (1, 2, 3):
        tree.insert([first, 5, 5, 5], alloc.alloc(4))
    # The least recently used leave first: [2, ...] to the host tier, then [3, ...] there, pushing
    # [2, ...] on to disk (the host tier holds 4 tokens).
    tree.match_node([1, 5, 5, 5])
    assert tree.evict(8) == 8
    tiers = {k: tree.match_node([k, 5, 5, 5])[1].tier for k in (1, 2, 3)}
    assert tiers == {1: "device", 2: "disk", 3: "host"}
    waiting = [_req("none", [4, 5, 5, 5, 6]), *(_req(f"{t}", [k, 5, 5, 5, 6]) for k, t in tiers.items())]
    ordered = SchedulePolicy("lpm", tree).order(waiting)
    assert [r.rid for r in ordered] == ["device", "host", "disk", "none"]
    assert [(r.prefix_len, r.load_len, r.disk_len) for r in ordered] == [
        (4, 0, 0),
        (4, 4, 0),
        (4, 4, 4),
        (0, 0, 0),
    ]


def test_dfs_weight_keeps_prefix_groups_together() -> None:
    alloc = TokenAllocator(64)
    tree = RadixCache(alloc)
    tree.insert([1, 1, 1, 1], alloc.alloc(4))
    tree.insert([2, 2, 2, 2], alloc.alloc(4))
    waiting = [
        _req("a1", [1, 1, 1, 1, 5]),
        _req("b1", [2, 2, 2, 2, 5]),
        _req("a2", [1, 1, 1, 1, 6]),
        _req("b2", [2, 2, 2, 2, 6]),
        _req("a3", [1, 1, 1, 1, 7]),
    ]
    ordered = [r.rid for r in SchedulePolicy("dfs-weight", tree).order(waiting)]
    # The heavier subtree (three "a" requests) comes first, each group contiguous.
    assert ordered == ["a1", "a2", "a3", "b1", "b2"]


def test_unknown_policy_rejected() -> None:
    with pytest.raises(ValueError, match="schedule_policy"):
        rt.ServerArgs.from_kwargs(schedule_policy="random")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("failing", ["launch", "collect"])
def test_a_failing_forward_fails_only_its_own_requests(
    tiny_llama_dir: Path, reference: list[list[int]], failing: str, overlap: bool
) -> None:
    """An exception inside a step (a kernel error, out of memory; raised when the step is queued or
    when its results are read) aborts that step's requests with the error, frees their KV, and the
    scheduler keeps serving the requests that come after. Under overlap (switched on by hand: the CPU
    runs steps synchronously) the step after it is in flight by then, with KV not yet published."""
    engine = rt.Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=8192, log_level="warning")
    sched = engine.scheduler
    sched.overlap = overlap
    call = getattr(engine.runner, failing)
    calls = {"n": 0}

    def flaky(arg):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device fault")
        return call(arg)

    setattr(engine.runner, failing, flaky)
    reqs = [sched.submit(message(f"d{i}", p, GREEDY)) for i, p in enumerate(_prompts(2))]
    outs = []
    while sched.has_work():
        outs += sched.step()
    # The second step holds both requests, or (overlap, the CUDA default) only the second prompt's
    # prefill: the first one's decode joins the step after its prefill's results are read.
    doomed = [r for r in reqs if r.finished_reason is not None and r.finished_reason.kind == "abort"]
    assert doomed and all("simulated device fault" in (r.finished_reason.message or "") for r in doomed)
    assert all(r.output_ids == reference[i] for i, r in enumerate(reqs) if r not in doomed)
    assert {o.rid for o in outs if o.finished_reason is not None} == {"d0", "d1"}
    assert not sched.has_work()
    assert_no_leak(engine)
    outs = engine.generate(input_ids=_prompts(12), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert_no_leak(engine)


def test_queue_time_reported_from_first_scheduled_step(tiny_llama_dir: Path) -> None:
    """Outputs carry arrival -> first admission (the first chunk, not the first token); a request
    aborted before it was ever scheduled reports none."""
    engine = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        max_total_tokens=8192,
        chunked_prefill_size=24,
        prefill_step_target_ms=0,  # chunks of exactly 24 tokens, however fast the machine is
        disable_overlap_schedule=True,  # as above
        log_level="warning",
    )
    sched = engine.scheduler
    first, never = (sched.submit(message(f"q{i}", p, GREEDY)) for i, p in enumerate(_prompts(2)))
    sched.abort("q1")
    outputs = sched.step()
    assert [(o.rid, o.queue_time) for o in outputs] == [("q1", None)]
    assert first.first_scheduled_time is not None and never.first_scheduled_time is None
    # The 46-token prompt's second chunk (24-token budget) gives its first token.
    outputs = sched.step()
    expected = first.first_scheduled_time - first.arrival_time
    assert [(o.rid, o.queue_time) for o in outputs] == [("q0", expected)] and expected >= 0
    while sched.has_work():
        sched.step()
    assert_no_leak(engine)
