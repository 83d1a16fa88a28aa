"""The contract between the scheduler and the model executor, in plain Python data.

The scheduler decides what runs (which requests, which KV slots, which tokens, what sampling and
logprobs each wants) and hands the executor a `StepPlan`; the executor owns every tensor, runs the
forward and the sampler, and answers with a `StepResult` of Python numbers read back from the
device once. Nothing here imports torch, so the scheduler never does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from radixlm_runtime.sampling.params import SamplingParams

# (logprob, token id) pairs, most likely first.
TopLogprobs = list[tuple[float, int]]


@dataclass(frozen=True)
class DiskEntry:
    """One file of the disk KV tier found at start: `tokens` are the ids of the path from the root of
    the tree through the tokens stored, which are its last len(slots), in disk slots `slots`;
    `windows`: it holds their window rows too (a windowed pool's)."""

    tokens: tuple[int, ...]
    slots: tuple[int, ...]
    windows: bool = False


@dataclass(frozen=True)
class RunnerInfo:
    """What the scheduler must know of the executor to size and validate its work."""

    vocab_size: int
    context_len: int
    max_total_tokens: int  # KV pool slots (1..max_total_tokens)
    max_reqs: int  # rows of the request-to-token table
    eos_token_ids: tuple[int, ...]
    host_kv_tokens: int = 0  # slots of the host KV tier (1..host_kv_tokens); 0: no host tier
    disk_kv_tokens: int = 0  # slots of the disk KV tier (1..disk_kv_tokens); 0: no disk tier
    # What the disk tier held at start (a restart): the tree rebuilds itself from these.
    disk_entries: tuple[DiskEntry, ...] = ()
    kv_bytes_per_token: int = 0  # of every tier (the bytes a tier move of one token copies)
    kv_bytes_per_window_slot: int = 0  # of a windowed pool's window slot (0: none)
    # The bytes of a disk entry file beside its KV rows: fixed, and per token id of its path.
    disk_entry_header: tuple[int, int] = (0, 0)
    # Whether `launch` returns before the device has run the step (CUDA), so the scheduler can plan
    # the next step meanwhile (overlap scheduling).
    async_launch: bool = False
    # Sliding-window layers' own KV slots (1..window_slots; 0: those layers use the token's slot),
    # and the widest of their windows: a token at position p needs its window KV while a query at
    # p + window - 1 or before may still run (kvcache/pool.py).
    window_slots: int = 0
    sliding_window: int = 0
    host_window_slots: int = 0  # the host tier's window slots (a windowed host tier); 0: none

    def disk_entry_slots(self, num_tokens: int, path_tokens: int, windows: bool = False) -> int:
        """Disk tier slots a disk entry of num_tokens rows (with their window rows, or not) under a
        path of path_tokens ids costs: its file's bytes, header included, in whole tokens' worth
        (DiskStore.entry_slots), so that the tree holding the disk tier's slots holds its files'
        bytes within --kv-disk-bytes."""
        fixed, per_path_token = self.disk_entry_header
        bpt = self.kv_bytes_per_token
        extra = (
            fixed
            + per_path_token * path_tokens
            + (num_tokens * self.kv_bytes_per_window_slot if windows else 0)
        )
        return num_tokens + (-(-extra // bpt) if bpt else 0)


def future_token(row: int) -> int:
    """The input id standing for the token sampled at sampled row `row` of the step launched just
    before: under overlap scheduling a step is planned before the previous one's tokens are read
    back, and the executor takes them from the device."""
    return -(row + 1)


@dataclass(slots=True)
class SampleSpec:
    """How to pick a request's next token from the last row of its logits."""

    params: SamplingParams
    seed: int
    draw: int  # which of the request's output tokens this row draws: its uniform is (seed, draw)'s
    banned_ids: list[int] = field(default_factory=list)  # blocked until min_new_tokens is reached
    # (prompt ids, output ids), given only when a penalty needs the history.
    history: tuple[list[int], list[int]] | None = None
    # int32 [ceil(vocab / 32)] bitmask from a constraint (bit t % 32 of word t // 32 set = token t
    # allowed); None = unconstrained.
    allowed: Any = None
    return_logprob: bool = False
    top_logprobs_num: int = 0


@dataclass(slots=True)
class PromptLogprobSpec:
    """Prompt logprobs wanted from this step's logits rows of one request."""

    rows: list[int]  # offsets among the request's logits rows
    targets: list[int]  # the token each of those rows predicts
    positions: list[int]  # and that token's position in the sequence
    top_logprobs_num: int = 0


@dataclass(slots=True)
class ForwardItem:
    """One request's part of a step: its new tokens, where their KV goes, and what it wants back."""

    row: int  # row of the request-to-token table
    prefix_len: int  # tokens whose KV is already in the pool
    input_ids: list[int]  # tokens computed this step, at positions prefix_len...
    # KV slots of the whole sequence after this step (the host mirror of the table row); entries
    # from `write_from` on are written to the device table before the forward.
    seq_slots: list[int]
    write_from: int
    logits_from: int  # first position whose logits are needed (past the end: none)
    sample: SampleSpec | None = None  # None: no next token is due this step
    prompt_logprobs: PromptLogprobSpec | None = None
    # Speculative decoding: the last draft_len of input_ids are draft tokens to verify. The row of
    # the last real token is sampled with `sample`, the row of draft token i with draft_samples[i]
    # (the spec that holds once draft[: i + 1] is accepted); the executor accepts drafts while each
    # equals the token its preceding row sampled.
    draft_len: int = 0
    draft_samples: list[SampleSpec] = field(default_factory=list)
    # With window slots (RunnerInfo.window_slots): those of seq_slots[write_from:] (0: none, a token
    # out of every query's window), written to the window table beside them.
    window_slots: list[int] | None = None

    @property
    def num_logit_rows(self) -> int:
        return max(self.prefix_len + len(self.input_ids) - self.logits_from, 0)

    @property
    def draft(self) -> list[int]:
        return self.input_ids[len(self.input_ids) - self.draft_len :]

    @property
    def samples(self) -> list[SampleSpec]:
        """The specs of the rows sampled, in row order (the item's last 1 + draft_len rows)."""
        return [] if self.sample is None else [self.sample, *self.draft_samples]


# Where a token's KV can live: the device pool, the host tier, the disk tier (kvcache/radix_cache.py).
Tier = Literal["device", "host", "disk"]


@dataclass(slots=True)
class KVCopy:
    """A batch of KV moves between tiers, every tensor the pool holds per token:
    dst_tier[dst[i]] = src_tier[src[i]]. A batch never writes one slot twice, so it can run as one
    gather and one scatter. A copy to the disk tier is one entry (one file), and carries `tokens`:
    the ids of the path from the root through the copied tokens (its last len(dst)), stored beside
    the KV so that a restarted server can rebuild the tree from the disk tier. dst_tier None: the
    tree let go of these disk slots (`src`), and the executor forgets them (an entry's file is
    deleted once none of its slots is held); one type for both keeps a step's moves in one ordered,
    msgpack-decodable list. With a windowed pool (RunnerInfo.window_slots) a token slot holds the
    other layers' KV and `window` copies are into window slots, of the sliding-window layers, from
    window slots or (the disk tier's window rows are its slots') from disk slots; a copy to the disk
    tier then carries `windows`, the source's window slots of its tokens, where the entry holds them."""

    src_tier: Tier
    dst_tier: Tier | None
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    tokens: list[int] | None = None
    window: bool = False
    windows: list[int] | None = None


@dataclass
class StepPlan:
    items: list[ForwardItem]
    # Run in order before the forward: KV demoted to lower tiers by the evictions that made room
    # for this step, and cached prefixes brought back from them (radix_cache.py).
    copies: list[KVCopy] = field(default_factory=list)


@dataclass(slots=True)
class ItemResult:
    """A request's part of a step's results. One is made per request per step, so the sequences
    default to a shared empty tuple instead of new lists."""

    next_token: int | None = None
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None
    # Speculative decoding: the draft tokens accepted, in order; next_token follows them (the
    # correction of the first rejected draft token, or the bonus token after the whole draft).
    accepted: Sequence[int] = ()
    accepted_logprobs: Sequence[float] = ()
    accepted_top_logprobs: Sequence[TopLogprobs] = ()
    prompt_logprobs: Sequence[float | None] = ()
    prompt_top_logprobs: Sequence[TopLogprobs | None] = ()


@dataclass
class StepResult:
    items: list[ItemResult]  # aligned with StepPlan.items


class Executor(Protocol):
    """What the scheduler calls: one forward step, plain data in and out. `launch` queues a step and
    returns a handle for `collect`, which waits for its results; `run` does both; `close` ends it."""

    info: RunnerInfo

    def run(self, plan: StepPlan) -> StepResult: ...

    def launch(self, plan: StepPlan) -> Any: ...

    def collect(self, handle: Any) -> StepResult: ...

    def move_kv(self, ops: list[KVCopy]) -> list[int]:
        """Runs tier moves now rather than before a step's forward (loads from the disk tier, which
        the scheduler must see succeed before it plans on them). Returns the disk slots whose data
        failed its checksum: those copies were not made. Called only where the executor has a disk
        tier (RunnerInfo.disk_kv_tokens), which one without it (tensor parallelism) need not answer."""
        ...

    def prefetch_kv(self, disk_slots: list[int]) -> int:
        """Starts reading these disk slots' data into host memory in the background (for a request
        waiting with a prefix on disk), so that the move_kv that reads them later, while other steps
        computed, waits only for what is still being read; a hint, which changes no slot. Returns how
        many of these slots are still being read (0: a move_kv reading them waits on no file). Called
        only where the executor has a disk tier, like move_kv."""
        ...

    def close(self) -> None:
        """Finishes what is still being written to the disk tier and releases what the executor
        started (tensor-parallel ranks); the last call."""
