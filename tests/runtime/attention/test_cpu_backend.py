"""The C++ CPU attention backend (attention/cpu_backend.py, cpu_attention.cpp) against a dense reference
and the torch backend, on each path this CPU has (AVX-512 rows-as-lanes for prefill chunks, AVX2) and
the forced portable one: decode tokens, short extends and prefill chunks (with and without a cached
prefix, longer than the kernel's 16-token query chunks and 64-key blocks) of requests whose KV sits in
shuffled pool slots, read through the fused projection's strided q/k/v views. Sliding windows and logit
soft-caps against the torch backend's per-request float32 path, the reference for them: sequences
around and past 3x the window, shared-prefix groups whose prefix a member's window holds or not, and
--deterministic's per-token decodes. Each over a float32 pool and a bf16 one (--dtype bfloat16 on CPU),
whose reference is float32 math on the bf16-rounded K/V and queries: paths 0-2 give over a bf16 pool the
bits they give over a float32 pool holding the rounded values; paths 3 (vdpbf16ps, where the CPU has
AVX512-BF16) and 4 (AMX tiles, where it has AMX-BF16) agree within bf16 rounding of the prefill weights;
every path is batch- and chunk-invariant. And over
an int8 pool (--kv-cache-dtype int8), whose reference is the dequantized K/V: every path gives the bits it
gives within float32 rounding of a float32 pool holding them, and its store quantizes as KVPool.set_kv
does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_backends import PROMPTS, _hand_built_step, _reference_attention, _run

from radixlm_runtime.attention import cpu_backend, registry
from radixlm_runtime.attention.base import AttentionLayer
from radixlm_runtime.attention.cpu_backend import (
    AMX_BF16,
    AVX2,
    AVX512,
    AVX512_BF16,
    SCALAR,
    CpuAttentionBackend,
    kernel_path,
)
from radixlm_runtime.attention.torch_backend import MAX_BATCHED_EXTEND, TorchAttentionBackend
from radixlm_runtime.config import EngineConfig
from radixlm_runtime.executor import model_runner
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.kernels.native import KernelBuildError
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenTable
from radixlm_runtime.layers.linear_kernels import bf16_available

MODES = [SCALAR, AVX2, AVX512]
TOL = {"atol": 1e-5, "rtol": 1e-4}
BF16 = torch.bfloat16
INT8 = torch.int8
# (pool dtype, mode): a float32 pool on each path (AVX512_BF16 runs AVX512's there), a bf16 one on each
# path including vdpbf16ps's and AMX tiles' (AVX512's where the CPU lacks them), an int8 one on each path.
POOL_MODES = [(torch.float32, m) for m in MODES] + [(BF16, m) for m in [*MODES, AVX512_BF16, AMX_BF16]]
POOL_MODES += [(INT8, m) for m in MODES]
POOL_MODE_IDS = [f"{str(d)[6:]}-mode{m}" for d, m in POOL_MODES]
needs_bf16 = pytest.mark.skipif(
    not bf16_available(), reason="this CPU has no bf16 dot products (AVX512-BF16)"
)
needs_amx = pytest.mark.skipif(kernel_path(64, AMX_BF16) != AMX_BF16, reason="this CPU has no AMX-BF16 tiles")
# Paths 3 and 4 over a bf16 pool round the prefill weights (P) to bf16 for P.V, as flash-attention
# kernels do: each output moves by up to a few bf16 roundings of the values it averages.
PAIRS_TOL = {"atol": 1e-2, "rtol": 1e-2}


def _tol(dtype: torch.dtype, mode: int) -> dict[str, float]:
    """The tolerance against a float32 reference of the path that `mode` runs over a pool of dtype."""
    return PAIRS_TOL if dtype == BF16 and kernel_path(64, mode) in (AVX512_BF16, AMX_BF16) else TOL


def _kernel_queries(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """q as the kernels use it over a pool of dtype, unscaled again for a reference that scales: over a
    bf16 pool each scaled query is rounded to bf16 (over float32 and int8 ones it is used as it is)."""
    return (q * scale).to(BF16).float() / scale if dtype == BF16 else q


def _fill(pool: KVPool, gen: torch.Generator) -> None:
    """Random K/V (standard normal) in every slot but the dummy of layer 0, stored as set_kv stores them
    (an int8 pool's quantized)."""
    shape = (pool.size, pool.num_kv_heads, pool.head_dim)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    pool.set_kv(0, torch.arange(1, pool.size + 1), k, v)


def _dense(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K/V as the reference reads them: float32 (a bf16 pool's widened, an int8 pool's
    dequantized)."""
    return pool.read_kv(0, slice(None), torch.float32)


def _shuffled_step(
    seq_lens: list[int],
    extend_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[KVPool, ReqToTokenTable, list[list[int]], ForwardBatch]:
    """Requests whose KV slots are a random permutation of the pool (of dtype) (no two neighbours adjacent
    in general), in scattered table rows, each adding its last extend_lens[b] tokens; every slot but the
    dummy holds random KV."""
    gen = torch.Generator().manual_seed(seed)
    size = sum(seq_lens) + 50
    pool = KVPool(size, 1, num_kv_heads, head_dim, dtype, "cpu")
    _fill(pool, gen)
    perm = (torch.randperm(size, generator=gen) + 1).tolist()
    seqs, start = [], 0
    for n in seq_lens:
        seqs.append(perm[start : start + n])
        start += n
    num_rows = 2 * len(seq_lens) + 3  # not a multiple of 3: the rows below are distinct
    rows = [(3 * b + 5) % num_rows for b in range(len(seq_lens))]
    assert len(set(rows)) == len(rows)
    table = ReqToTokenTable(num_rows, max(seq_lens) + 3)
    for row, slots in zip(rows, seqs):
        table.req_to_token[row, : len(slots)] = torch.tensor(slots)
    batch = ForwardBatch.build(
        input_ids=[0] * sum(extend_lens),
        req_pool_indices=rows,
        prefix_lens=[n - e for n, e in zip(seq_lens, extend_lens)],
        extend_lens=extend_lens,
        out_cache_loc=[s for slots, e in zip(seqs, extend_lens) for s in slots[len(slots) - e :]],
        logits_indices=[],
        seq_slots=seqs,
        device=torch.device("cpu"),
    )
    return pool, table, seqs, batch


def _qkv_views(
    tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model hands them over: views of one fused projection row per token."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(tokens, num_q_heads, head_dim),
        k.view(tokens, num_kv_heads, head_dim),
        v.view(tokens, num_kv_heads, head_dim),
    )


# Decodes and short extends (1..16 new tokens) over sequences shorter and longer than the kernel's
# 64-key blocks, with prefill chunks in the batch: one over a cached prefix (20 tokens after 40), a
# whole prompt (90 tokens, six query chunks), one of 150 tokens after 150 cached.
SEQ_LENS = [1, 37, 150, 100, 60, 7, 70, 16, 90, 300]
EXTEND_LENS = [1, 3, 1, 16, 20, 5, 2, 9, 90, 150]


# One request decoding: too few items for the threads, so the kernel gives each kv head its own item
# (a batch gives each request and query chunk one item with every head).
ONE_DECODE = ([300], [1])


@pytest.mark.parametrize("dtype, mode", POOL_MODES, ids=POOL_MODE_IDS)
@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads, head_dim",
    [(9, 3, 64), (8, 2, 128), (8, 2, 24), (4, 4, 16), (6, 3, 20)],
    ids=["gqa3-d64", "gqa4-d128", "gqa4-d24", "mha-d16", "gqa2-d20-scalar-only"],
)
@pytest.mark.parametrize("lens", [(SEQ_LENS, EXTEND_LENS), ONE_DECODE], ids=["batch", "one-decode"])
def test_forward_matches_dense_reference(
    dtype: torch.dtype,
    mode: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    lens: tuple[list[int], list[int]],
) -> None:
    """forward stores the new tokens' K/V (a bf16 pool's rounded as .to(bfloat16) rounds), then every
    token attends causally over its request's KV, all requests in one kernel call."""
    seq_lens, extend_lens = lens
    pool, table, seqs, batch = _shuffled_step(
        seq_lens, extend_lens, num_kv_heads, head_dim, seed=head_dim, dtype=dtype
    )
    q, k, v = _qkv_views(batch.num_tokens, num_q_heads, num_kv_heads, head_dim, seed=1)
    scale = head_dim**-0.5
    backend = CpuAttentionBackend(pool, table, AttentionLayer.uniform(pool.num_layers, scale), mode=mode)
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.requests.shape == (4, len(seq_lens))
    got = backend.forward(q, k, v, 0, batch)
    stored = KVPool(pool.size, 1, num_kv_heads, head_dim, dtype, "cpu")
    stored.set_kv(0, batch.out_cache_loc, k, v)
    for mine, theirs in zip(pool.layer_tensors(0), stored.layer_tensors(0)):
        assert torch.equal(mine[batch.out_cache_loc], theirs[batch.out_cache_loc])
    q_ref = _kernel_queries(q, scale, dtype)
    want = _reference_attention(q_ref, *_dense(pool), seqs, extend_lens, scale)
    torch.testing.assert_close(got, want, **_tol(dtype, mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "extend_lens",
    [[1, 1, 1, 1], [1, 3, 5, 2], [1, 1, 20, 4], [MAX_BATCHED_EXTEND, 1, 2, 1], [40, 17, 33, 2]],
    ids=["decodes", "short-extends", "with-long-extend", "longest-short-extend", "prefill-chunks"],
)
def test_attend_matches_torch_backend(mode: int, extend_lens: list[int]) -> None:
    """The torch backend's hand-built step (three requests sharing 40 prefix slots, which it attends
    to as a group, and an outsider): both backends agree token for token."""
    torch.manual_seed(0)
    pool, table, _, batch = _hand_built_step(extend_lens, 16, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, 6, 16)
    reference = TorchAttentionBackend(pool, table, AttentionLayer.uniform(pool.num_layers, 0.25))
    reference.init_forward_metadata(batch)
    want = reference.attend(q, 0, batch)
    backend = CpuAttentionBackend(pool, table, AttentionLayer.uniform(pool.num_layers, 0.25), mode=mode)
    backend.init_forward_metadata(batch)
    torch.testing.assert_close(backend.attend(q, 0, batch), want, **TOL)


def _table_and_batch(seqs: list[list[int]], extend_lens: list[int]) -> tuple[ReqToTokenTable, ForwardBatch]:
    """A table row per request (its slots in order) and the step adding each one's last extend_lens[b]
    tokens."""
    table = ReqToTokenTable(len(seqs), max(len(s) for s in seqs) + 8)
    for row, slots in enumerate(seqs):
        table.req_to_token[row, : len(slots)] = torch.tensor(slots)
    batch = ForwardBatch.build(
        input_ids=[0] * sum(extend_lens),
        req_pool_indices=list(range(len(seqs))),
        prefix_lens=[len(s) - n for s, n in zip(seqs, extend_lens)],
        extend_lens=extend_lens,
        out_cache_loc=[s for slots, n in zip(seqs, extend_lens) for s in slots[len(slots) - n :]],
        logits_indices=[],
        seq_slots=seqs,
        device=torch.device("cpu"),
    )
    return table, batch


def _shared_prefix_step(
    dtype: torch.dtype = torch.float32,
) -> tuple[KVPool, ReqToTokenTable, ForwardBatch, torch.Generator]:
    """20 decoding requests share a 150-slot prefix, 5 more a 40-slot one (their own suffixes of
    different lengths), one decodes alone and one prefills 30 tokens over the first prefix; one layer of
    random KV (3 kv heads of 64) in a pool of dtype, and the generator that made it, for the queries."""
    gen = torch.Generator().manual_seed(3)
    num_kv_heads, head_dim = 3, 64
    size = 2000
    pool = KVPool(size, 1, num_kv_heads, head_dim, dtype, "cpu")
    _fill(pool, gen)
    free = iter((torch.randperm(size, generator=gen) + 1).tolist())
    first, second = [next(free) for _ in range(150)], [next(free) for _ in range(40)]
    seqs = [first + [next(free) for _ in range(1 + i % 7)] for i in range(20)]
    seqs += [second + [next(free) for _ in range(1 + 9 * i)] for i in range(5)]
    seqs += [[next(free) for _ in range(60)], first + [next(free) for _ in range(30)]]
    extend_lens = [1] * 26 + [30]
    table, batch = _table_and_batch(seqs, extend_lens)
    return pool, table, batch, gen


@pytest.mark.parametrize("dtype, mode", POOL_MODES, ids=POOL_MODE_IDS)
def test_shared_prefix_groups_match_the_dense_reference(dtype: torch.dtype, mode: int) -> None:
    """20 decoding requests share a 150-slot prefix (more members than one group item holds, a prefix of
    three key blocks), 5 more share another (their own suffixes of different lengths), one decodes alone
    and one prefills over the first prefix: the groups' prefix parts computed once, merged into each
    member's own attention, equal attention computed per request."""
    pool, table, batch, gen = _shared_prefix_step(dtype)
    head_dim = pool.head_dim
    backend = CpuAttentionBackend(
        pool, table, AttentionLayer.uniform(pool.num_layers, head_dim**-0.5), mode=mode
    )
    backend.init_forward_metadata(batch)
    step = batch.attn_metadata
    assert step.groups is not None and step.members is not None
    assert sorted(zip(step.groups[1].tolist(), step.groups[2].tolist())) == [(5, 40), (20, 150)]
    q = torch.randn(batch.num_tokens, 9, head_dim, generator=gen)
    got = backend.attend(q, 0, batch)
    seqs, extend_lens = batch.seq_slots_cpu, batch.extend_lens_cpu
    scale = head_dim**-0.5
    q_ref = _kernel_queries(q, scale, dtype)
    want = _reference_attention(q_ref, *_dense(pool), seqs, extend_lens, scale)
    torch.testing.assert_close(got, want, **_tol(dtype, mode))


def _check_group_step(
    mode: int,
    members: int,
    kv_heads: int,
    q_heads: int,
    head_dim: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """`members` decoding requests on one 130-slot prefix (plus 1-5 tokens of their own), KV in a pool of
    dtype, against the dense reference."""
    gen = torch.Generator().manual_seed(seed)
    size = 130 + 5 * members
    pool = KVPool(size, 1, kv_heads, head_dim, dtype, "cpu")
    _fill(pool, gen)
    free = iter((torch.randperm(size, generator=gen) + 1).tolist())
    prefix = [next(free) for _ in range(130)]
    seqs = [prefix + [next(free) for _ in range(1 + i % 5)] for i in range(members)]
    table, batch = _table_and_batch(seqs, [1] * members)
    scale = head_dim**-0.5
    backend = CpuAttentionBackend(pool, table, AttentionLayer.uniform(pool.num_layers, scale), mode=mode)
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.groups is not None
    assert batch.attn_metadata.groups[1].tolist() == [members]
    q = torch.randn(members, q_heads, head_dim, generator=gen)
    q_ref = _kernel_queries(q, scale, dtype)
    want = _reference_attention(q_ref, *_dense(pool), seqs, [1] * members, scale)
    # Decode tokens only: a group item keeps float32 P.V on every path (path 3's bf16 weights are a
    # prefill chunk's), so the float32 tolerance holds.
    torch.testing.assert_close(backend.attend(q, 0, batch), want, **TOL)


@pytest.mark.parametrize("dtype, mode", POOL_MODES, ids=POOL_MODE_IDS)
def test_a_large_group_matches_the_dense_reference(
    dtype: torch.dtype, mode: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 decoding requests on one 130-slot prefix: with two threads the kernel gives its group items
    16 members (48 query rows, whole AVX-512 panels) instead of 8, the last one partly filled."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _check_group_step(mode, members=40, kv_heads=3, q_heads=9, head_dim=64, seed=11, dtype=dtype)


@pytest.mark.parametrize("dtype, mode", POOL_MODES, ids=POOL_MODE_IDS)
def test_steps_of_other_shapes_reuse_the_kernel_buffers_safely(dtype: torch.dtype, mode: int) -> None:
    """The kernel keeps its per-thread buffers across calls; a call with more requests and smaller heads
    (another model in the same process) must not leave them too small for the next. Under
    AddressSanitizer (tests/runtime/kernels/test_sanitizers.py) an overrun here is an error, not luck."""
    _check_group_step(mode, members=60, kv_heads=4, q_heads=12, head_dim=16, seed=5, dtype=dtype)
    _check_group_step(mode, members=30, kv_heads=3, q_heads=9, head_dim=64, seed=6, dtype=dtype)
    _check_group_step(mode, members=2, kv_heads=1, q_heads=8, head_dim=128, seed=7, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, BF16, INT8])
def test_vector_widths_give_the_same_bits(dtype: torch.dtype) -> None:
    """Prefill chunks run the rows-as-lanes kernel on AVX2 and AVX-512 vectors alike, each lane the same
    operations in the same order, and decode tokens the same AVX2 tiles: so a whole step gives the same
    bits on either width (a result does not depend on which x86 CPU served it)."""
    lib = cpu_backend._library()
    if not (lib.ca_has_avx2_fma() and lib.ca_has_avx512()):
        pytest.skip("needs a CPU with AVX-512 to run both widths")
    pool, table, _, batch = _shuffled_step(SEQ_LENS, EXTEND_LENS, 3, 64, seed=7, dtype=dtype)
    q, _, _ = _qkv_views(batch.num_tokens, 9, 3, 64, seed=8)
    outs = []
    for mode in (AVX2, AVX512):
        backend = CpuAttentionBackend(pool, table, AttentionLayer.uniform(pool.num_layers, 0.125), mode=mode)
        backend.init_forward_metadata(batch)
        outs.append(backend.attend(q, 0, batch))
    assert torch.equal(outs[0], outs[1])


# Values whose bf16 rounding is its own case: ties to even (1 + 2^-8 down, 1 + 3 * 2^-8 up), just above a
# tie, signed zeros, infinities, the largest float (rounds to inf) and the largest below bf16's overflow,
# subnormals (one rounding up into the normals), NaN.
SPECIAL = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -0.0, 0.0, float("inf"), -float("inf")]
SPECIAL += [3.4028234e38, 3.3895e38, 1e-40, -3e-39, 1.1754942e-38, float("nan")]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_store_writes_what_set_kv_writes(dtype: torch.dtype) -> None:
    """The C++ row store equals KVPool.set_kv's index_put on every slot, from strided k/v views: a copy,
    or into a bf16 pool the rounding of .to(torch.bfloat16) (to nearest even), special values included."""
    gen = torch.Generator().manual_seed(5)
    pools = [KVPool(64, 2, 3, 8, dtype, "cpu") for _ in range(2)]
    for pool in pools:
        for buf in pool.k_buffers + pool.v_buffers:
            buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view_as(buf))
    loc = torch.randperm(64, generator=gen)[:11] + 1
    _, k, v = _qkv_views(11, 6, 3, 8, seed=2)
    k[0].view(-1)[: len(SPECIAL)] = torch.tensor(SPECIAL)  # writes through into the fused projection
    v[5].view(-1)[: len(SPECIAL)] = torch.tensor(SPECIAL[::-1])
    pools[0].set_kv(1, loc, k, v)
    cpu_backend.store_kv(pools[1], 1, loc, k, v)
    bits = torch.int16 if dtype == BF16 else torch.int32
    for a, b in zip(pools[0].k_buffers + pools[0].v_buffers, pools[1].k_buffers + pools[1].v_buffers):
        nan = a.isnan()
        assert torch.equal(nan, b.isnan())
        assert torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])  # to the bit: -0.0 is not 0.0


def test_cpu_features_pick_the_path() -> None:
    """A fake CPU without AVX2+FMA, or a head dim that is not whole vectors, gets the portable path; one
    without AVX-512 the AVX2 path, one without AVX512-BF16 the AVX-512 one; this CPU the widest it has."""
    assert kernel_path(64, AVX512_BF16, True, True, True) == AVX512_BF16
    assert kernel_path(64, AVX512_BF16, True, True, False) == AVX512
    assert kernel_path(64, AVX512, True, True, True) == AVX512
    assert kernel_path(64, AVX512_BF16, True, False, True) == AVX2
    assert kernel_path(64, AVX512, cpu_has_avx2_fma=True, cpu_has_avx512=False) == AVX2
    assert kernel_path(64, AVX2, cpu_has_avx2_fma=True, cpu_has_avx512=True) == AVX2
    assert kernel_path(64, AVX512_BF16, False, False, False) == SCALAR
    assert kernel_path(20, AVX512_BF16, True, True, True) == SCALAR
    assert kernel_path(64, SCALAR, True, True, True) == SCALAR
    # AMX tiles where the CPU has them and a head is whole 32-element tiles; else AVX-512 (not path 3).
    assert kernel_path(64, AMX_BF16, True, True, True, True) == AMX_BF16
    assert kernel_path(128, AMX_BF16, True, True, True, True) == AMX_BF16
    assert kernel_path(64, AMX_BF16, True, True, True, False) == AVX512
    assert kernel_path(48, AMX_BF16, True, True, True, True) == AVX512
    assert kernel_path(64, AMX_BF16, True, False, True, True) == AVX2
    assert kernel_path(64, AVX512_BF16, True, True, True, True) == AVX512_BF16
    lib = cpu_backend._library()
    widest = (AVX512 if lib.ca_has_avx512() else AVX2) if lib.ca_has_avx2_fma() else SCALAR
    if widest == AVX512 and lib.ca_has_avx512_bf16():
        widest = AVX512_BF16
    assert kernel_path(64) == widest
    assert bool(lib.ca_has_avx512_bf16()) == bf16_available()


class _Ratio:
    """A library stand-in that reports a given vdpbf16ps / FMA flop-rate ratio, zmm / ymm FMA ratio, and
    AMX-BF16 or not."""

    def __init__(self, ratio: float, amx: bool, wide: float = 1.0) -> None:
        self.ratio = ratio
        self.amx = amx
        self.wide = wide

    def ca_bf16_dot_over_fma(self) -> float:
        return self.ratio

    def ca_fma_zmm_over_ymm(self) -> float:
        return self.wide

    def ca_full_width_zmm(self) -> int:
        return int(self.wide >= 1.5)  # simd.h's kFullWidthFmaRatio

    def ca_has_amx_bf16(self) -> int:
        return int(self.amx)


@pytest.mark.parametrize(
    ("ratio", "wide", "amx", "mode", "logged"),
    [
        (2.0, 1.0, False, AVX512_BF16, False),
        (1.5, 1.0, False, AVX512_BF16, False),
        (2.0, 2.0, False, AVX512, True),
        (0.44, 2.0, False, AVX512, True),
        (0.0, 1.0, False, AVX512, False),
        (0.44, 2.0, True, AMX_BF16, False),
    ],
)
def test_the_bf16_path_is_the_default_only_where_it_outruns_fmas(
    monkeypatch: pytest.MonkeyPatch,
    runtime_caplog: pytest.LogCaptureFixture,
    ratio: float,
    wide: float,
    amx: bool,
    mode: int,
    logged: bool,
) -> None:
    """Zen 4 (vdpbf16ps at 2x the FMAs' flops, zmm FMAs at ymm's rate) takes path 3 by default; a Zen 5
    (the same 2x, but full-width zmm FMAs: path 3 measured 0.72-0.79x the float32 path there) and a Xeon
    without AMX that ran vdpbf16ps at 0.44x widen bf16 pools to float32 and say so; a CPU without
    AVX512-BF16 (0) takes the AVX-512 path silently; a Sapphire Rapids Xeon (AMX tiles) takes the tiles."""
    monkeypatch.setattr(cpu_backend, "_library", lambda: _Ratio(ratio, amx, wide))
    cpu_backend.default_mode.cache_clear()
    try:
        assert cpu_backend.default_mode() == mode
    finally:
        cpu_backend.default_mode.cache_clear()
    assert ("vdpbf16ps runs at" in runtime_caplog.text) is logged


def test_this_cpu_measures_its_bf16_dot_rate() -> None:
    """The library times vdpbf16ps against FMAs (0 without AVX512-BF16), and zmm FMAs against ymm ones
    (0 without AVX-512), once: rate ratios within what CPUs have (0.44x on a Xeon with AMX, 2x on a Zen 4;
    zmm 1x on a Zen 4, 2x on a Zen 5), full width from 1.5x; the backend's default mode follows them."""
    lib = cpu_backend._library()
    ratio, wide = lib.ca_bf16_dot_over_fma(), lib.ca_fma_zmm_over_ymm()
    assert (ratio == 0.0) == (not lib.ca_has_avx512_bf16()) and (wide == 0.0) == (not lib.ca_has_avx512())
    assert ratio == 0.0 or 0.1 < ratio < 8.0
    assert wide == 0.0 or 0.5 < wide < 4.0
    assert lib.ca_full_width_zmm() == int(wide >= 1.5)
    pool, table = KVPool(8, 1, 1, 8, torch.float32, "cpu"), ReqToTokenTable(2, 8)
    backend = CpuAttentionBackend(pool, table, AttentionLayer.uniform(1, 1.0))
    pays = ratio >= cpu_backend.BF16_DOT_MIN_RATIO and not lib.ca_full_width_zmm()
    bf16_mode = AVX512_BF16 if pays else AVX512
    assert backend.mode == cpu_backend.default_mode() == (AMX_BF16 if lib.ca_has_amx_bf16() else bf16_mode)


def test_rejects_what_it_cannot_serve() -> None:
    table = ReqToTokenTable(2, 8)
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        CpuAttentionBackend(KVPool(8, 1, 1, 8, torch.float16, "cpu"), table, AttentionLayer.uniform(1, 1.0))


def test_engine_generates_like_the_torch_backend(tiny_llama_dir: Path) -> None:
    """Through the whole engine (prefill and decode through the kernel): the same tokens,
    logprobs within float error. On the CPU whatever the test device: the kernel is CPU-only."""
    ref_ids, ref_lp = _run(tiny_llama_dir, "torch", device="cpu")
    ids, lp = _run(tiny_llama_dir, "cpu", device="cpu")
    assert ids == ref_ids and len(ids) == len(PROMPTS)
    assert len(lp) == len(ref_lp)
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-4


def test_runner_picks_cpu_by_default_and_falls_back_without_a_compiler(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def runner(backend: str) -> model_runner.ModelRunner:
        config = EngineConfig(
            model_path=str(tiny_llama_dir), device="cpu", max_total_tokens=64, attention_backend=backend
        )
        return model_runner.ModelRunner(tiny_llama_dir, config, max_step_tokens=1024)

    assert type(runner("auto").attn_backend) is CpuAttentionBackend
    assert type(runner("torch").attn_backend) is TorchAttentionBackend

    def no_compiler() -> None:
        raise KernelBuildError("no C++ compiler")

    warnings: list[str] = []
    monkeypatch.setattr(cpu_backend, "_library", no_compiler)
    monkeypatch.setattr(registry.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    assert type(runner("auto").attn_backend) is TorchAttentionBackend
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]
    with pytest.raises(KernelBuildError):
        runner("cpu")


# ---------------------------------------------------------------- sliding windows, logit soft-caps

WINDOW = 40
# Decodes at and around the window (39, 40 keys; 121, past 3x it), short extends (3 after 38, 2 after
# 43), prefill chunks over a cached prefix (16 after 104, 20 after 40, 40 after 110, 150 after 150: ten
# 16-token query chunks, each starting at its first token's window) and whole prompts (1, 90).
WINDOW_SEQ_LENS = [1, 39, 40, 41, 120, 121, 300, 90, 60, 150, 45]
WINDOW_EXTEND_LENS = [1, 1, 1, 3, 16, 1, 150, 90, 20, 40, 2]

# A window that hides part of a 64-key block, one of a block, a token alone, one longer than some
# sequences; soft-caps that saturate tanh (scores of a few units against a cap of 2) or barely bend it.
WINDOW_LAYERS = {
    "window": (WINDOW, None),
    "window-softcap": (WINDOW, 2.0),
    "softcap": (None, 2.0),
    "block-window-softcap": (64, 30.0),
    "window-1": (1, None),
    "window-100": (100, None),
}
WINDOW_SHAPES = [(9, 3, 64), (8, 2, 24)]


def _torch_reference(
    pool: KVPool, table: ReqToTokenTable, layer: AttentionLayer, q: torch.Tensor, batch: ForwardBatch
) -> torch.Tensor:
    """The torch backend's float32 path over the pool's K/V (a bf16 pool's widened) and the queries the
    C++ kernels use over that pool."""
    reference = TorchAttentionBackend(pool, table, [layer])
    reference.init_forward_metadata(batch)
    return reference.attend(_kernel_queries(q, layer.scale, pool.dtype), 0, batch)


def _cpu_attend(
    pool: KVPool,
    table: ReqToTokenTable,
    layer: AttentionLayer,
    q: torch.Tensor,
    batch: ForwardBatch,
    mode: int,
    per_token: bool = False,
) -> torch.Tensor:
    backend = CpuAttentionBackend(pool, table, [layer], mode=mode)
    backend.per_token = per_token
    backend.init_forward_metadata(batch)
    return backend.attend(q, 0, batch)


def _window_step(dtype: torch.dtype) -> tuple[KVPool, ReqToTokenTable, ForwardBatch, torch.Tensor]:
    pool, table, _, batch = _shuffled_step(WINDOW_SEQ_LENS, WINDOW_EXTEND_LENS, 3, 64, seed=4, dtype=dtype)
    q, _, _ = _qkv_views(batch.num_tokens, 9, 3, 64, seed=5)
    return pool, table, batch, q


def _groups_step(dtype: torch.dtype) -> tuple[KVPool, ReqToTokenTable, ForwardBatch, torch.Tensor]:
    pool, table, batch, gen = _shared_prefix_step(dtype)
    return pool, table, batch, torch.randn(batch.num_tokens, 9, pool.head_dim, generator=gen)


def test_the_backend_serves_windows_and_softcaps() -> None:
    layers = [AttentionLayer(0.1, 4096, None), AttentionLayer(0.1, None, 50.0)]
    assert CpuAttentionBackend.unsupported(layers) is None


@pytest.mark.parametrize("dtype, mode", POOL_MODES, ids=POOL_MODE_IDS)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", WINDOW_SHAPES, ids=["gqa3-d64", "gqa4-d24"])
@pytest.mark.parametrize("features", WINDOW_LAYERS.values(), ids=WINDOW_LAYERS.keys())
def test_windowed_softcapped_step_matches_the_torch_backend(
    dtype: torch.dtype,
    mode: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    features: tuple[int | None, float | None],
) -> None:
    """Every kind of request in one kernel call, each token attending to its window's keys only, its
    scores soft-capped, through the fused projection's strided q view."""
    pool, table, _, batch = _shuffled_step(
        WINDOW_SEQ_LENS, WINDOW_EXTEND_LENS, num_kv_heads, head_dim, seed=head_dim, dtype=dtype
    )
    q, _, _ = _qkv_views(batch.num_tokens, num_q_heads, num_kv_heads, head_dim, seed=2)
    layer = AttentionLayer(4 * head_dim**-0.5, *features)
    want = _torch_reference(pool, table, layer, q, batch)
    torch.testing.assert_close(_cpu_attend(pool, table, layer, q, batch, mode), want, **_tol(dtype, mode))


@pytest.mark.parametrize("dtype, mode", POOL_MODES, ids=POOL_MODE_IDS)
def test_windowed_softcapped_per_token_decodes_match_the_torch_backend(dtype: torch.dtype, mode: int) -> None:
    """--deterministic: every new token, prefill chunks' included, attends as a decode of its own
    request prefix, its keys starting at its window."""
    pool, table, batch, q = _window_step(dtype)
    layer = AttentionLayer(0.5, WINDOW, 2.0)
    want = _torch_reference(pool, table, layer, q, batch)
    torch.testing.assert_close(_cpu_attend(pool, table, layer, q, batch, mode, per_token=True), want, **TOL)


@pytest.mark.parametrize("dtype, mode", POOL_MODES, ids=POOL_MODE_IDS)
@pytest.mark.parametrize(
    "features",
    [(None, 2.0), (160, None), (100, 2.0), (50, None)],
    ids=["softcap", "both-groups-in-window", "one-group-in-window", "no-group-in-window"],
)
def test_windowed_shared_prefix_groups_match_the_torch_backend(
    dtype: torch.dtype, mode: int, features: tuple[int | None, float | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 decoding requests on a 150-slot prefix (sequences of 151-157), 5 on a 40-slot one (41-77), one
    decoding alone, one prefilling over the first prefix. A group is attended together only where every
    member's window holds the whole prefix; the kernel runs the other groups' members alone, and the
    groups it keeps are found at their place in its list. Two threads: group items of 16 members, three
    whole AVX-512 panels."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    pool, table, batch, q = _groups_step(dtype)
    layer = AttentionLayer(0.5, *features)
    want = _torch_reference(pool, table, layer, q, batch)
    torch.testing.assert_close(_cpu_attend(pool, table, layer, q, batch, mode), want, **_tol(dtype, mode))
    assert batch.attn_metadata.groups is not None  # formed for the step; the kernel decides per layer


def test_each_layer_runs_with_its_own_window_and_softcap() -> None:
    """One backend over a plain, a windowed and a soft-capped layer holding the same KV: each layer's
    call honours its own parameters."""
    one, table, _, batch = _shuffled_step(WINDOW_SEQ_LENS, WINDOW_EXTEND_LENS, 2, 16, seed=9)
    pool = KVPool(one.k_buffers[0].shape[0] - 1, 3, 2, 16, torch.float32, "cpu")
    for i in range(3):
        pool.k_buffers[i].copy_(one.k_buffers[0])
        pool.v_buffers[i].copy_(one.v_buffers[0])
    layers = [AttentionLayer(0.7), AttentionLayer(0.7, WINDOW), AttentionLayer(0.7, None, 2.0)]
    q, _, _ = _qkv_views(batch.num_tokens, 4, 2, 16, seed=3)
    backend = CpuAttentionBackend(pool, table, layers)
    backend.init_forward_metadata(batch)
    outs = [backend.attend(q, i, batch) for i in range(3)]
    for layer, out in zip(layers, outs):
        torch.testing.assert_close(out, _torch_reference(one, table, layer, q, batch), **TOL)
    assert not torch.allclose(outs[0], outs[1]) and not torch.allclose(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, BF16, INT8])
def test_windowed_softcapped_vector_widths_give_the_same_bits(dtype: torch.dtype) -> None:
    """Windowed, soft-capped prefill chunks on AVX2 and AVX-512 lanes run the same operations per lane
    (tanh included): the same bits on either width."""
    lib = cpu_backend._library()
    if not (lib.ca_has_avx2_fma() and lib.ca_has_avx512()):
        pytest.skip("needs a CPU with AVX-512 to run both widths")
    pool, table, _, batch = _shuffled_step(WINDOW_SEQ_LENS, WINDOW_EXTEND_LENS, 3, 64, seed=7, dtype=dtype)
    q, _, _ = _qkv_views(batch.num_tokens, 9, 3, 64, seed=8)
    layer = AttentionLayer(0.5, WINDOW, 2.0)
    outs = [_cpu_attend(pool, table, layer, q, batch, mode) for mode in (AVX2, AVX512)]
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------- bf16 pools


def _float32_copy(pool: KVPool) -> KVPool:
    """A float32 pool holding a bf16 pool's values (widened: exact) or an int8 pool's dequantized ones."""
    copy = KVPool(pool.size, pool.num_layers, pool.num_kv_heads, pool.head_dim, torch.float32, "cpu")
    for layer in range(pool.num_layers):
        for mine, theirs in zip(copy.layer_tensors(layer), pool.read_kv(layer, slice(None), torch.float32)):
            mine.copy_(theirs)
    return copy


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "features", [(None, None), (WINDOW, 2.0), (None, 2.0)], ids=["plain", "window-softcap", "softcap"]
)
@pytest.mark.parametrize("per_token", [False, True], ids=["batched", "per-token"])
def test_a_bf16_pool_reads_as_a_float32_pool_of_its_rounded_values(
    mode: int, features: tuple[int | None, float | None], per_token: bool
) -> None:
    """Paths 0-2 widen a bf16 pool's K/V (exactly) and round the scaled queries to bf16: on the same step
    they give the bits they give over a float32 pool holding the rounded K/V, with queries rounded before
    a power-of-two scale (which keeps them rounded). Decodes, extends, prefill chunks and shared-prefix
    groups alike."""
    for pool, table, batch, q in (_window_step(BF16), _groups_step(BF16)):
        layer = AttentionLayer(0.5, *features)
        q_rounded = q.to(BF16).float()
        got = _cpu_attend(pool, table, layer, q, batch, mode, per_token)
        want = _cpu_attend(_float32_copy(pool), table, layer, q_rounded, batch, mode, per_token)
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "features", [(None, None), (WINDOW, 2.0), (None, 2.0)], ids=["plain", "window-softcap", "softcap"]
)
@pytest.mark.parametrize("per_token", [False, True], ids=["batched", "per-token"])
def test_an_int8_pool_reads_as_a_float32_pool_of_its_dequantized_values(
    mode: int, features: tuple[int | None, float | None], per_token: bool
) -> None:
    """Every path reads an int8 pool's codes as they are (converted in registers on the decode tiles, per
    block into the scratch on the rows-as-lanes path, element by element on the scalar one) and applies
    the scales once per key: k_scale x (q . codes), (p x v_scale) . codes. Within float32 rounding of the
    same path over a float32 pool holding the dequantized K/V, so its errors are the quantization's
    alone. Decodes, extends, prefill chunks and shared-prefix groups alike."""
    for step in (_window_step, _groups_step):
        pool, table, batch, q = step(INT8)
        layer = AttentionLayer(0.5, *features)
        got = _cpu_attend(pool, table, layer, q, batch, mode, per_token)
        want = _cpu_attend(_float32_copy(pool), table, layer, q, batch, mode, per_token)
        torch.testing.assert_close(got, want, **TOL)
        unquantized = _cpu_attend(step(torch.float32)[0], table, layer, q, batch, mode, per_token)
        # The quantization shows, within its error: K/V off by up to max |x| / 254 per element.
        err = (got - unquantized).abs()
        assert 0 < err.mean() < 0.01 and err.max() < 0.2


def test_int8_store_quantizes_as_set_kv_does() -> None:
    """The C++ store writes an int8 pool's codes and scales with the bits of KVPool.set_kv's quantize_int8
    (scale max |x| / 127, codes rounded to nearest even), from strided k/v views: ties, an all-zero head
    (scale 0, codes 0), values of every magnitude; the other slots untouched."""
    gen = torch.Generator().manual_seed(5)
    pools = [KVPool(64, 2, 3, 8, INT8, "cpu") for _ in range(2)]
    for pool in pools:
        for t in pool.tensors():
            t.fill_(-3)
    loc = torch.randperm(64, generator=gen)[:11] + 1
    _, k, v = _qkv_views(11, 6, 3, 8, seed=2)
    k[0, 0] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5])  # scale 1: ties to even
    k[1, 2] = 0.0
    v[3] *= torch.logspace(-30, 30, 8)
    pools[0].set_kv(1, loc, k, v)
    cpu_backend.store_kv(pools[1], 1, loc, k, v)
    for a, b in zip(pools[0].tensors(), pools[1].tensors()):
        assert torch.equal(a, b)
    assert pools[1].k_buffers[1][loc[0], 0].tolist() == [127, 2, -4, 0, 0, 2, 126, -126]
    assert pools[1].k_scales[1][loc[1], 2] == 0 and torch.all(pools[1].k_buffers[1][loc[1], 2] == 0)


# One request of 150 tokens prefilled in pieces (each over the KV of the pieces before it), and the pieces'
# lengths: whole, halves, 2 + 148 (a piece of 6 query rows: AVX2-width lanes) and ragged (with a piece of
# 12 rows: one part-empty AVX-512 panel where zmm FMAs run at full width).
SPLITS = [[150], [75, 75], [2, 148], [17, 29, 4, 2, 64, 34]]


@pytest.mark.parametrize("dtype, mode", POOL_MODES, ids=POOL_MODE_IDS)
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_a_tokens_bits_do_not_depend_on_chunking_or_batching(
    dtype: torch.dtype, mode: int, softcap: float | None
) -> None:
    """A prompt's tokens attend to the same bits whether the prompt is prefilled at once or in pieces of
    two or more tokens over its cached part (cached == uncached), alone or batched with other requests:
    each query row is computed alone, whatever shares its item (rows-as-lanes on either width; vdpbf16ps
    on path 3)."""
    seq_lens = [150, 37, 90]
    pool, table, seqs, _ = _shuffled_step(seq_lens, [1, 1, 1], 3, 64, seed=6, dtype=dtype)
    q, _, _ = _qkv_views(150, 9, 3, 64, seed=7)
    layer = AttentionLayer(0.5, None, softcap)
    outs = []
    for split in SPLITS:
        pieces, done = [], 0
        for n in split:
            done += n
            # The piece, then two other requests (a decode and a prefill chunk) in the same step.
            sub_table, batch = _table_and_batch([seqs[0][:done], seqs[1], seqs[2]], [n, 1, 30])
            qs = torch.cat([q[done - n : done], torch.randn(31, 9, 64)])
            pieces.append(_cpu_attend(pool, sub_table, layer, qs, batch, mode)[:n])
        outs.append(torch.cat(pieces))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    alone_table, alone = _table_and_batch([seqs[0]], [150])
    assert torch.equal(_cpu_attend(pool, alone_table, layer, q, alone, mode), outs[0])


@pytest.mark.parametrize("dtype", [torch.float32, BF16, INT8])
@pytest.mark.parametrize("mode", [AVX2, AVX512])
def test_p_v_by_rows_or_by_head_elements_gives_the_same_bits(dtype: torch.dtype, mode: int) -> None:
    """Items of up to three panels run P.V with the head elements as the lanes (rows_pv), larger ones with
    the query rows as the lanes (lanes_pv): the same products and sums in the same order. With G = 8 (a
    16-token item is 128 rows, 8 panels) a prompt's tokens 130-149 come from lanes_pv when it is
    prefilled whole and from rows_pv in pieces of 2 to 5 tokens (16-40 rows) after the first 130, each
    over three blocks of keys (the accumulators rescaled between them): the same bits."""
    pool, table, seqs, _ = _shuffled_step([150], [1], 2, 64, seed=3, dtype=dtype)
    q, _, _ = _qkv_views(150, 16, 2, 64, seed=4)
    layer = AttentionLayer(0.5)
    whole_table, whole = _table_and_batch([seqs[0]], [150])
    want = _cpu_attend(pool, whole_table, layer, q, whole, mode)
    pieces, done = [], 0
    for n in [130, 2, 5, 3, 4, 2, 4]:
        done += n
        sub_table, batch = _table_and_batch([seqs[0][:done]], [n])
        pieces.append(_cpu_attend(pool, sub_table, layer, q[done - n : done], batch, mode))
    assert done == 150
    assert torch.equal(torch.cat(pieces), want)


@needs_bf16
def test_bf16_prefill_by_vdpbf16ps_where_the_cpu_has_them() -> None:
    """On a CPU with AVX512-BF16 a bf16 pool's prefill chunks take path 3 by default: scores by vdpbf16ps
    (the same bf16 operands as path 2's float32 FMAs, their sums rounded vdpbf16ps's way) and P.V by
    vdpbf16ps over the weights rounded to bf16, so their bits differ from path 2's, within bf16 rounding
    of the weights; decode tokens run the same tiles either way."""
    pool, table, batch, q = _window_step(BF16)
    layer = AttentionLayer(0.5)
    pairs = _cpu_attend(pool, table, layer, q, batch, AVX512_BF16)
    floats = _cpu_attend(pool, table, layer, q, batch, AVX512)
    assert kernel_path(64) == AVX512_BF16
    decode_rows = [s for s, n in zip(batch.extend_start_loc_cpu, batch.extend_lens_cpu) if n == 1]
    assert torch.equal(pairs[decode_rows], floats[decode_rows])
    assert not torch.equal(pairs, floats)
    torch.testing.assert_close(pairs, floats, **PAIRS_TOL)


@needs_amx
def test_bf16_prefill_on_amx_tiles_where_the_cpu_has_them() -> None:
    """On a CPU with AMX-BF16 a bf16 pool's prefill chunks take path 4 by default: both products as tile
    products over the same bf16 operands as path 3 (each tile product summing its 32 products its own
    way), within bf16 rounding of the weights of the float32 path; decode tokens and shared-prefix groups
    run path 2's code, to the bit; windows and soft-caps as on the other paths."""
    for features in ((None, None), (WINDOW, 2.0)):
        for pool, table, batch, q in (_window_step(BF16), _groups_step(BF16)):
            layer = AttentionLayer(0.5, *features)
            tiles = _cpu_attend(pool, table, layer, q, batch, AMX_BF16)
            floats = _cpu_attend(pool, table, layer, q, batch, AVX512)
            decode_rows = [s for s, n in zip(batch.extend_start_loc_cpu, batch.extend_lens_cpu) if n == 1]
            assert torch.equal(tiles[decode_rows], floats[decode_rows])
            assert not torch.equal(tiles, floats)
            torch.testing.assert_close(tiles, floats, **PAIRS_TOL)
    assert cpu_backend.default_mode() == AMX_BF16
