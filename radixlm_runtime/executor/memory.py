"""How many tokens the KV pool holds when --max-total-tokens is not given: a fraction of the memory
left after the weights, less (on CUDA) what the largest steps were measured to need at start-up."""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixlm_runtime.step import ForwardItem, StepPlan

# Share of available memory for the KV pool by default: (CPU, CUDA). On CUDA it is a share of what is
# left once the measured activations are set aside; the rest covers the allocator's fragmentation
# and library workspaces.
DEFAULT_MEM_FRACTION = (0.15, 0.9)
# The smallest pool worth starting with; on CPU a smaller budget is raised to it.
MIN_POOL_TOKENS = 1024


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
