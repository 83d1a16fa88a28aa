"""The disk tier's entry files (kvcache/disk_tier.py) on their own: whatever tensors a pool holds per
token (float32 and bf16 K/V here, and an int8 pool's per-token scales) come back bit-identical, from
memory while the write is queued and from the file after; damaged, foreign or half-written files are
never read back; a file goes once none of its slots is held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixlm_runtime.kvcache.disk_tier import DiskStore, TensorSpec, layout_of

LAYOUT = [
    TensorSpec("k0", "torch.bfloat16", (2, 4)),
    TensorSpec("v0", "torch.float32", (2, 4)),
    TensorSpec("k0_scale", "torch.float32", (2,)),
    TensorSpec("q0", "torch.int8", (2, 4)),
]


def _rows(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for spec in LAYOUT:
        dtype = getattr(torch, spec.dtype.removeprefix("torch."))
        if dtype == torch.int8:
            out.append(torch.randint(-128, 128, (n, *spec.row_shape), generator=g, dtype=torch.int8))
        else:
            out.append(torch.randn((n, *spec.row_shape), generator=g).to(dtype))
    return out


def _store(root: Path, identity: str = "a" * 40, capacity: int = 64) -> DiskStore:
    return DiskStore(root, identity, LAYOUT, capacity)


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(
        g.dtype == w.dtype and torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        for g, w in zip(got, want)
    )


def test_rows_come_back_bit_identical_before_and_after_the_write(tmp_path: Path) -> None:
    store = _store(tmp_path)
    rows = _rows(5, 0)
    store.write([3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3], rows)
    got, failed = store.read([5, 3])  # maybe still queued: served from memory
    assert not failed and _same(got, [r[[2, 0]] for r in rows])
    store.flush()
    got, failed = store.read([7, 4, 6])
    assert not failed and _same(got, [r[[4, 1, 3]] for r in rows])
    store.close()
    again = _store(tmp_path)
    (entry,) = again.scan()
    assert entry.tokens == (9, 8, 7, 6, 5, 4, 3) and entry.slots == (1, 2, 3, 4, 5)
    got, failed = again.read([1, 2, 3, 4, 5])
    assert not failed and _same(got, rows)
    again.close()


def test_a_flipped_byte_fails_the_read_and_the_file_goes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write([1, 2], [1, 2], _rows(2, 1))
    store.write([3], [1, 2, 3], _rows(1, 2))
    store.close()
    first = sorted(store.dir.glob("*.kv"))[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 1
    first.write_bytes(data)
    again = _store(tmp_path)
    entries = again.scan()
    assert len(entries) == 2  # headers whole: found, and read only when asked
    bad = next(e for e in entries if len(e.slots) == 2)
    _, failed = again.read(list(bad.slots))
    assert failed == list(bad.slots) and not first.exists() and again.corrupt_entries == 1
    again.close()


def test_foreign_short_and_half_written_files_are_deleted_at_start(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write([1, 2], [1, 2], _rows(2, 1))
    store.write([3, 4], [5, 6], _rows(2, 2))
    store.close()
    files = sorted(store.dir.glob("*.kv"))
    files[0].write_bytes(files[0].read_bytes()[:-3])  # truncated
    (store.dir / "x.tmp").write_bytes(b"half")  # a crash mid-write
    (store.dir / "junk.kv").write_bytes(b"not an entry")
    again = _store(tmp_path)
    assert [e.tokens for e in again.scan()] == [(5, 6)]
    assert sorted(p.name for p in again.dir.iterdir() if p.name != ".lock") == [files[1].name]
    again.close()
    # Another layout under the same identity directory reads nothing of it.
    other = DiskStore(tmp_path, "a" * 40, LAYOUT[:2], 64)
    assert other.scan() == [] and not list(other.dir.glob("*.kv"))
    other.close()


def test_capacity_keeps_the_newest_and_dropping_every_slot_deletes_the_file(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write([1, 2, 3], [1, 2, 3], _rows(3, 0))
    store.flush()
    store.write([4, 5], [7, 8], _rows(2, 1))
    store.drop([1, 2])
    store.flush()
    assert len(list(store.dir.glob("*.kv"))) == 2  # slot 3 still holds the first
    store.drop([3])
    store.close()
    assert len(list(store.dir.glob("*.kv"))) == 1
    small = _store(tmp_path, capacity=1)  # the remaining entry (2 tokens) no longer fits
    assert small.scan() == [] and not list(small.dir.glob("*.kv"))
    small.close()


def test_layout_of_a_pool_names_every_tensor_it_holds() -> None:
    from radixlm_runtime.kvcache.pool import KVPool

    pool = KVPool(8, 2, 2, 4, torch.bfloat16, "cpu")
    layout = layout_of(pool.named_tensors())
    assert [s.name for s in layout] == ["k0", "v0", "k1", "v1"]
    assert {s.dtype for s in layout} == {"torch.bfloat16"} and layout[0].row_shape == (2, 4)
    assert sum(s.row_bytes for s in layout) == pool.bytes_per_token()
    # An int8 pool stores its codes and each token's per-head scales: every one of them is listed.
    int8 = KVPool(8, 2, 2, 4, torch.int8, "cpu")
    layout = layout_of(int8.named_tensors())
    names = ["k0", "v0", "k_scale0", "v_scale0", "k1", "v1", "k_scale1", "v_scale1"]
    assert [s.name for s in layout] == names
    assert [s.dtype for s in layout[:4]] == ["torch.int8"] * 2 + ["torch.float32"] * 2
    assert layout[2].row_shape == (2,)
    assert sum(s.row_bytes for s in layout) == int8.bytes_per_token()


def test_a_slot_written_twice_is_a_bug(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.write([1], [1], _rows(1, 0))
    with pytest.raises(RuntimeError, match="disk slot 1"):
        store.write([1], [2], _rows(1, 1))
    store.close()


WINDOW_LAYOUT = [TensorSpec("k1", "torch.float32", (2, 4)), TensorSpec("v1", "torch.float32", (2, 4))]


def test_an_entry_with_windows_keeps_them_beside_its_tokens_across_a_restart(tmp_path: Path) -> None:
    """A windowed pool's store: an entry written with its tokens' window rows gives them back apart
    (read(..., window=True)), before and after a restart, whose scan says it holds windows; an entry
    without them beside it holds only its tokens; each file's size is entry_bytes of its kind."""
    store = DiskStore(tmp_path, "a" * 40, LAYOUT, 64, window_layout=WINDOW_LAYOUT)
    rows = _rows(3, 0)
    windows = [torch.randn(3, 2, 4), torch.randn(3, 2, 4)]
    store.write([1, 2, 3], [5, 6, 7], rows + windows)
    store.write([4, 5], [5, 6, 7, 8, 9], _rows(2, 1))
    got, failed = store.read([3, 1], window=True)
    assert not failed and _same(got, [w[[2, 0]] for w in windows])
    store.flush()
    sizes = sorted(p.stat().st_size for p in store.dir.glob("*.kv"))
    assert sizes == sorted([store.entry_bytes(3, 3, windows=True), store.entry_bytes(2, 5)])
    assert store.entry_slots(3, 3, windows=True) > store.entry_slots(3, 3)
    store.close()
    again = DiskStore(tmp_path, "a" * 40, LAYOUT, 64, window_layout=WINDOW_LAYOUT)
    by_tokens = {e.tokens: e for e in again.scan()}
    with_windows, without = by_tokens[(5, 6, 7)], by_tokens[(5, 6, 7, 8, 9)]
    assert with_windows.windows and not without.windows
    got, failed = again.read(list(with_windows.slots), window=True)
    assert not failed and _same(got, windows)
    got, failed = again.read(list(with_windows.slots) + list(without.slots))
    assert not failed and _same(got, [torch.cat([a, b]) for a, b in zip(rows, _rows(2, 1))])
    again.close()
    # A store of another window layout (or none) finds neither entry its own.
    other = DiskStore(tmp_path, "a" * 40, LAYOUT, 64)
    assert other.scan() == []
    other.close()
