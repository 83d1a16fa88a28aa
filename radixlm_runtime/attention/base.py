"""One interface for every attention implementation: the model never knows which kernels run."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm_runtime.forward_batch import ForwardBatch
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenTable


@dataclass(frozen=True)
class AttentionLayer:
    """What one layer's attention differs in, set by the model and honoured by every backend (or
    refused by it at construction, never ignored)."""

    scale: float
    # A query at position p sees keys p - sliding_window + 1 .. p (transformers' convention); None:
    # every earlier key.
    sliding_window: int | None = None
    # Scores s become cap * tanh(s / cap) before the softmax (Gemma 2); None: unchanged.
    logit_softcap: float | None = None

    @staticmethod
    def uniform(num_layers: int, scale: float) -> tuple[AttentionLayer, ...]:
        """num_layers plain layers of one scale (a Llama's attention)."""
        return (AttentionLayer(scale),) * num_layers


class AttentionBackend(ABC):
    # Whether a decode forward through it can be captured in a CUDA graph: no host reads, no
    # host-built metadata that changes between steps.
    graph_capturable = False
    # --deterministic: every new token attends on its own, through the decode path, as a decode of
    # its own request prefix; its result is then the same whatever its chunk or batch.
    per_token = False
    supports_per_token = False
    # Per-layer features a backend's kernels implement; a model that needs one a backend lacks is
    # refused when the backend is built.
    supports_sliding_window = False
    supports_logit_softcap = False

    def __init__(
        self, kv_pool: KVPool, req_to_token_table: ReqToTokenTable, layers: Sequence[AttentionLayer]
    ) -> None:
        if len(layers) != kv_pool.num_layers:
            raise ValueError(f"{len(layers)} attention layers for a KV pool of {kv_pool.num_layers}")
        missing = self.unsupported(layers)
        if missing:
            raise ValueError(f"the {type(self).__name__} does not serve {missing}")
        if kv_pool.windowed and req_to_token_table.req_to_window is None:
            raise ValueError("a KV pool with window slots needs a request-to-token table with a window table")
        for i in kv_pool.window_layers:
            if layers[i].sliding_window is None:
                raise ValueError(f"layer {i} keeps window slots in the KV pool but has no sliding window")
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_table.req_to_token
        self.req_to_window = req_to_token_table.req_to_window
        self.layers = tuple(layers)

    def table_of(self, layer_id: int) -> torch.Tensor:
        """The request-to-token table this layer reads its KV slots from: the window table for a
        layer that keeps its KV in window slots."""
        if layer_id in self.kv_pool.window_layers:
            assert self.req_to_window is not None
            return self.req_to_window
        return self.req_to_token

    def loc_of(self, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """The slots this layer stores the new tokens' KV in (window slots: see table_of)."""
        if layer_id in self.kv_pool.window_layers:
            assert batch.window_loc is not None, "a step on a windowed pool without window slots"
            return batch.window_loc
        return batch.out_cache_loc

    @classmethod
    def unsupported(cls, layers: Sequence[AttentionLayer]) -> str | None:
        """The first per-layer feature of `layers` this backend lacks, named, or None."""
        for i, layer in enumerate(layers):
            if layer.sliding_window is not None and not cls.supports_sliding_window:
                return f"sliding-window attention (layer {i}, window {layer.sliding_window})"
            if layer.logit_softcap is not None and not cls.supports_logit_softcap:
                return f"attention logit soft-capping (layer {i}, cap {layer.logit_softcap})"
        return None

    @staticmethod
    def per_token_decodes(batch: ForwardBatch) -> tuple[list[int], list[int]]:
        """Each new token as a decode: (its request's req_to_token row, its sequence length)."""
        rows: list[int] = []
        lens: list[int] = []
        for row, seq_len, n in zip(batch.req_pool_indices_cpu, batch.seq_lens_cpu, batch.extend_lens_cpu):
            rows += [row] * n
            lens += range(seq_len - n + 1, seq_len + 1)
        return rows, lens

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precomputes per-step index tensors once, so the per-layer calls only do math."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq, D]; k, v [T, Hkv, D] of the new tokens. Their KV is stored first, then every
        request attends to its whole sequence through the request-to-token table."""
        self.kv_pool.set_kv(layer_id, self.loc_of(layer_id, batch), k, v)
        return self.attend(q, layer_id, batch)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor: ...
