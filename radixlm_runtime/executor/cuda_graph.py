"""CUDA graphs for decode steps: the whole model forward, captured once per padded batch size at
start-up and replayed, so a decode step costs one graph launch instead of ~300 kernel launches.

A graph replays the exact kernels and addresses it captured, so every step's inputs are copied into
static buffers first and the batch is padded up to the nearest captured size. Padding rows are a
dummy request: token 0 at position 0, its one KV entry in the pool's dummy slot 0, read through a
request-to-token row no request is ever given. Steps with a prefill chunk (or more than one new
token per request) run eagerly: their shapes vary too much to capture.

Recording and replaying is a `GraphCapturer`'s job (`CudaGraphCapturer` on a GPU), apart from the
static buffers and padding, so the runner's logic can be exercised where CUDA cannot run.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Callable
from typing import Protocol

import torch

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.models.registry import CausalLM
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

# Rows of the static input buffer, and what a padding row holds in each (the dummy request's
# req_to_token row is filled in at construction).
_INPUT_IDS, _POSITIONS, _OUT_CACHE_LOC, _REQ_POOL_INDICES, _SEQ_LENS, _WINDOW_LOC = range(6)
_PAD_VALUES = (0, 0, 0, None, 1, 0)


def capture_sizes(max_bs: int) -> list[int]:
    """Padded batch sizes to capture: dense where padding would waste most, every 16 above 16."""
    sizes = [bs for bs in (1, 2, 4, 8, 12) if bs < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class GraphCapturer(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], object], torch.Tensor]:
        """Records `forward` and returns (replay, output): each replay call runs the recorded work
        again on the same input buffers and leaves its result in `output`."""
        ...


class CudaGraphCapturer:
    """Records into torch.cuda.CUDAGraph objects that share one memory pool: captured largest batch
    first, the smaller graphs fit in the memory the largest one reserved."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool: object = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], object], torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # compiles the Triton kernels and settles the allocator
                forward()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            output = forward()
        self.pool = graph.pool()
        torch.cuda.synchronize(self.device)
        return graph.replay, output


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        attn: AttentionBackend,
        max_bs: int,
        dummy_row: int,
        device: torch.device,
        capturer: GraphCapturer | None = None,
    ) -> None:
        self.model = model
        self.attn = attn
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.dummy_row = dummy_row
        n = self.max_bs
        pad = [dummy_row if v is None else v for v in _PAD_VALUES]
        # [6, max_bs]: input ids, positions, KV slots, table rows, sequence lengths, window slots (a
        # windowed pool's; kvcache/pool.py); padding rows
        # hold the dummy request. Rows from `_dirty_until` on hold padding values.
        self.pad = torch.tensor(pad, dtype=torch.int64, device=device)[:, None].expand(-1, n)
        self.inputs = self.pad.clone(memory_format=torch.contiguous_format)
        self._dirty_until = 0
        self.arange = torch.arange(n, dtype=torch.int64, device=device)
        self.ones = torch.ones(n, dtype=torch.int64, device=device)
        self.replays: dict[int, Callable[[], object]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        self._capture_all(capturer or CudaGraphCapturer(device))
        logger.info(
            "CUDA graphs: %d decode batch sizes up to %d captured in %.2fs",
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - t0,
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A decode batch of views into the static buffers: what the captured kernels read."""
        inputs = self.inputs[:, :bs]
        return ForwardBatch(
            input_ids=inputs[_INPUT_IDS],
            positions=inputs[_POSITIONS],
            out_cache_loc=inputs[_OUT_CACHE_LOC],
            req_pool_indices=inputs[_REQ_POOL_INDICES],
            seq_lens=inputs[_SEQ_LENS],
            extend_lens=self.ones[:bs],
            extend_start_loc=self.arange[:bs],
            logits_indices=self.arange[:bs],
            req_pool_indices_cpu=[self.dummy_row] * bs,
            seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs,
            extend_start_loc_cpu=list(range(bs)),
            seq_slots_cpu=[[0]] * bs,
            window_loc=inputs[_WINDOW_LOC] if self.attn.kv_pool.windowed else None,
        )

    @torch.inference_mode()
    def _capture_all(self, capturer: GraphCapturer) -> None:
        # A garbage collection during a capture may destroy another runner's graphs (an engine
        # dropped earlier in this process), which CUDA forbids while a stream captures: collect now,
        # then not until capture is over.
        gc.collect()
        gc.disable()
        try:
            for bs in reversed(self.sizes):
                batch = self._static_batch(bs)
                # Set once, at capture: a replay runs with what it held then, so it must not depend
                # on the values in the buffers (the backend's graph_capturable says so).
                self.attn.init_forward_metadata(batch)
                self.replays[bs], self.outputs[bs] = capturer.capture(
                    lambda batch=batch: self.model(batch, self.attn)
                )
        finally:
            gc.enable()

    def can_run(self, batch: ForwardBatch) -> bool:
        """Pure decode (one new token and one logits row per request) within the captured sizes."""
        bs = batch.batch_size
        return (
            bs <= self.max_bs
            and batch.num_tokens == bs
            and batch.logits_indices.shape[0] == bs
            and batch.max_extend_len == 1
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] of a decode batch; valid until the next replay."""
        bs = batch.batch_size
        padded = self.sizes[bisect.bisect_left(self.sizes, bs)]
        inputs = self.inputs
        inputs[_INPUT_IDS, :bs].copy_(batch.input_ids)
        inputs[_POSITIONS, :bs].copy_(batch.positions)
        inputs[_OUT_CACHE_LOC, :bs].copy_(batch.out_cache_loc)
        inputs[_REQ_POOL_INDICES, :bs].copy_(batch.req_pool_indices)
        inputs[_SEQ_LENS, :bs].copy_(batch.seq_lens)
        if batch.window_loc is not None:
            inputs[_WINDOW_LOC, :bs].copy_(batch.window_loc)
        # Padding rows that an earlier, larger batch used get the dummy request back; in a steady
        # batch size there are none.
        end = min(self._dirty_until, padded)
        if end > bs:
            inputs[:, bs:end].copy_(self.pad[:, bs:end])
        if self._dirty_until <= padded:  # else rows past the padded batch keep real values
            self._dirty_until = bs
        self.replays[padded]()
        return self.outputs[padded][:bs]
