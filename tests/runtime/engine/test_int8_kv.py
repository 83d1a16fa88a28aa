"""--kv-cache-dtype int8 end to end (issue 29): the device pool and the host tier hold int8 codes and
their per-token, per-head scales, the C++ attention and the one-call decoder read them; a prompt served
from the radix cache, from the host tier after eviction, or batched with others gives the same greedy
tokens and logprobs as one served fresh and alone by an engine without a cache (--deterministic: every
kernel then batch- and chunk-invariant, and a token's K/V is quantized on its own, so its codes do not
depend on what was computed with it); the torch backend serves the same pool; fp8 is refused on the
CPU. On the default model, int8 KV agrees with float32 KV on most greedy tokens (slow)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from test_bf16_kv import GREEDY, PROMPTS, _generate, check_host_tier_round_trip

import radixlm_runtime as rt
from radixlm_runtime.attention.cpu_backend import KV_TYPES, CpuAttentionBackend
from radixlm_runtime.attention.torch_backend import TorchAttentionBackend


def _engine(model_dir: Path | None, **flags: Any) -> rt.Engine:
    flags = {"max_total_tokens": 4096, "kv_cache_dtype": "int8", **flags}
    path = None if model_dir is None else str(model_dir)
    return rt.Engine(path, device="cpu", dtype="float32", log_level="warning", **flags)


def _tokens_and_logprobs(
    outs: list[tuple[list[int], list[float], int]],
) -> list[tuple[list[int], list[float]]]:
    return [(ids, lps) for ids, lps, _ in outs]


def test_the_pool_and_the_host_tier_hold_int8_and_scales(tiny_llama_dir: Path) -> None:
    engine = _engine(tiny_llama_dir, kv_host_tokens=1024)
    try:
        runner = engine.runner
        pool, host = runner.kv_pool, runner.host_pool
        assert pool.dtype == host.dtype == torch.int8 and pool.quantized and host.quantized
        assert len(pool.tensors()) == len(host.tensors()) == 4 * pool.num_layers
        assert all(
            s.dtype == torch.float32 and s.shape == (pool.size + 1, pool.num_kv_heads) for s in pool.k_scales
        )
        assert type(runner.attn_backend) is CpuAttentionBackend
        decoder = runner.model.cpu_decoder
        assert decoder is not None and decoder.kv_type == KV_TYPES[torch.int8]
        (ids, _, _), *_ = _generate(engine, PROMPTS[:1])
        assert len(ids) == GREEDY["max_new_tokens"]
        assert any(torch.any(s[1:] > 0) for s in pool.k_scales)  # the scales were written
    finally:
        engine.shutdown()


@pytest.mark.parametrize("native", [True, False], ids=["one-call-decoder", "python-layers"])
def test_cached_and_batched_equal_uncached_and_alone_under_deterministic(
    tiny_llama_dir: Path, native: bool
) -> None:
    """Each prompt served alone by an engine without a cache is the reference; a caching engine serving
    them all in one batch, then again (their prefixes from the radix cache), gives the same tokens and
    logprobs, to the bit."""
    fresh = _engine(tiny_llama_dir, deterministic=True, disable_radix_cache=True)
    cached = _engine(tiny_llama_dir, deterministic=True)
    try:
        if not native:
            cached.runner.model.cpu_decoder = None
        assert cached.runner.kv_pool.dtype == fresh.runner.kv_pool.dtype == torch.int8
        want = [_generate(fresh, [p])[0] for p in PROMPTS]
        first = _generate(cached, PROMPTS)
        again = _generate(cached, PROMPTS)
    finally:
        fresh.shutdown()
        cached.shutdown()
    assert all(n > 0 for _, _, n in again)
    assert _tokens_and_logprobs(again) == _tokens_and_logprobs(want)
    assert _tokens_and_logprobs(first) == _tokens_and_logprobs(want)


def test_prefixes_evicted_to_the_host_tier_come_back_the_same(tiny_llama_dir: Path) -> None:
    """Copies between two int8 pools, codes and scales."""
    check_host_tier_round_trip(functools.partial(_engine, tiny_llama_dir))


def test_the_torch_backend_reads_the_int8_pool(tiny_llama_dir: Path) -> None:
    """attention_backend='torch' on the same int8 pool (dequantized as gathered; the C++ kernels apply
    the same scales per key): the prompt's logprobs within float32 rounding of the C++ kernels'; and
    int8 KV moves them away from float32 KV's, a little."""

    def prompt_logprobs(backend: str, kv_cache_dtype: str = "int8") -> list[float]:
        engine = _engine(tiny_llama_dir, attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
        try:
            kind = TorchAttentionBackend if backend == "torch" else CpuAttentionBackend
            assert type(engine.runner.attn_backend) is kind
            outs = engine.generate(PROMPTS, {"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
        finally:
            engine.shutdown()
        return [lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]

    ours, theirs = prompt_logprobs("cpu"), prompt_logprobs("torch")
    assert len(ours) == len(theirs) > 100
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3
    fp32 = prompt_logprobs("cpu", "auto")
    drift = max(abs(a - b) for a, b in zip(ours, fp32))
    assert 0 < drift < 0.5


def test_fp8_kv_is_refused_on_the_cpu(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e4m3' needs a CUDA GPU"):
        _engine(tiny_llama_dir, kv_cache_dtype="fp8_e4m3")


@pytest.mark.slow
def test_the_default_model_with_int8_kv_agrees_with_float32_kv() -> None:
    """SmolLM2-135M, 16 prompts x 32 greedy tokens: int8 KV picks float32 KV's token at most positions
    up to the first disagreement (after which the texts continue from different tokens), and the first
    tokens all agree. The rate is printed for the record."""
    prompts = [
        f"Write one sentence about the number {i} and why it matters in mathematics." for i in range(16)
    ]
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    outs = {}
    for kv in ("auto", "int8"):
        engine = _engine(None, kv_cache_dtype=kv)
        try:
            outs[kv] = [o["output_ids"] for o in engine.generate(prompts, params)]
        finally:
            engine.shutdown()
    agreed = total = 0
    for a, b in zip(outs["auto"], outs["int8"]):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agreed, total = agreed + same, total + len(a)
    rate = agreed / total
    print(f"int8 KV greedy agreement with float32 KV: {rate:.3f} ({agreed}/{total} tokens before divergence)")
    assert all(a[0] == b[0] for a, b in zip(outs["auto"], outs["int8"]))
    assert rate >= 0.6
