"""KVPool, ReqToTokenTable, TokenAllocator and RowAllocator: slot accounting and the validation
that catches leaks."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm_runtime.kvcache import RowAllocator, TokenAllocator
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenTable, dequantize_int8, quantize_int8


def _free_set(alloc: TokenAllocator) -> set[int]:
    """Observes the free slots by taking them all and giving them back (no private state)."""
    slots = alloc.alloc(alloc.available_size())
    assert slots is not None
    alloc.free(slots)
    return set(slots)


def test_alloc_returns_distinct_valid_slots() -> None:
    alloc = TokenAllocator(16)
    assert alloc.available_size() == 16
    a = alloc.alloc(5)
    b = alloc.alloc(7)
    assert a is not None and b is not None
    assert isinstance(a, list) and len(a) == 5 and len(b) == 7
    assert all(type(s) is int for s in a + b)
    got = a + b
    assert len(set(got)) == 12
    assert all(1 <= s <= 16 for s in got)
    assert alloc.available_size() == 4
    assert _free_set(alloc) == set(range(1, 17)) - set(got)


def test_fresh_allocator_prefers_low_contiguous_slots() -> None:
    alloc = TokenAllocator(10)
    assert alloc.alloc(4) == [1, 2, 3, 4]
    assert alloc.alloc(3) == [5, 6, 7]


def test_alloc_zero_gives_empty_list() -> None:
    alloc = TokenAllocator(4)
    assert alloc.alloc(0) == []
    assert alloc.available_size() == 4


def test_alloc_negative_and_nonpositive_size_raise() -> None:
    with pytest.raises(ValueError):
        TokenAllocator(0)
    alloc = TokenAllocator(4)
    with pytest.raises(ValueError):
        alloc.alloc(-1)
    assert alloc.available_size() == 4


def test_alloc_when_exhausted_returns_none_without_side_effects() -> None:
    alloc = TokenAllocator(8)
    held = alloc.alloc(6)
    assert held is not None
    assert alloc.alloc(3) is None
    assert alloc.available_size() == 2
    rest = alloc.alloc(2)
    assert rest is not None
    assert set(rest) == set(range(1, 9)) - set(held)
    assert alloc.alloc(1) is None


def test_free_returns_slots_and_they_are_reused() -> None:
    alloc = TokenAllocator(8)
    a = alloc.alloc(8)
    assert a is not None
    alloc.free(a[2:5])
    assert alloc.available_size() == 3
    again = alloc.alloc(3)
    assert again is not None
    assert sorted(again) == sorted(a[2:5])


def test_freed_slots_are_used_once_fresh_ones_run_short() -> None:
    """Frees are parked and merged only when the fresh slots do not cover an allocation; the
    merged allocation still comes out lowest first."""
    alloc = TokenAllocator(10)
    a = alloc.alloc(6)
    assert a == [1, 2, 3, 4, 5, 6]
    alloc.free([5, 2])
    assert alloc.available_size() == 6
    got = alloc.alloc(5)
    assert got is not None
    assert set(got) <= {2, 5, 7, 8, 9, 10} and len(set(got)) == 5
    assert got == sorted(got)
    assert alloc.available_size() == 1
    assert _free_set(alloc) == {2, 5, 7, 8, 9, 10} - set(got)


def test_free_of_empty_list_is_a_noop() -> None:
    alloc = TokenAllocator(4)
    alloc.free([])
    assert alloc.available_size() == 4
    a = alloc.alloc(2)
    assert a is not None
    alloc.free([])
    assert alloc.available_size() == 2
    alloc.free(a)
    assert alloc.available_size() == 4


def test_free_in_any_order_and_across_allocations() -> None:
    """A request's slots may come from several allocations (prefix chunks, decode tokens) and be
    freed in one unsorted list."""
    alloc = TokenAllocator(8)
    a = alloc.alloc(3)
    b = alloc.alloc(2)
    assert a is not None and b is not None
    alloc.free([b[1], a[2], a[0], b[0]])
    assert alloc.available_size() == 7
    assert _free_set(alloc) == set(range(1, 9)) - {a[1]}


def test_free_copies_its_input() -> None:
    """A caller that reuses the list it freed must not corrupt the free list."""
    alloc = TokenAllocator(4)
    a = alloc.alloc(2)
    assert a is not None
    buf = list(a)
    alloc.free(buf)
    buf[:] = [0, 0]
    assert _free_set(alloc) == {1, 2, 3, 4}


def test_alloc_result_is_owned_by_the_caller() -> None:
    """Mutating a returned list (appending decode slots to it, say) does not touch the free list."""
    alloc = TokenAllocator(4)
    a = alloc.alloc(2)
    assert a is not None
    a.append(99)
    a[0] = 0
    assert alloc.available_size() == 2
    assert _free_set(alloc) == {3, 4}


def test_double_free_raises() -> None:
    alloc = TokenAllocator(8)
    a = alloc.alloc(3)
    assert a is not None
    alloc.free(a)
    with pytest.raises(RuntimeError):
        alloc.free(a[:1])
    assert alloc.available_size() == 8


def test_duplicate_slot_in_one_free_raises() -> None:
    alloc = TokenAllocator(8)
    a = alloc.alloc(3)
    assert a is not None
    with pytest.raises(RuntimeError):
        alloc.free(a + a[:1])
    # A rejected free changes nothing: the slots are still allocated and can be freed normally.
    assert alloc.available_size() == 5
    alloc.free(a)
    assert alloc.available_size() == 8


@pytest.mark.parametrize("slot", [0, 9, -1])
def test_free_of_invalid_slot_raises(slot: int) -> None:
    alloc = TokenAllocator(8)
    with pytest.raises(RuntimeError):
        alloc.free([slot])


def test_free_of_never_allocated_slot_raises() -> None:
    alloc = TokenAllocator(8)
    alloc.alloc(2)
    with pytest.raises(RuntimeError):
        alloc.free([5])


def test_rejected_free_with_some_valid_slots_frees_none_of_them() -> None:
    alloc = TokenAllocator(8)
    a = alloc.alloc(3)
    assert a is not None
    with pytest.raises(RuntimeError):
        alloc.free([a[0], a[1], 7])  # 7 was never allocated
    assert alloc.available_size() == 5
    alloc.free(a)
    assert alloc.available_size() == 8


def test_clear_frees_everything() -> None:
    alloc = TokenAllocator(8)
    a = alloc.alloc(5)
    assert a is not None
    alloc.free(a[:2])
    alloc.clear()
    assert alloc.available_size() == 8
    assert _free_set(alloc) == set(range(1, 9))
    # Slots from before the clear are no longer allocated.
    with pytest.raises(RuntimeError):
        alloc.free(a[2:])
    # And allocation starts over from the lowest slots.
    assert alloc.alloc(3) == [1, 2, 3]


def test_many_alloc_free_cycles_keep_exact_accounting() -> None:
    alloc = TokenAllocator(1000)
    rng = random.Random(0)
    held: list[list[int]] = []
    for _ in range(200):
        got = alloc.alloc(rng.randrange(50))
        if got is not None:
            held.append(got)
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.randrange(len(held))))
    in_use = [s for part in held for s in part]
    assert len(set(in_use)) == len(in_use)
    assert alloc.available_size() + len(in_use) == 1000
    assert _free_set(alloc) == set(range(1, 1001)) - set(in_use)


def test_row_allocator_alloc_free() -> None:
    rows = RowAllocator(3)
    assert rows.max_reqs == 3
    assert rows.available_size() == 3
    # Lowest free row first.
    assert [rows.alloc() for _ in range(3)] == [0, 1, 2]
    assert rows.alloc() is None
    assert rows.available_size() == 0
    rows.free(1)
    assert rows.available_size() == 1
    assert rows.alloc() == 1
    assert rows.alloc() is None


def test_row_allocator_double_free_and_invalid_raise() -> None:
    rows = RowAllocator(2)
    idx = rows.alloc()
    assert idx is not None
    rows.free(idx)
    with pytest.raises(RuntimeError):
        rows.free(idx)
    for bad in (2, -1):
        with pytest.raises(RuntimeError):
            rows.free(bad)
    # A row that was never handed out cannot be freed either.
    with pytest.raises(RuntimeError):
        rows.free(1)
    assert rows.available_size() == 2
    assert {rows.alloc(), rows.alloc()} == {0, 1}


def test_row_allocator_clear_and_size_validation() -> None:
    rows = RowAllocator(2)
    rows.alloc()
    rows.alloc()
    rows.clear()
    assert rows.available_size() == 2
    assert rows.alloc() == 0
    with pytest.raises(ValueError):
        RowAllocator(0)


def test_kv_pool_shapes_and_dummy_slot() -> None:
    pool = KVPool(size=10, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    assert pool.size == 10
    assert len(pool.k_buffers) == len(pool.v_buffers) == 3
    for buf in pool.k_buffers + pool.v_buffers:
        assert buf.shape == (11, 2, 4)
        assert buf.dtype == torch.float32
        assert torch.all(buf[0] == 0)


def test_kv_pool_set_kv_writes_rows_of_one_layer() -> None:
    pool = KVPool(size=8, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    for buf in pool.k_buffers + pool.v_buffers:
        buf.fill_(-1.0)
    loc = torch.tensor([5, 2], dtype=torch.int64)
    k = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3)
    v = -k - 100
    pool.set_kv(1, loc, k, v)
    assert torch.equal(pool.k_buffers[1][5], k[0])
    assert torch.equal(pool.k_buffers[1][2], k[1])
    assert torch.equal(pool.v_buffers[1][5], v[0])
    assert torch.equal(pool.v_buffers[1][2], v[1])
    untouched = [i for i in range(9) if i not in (2, 5)]
    assert torch.all(pool.k_buffers[1][untouched] == -1.0)
    assert torch.all(pool.k_buffers[0] == -1.0) and torch.all(pool.v_buffers[0] == -1.0)


def test_kv_pool_set_kv_casts_to_pool_dtype() -> None:
    pool = KVPool(size=4, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.bfloat16, device="cpu")
    k = torch.tensor([[[1.5, 2.0]]], dtype=torch.float32)
    pool.set_kv(0, torch.tensor([3]), k, k * 2)
    assert pool.k_buffers[0].dtype == torch.bfloat16
    assert pool.k_buffers[0][3].float().tolist() == [[1.5, 2.0]]
    assert pool.v_buffers[0][3].float().tolist() == [[3.0, 4.0]]


def test_kv_pool_bytes_per_token() -> None:
    pool = KVPool(size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, device="cpu")
    expected = 2 * 3 * 2 * 8 * 2
    assert pool.bytes_per_token() == expected
    assert KVPool.bytes_per_token_for(3, 2, 8, torch.float16) == expected
    assert KVPool.bytes_per_token_for(3, 2, 8, torch.float32) == 2 * expected


def test_a_bf16_pool_holds_a_token_in_half_the_bytes() -> None:
    """--dtype bfloat16 on CPU keeps K/V in bf16: half a float32 pool's bytes per token, so the same
    memory holds twice the tokens."""
    pools = {dtype: KVPool(16, 3, 2, 8, dtype, "cpu") for dtype in (torch.float32, torch.bfloat16)}
    assert 2 * pools[torch.bfloat16].bytes_per_token() == pools[torch.float32].bytes_per_token()
    assert KVPool.bytes_per_token_for(3, 2, 8, torch.bfloat16) == 2 * 3 * 2 * 8 * 2
    for buf in pools[torch.bfloat16].k_buffers + pools[torch.bfloat16].v_buffers:
        assert buf.dtype == torch.bfloat16 and buf.element_size() == 2 and torch.all(buf[0] == 0)


def test_req_to_token_table_starts_zeroed() -> None:
    table = ReqToTokenTable(max_reqs=3, max_context_len=5, device="cpu")
    assert table.max_reqs == 3 and table.max_context_len == 5
    assert table.req_to_token.shape == (3, 5)
    assert table.req_to_token.dtype == torch.int64
    assert table.req_to_token.device == torch.device("cpu")
    assert torch.all(table.req_to_token == 0)


@pytest.mark.parametrize(("max_reqs", "max_context_len"), [(0, 4), (2, 0), (-1, 4)])
def test_req_to_token_table_rejects_nonpositive_dimensions(max_reqs: int, max_context_len: int) -> None:
    with pytest.raises(ValueError):
        ReqToTokenTable(max_reqs, max_context_len)


def test_req_to_token_table_write_scatters_entries() -> None:
    """One write sets (row, col) -> slot for entries of several rows and leaves the rest alone."""
    table = ReqToTokenTable(max_reqs=3, max_context_len=5)
    table.req_to_token.fill_(-1)
    # Row 2 gets a three-token prefill, row 0 one decode token at position 4.
    rows = torch.tensor([2, 2, 2, 0])
    cols = torch.tensor([0, 1, 2, 4])
    slots = torch.tensor([7, 3, 9, 11])
    table.write(rows, cols, slots)
    assert table.req_to_token.tolist() == [
        [-1, -1, -1, -1, 11],
        [-1, -1, -1, -1, -1],
        [7, 3, 9, -1, -1],
    ]
    # A later write overwrites entries (a row reused by the next request) and extends others.
    table.write(torch.tensor([2, 0]), torch.tensor([0, 3]), torch.tensor([5, 6]))
    assert table.req_to_token[2].tolist() == [5, 3, 9, -1, -1]
    assert table.req_to_token[0].tolist() == [-1, -1, -1, 6, 11]
    assert table.req_to_token[1].tolist() == [-1] * 5


def test_req_to_token_table_write_of_nothing_is_a_noop() -> None:
    table = ReqToTokenTable(max_reqs=2, max_context_len=3)
    empty = torch.empty(0, dtype=torch.int64)
    table.write(empty, empty, empty)
    assert torch.all(table.req_to_token == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_copy_from_moves_every_layer_between_pools(test_device: torch.device, dtype: torch.dtype) -> None:
    """The host tier's copies: the device pool's slots into host slots and back, every tensor of every
    layer (K and V, an int8 pool's scales too), bit for bit; the other slots untouched. Both tiers of a
    bf16 pool (--dtype bfloat16 on CPU) are bf16, of an int8 one (--kv-cache-dtype int8) int8."""
    device = KVPool(8, 3, 2, 4, dtype, test_device)
    host = KVPool(6, 3, 2, 4, dtype, "cpu")
    assert len(host.tensors()) == 3 * (4 if dtype == torch.int8 else 2)
    for buf in device.tensors() + host.tensors():
        buf.copy_((torch.randn(buf.shape) * 30).to(buf.dtype))
    before = [b.clone() for b in host.tensors()]
    host.copy_from(device, [3, 7, 1], [6, 2, 4])
    for mine, theirs, old in zip(host.tensors(), device.tensors(), before):
        assert torch.equal(mine[[6, 2, 4]], theirs[[3, 7, 1]].cpu())
        assert torch.equal(mine[[1, 3, 5]], old[[1, 3, 5]])
    device.copy_from(host, [6, 2], [5, 8])
    for mine, theirs in zip(device.tensors(), host.tensors()):
        assert torch.equal(mine[[5, 8]].cpu(), theirs[[6, 2]])


def test_an_int8_pool_copies_only_to_and_from_int8() -> None:
    """Codes without their scales mean nothing in another pool: such a copy is refused."""
    int8, fp32 = KVPool(4, 1, 1, 4, torch.int8, "cpu"), KVPool(4, 1, 1, 4, torch.float32, "cpu")
    for dst, src in ((int8, fp32), (fp32, int8)):
        with pytest.raises(ValueError, match="int8 only to int8"):
            dst.copy_from(src, [1], [2])


def test_int8_round_trip_error_is_within_half_a_step() -> None:
    """quantize_int8: per (token, head) the largest |x| becomes +-127 exactly, every value comes back
    within half a quantization step (scale / 2), an all-zero head stays zero (scale 0)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    x[5, 1] = 0.0
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == (64, 3) and scale.dtype == torch.float32
    assert torch.equal(
        codes.abs().amax(-1)[scale > 0], torch.full_like(scale[scale > 0], 127, dtype=torch.int8)
    )
    back = dequantize_int8(codes, scale, torch.float32)
    err = (back - x).abs()
    assert torch.all(err <= scale[..., None] * (0.5 + 1e-5))
    assert torch.all(err / x.abs().amax(-1, keepdim=True).clamp_min(1e-30) <= 1 / 254 + 1e-6)
    assert scale[5, 1] == 0 and torch.all(codes[5, 1] == 0) and torch.all(back[5, 1] == 0)


def test_an_int8_pool_stores_codes_and_scales_and_reads_them_dequantized() -> None:
    """set_kv quantizes into the layer's codes and scales (slot 0 stays the zeroed dummy); read_kv gathers
    and dequantizes the rows asked for (index or slice), nothing else; the layer's tensors are listed K,
    V, K-scale, V-scale for tier code; a token costs 2 L H (D + 4) bytes, 3.76x fewer than float32's at
    the default model's shape."""
    pool = KVPool(10, 2, 3, 8, torch.int8, "cpu")
    assert pool.quantized and pool.layer_tensors(1) == [
        pool.k_buffers[1],
        pool.v_buffers[1],
        pool.k_scales[1],
        pool.v_scales[1],
    ]
    assert all(torch.all(t[0] == 0) for t in pool.tensors())
    k, v = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    loc = torch.tensor([7, 2, 9, 4])
    pool.set_kv(1, loc, k, v)
    for codes, scales, x in (
        (pool.k_buffers[1], pool.k_scales[1], k),
        (pool.v_buffers[1], pool.v_scales[1], v),
    ):
        want_codes, want_scales = quantize_int8(x)
        assert torch.equal(codes[loc], want_codes) and torch.equal(scales[loc], want_scales)
    got_k, got_v = pool.read_kv(1, loc, torch.float32)
    torch.testing.assert_close(got_k, k, atol=k.abs().max().item() / 254 + 1e-6, rtol=0)
    torch.testing.assert_close(got_v, v, atol=v.abs().max().item() / 254 + 1e-6, rtol=0)
    whole_k, _ = pool.read_kv(1, slice(0, 11), torch.float32)
    assert torch.equal(whole_k[loc], got_k) and torch.all(whole_k[0] == 0)
    assert pool.bytes_per_token() == KVPool.bytes_per_token_for(2, 3, 8, torch.int8) == 2 * 2 * 3 * (8 + 4)
    fp32, int8 = (KVPool.bytes_per_token_for(30, 3, 64, d) for d in (torch.float32, torch.int8))
    assert (fp32, int8) == (46080, 12240)


def test_copy_from_a_float32_pool_rounds_into_a_bf16_one() -> None:
    """Copies land in the receiving pool's dtype: a float32 pool's slots copied into a bf16 pool are
    rounded as set_kv rounds them (to nearest even)."""
    src = KVPool(4, 2, 1, 4, torch.float32, "cpu")
    dst = KVPool(4, 2, 1, 4, torch.bfloat16, "cpu")
    for buf in src.k_buffers + src.v_buffers:
        buf.copy_(torch.randn(buf.shape))
    dst.copy_from(src, [1, 3], [4, 2])
    for mine, theirs in zip(dst.k_buffers + dst.v_buffers, src.k_buffers + src.v_buffers):
        assert torch.equal(mine[[4, 2]], theirs[[1, 3]].to(torch.bfloat16))


def test_window_layers_keep_their_kv_in_window_slots() -> None:
    """Layers 0 and 2 windowed: their buffers have window_size + 1 rows, a token slot's bytes are the
    other layers', and a window slot's theirs."""
    pool = KVPool(10, 3, 2, 4, torch.float32, "cpu", window_layers=frozenset({0, 2}), window_size=3)
    assert pool.windowed
    assert [b.shape[0] for b in pool.k_buffers] == [4, 11, 4]
    assert [b.shape[0] for b in pool.v_buffers] == [4, 11, 4]
    assert pool.bytes_per_token() == KVPool.bytes_per_token_for(1, 2, 4, torch.float32)
    assert pool.bytes_per_window_slot() == KVPool.bytes_per_token_for(2, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="window_size"):
        KVPool(10, 3, 2, 4, torch.float32, "cpu", window_layers=frozenset({0}))


def test_table_writes_window_slots_beside_the_slots() -> None:
    table = ReqToTokenTable(2, 4, windowed=True)
    assert table.req_to_window is not None
    table.write(torch.tensor([1, 1]), torch.tensor([0, 3]), torch.tensor([5, 6]), torch.tensor([2, 0]))
    assert table.req_to_token[1].tolist() == [5, 0, 0, 6]
    assert table.req_to_window[1].tolist() == [2, 0, 0, 0]
    assert ReqToTokenTable(2, 4).req_to_window is None


def test_copy_from_between_windowed_pools_moves_token_or_window_rows() -> None:
    """A windowed pool and its host tier: a token copy moves the full layers' rows of token slots, a
    window copy (window=True) the window layers' rows of window slots; neither touches the other's.
    Pools with other window layers refuse to copy."""
    layers = frozenset({0, 2})
    device = KVPool(10, 3, 2, 4, torch.float32, "cpu", window_layers=layers, window_size=4)
    host = KVPool(12, 3, 2, 4, torch.float32, "cpu", window_layers=layers, window_size=6)
    for buf in device.tensors() + host.tensors():
        buf.copy_(torch.randn(buf.shape))
    before = [b.clone() for b in host.tensors()]
    host.copy_from(device, [9, 2], [11, 5])
    host.copy_from(device, [4, 1], [6, 3], window=True)
    for layer in range(3):
        rows, src = ([6, 3], [4, 1]) if layer in layers else ([11, 5], [9, 2])
        for mine, theirs, old in zip(
            host.layer_tensors(layer), device.layer_tensors(layer), before[2 * layer :]
        ):
            assert torch.equal(mine[rows], theirs[src])
            untouched = [r for r in range(mine.shape[0]) if r not in rows]
            assert torch.equal(mine[untouched], old[untouched])
    with pytest.raises(ValueError, match="window layers"):
        KVPool(4, 3, 2, 4, torch.float32, "cpu").copy_from(device, [1], [1])
