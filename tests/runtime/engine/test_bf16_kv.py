"""A bf16 KV cache on the CPU, end to end on the tiny Llama, where --dtype bfloat16 puts it
(executor/memory.py's kv_dtype_for) and where --kv-cache-dtype bfloat16 asks for it under float32
arithmetic, float32 or int4 weights with int8 activations: the device pool and the host tier hold K/V in
bf16, the C++ attention and the one-call decoder read them; a prompt served from the radix cache, or
from the host tier after eviction, gives the same greedy tokens and logprobs as one served fresh by an
engine without a cache (--deterministic: every kernel then batch- and chunk-invariant); the torch
backend serves the same pool. On a CPU without bf16 dot products --dtype bfloat16 runs float32, the KV
pool included, while --kv-cache-dtype bfloat16 still stores bf16 (the kernels widen it)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import radixlm_runtime as rt
from radixlm_runtime.attention.cpu_backend import KV_TYPES, CpuAttentionBackend
from radixlm_runtime.attention.torch_backend import TorchAttentionBackend
from radixlm_runtime.executor import model_runner
from radixlm_runtime.layers.linear_kernels import BF16, bf16_available

needs_bf16 = pytest.mark.skipif(
    not bf16_available(), reason="this CPU has no bf16 dot products (AVX512-BF16)"
)

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PREFIX = "The council of the harbour town met every spring to discuss the fishing season. " * 2
PROMPTS = [PREFIX + f"Question {i}: what did they decide?" for i in range(4)] + ["hello world " * 20]


# How each engine kind gets a bf16 pool: bf16 arithmetic (its 'auto' KV), or the flag under float32
# arithmetic, with float32 weights or int4 weights and int8 activations.
KINDS = {
    "bf16-arithmetic": {"dtype": "bfloat16"},
    "fp32-bf16-kv": {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
    "int4-act8-bf16-kv": {
        "dtype": "float32",
        "kv_cache_dtype": "bfloat16",
        "quantization": "int4",
        "cpu_act_quant": "int8",
    },
}
# The bf16-arithmetic kind needs bf16 dot products; the flag stores bf16 on any CPU.
KIND_PARAMS = [
    pytest.param("bf16-arithmetic", marks=needs_bf16),
    "fp32-bf16-kv",
    "int4-act8-bf16-kv",
]


def _engine(model_dir: Path, kind: str = "bf16-arithmetic", **flags: Any) -> rt.Engine:
    flags = {"max_total_tokens": 4096, **KINDS[kind], **flags}
    return rt.Engine(str(model_dir), device="cpu", log_level="warning", **flags)


def _generate(engine: rt.Engine, prompts: list[str]) -> list[tuple[list[int], list[float], int]]:
    """Greedy tokens, their logprobs and the prompt's cached tokens, per prompt."""
    outs = engine.generate(prompts, GREEDY, return_logprob=True)
    return [
        (
            o["output_ids"],
            [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
            o["meta_info"]["cached_tokens"],
        )
        for o in outs
    ]


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_the_pool_and_the_host_tier_hold_bf16(tiny_llama_dir: Path, kind: str) -> None:
    engine = _engine(tiny_llama_dir, kind, kv_host_tokens=1024)
    try:
        runner = engine.runner
        assert runner.dtype == torch.float32
        assert (runner.compute == BF16) == (kind == "bf16-arithmetic")
        assert runner.kv_pool.dtype == runner.host_pool.dtype == torch.bfloat16
        assert all(b.dtype == torch.bfloat16 for b in runner.kv_pool.k_buffers + runner.kv_pool.v_buffers)
        assert type(runner.attn_backend) is CpuAttentionBackend
        decoder = runner.model.cpu_decoder
        assert decoder is not None and decoder.kv_type == KV_TYPES[torch.bfloat16]
        (ids, _, _), *_ = _generate(engine, PROMPTS[:1])
        assert len(ids) == GREEDY["max_new_tokens"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", KIND_PARAMS)
@pytest.mark.parametrize("native", [True, False], ids=["one-call-decoder", "python-layers"])
def test_cached_equals_uncached_under_deterministic(tiny_llama_dir: Path, native: bool, kind: str) -> None:
    """Each prompt served twice by a caching engine (the second time its prefix from the radix cache)
    gives the tokens and logprobs of an engine without a cache, to the bit."""
    fresh = _engine(tiny_llama_dir, kind, deterministic=True, disable_radix_cache=True)
    cached = _engine(tiny_llama_dir, kind, deterministic=True)
    try:
        if not native:
            cached.runner.model.cpu_decoder = None
        assert cached.runner.kv_pool.dtype == fresh.runner.kv_pool.dtype == torch.bfloat16
        want = _generate(fresh, PROMPTS)
        first = _generate(cached, PROMPTS)
        again = _generate(cached, PROMPTS)
    finally:
        fresh.shutdown()
        cached.shutdown()
    assert all(n > 0 for _, _, n in again)
    assert [(ids, lps) for ids, lps, _ in again] == [(ids, lps) for ids, lps, _ in want]
    assert [(ids, lps) for ids, lps, _ in first] == [(ids, lps) for ids, lps, _ in want]


def check_host_tier_round_trip(engine: Callable[..., rt.Engine]) -> None:
    """A pool too small for the prompts: their prefixes go to the host tier and come back from it, with
    the tokens and logprobs of an engine without a cache (both made by `engine(**flags)`)."""
    prompts = [f"document {i} " + "the theater then an answer abc " * 6 + f" question {i}" for i in range(8)]
    fresh = engine(deterministic=True, disable_radix_cache=True)
    tiered = engine(deterministic=True, max_total_tokens=300, kv_host_tokens=4096)
    try:
        want = _generate(fresh, prompts)
        for p in prompts:
            _generate(tiered, [p])
        got = [_generate(tiered, [p])[0] for p in prompts]
        info = tiered.get_server_info()
    finally:
        fresh.shutdown()
        tiered.shutdown()
    assert [(ids, lps) for ids, lps, _ in got] == [(ids, lps) for ids, lps, _ in want]
    assert info["host_hit_tokens"] > 0


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_prefixes_evicted_to_the_host_tier_come_back_the_same(tiny_llama_dir: Path, kind: str) -> None:
    """Copies between two bf16 pools."""
    check_host_tier_round_trip(functools.partial(_engine, tiny_llama_dir, kind))


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_the_torch_backend_reads_the_bf16_pool(tiny_llama_dir: Path, kind: str) -> None:
    """attention_backend='torch' on the same bf16 pool (K/V widened as gathered): the prompt's logprobs
    within bf16 rounding of the C++ kernels' (which round the queries, and on a CPU with AVX512-BF16
    the prefill weights, to bf16 too)."""

    def prompt_logprobs(backend: str) -> list[float]:
        engine = _engine(tiny_llama_dir, kind, attention_backend=backend)
        try:
            assert engine.runner.kv_pool.dtype == torch.bfloat16
            backend_type = TorchAttentionBackend if backend == "torch" else CpuAttentionBackend
            assert type(engine.runner.attn_backend) is backend_type
            outs = engine.generate(PROMPTS, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
        finally:
            engine.shutdown()
        return [lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]

    ours, theirs = prompt_logprobs("cpu"), prompt_logprobs("torch")
    assert len(ours) == len(theirs) > 100
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 0.05


def test_the_triton_backend_reads_a_bf16_pool_under_float32_arithmetic(tiny_llama_dir: Path) -> None:
    """--kv-cache-dtype bfloat16 under float32 queries on the Triton backend (the interpreter here, a GPU
    there): the greedy tokens of the C++ kernels over the same pool, the logprobs within bf16 rounding."""
    outs = {}
    for backend in ("cpu", "triton"):
        engine = _engine(tiny_llama_dir, "fp32-bf16-kv", attention_backend=backend)
        try:
            assert engine.runner.kv_pool.dtype == torch.bfloat16
            outs[backend] = _generate(engine, PROMPTS[:2])
        finally:
            engine.shutdown()
    assert [ids for ids, _, _ in outs["triton"]] == [ids for ids, _, _ in outs["cpu"]]
    for (_, ours, _), (_, theirs, _) in zip(outs["cpu"], outs["triton"]):
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 0.05


def test_without_bf16_dot_products_the_kv_stays_float32(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_runner, "bf16_available", lambda: False)
    engine = _engine(tiny_llama_dir, kv_host_tokens=512)
    try:
        assert engine.runner.kv_pool.dtype == engine.runner.host_pool.dtype == torch.float32
    finally:
        engine.shutdown()
    # Asked for by name, a bf16 pool needs no bf16 dot products: the kernels widen it.
    engine = _engine(tiny_llama_dir, "fp32-bf16-kv", kv_host_tokens=512)
    try:
        assert engine.runner.kv_pool.dtype == engine.runner.host_pool.dtype == torch.bfloat16
        (ids, _, _), *_ = _generate(engine, PROMPTS[:1])
        assert len(ids) == GREEDY["max_new_tokens"]
    finally:
        engine.shutdown()


def test_the_bf16_kv_flag_halves_the_pool_bytes_per_token(tiny_llama_dir: Path) -> None:
    """Asked for under float32 arithmetic, a bf16 pool costs half a float32 pool's bytes per token, so a
    pool sized from the same memory holds twice the tokens."""
    pools = {}
    for kv in ("auto", "bfloat16"):
        engine = _engine(tiny_llama_dir, "fp32-bf16-kv", kv_cache_dtype=kv)
        try:
            pools[kv] = engine.runner.kv_pool
        finally:
            engine.shutdown()
    assert pools["auto"].dtype == torch.float32 and pools["bfloat16"].dtype == torch.bfloat16
    assert 2 * pools["bfloat16"].bytes_per_token() == pools["auto"].bytes_per_token()
