"""The executor's side of the KV tiers: it runs the moves the radix tree records (step.KVCopy,
disk slots let go) between the device pool, the host tier (a KVPool in host memory) and the disk tier
(kvcache/disk_tier.py), in order. The tree decides what moves where with slot integers only; the
data is touched here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixlm_runtime.kvcache.disk_tier import TOKEN_ID_BYTES, DiskStore, layout_of, model_identity
from radixlm_runtime.kvcache.pool import KVPool
from radixlm_runtime.step import DiskEntry, KVCopy, Tier
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)


class KVTiers:
    def __init__(self, pool: KVPool, host: KVPool | None, disk: DiskStore | None) -> None:
        self.pool = pool
        self.host = host
        self.disk = disk
        # What the disk tier held at start, for the scheduler's tree to rebuild itself from.
        self.disk_entries: tuple[DiskEntry, ...] = tuple(disk.scan()) if disk is not None else ()

    @classmethod
    def build(
        cls,
        pool: KVPool,
        host: KVPool | None,
        disk_dir: str | None,
        disk_bytes: int,
        model_path: Path,
        numerics: dict[str, Any],
    ) -> KVTiers:
        """The tiers of `pool`; the disk tier's entries keyed by the model's files, the `numerics`
        that change its KV (dtype, arithmetic, quantization) and the pool's layout, and read ahead
        (for requests waiting with a prefix on disk) up to the host tier's size in bytes, which is
        where they are read into."""
        if disk_dir is None:
            return cls(pool, host, None)
        layout, window_layout = layout_of(pool.named_tensors()), layout_of(pool.named_tensors(window=True))
        Path(disk_dir).mkdir(parents=True, exist_ok=True)
        identity = model_identity(
            model_path, numerics, [*layout, *window_layout], Path(disk_dir) / "file-digests.json"
        )
        capacity = disk_bytes // pool.bytes_per_token()
        ahead = host.size * host.bytes_per_token() if host is not None else 0
        store = DiskStore(Path(disk_dir), identity, layout, capacity, ahead, window_layout)
        logger.info("disk KV tier: %s, %d tokens (%.2f GiB)", store.dir, capacity, disk_bytes / 2**30)
        return cls(pool, host, store)

    @property
    def disk_tokens(self) -> int:
        return self.disk.capacity_tokens if self.disk is not None else 0

    @property
    def disk_entry_header(self) -> tuple[int, int]:
        """An entry file's bytes beside its KV rows: fixed, and per token id of its path."""
        return (self.disk.header_bytes, TOKEN_ID_BYTES) if self.disk is not None else (0, 0)

    def _tier(self, tier: Tier) -> KVPool:
        if tier == "device":
            return self.pool
        assert tier == "host" and self.host is not None, f"a KV copy through the {tier} tier, which is off"
        return self.host

    def prefetch(self, slots: list[int]) -> int:
        """Starts reading these disk slots' entries ahead (DiskStore.prefetch); the slots still being
        read."""
        return self.disk.prefetch(slots) if self.disk is not None else 0

    def run(self, ops: list[KVCopy]) -> list[int]:
        """Runs the moves in order; returns the disk slots whose entry failed its checksum (their
        destination slots are left zero: the tree drops them)."""
        failed: list[int] = []
        for op in ops:
            if op.dst_tier is None:
                assert self.disk is not None
                self.disk.drop(op.src)
            elif op.dst_tier == "disk":
                assert self.disk is not None and op.tokens is not None
                src = self._tier(op.src_tier)
                rows = src.gather(op.src) + (src.gather(op.windows, window=True) if op.windows else [])
                self.disk.write(op.dst, op.tokens, rows)
            elif op.src_tier == "disk":
                assert self.disk is not None
                rows, bad = self.disk.read(op.src, op.window)
                failed.extend(bad)
                self._tier(op.dst_tier).scatter(op.dst, rows, op.window)
            else:
                self._tier(op.dst_tier).copy_from(self._tier(op.src_tier), op.src, op.dst, op.window)
        return failed

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
