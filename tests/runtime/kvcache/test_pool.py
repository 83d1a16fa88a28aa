"""KVPool, TokenAllocator and ReqToTokenPool: slot accounting and the validation that catches leaks."""

from __future__ import annotations

import pytest
import torch

from radixlm_runtime.kvcache import KVPool, ReqToTokenPool, TokenAllocator


def _free_set(alloc: TokenAllocator) -> set[int]:
    """Observes the free slots by taking them all and giving them back (no private state)."""
    slots = alloc.alloc(alloc.available_size())
    assert slots is not None
    alloc.free(slots)
    return set(slots.tolist())


def test_alloc_returns_distinct_valid_slots() -> None:
    alloc = TokenAllocator(16)
    assert alloc.available_size() == 16
    a = alloc.alloc(5)
    b = alloc.alloc(7)
    assert a is not None and b is not None
    assert a.dtype == torch.int64 and a.shape == (5,) and b.shape == (7,)
    got = a.tolist() + b.tolist()
    assert len(set(got)) == 12
    assert all(1 <= s <= 16 for s in got)
    assert alloc.available_size() == 4
    assert _free_set(alloc) == set(range(1, 17)) - set(got)


def test_fresh_allocator_prefers_low_contiguous_slots() -> None:
    alloc = TokenAllocator(10)
    first = alloc.alloc(4)
    assert first is not None
    assert first.tolist() == [1, 2, 3, 4]


def test_alloc_zero_gives_empty_tensor() -> None:
    alloc = TokenAllocator(4)
    out = alloc.alloc(0)
    assert out is not None and out.numel() == 0
    assert alloc.available_size() == 4


def test_alloc_when_exhausted_returns_none_without_side_effects() -> None:
    alloc = TokenAllocator(8)
    held = alloc.alloc(6)
    assert held is not None
    assert alloc.alloc(3) is None
    assert alloc.available_size() == 2
    rest = alloc.alloc(2)
    assert rest is not None
    assert set(rest.tolist()) == set(range(1, 9)) - set(held.tolist())
    assert alloc.alloc(1) is None


def test_free_returns_slots_and_they_are_reused() -> None:
    alloc = TokenAllocator(8)
    a = alloc.alloc(8)
    assert a is not None
    alloc.free(a[2:5])
    assert alloc.available_size() == 3
    again = alloc.alloc(3)
    assert again is not None
    assert sorted(again.tolist()) == sorted(a[2:5].tolist())


def test_free_accepts_empty_and_int32() -> None:
    alloc = TokenAllocator(4)
    alloc.free(torch.empty(0, dtype=torch.int64))
    a = alloc.alloc(2)
    assert a is not None
    alloc.free(a.to(torch.int32))
    assert alloc.available_size() == 4


def test_free_copies_its_input() -> None:
    """A caller that reuses the tensor it freed must not corrupt the free list."""
    alloc = TokenAllocator(4)
    a = alloc.alloc(2)
    assert a is not None
    buf = a.clone()
    alloc.free(buf)
    buf.fill_(0)
    assert _free_set(alloc) == {1, 2, 3, 4}


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
        alloc.free(torch.cat([a, a[:1]]))
    # A rejected free changes nothing: the slots are still allocated and can be freed normally.
    assert alloc.available_size() == 5
    alloc.free(a)
    assert alloc.available_size() == 8


@pytest.mark.parametrize("slot", [0, 9, -1])
def test_free_of_invalid_slot_raises(slot: int) -> None:
    alloc = TokenAllocator(8)
    with pytest.raises(RuntimeError):
        alloc.free(torch.tensor([slot]))


def test_free_of_never_allocated_slot_raises() -> None:
    alloc = TokenAllocator(8)
    alloc.alloc(2)
    with pytest.raises(RuntimeError):
        alloc.free(torch.tensor([5]))


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


def test_many_alloc_free_cycles_keep_exact_accounting() -> None:
    alloc = TokenAllocator(1000)
    gen = torch.Generator().manual_seed(0)
    held: list[torch.Tensor] = []
    for _ in range(200):
        n = int(torch.randint(0, 50, (1,), generator=gen))
        got = alloc.alloc(n)
        if got is not None:
            held.append(got)
        if held and bool(torch.rand(1, generator=gen) < 0.5):
            alloc.free(held.pop(int(torch.randint(0, len(held), (1,), generator=gen))))
    in_use = torch.cat(held).tolist() if held else []
    assert len(set(in_use)) == len(in_use)
    assert alloc.available_size() + len(in_use) == 1000
    assert _free_set(alloc) == set(range(1, 1001)) - set(in_use)


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


def test_req_to_token_pool_alloc_free() -> None:
    pool = ReqToTokenPool(max_reqs=3, max_context_len=5, device="cpu")
    assert pool.req_to_token.shape == (3, 5)
    assert pool.req_to_token.dtype == torch.int64
    assert torch.all(pool.req_to_token == 0)
    assert pool.available_size() == 3
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(r for r in rows if r is not None) == [0, 1, 2]
    assert pool.alloc() is None
    assert pool.available_size() == 0
    pool.free(1)
    assert pool.available_size() == 1
    assert pool.alloc() == 1


def test_req_to_token_pool_double_free_and_invalid_raise() -> None:
    pool = ReqToTokenPool(max_reqs=2, max_context_len=4)
    idx = pool.alloc()
    assert idx is not None
    pool.free(idx)
    with pytest.raises(RuntimeError):
        pool.free(idx)
    with pytest.raises(RuntimeError):
        pool.free(2)
    assert pool.available_size() == 2


def test_req_to_token_pool_clear() -> None:
    pool = ReqToTokenPool(max_reqs=2, max_context_len=4)
    pool.alloc()
    pool.alloc()
    pool.clear()
    assert pool.available_size() == 2
    assert pool.alloc() == 0
