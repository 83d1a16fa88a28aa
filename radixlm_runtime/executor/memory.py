"""How many tokens the KV pool holds when --max-total-tokens is not given: a fraction of the memory
left after the weights, less (on CUDA) what the largest steps were measured to need at start-up. The
executor lends the measurement a step runner on a scratch pool (`Scratch`); the sizing is decided here."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixlm_runtime.config import EngineConfig
from radixlm_runtime.kvcache.pool import KVPool
from radixlm_runtime.layers.linear_kernels import BF16
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.sampling.sampler import SamplingBatchInfo
from radixlm_runtime.step import ForwardItem, StepPlan
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

# Share of available memory for the KV pool by default: (CPU, CUDA). On CUDA it is a share of what is
# left once the measured activations are set aside; the rest covers the allocator's fragmentation
# and library workspaces.
DEFAULT_MEM_FRACTION = (0.15, 0.9)
# The smallest pool worth starting with; on CPU a smaller budget is raised to it.
MIN_POOL_TOKENS = 1024


# --kv-cache-dtype names of the quantized pools (kvcache/pool.py).
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def kv_dtype_for(
    dtype: torch.dtype, compute: str, device: torch.device, kv_cache_dtype: str = "auto"
) -> torch.dtype:
    """The KV pool's dtype. 'auto': the model's, except under bf16 arithmetic on the CPU (--dtype bfloat16
    on a CPU with AVX512-BF16: float32 tensors, `compute` BF16), where K/V are stored as bf16, half the
    bytes per token, so a pool sized from memory holds twice the tokens (the CPU attention reads them
    back exactly widened). 'bfloat16': the same bf16 K/V under float32 arithmetic. 'int8': codes with
    per-token, per-head scales (~3.8x fp32's tokens at head dim 64), any device. 'fp8_e4m3': float8 K/V,
    on CUDA GPUs of compute capability 8.9 or later only."""
    if kv_cache_dtype == "auto":
        return torch.bfloat16 if device.type == "cpu" and compute == BF16 else dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {['auto', *KV_CACHE_DTYPES]}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "fp8_e4m3" and (
        device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ValueError(
            f"kv_cache_dtype 'fp8_e4m3' needs a CUDA GPU of compute capability 8.9 or later (fp8 KV is read "
            f"by the torch and Triton backends there), not {device}; use kv_cache_dtype 'int8' on the CPU"
        )
    return KV_CACHE_DTYPES[kv_cache_dtype]


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory on CUDA (after empty_cache, so blocks the caching allocator holds count as
    free), MemAvailable of the host otherwise."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass max_total_tokens")


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Device memory `run` allocates at its peak beyond what was allocated before it (CUDA); what it
    returns is dropped before this returns."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def kv_pool_tokens(
    available: int, reserved: int, fraction: float, bytes_per_token: int, device: torch.device
) -> int:
    """Tokens of KV that fit in `fraction` of the available bytes once `reserved` (measured
    activations) are set aside. On CUDA too little is an error naming the ways out; on CPU, where
    nothing is reserved and host memory pages in lazily, the pool is raised to MIN_POOL_TOKENS."""
    tokens = int((available - reserved) * fraction) // bytes_per_token
    if tokens >= MIN_POOL_TOKENS or device.type != "cuda":
        return max(tokens, MIN_POOL_TOKENS)
    gib = 2**30
    raise ValueError(
        f"KV pool: only {max(tokens, 0)} tokens fit ({available / gib:.2f} GiB free after the weights, "
        f"{reserved / gib:.2f} GiB of it needed by the largest steps, mem_fraction_static {fraction}); "
        "lower chunked_prefill_size, max_running_requests or cuda_graph_max_bs, or set max_total_tokens"
    )


def scratch_plan(extend_lens: list[int], logit_rows: list[int]) -> StepPlan:
    """A step of new requests for measuring: request i in table row i, extend_lens[i] tokens of id 0,
    their KV in consecutive pool slots from 1, logits for its last logit_rows[i] tokens."""
    items, start = [], 1
    for row, (n, rows) in enumerate(zip(extend_lens, logit_rows, strict=True)):
        slots = list(range(start, start + n))
        items.append(ForwardItem(row, 0, [0] * n, slots, write_from=0, logits_from=n - rows))
        start += n
    return StepPlan(items)


def scratch_prefill(tokens: int, context_len: int, sampled: int) -> StepPlan:
    """The largest prefill step: `tokens` new tokens as requests no longer than the context (positions
    past it have no rotary entry), logits for the step's last `sampled` tokens."""
    longest = min(tokens, context_len)
    lens = [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else [])
    rows, left = [], sampled
    for n in reversed(lens):
        rows.append(min(n, left))
        left -= rows[-1]
    return scratch_plan(lens, rows[::-1])


@dataclass(frozen=True)
class StepLimits:
    """The largest steps the scheduler plans, which the memory beside the KV pool must hold."""

    max_step_tokens: int  # the chunked-prefill budget
    context_len: int
    max_running_requests: int
    graph_batch: int  # the largest decode batch CUDA graphs capture; 0 when decode runs eagerly

    @classmethod
    def of(cls, config: EngineConfig, max_step_tokens: int, context_len: int) -> StepLimits:
        graph_batch = 0 if config.disable_cuda_graph else config.cuda_graph_max_bs
        return cls(max_step_tokens, context_len, config.max_running_requests, graph_batch)


@dataclass(frozen=True)
class ScratchShape:
    """The scratch KV pool and request-to-token table the measured steps run on."""

    pool_tokens: int
    table_rows: int
    table_cols: int


@dataclass(frozen=True)
class Scratch:
    """The executor's step runner on a scratch pool: `run(plan, sampling)` runs the forward of plan and,
    given sampling, samples its logits rows (with logprobs); what it returns is only measured."""

    run: Callable[[StepPlan, SamplingBatchInfo | None], object]
    graph_capturable: bool  # whether its attention backend's decode steps are captured in CUDA graphs


OpenScratch = Callable[[ScratchShape], Scratch]


@torch.inference_mode()
def activation_reserve(
    limits: StepLimits, vocab_size: int, device: torch.device, open_scratch: OpenScratch
) -> int:
    """Device memory, beyond the weights and the KV pool, of the largest steps: a prefill of
    max_step_tokens tokens (requests no longer than the context) whose last max_running_requests rows are
    sampled with top-p (a sort of the whole vocabulary), plus a decode of the largest captured batch (CUDA
    graphs keep a memory pool of their own). Measured on a scratch pool before the real one is sized; the
    run also compiles the kernels the first requests would otherwise wait for."""
    rows = min(limits.max_running_requests, limits.max_step_tokens)
    prefill = scratch_prefill(limits.max_step_tokens, limits.context_len, rows)
    longest = max(len(it.input_ids) for it in prefill.items)
    shape = ScratchShape(max(limits.max_step_tokens, rows) + 1, max(len(prefill.items), rows), longest)
    scratch = open_scratch(shape)
    params = SamplingParams.from_dict({"temperature": 1.0, "top_p": 0.9}, vocab_size)
    draws = [(0, i) for i in range(rows)]
    sampling = SamplingBatchInfo.build([params] * rows, draws, None, vocab_size, device)
    reserved = peak_bytes(lambda: scratch.run(prefill, sampling), device)
    if limits.graph_batch and scratch.graph_capturable:
        n = min(rows, limits.graph_batch)
        reserved += peak_bytes(lambda: scratch.run(scratch_plan([1] * n, [1] * n), None), device)
    return reserved


def kv_pool_size(
    config: EngineConfig,
    model: ModelConfig,
    kv_dtype: torch.dtype,
    device: torch.device,
    limits: StepLimits,
    open_scratch: OpenScratch,
    windows: tuple[int, float] = (0, 0.0),
) -> int:
    """Tokens of the KV pool (of kv_dtype, kv_dtype_for's): --max-total-tokens when given, else
    --mem-fraction-static (or its default) of the available memory, less on CUDA the activations of the
    largest steps, measured; a token's bytes are what the pool stores for it (an int8 pool's scales
    included), so a quantized pool holds more tokens in the same memory. `windows`: how many layers keep
    their KV in window slots, and how many of those a token of the pool comes with (kvcache/pool.py)."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    window_layers, ratio = windows
    full, window = (
        KVPool.bytes_per_token_for(n, model.num_kv_heads, model.head_dim, kv_dtype)
        for n in (model.num_layers - window_layers, window_layers)
    )
    per_token = full + math.ceil(ratio * window)
    fraction = config.mem_fraction_static
    if fraction is None:
        fraction = DEFAULT_MEM_FRACTION[device.type == "cuda"]
    reserved = 0
    if device.type == "cuda":
        try:
            reserved = activation_reserve(limits, model.vocab_size, device, open_scratch)
        except torch.OutOfMemoryError as e:
            raise ValueError(
                f"the largest step ({limits.max_step_tokens} tokens) does not fit in GPU memory beside the "
                "weights; lower chunked_prefill_size, max_running_requests or cuda_graph_max_bs"
            ) from e
        logger.info("activations of the largest steps: %.2f GiB (measured)", reserved / 2**30)
    tokens = kv_pool_tokens(available_memory_bytes(device), reserved, fraction, per_token, device)
    logger.info("KV pool of %s: %d bytes per token, %d tokens", kv_dtype, per_token, tokens)
    return tokens
