"""CUDA graphs for decode steps: the whole model forward, captured once per padded batch size at
start-up and replayed, so a decode step costs one graph launch instead of ~300 kernel launches.

A graph replays the exact kernels and addresses it captured, so every step's inputs are copied into
static buffers first and the batch is padded up to the nearest captured size. Padding rows are a
dummy request: token 0 at position 0, its one KV entry in the pool's dummy slot 0, read through a
request-to-token row no request is ever given. Steps with a prefill chunk (or more than one new
token per request) run eagerly: their shapes vary too much to capture.
"""

from __future__ import annotations

import bisect
import gc
import time

import torch

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.models.llama import LlamaForCausalLM
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """Padded batch sizes to capture: dense where padding would waste most, every 16 above 16."""
    sizes = [bs for bs in (1, 2, 4, 8, 12) if bs < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class CudaGraphRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attn: AttentionBackend,
        max_bs: int,
        dummy_row: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn = attn
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.dummy_row = dummy_row
        n = self.max_bs
        zeros = torch.zeros(n, dtype=torch.int64, device=device)
        self.input_ids = zeros.clone()
        self.positions = zeros.clone()
        self.out_cache_loc = zeros.clone()
        self.req_pool_indices = torch.full((n,), dummy_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.arange = torch.arange(n, dtype=torch.int64, device=device)
        self.ones = torch.ones(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        self._capture_all(device)
        logger.info(
            "CUDA graphs: %d decode batch sizes up to %d captured in %.2fs",
            len(self.sizes),
            self.max_bs,
            time.perf_counter() - t0,
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        """A decode batch of views into the static buffers: what the captured kernels read."""
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.ones[:bs],
            extend_start_loc=self.arange[:bs],
            logits_indices=self.arange[:bs],
            req_pool_indices_cpu=[self.dummy_row] * bs,
            seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs,
            extend_start_loc_cpu=list(range(bs)),
            seq_slots_cpu=[[0]] * bs,
        )

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        # A garbage collection during a capture may destroy another runner's graphs (an engine
        # dropped earlier in this process), which CUDA forbids while a stream captures: collect now,
        # then not until capture is over.
        gc.collect()
        gc.disable()
        try:
            self._capture_sizes(device)
        finally:
            gc.enable()

    def _capture_sizes(self, device: torch.device) -> None:
        pool = None
        stream = torch.cuda.Stream(device)
        # Largest first: the smaller graphs then fit in the memory the largest one reserved.
        for bs in reversed(self.sizes):
            batch = self._static_batch(bs)
            self.attn.init_forward_metadata(batch)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the Triton kernels and settles the allocator
                    self.model(batch, self.attn)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self.model(batch, self.attn)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)

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
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc)
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        if padded > bs:
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.out_cache_loc[bs:padded].zero_()
            self.req_pool_indices[bs:padded].fill_(self.dummy_row)
            self.seq_lens[bs:padded].fill_(1)
        self.graphs[padded].replay()
        return self.outputs[padded][:bs]
