"""The disk KV tier through the offline Engine (tiny random-init model): prefixes pushed out of a small
pool and host tier come back from disk with the tokens of an engine without a cache; a second engine
on the same directory (a restart) serves them from disk; another model on the directory finds
nothing; a truncated or corrupted entry is dropped and recomputed, never served."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_host_tier import GREEDY, POOL, PROMPTS, reference

import radixlm_runtime as rt

__all__ = ["reference"]  # the uncached engine's outputs, a fixture shared with test_host_tier

# The host tier's workload (~3x the pool) and its uncached reference, with a host tier of ~1/4 of it.
HOST = 160


def _engine(model_dir: Path, disk_dir: Path, policy: str = "write_through", **kw: object) -> rt.Engine:
    return rt.Engine(
        str(model_dir),
        deterministic=True,
        dtype="float32",
        max_total_tokens=POOL,
        kv_host_tokens=HOST,
        kv_disk_dir=str(disk_dir),
        kv_disk_write_policy=policy,
        log_level="warning",
        **kw,
    )


def _same_as_reference(outs: list[dict], reference: list[dict]) -> None:
    for got, want in zip(outs, reference, strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]


def _serve(engine: rt.Engine) -> list[dict]:
    return [engine.generate(p, GREEDY, return_logprob=True) for p in PROMPTS]


def _entries(disk_dir: Path) -> list[Path]:
    return sorted(disk_dir.glob("*/*.kv"))


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_prefixes_past_pool_and_host_come_back_from_disk(
    tiny_llama_dir: Path, reference: list[dict], tmp_path: Path, policy: str
) -> None:
    engine = _engine(tiny_llama_dir, tmp_path, policy)
    _serve(engine)
    outs = _serve(engine)
    _same_as_reference(outs, reference)
    info = engine.get_server_info()
    assert info["disk_hit_tokens"] > sum(o["meta_info"]["prompt_tokens"] for o in outs) // 3
    assert info["disk_loaded_tokens"] >= info["disk_hit_tokens"] > 0
    assert info["disk_loaded_bytes"] == info["disk_loaded_tokens"] * info["kv_bytes_per_token"] > 0
    assert info["disk_reads"] > 0 and info["disk_read_seconds"] > 0
    assert 0 < info["cached_tokens_on_disk"] <= info["disk_tier_tokens"]
    assert info["cached_tokens_on_host"] <= HOST
    assert info["free_tokens"] + info["cached_tokens_in_tree"] == POOL
    assert info["disk_failed_tokens"] == 0
    engine.shutdown()
    assert _entries(tmp_path), "nothing written to the disk tier"
    assert not list(tmp_path.glob("*/*.tmp")), "a temporary file left behind"


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_restarted_engine_serves_prefixes_from_disk(
    tiny_llama_dir: Path, reference: list[dict], tmp_path: Path, policy: str
) -> None:
    """Write-through wrote everything as it was cached; write-back writes what is still in memory
    at shutdown."""
    first = _engine(tiny_llama_dir, tmp_path, policy)
    _same_as_reference(_serve(first), reference)
    first.shutdown()
    second = _engine(tiny_llama_dir, tmp_path, policy)
    outs = _serve(second)
    _same_as_reference(outs, reference)
    # Every prompt but its last token was cached before the restart, and nothing else serves it now.
    for out in outs:
        assert out["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"] - 2
    info = second.get_server_info()
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    assert info["device_hit_tokens"] + info["host_hit_tokens"] + info["disk_hit_tokens"] == cached
    # All of it from disk but the few leading tokens the prompts share, which the first one read.
    assert info["disk_hit_tokens"] >= cached - 10 * len(PROMPTS)
    second.shutdown()


def test_a_batch_after_a_restart_reads_its_prefixes_ahead(
    tiny_llama_dir: Path, reference: list[dict], tmp_path: Path
) -> None:
    """Every prompt at once after a restart: the first is admitted at once (nothing else runs), the
    others' prefixes are read from disk ahead while it computes, then admitted without reading a
    file; the tokens are the uncached engine's."""
    first = _engine(tiny_llama_dir, tmp_path)
    _serve(first)
    first.shutdown()
    second = _engine(tiny_llama_dir, tmp_path)
    outs = second.generate(PROMPTS, GREEDY, return_logprob=True)
    _same_as_reference(outs, reference)
    store = second.runner.tiers.disk
    assert store is not None and store.files_prefetched > 0 and store.prefetch_hits > 0
    info = second.get_server_info()
    assert info["disk_hit_tokens"] > 0 and info["disk_failed_tokens"] == 0
    second.shutdown()


def test_an_int8_pool_survives_a_restart_bit_for_bit(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The disk tier stores every tensor the pool holds: an int8 pool's codes and per-token scales
    come back from disk with the tokens and logprobs of an uncached int8 engine."""
    uncached = rt.Engine(
        str(tiny_llama_dir),
        dtype="float32",
        kv_cache_dtype="int8",
        disable_radix_cache=True,
        deterministic=True,
        max_total_tokens=4096,
        log_level="warning",
    )
    want = uncached.generate(PROMPTS[:4], GREEDY, return_logprob=True)
    first = _engine(tiny_llama_dir, tmp_path, kv_cache_dtype="int8")
    _serve(first)
    first.shutdown()
    second = _engine(tiny_llama_dir, tmp_path, kv_cache_dtype="int8")
    outs = [second.generate(p, GREEDY, return_logprob=True) for p in PROMPTS[:4]]
    _same_as_reference(outs, want)
    assert all(o["meta_info"]["cached_tokens"] >= o["meta_info"]["prompt_tokens"] - 2 for o in outs)
    assert second.get_server_info()["disk_hit_tokens"] > 0
    second.shutdown()


def test_another_model_on_the_same_directory_gets_no_hits(
    tiny_llama_dir: Path, reference: list[dict], tmp_path: Path
) -> None:
    """Same architecture, same layout, other weights: the entries are keyed by the weights."""
    first = _engine(tiny_llama_dir, tmp_path / "kv")
    _serve(first)
    first.shutdown()
    other = tmp_path / "other"
    other.mkdir()
    for path in tiny_llama_dir.iterdir():
        if path.name != "model.safetensors":
            (other / path.name).symlink_to(path.resolve())
    weights = load_file(tiny_llama_dir / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    engine = _engine(other, tmp_path / "kv")
    assert engine.scheduler.runner_info.disk_entries == ()
    outs = _serve(engine)
    # Nothing cached for the first prompt, and later ones only what this engine computed.
    assert outs[0]["meta_info"]["cached_tokens"] == 0
    assert engine.get_server_info()["disk_hit_tokens"] < len(PROMPTS)
    engine.shutdown()
    assert len({p.parent for p in _entries(tmp_path / "kv")}) == 2, "one directory per model identity"


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_entry_is_recomputed_not_served(
    tiny_llama_dir: Path, reference: list[dict], tmp_path: Path, damage: str
) -> None:
    """Truncated: found short at start and deleted. One byte of KV flipped: the header is whole, so
    the entry is found, and its checksum fails when it is read."""
    first = _engine(tiny_llama_dir, tmp_path)
    _serve(first)
    first.shutdown()
    entries = _entries(tmp_path)
    for path in entries:
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            path.write_bytes(data[: len(data) - 100])
        else:
            data[-5] ^= 0x40
            path.write_bytes(data)
    second = _engine(tiny_llama_dir, tmp_path)
    found = second.scheduler.runner_info.disk_entries
    assert len(found) == (0 if damage == "truncate" else len(entries))
    outs = _serve(second)
    _same_as_reference(outs, reference)
    # Nothing of the damaged entries served: the first prompt found no prefix at all.
    assert outs[0]["meta_info"]["cached_tokens"] == 0
    info = second.get_server_info()
    assert info["disk_hit_tokens"] < len(PROMPTS)  # the few tokens prompts share, written anew
    if damage == "flip":
        assert info["disk_failed_tokens"] > 0
    second.shutdown()
    assert not set(_entries(tmp_path)) & set(entries), "a damaged entry kept"


def test_disk_tier_flags_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_host_tokens"):
        rt.Engine(kv_disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match="kv_disk_bytes"):
        rt.Engine(kv_disk_bytes=0)
    with pytest.raises(ValueError, match="kv_disk_write_policy"):
        rt.Engine(kv_disk_write_policy="never")
    with pytest.raises(ValueError, match="tensor parallelism"):
        rt.Engine(kv_disk_dir=str(tmp_path), kv_host_tokens=64, tp_size=2)


def test_one_server_per_directory(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A second engine on a directory in use is refused (its scan would take the first's files),
    and gets it once the first has shut down; the weights are hashed once, not at every start."""
    first = _engine(tiny_llama_dir, tmp_path)
    with pytest.raises(ValueError, match="kv_disk_dir"):
        _engine(tiny_llama_dir, tmp_path)
    first.shutdown()
    digests = (tmp_path / "file-digests.json").read_text()
    assert "model.safetensors" in digests
    _engine(tiny_llama_dir, tmp_path).shutdown()
    assert (tmp_path / "file-digests.json").read_text() == digests


def test_entries_hold_every_tensor_of_the_pool(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """An entry's header lists the pool's per-token tensors, and its payload is their raw bytes."""
    from radixlm_runtime.kvcache.disk_tier import DiskStore

    engine = _engine(tiny_llama_dir, tmp_path)
    engine.generate(PROMPTS[0], GREEDY)
    pool = engine.runner.kv_pool
    names = [n for n, _ in pool.named_tensors()]
    engine.shutdown()
    path = _entries(tmp_path)[0]
    with path.open("rb") as f:
        header, payload_at = DiskStore._read_header(f)
    assert [t[0] for t in header["tensors"]] == names
    assert path.stat().st_size - payload_at == header["num_tokens"] * pool.bytes_per_token()
    assert len(header["tokens"]) >= header["num_tokens"] > 0
    assert header["identity"] in str(path.parent.name) or path.parent.name in header["identity"]
