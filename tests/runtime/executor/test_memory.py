"""Sizing the KV pool: the budget arithmetic, the scratch steps the executor measures on CUDA (their
plans run through the normal batch path on any device), and on a GPU the measurement itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import radixlm_runtime as rt
from radixlm_runtime.executor import model_runner
from radixlm_runtime.executor.memory import (
    MIN_POOL_TOKENS,
    kv_pool_tokens,
    peak_bytes,
    scratch_plan,
    scratch_prefill,
)
from radixlm_runtime.executor.step_io import build_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GIB = 2**30


def test_pool_is_a_fraction_of_what_the_measured_activations_leave() -> None:
    assert kv_pool_tokens(10 * GIB, 2 * GIB, 0.9, 2**20, CUDA) == int(8 * GIB * 0.9) // 2**20
    assert kv_pool_tokens(10 * GIB, 0, 0.15, 2**20, CPU) == int(10 * GIB * 0.15) // 2**20


def test_too_little_memory_is_an_error_on_cuda_and_the_minimum_pool_on_cpu() -> None:
    with pytest.raises(ValueError, match="chunked_prefill_size.*max_total_tokens") as e:
        kv_pool_tokens(3 * GIB, 3 * GIB, 0.9, 2**20, CUDA)
    assert "3.00 GiB free after the weights, 3.00 GiB of it needed by the largest steps" in str(e.value)
    assert kv_pool_tokens(GIB, 0, 0.15, 2**30, CPU) == MIN_POOL_TOKENS


def test_scratch_plans_are_new_requests_in_fresh_rows_and_slots() -> None:
    batch, writes = build_batch(scratch_plan([5, 1, 2], [2, 1, 1]), CPU)
    assert batch.input_ids.tolist() == [0] * 8
    assert batch.req_pool_indices_cpu == [0, 1, 2] and batch.seq_lens_cpu == [5, 1, 2]
    assert batch.out_cache_loc.tolist() == list(range(1, 9))
    assert batch.logits_indices.tolist() == [3, 4, 5, 7]
    assert writes is not None
    rows, cols, slots = (t.tolist() for t in writes)
    assert rows == [0] * 5 + [1] + [2] * 2
    assert cols == [0, 1, 2, 3, 4, 0, 0, 1]
    assert slots == list(range(1, 9))


def test_the_largest_prefill_is_split_at_the_context_length() -> None:
    plan = scratch_prefill(70, 32, 40)
    assert [len(it.input_ids) for it in plan.items] == [32, 32, 6]
    assert [it.num_logit_rows for it in plan.items] == [2, 32, 6]
    assert [len(it.input_ids) for it in scratch_prefill(20, 512, 4).items] == [20]


def test_measured_steps_run_on_any_device(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The two steps measured on CUDA (a full prefill chunk sampled on max_running_requests rows, a
    decode of the largest graph batch) run on the CPU too, the measurement replaced by a record of
    what each step returned; the Triton backend (interpreter here) is the graph-capturable one."""
    engine = rt.Engine(
        str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=256,
        max_running_requests=6,
        log_level="warning",
    )
    returned: list[object] = []

    def record(run, device):  # type: ignore[no-untyped-def]
        returned.append(run())
        return 1

    monkeypatch.setattr(model_runner, "peak_bytes", record)
    assert engine.runner._activation_reserve(40) == 2
    # More tokens than the context (512) holds: the prefill is split into requests.
    assert engine.runner._activation_reserve(1100) == 2
    for sampled, decode_logits in (returned[:2], returned[2:]):
        assert sampled.next_token_ids.shape == (6,) and sampled.logprobs.shape == (6,)
        assert decode_logits.shape == (6, 300)


def test_a_step_too_large_for_the_gpu_is_a_clear_error(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = rt.Engine(str(tiny_llama_dir), device="cpu", max_total_tokens=256, log_level="warning")
    runner = engine.runner

    def out_of_memory(max_step_tokens: int) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(runner, "_activation_reserve", out_of_memory)
    unsized = dataclasses.replace(runner.engine_config, max_total_tokens=None)
    monkeypatch.setattr(runner, "engine_config", unsized)
    monkeypatch.setattr(runner, "device", CUDA)
    with pytest.raises(ValueError, match=r"largest step \(4096 tokens\).*lower chunked_prefill_size"):
        runner._kv_pool_size(4096)


@needs_cuda
def test_peak_bytes_counts_what_a_step_allocates() -> None:
    assert peak_bytes(lambda: torch.empty(2**24, dtype=torch.uint8, device=CUDA), CUDA) >= 2**24


@needs_cuda
def test_cuda_pool_leaves_room_for_the_largest_steps(tiny_llama_dir: Path) -> None:
    """The reserve grows with the step budget, and with the pool sized from free memory (a small
    fraction: the tiny model's KV is so small that the default would give the host a free list of
    ~10^8 slots) a full prefill chunk and a full decode batch run beside it."""
    engine = rt.Engine(
        str(tiny_llama_dir),
        device="cuda",
        dtype="float32",
        mem_fraction_static=0.002,
        chunked_prefill_size=480,
        max_running_requests=16,
        log_level="warning",
    )
    runner = engine.runner
    assert runner._activation_reserve(2048) > runner._activation_reserve(64) > 0
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    long_prompt = engine.generate(input_ids=[[5] * 470], sampling_params=params)
    batch = engine.generate(input_ids=[[5 + i] * 8 for i in range(16)], sampling_params=params)
    assert long_prompt[0]["meta_info"]["completion_tokens"] == 4
    assert all(out["meta_info"]["completion_tokens"] == 4 for out in batch)
