"""Overlap scheduling: planning step N+1 before step N's tokens are read back (their places taken by
future tokens the executor fills in on the device) changes no output. The CPU executor runs steps
synchronously, so the scheduler is switched to overlap by hand here; the kernels are batch-invariant
(--deterministic), so any difference would be the scheduler's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from scheduler_helpers import message

import radixlm_runtime as rt
from radixlm_runtime.step import future_token

PREFIX = "the theater then an interesting answer " * 3
PROMPTS = [PREFIX + "abc", PREFIX + "the the", "an answer", PREFIX * 2 + "x", "hello there"]
PARAMS: list[dict[str, Any]] = [
    {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
    {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    {"max_new_tokens": 17, "temperature": 0.9, "top_k": 20, "seed": 5, "ignore_eos": True},
    {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 6, "stop": ["he"]},
    {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True, "frequency_penalty": 0.5},
]


def _engine(model_dir: Path, overlap: bool, **flags: Any) -> rt.Engine:
    engine = rt.Engine(
        str(model_dir),
        device="cpu",
        deterministic=True,
        chunked_prefill_size=64,
        max_total_tokens=flags.pop("max_total_tokens", 4096),
        log_level="warning",
        **flags,
    )
    engine.scheduler.overlap = overlap
    return engine


def _outputs(engine: rt.Engine, prompts: list[str], params: list[dict[str, Any]]) -> list[tuple]:
    outs = engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2)
    return [
        (
            out["text"],
            out["meta_info"]["finish_reason"],
            out["meta_info"]["completion_tokens"],
            out["meta_info"]["output_token_logprobs"],
            out["meta_info"]["output_top_logprobs"],
        )
        for out in outs
    ]


def _check_pool_whole(engine: rt.Engine) -> None:
    info = engine.scheduler.info()
    assert info["num_running"] == info["num_waiting"] == 0
    assert info["free_tokens"] + info["cached_tokens_in_tree"] == info["max_total_tokens"]


def test_future_tokens_are_negative_row_markers() -> None:
    assert [future_token(i) for i in range(3)] == [-1, -2, -3]


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_overlap_changes_no_output(tiny_llama_dir: Path, disable_radix_cache: bool) -> None:
    runs = []
    for overlap in (False, True):
        engine = _engine(tiny_llama_dir, overlap, disable_radix_cache=disable_radix_cache)
        first = _outputs(engine, PROMPTS, PARAMS)
        again = _outputs(engine, PROMPTS[::-1], PARAMS[::-1])[::-1]  # cached prefixes, other order
        _check_pool_whole(engine)
        runs.append((first, again))
    assert runs[0] == runs[1]
    assert runs[0][0] == runs[0][1]


def test_overlap_under_memory_pressure(tiny_llama_dir: Path) -> None:
    """A pool too small for every request at once retracts some; overlap waits for each step's
    results before such a step, so the outputs stay the same."""
    prompts = [PREFIX + str(i) for i in range(8)]
    params = [{"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}] * 8
    runs = []
    for overlap in (False, True):
        engine = _engine(tiny_llama_dir, overlap, max_total_tokens=200)
        runs.append(_outputs(engine, prompts, params))
        _check_pool_whole(engine)
        assert engine.scheduler.stats.num_retractions > 0
    assert runs[0] == runs[1]


def test_overlapped_steps_use_future_tokens(tiny_llama_dir: Path) -> None:
    """The overlapped run did plan steps on future tokens (so the test above compared something)."""
    engine = _engine(tiny_llama_dir, True)
    runner = engine.runner
    launch = runner.launch
    futures = 0

    def counting(plan):  # type: ignore[no-untyped-def]
        nonlocal futures
        futures += sum(1 for it in plan.items if it.input_ids and it.input_ids[0] < 0)
        return launch(plan)

    runner.launch = counting
    engine.generate(PROMPTS[:3], PARAMS[:3])
    assert futures >= 20


def test_a_prefilled_prompt_decodes_in_the_next_step(tiny_llama_dir: Path) -> None:
    """A prompt whose last chunk was launched joins the running requests at once: its first decode
    is planned on its future token in the very next step, rather than after a step that launches
    nothing while the prefill is read (on a GPU, an idle device). The only step without a forward is
    the last one, which reads the final results."""
    engine = _engine(tiny_llama_dir, True)
    sched = engine.scheduler
    sched.submit(message("r", engine.tokenizer.encode(PROMPTS[0]), PARAMS[0]))
    idle = 0
    while sched.has_work():
        before = sched.stats.forward_passes
        sched.step()
        idle += sched.stats.forward_passes == before
    assert idle == 1
    _check_pool_whole(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="asynchronous steps need a CUDA device")
def test_overlap_is_on_by_default_on_cuda_and_changes_no_output(tiny_llama_dir: Path) -> None:
    """On CUDA the step really runs while the next is planned: same outputs as with it disabled."""
    runs = []
    for disable in (False, True):
        engine = rt.Engine(
            str(tiny_llama_dir),
            device="cuda",
            dtype="float32",
            deterministic=True,
            max_total_tokens=4096,
            disable_overlap_schedule=disable,
            log_level="warning",
        )
        assert engine.scheduler.overlap is not disable
        runs.append(_outputs(engine, PROMPTS, PARAMS))
        _check_pool_whole(engine)
    assert runs[0] == runs[1]
