"""Sizing the KV pool: the budget arithmetic, the pool size from the flags and the measured reserve,
the scratch steps the executor measures on CUDA (their plans run through the normal batch path on any
device), and on a GPU the measurement itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import radixlm_runtime as rt
from radixlm_runtime.config import EngineConfig
from radixlm_runtime.executor import memory
from radixlm_runtime.executor.memory import (
    MIN_POOL_TOKENS,
    Scratch,
    ScratchShape,
    StepLimits,
    activation_reserve,
    kv_dtype_for,
    kv_pool_size,
    kv_pool_tokens,
    peak_bytes,
    scratch_plan,
    scratch_prefill,
)
from radixlm_runtime.executor.model_runner import ModelRunner
from radixlm_runtime.executor.step_io import build_batch
from radixlm_runtime.kvcache.pool import KVPool
from radixlm_runtime.layers.linear_kernels import BF16, FP32
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.sampling.sampler import SamplingBatchInfo
from radixlm_runtime.step import StepPlan

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GIB = 2**30


def runner_reserve(runner: ModelRunner, max_step_tokens: int) -> int:
    """The measured reserve of the runner's largest steps for a step budget of max_step_tokens."""
    limits = StepLimits.of(runner.engine_config, max_step_tokens, runner.context_len)
    return activation_reserve(limits, runner.config.vocab_size, runner.device, runner.open_scratch)


def no_scratch(shape: ScratchShape) -> Scratch:
    raise AssertionError("nothing is measured here")


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
    rows, cols, slots = (t.tolist() for t in writes[:3])
    assert writes[3] is None and batch.window_loc is None  # no window slots
    assert rows == [0] * 5 + [1] + [2] * 2
    assert cols == [0, 1, 2, 3, 4, 0, 0, 1]
    assert slots == list(range(1, 9))


def test_the_largest_prefill_is_split_at_the_context_length() -> None:
    plan = scratch_prefill(70, 32, 40)
    assert [len(it.input_ids) for it in plan.items] == [32, 32, 6]
    assert [it.num_logit_rows for it in plan.items] == [2, 32, 6]
    assert [len(it.input_ids) for it in scratch_prefill(20, 512, 4).items] == [20]


def test_measured_steps_run_on_any_device(
    tiny_llama_dir: Path, test_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two steps measured on CUDA (a full prefill chunk sampled on max_running_requests rows, a
    decode of the largest graph batch) run on the test device, the measurement replaced by a record of
    what each step returned; the Triton backend (the interpreter on CPU) is the graph-capturable one."""
    engine = rt.Engine(
        str(tiny_llama_dir),
        device=test_device.type,
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

    monkeypatch.setattr(memory, "peak_bytes", record)
    assert runner_reserve(engine.runner, 40) == 2
    # More tokens than the context (512) holds: the prefill is split into requests.
    assert runner_reserve(engine.runner, 1100) == 2
    for sampled, decode_logits in (returned[:2], returned[2:]):
        assert sampled.next_token_ids.shape == (6,) and sampled.logprobs.shape == (6,)
        assert decode_logits.shape == (6, 300)


def test_a_step_too_large_for_the_gpu_is_a_clear_error(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(*args: object) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(memory, "activation_reserve", out_of_memory)
    config = EngineConfig()
    limits = StepLimits.of(config, 4096, 512)
    model = ModelConfig.from_dir(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"largest step \(4096 tokens\).*lower chunked_prefill_size"):
        kv_pool_size(config, model, torch.bfloat16, CUDA, limits, no_scratch)


def test_pool_size_from_the_flags_and_the_available_memory(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-total-tokens is the size; otherwise --mem-fraction-static (0.15 on CPU, 0.9 on CUDA by
    default) of what is available, less on CUDA the reserve measured for these limits (CUDA faked here:
    the memory read and the measurement replaced)."""
    model = ModelConfig.from_dir(tiny_llama_dir)
    per_token = KVPool.bytes_per_token_for(
        model.num_layers, model.num_kv_heads, model.head_dim, torch.float32
    )
    limits = StepLimits(max_step_tokens=64, context_len=512, max_running_requests=8, graph_batch=4)
    measured: list[StepLimits] = []

    def reserve(got: StepLimits, vocab_size: int, device: torch.device, open_scratch: object) -> int:
        measured.append(got)
        return 2 * GIB

    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 10 * GIB)
    monkeypatch.setattr(memory, "activation_reserve", reserve)

    def size(device: torch.device, **flags: object) -> int:
        return kv_pool_size(EngineConfig(**flags), model, torch.float32, device, limits, no_scratch)

    assert size(CPU, max_total_tokens=300) == size(CUDA, max_total_tokens=300) == 300
    assert size(CPU) == int(10 * GIB * 0.15) // per_token
    assert size(CPU, mem_fraction_static=0.5) == int(10 * GIB * 0.5) // per_token
    assert measured == []
    assert size(CUDA) == int(8 * GIB * 0.9) // per_token
    assert measured == [limits]


def test_bf16_arithmetic_on_the_cpu_keeps_kv_in_bf16_and_twice_the_tokens(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under bf16 arithmetic on the CPU (float32 tensors, BF16 linears) the KV pool is bf16, so the pool
    sized from memory holds twice the tokens; everywhere else it is the model's dtype."""
    assert kv_dtype_for(torch.float32, BF16, CPU) == torch.bfloat16
    assert kv_dtype_for(torch.float32, FP32, CPU) == torch.float32
    assert kv_dtype_for(torch.bfloat16, FP32, CUDA) == torch.bfloat16
    assert kv_dtype_for(torch.float16, FP32, CUDA) == torch.float16
    model = ModelConfig.from_dir(tiny_llama_dir)
    limits = StepLimits(max_step_tokens=64, context_len=512, max_running_requests=8, graph_batch=0)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 10 * GIB)
    for dtype, element in ((torch.float32, 4), (torch.bfloat16, 2)):
        per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * element
        tokens = kv_pool_size(EngineConfig(), model, dtype, CPU, limits, no_scratch)
        assert tokens == int(10 * GIB * 0.15) // per_token


def test_an_int8_kv_cache_holds_nearly_four_times_the_tokens(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kv-cache-dtype int8: the pool's bytes per token are its codes plus a float32 scale per kv head
    for K and for V, so the same memory holds (4 D) / (D + 4) times float32's tokens (3.76x at the
    default model's head dim 64). fp8 needs a CUDA GPU: on the CPU a ValueError names the flag."""
    assert kv_dtype_for(torch.float32, FP32, CPU, "int8") == torch.int8
    assert kv_dtype_for(torch.float32, BF16, CPU, "int8") == torch.int8
    assert kv_dtype_for(torch.float32, FP32, CPU, "auto") == torch.float32
    assert kv_dtype_for(torch.float32, FP32, CPU, "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e4m3' needs a CUDA GPU"):
        kv_dtype_for(torch.float32, FP32, CPU, "fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_dtype_for(torch.float32, FP32, CPU, "int4")
    model = ModelConfig.from_dir(tiny_llama_dir)
    limits = StepLimits(max_step_tokens=64, context_len=512, max_running_requests=8, graph_batch=0)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 10 * GIB)
    tokens = {
        d: kv_pool_size(EngineConfig(), model, d, CPU, limits, no_scratch)
        for d in (torch.float32, torch.int8)
    }
    per_token = 2 * model.num_layers * model.num_kv_heads * (model.head_dim + 4)
    assert tokens[torch.int8] == int(10 * GIB * 0.15) // per_token
    ratio = tokens[torch.int8] / tokens[torch.float32]
    assert ratio == pytest.approx(4 * model.head_dim / (model.head_dim + 4), rel=1e-3)


def test_step_limits_follow_the_engine_flags() -> None:
    config = EngineConfig(max_running_requests=12, cuda_graph_max_bs=8)
    assert StepLimits.of(config, 2048, 512) == StepLimits(2048, 512, 12, 8)
    eager = EngineConfig(max_running_requests=12, disable_cuda_graph=True)
    assert StepLimits.of(eager, 2048, 512).graph_batch == 0


@pytest.mark.parametrize("capturable", [True, False])
def test_the_reserve_measures_the_largest_prefill_and_graph_decode(
    monkeypatch: pytest.MonkeyPatch, capturable: bool
) -> None:
    """The scratch pool and table hold the largest prefill (split at the context) sampled on
    max_running_requests rows; a decode of the largest graph batch is measured too where the backend's
    decode steps are captured. Run on a stand-in scratch that records what it was given."""
    shapes: list[ScratchShape] = []
    steps: list[tuple[StepPlan, SamplingBatchInfo | None]] = []

    def open_scratch(shape: ScratchShape) -> Scratch:
        shapes.append(shape)
        return Scratch(lambda plan, sampling: steps.append((plan, sampling)), capturable)

    monkeypatch.setattr(memory, "peak_bytes", lambda run, device: run() or 10)
    limits = StepLimits(max_step_tokens=70, context_len=32, max_running_requests=6, graph_batch=4)
    assert activation_reserve(limits, 300, CPU, open_scratch) == (20 if capturable else 10)
    assert shapes == [ScratchShape(pool_tokens=71, table_rows=6, table_cols=32)]
    (prefill, sampling), *decode = steps
    assert [len(it.input_ids) for it in prefill.items] == [32, 32, 6]
    assert sum(it.num_logit_rows for it in prefill.items) == 6
    assert sampling is not None and sampling.temperatures.shape[0] == 6 and sampling.need_top_p
    if capturable:
        [(graph_step, no_sampling)] = decode
        assert [len(it.input_ids) for it in graph_step.items] == [1] * 4 and no_sampling is None
    else:
        assert decode == []


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
    assert runner_reserve(runner, 2048) > runner_reserve(runner, 64) > 0
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    long_prompt = engine.generate(input_ids=[[5] * 470], sampling_params=params)
    batch = engine.generate(input_ids=[[5 + i] * 8 for i in range(16)], sampling_params=params)
    assert long_prompt[0]["meta_info"]["completion_tokens"] == 4
    assert all(out["meta_info"]["completion_tokens"] == 4 for out in batch)
