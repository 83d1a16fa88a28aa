"""One tensor-parallel group of rank processes on torch.distributed, and its collectives.

The model's collectives (the all-reduce after each row-parallel linear and after the vocab-parallel
embedding, the gather of the vocab-parallel logits) run on the model's backend: gloo on CPU, NCCL on
CUDA, whose collectives may be captured in CUDA graphs. The step plans travel on a second group that
is always gloo, so they never need a device tensor. Every rank makes the same calls in the same order:
they all run the same `ModelRunner` code on the same plans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a collective waits for a peer before failing (a rank that died is noticed sooner: its
# sockets close, and rank 0's monitor sees its process end).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def _broadcast_options() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


@dataclass
class TPGroup:
    """This process's rank among `size`; the model's collectives go on `group`, plans on `control`.

    The groups are process groups of their own, not torch.distributed's global default one, so a
    process may hold more than one engine's group (and start another after one failed)."""

    rank: int
    size: int
    group: dist.ProcessGroup
    control: dist.ProcessGroup
    device: torch.device
    # Seconds spent in the model's collectives since the last `reset_timing` (what bench_tp.py
    # reports as the communication share of a step). On CUDA they are queued, not waited for, so this
    # counts only the launches there.
    comm_s: float = 0.0
    comm_calls: int = 0
    _plan_len: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int64))

    @staticmethod
    def open_store(size: int) -> dist.TCPStore:
        """Rank 0's rendezvous store, on a free loopback port (`.port`), before the others start."""
        return dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
        )

    @staticmethod
    def connect_store(port: int, size: int) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)

    @classmethod
    def join(cls, rank: int, size: int, store: dist.Store, device: torch.device) -> TPGroup:
        """Forms the groups with the other ranks through `store` (blocks until all have joined)."""
        control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, size, COLLECTIVE_TIMEOUT)
        if device.type != "cuda":
            return cls(rank, size, control, control, device)
        torch.cuda.set_device(device)  # NCCL's communicator binds to the current device
        group = dist.ProcessGroupNCCL(dist.PrefixStore("model/", store), rank, size)
        return cls(rank, size, group, control, device)

    # -- the model's collectives ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place: a row-parallel linear's partial sums."""
        t0 = time.perf_counter()
        self.group.allreduce([x]).wait()
        self._timed(t0)
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """[T, n] per rank -> [T, width]: the ranks' column blocks side by side (the vocab-parallel
        logits, each rank's block padded to one size), the padding cut off."""
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        self._timed(t0)
        return torch.cat(parts, dim=-1)[..., :width]

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (the KV pool every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([t], opts).wait()
        return int(t.item())

    def _timed(self, t0: float) -> None:
        self.comm_s += time.perf_counter() - t0
        self.comm_calls += 1

    def reset_timing(self) -> None:
        self.comm_s, self.comm_calls = 0.0, 0

    # -- plans: rank 0 to the others ----------------------------------------------------------------
    def send_bytes(self, data: bytes) -> None:
        """Rank 0: broadcasts one message (its length, then its bytes); empty means stop."""
        self._plan_len[0] = len(data)
        self.control.broadcast([self._plan_len], _broadcast_options()).wait()
        if data:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.control.broadcast([payload], _broadcast_options()).wait()

    def recv_bytes(self) -> bytes:
        """Ranks 1..: the next message rank 0 sends (empty: stop)."""
        self.control.broadcast([self._plan_len], _broadcast_options()).wait()
        n = int(self._plan_len[0])
        if n == 0:
            return b""
        buf = torch.empty(n, dtype=torch.uint8)
        self.control.broadcast([buf], _broadcast_options()).wait()
        return buf.numpy().tobytes()
