"""Owns the weights, the KV pool and the attention backend; turns a ForwardBatch into logits."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from radixlm_runtime.attention.base import AttentionBackend
from radixlm_runtime.engine.forward_batch import ForwardBatch
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenPool, TokenAllocator
from radixlm_runtime.layers.linear import prepack_linears
from radixlm_runtime.layers.rotary import build_rotary
from radixlm_runtime.models.config import ModelConfig
from radixlm_runtime.models.llama import LlamaForCausalLM
from radixlm_runtime.models.loader import load_weights
from radixlm_runtime.server_args import ServerArgs
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass max_total_tokens")


class ModelRunner:
    def __init__(self, model_dir: Path, args: ServerArgs) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
        self.config = ModelConfig.from_dir(model_dir)
        self.context_len = args.context_length or self.config.max_position_embeddings
        if self.context_len > self.config.max_position_embeddings:
            logger.warning(
                "context_length %d exceeds the model's max_position_embeddings %d",
                self.context_len,
                self.config.max_position_embeddings,
            )

        t0 = time.perf_counter()
        torch.manual_seed(args.random_seed)
        self.model = self._load_model(model_dir)
        logger.info(
            "loaded %s weights in %.2fs (%s, %s)",
            self.config.architecture,
            time.perf_counter() - t0,
            self.device,
            self.dtype,
        )

        self.max_total_tokens = self._kv_pool_size()
        self.kv_pool = KVPool(
            self.max_total_tokens,
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.dtype,
            self.device,
        )
        self.allocator = TokenAllocator(self.max_total_tokens, self.device)
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 8, self.context_len + 8, self.device
        )
        self.attn_backend = self._make_attention_backend()
        logger.info(
            "KV pool: %d tokens (%.2f GiB), attention backend %s",
            self.max_total_tokens,
            self.max_total_tokens * self.kv_pool.bytes_per_token() / 2**30,
            type(self.attn_backend).__name__,
        )

    def _load_model(self, model_dir: Path) -> LlamaForCausalLM:
        hf_config = None
        if self.config.rope_scaling and self.config.rope_scaling.get("rope_type", "default") != "default":
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(model_dir)
        rotary = build_rotary(
            hf_config, self.config.head_dim, self.config.rope_theta, self.context_len, self.device
        )
        # Built on the meta device: every weight is overwritten by the checkpoint, so random init
        # would only cost start-up time.
        with torch.device("meta"):
            model = LlamaForCausalLM(self.config, rotary)
        model = model.to_empty(device=self.device)
        model.load_weights(load_weights(model_dir))
        model = model.to(device=self.device, dtype=self.dtype).eval()
        prepack_linears(model)
        return model

    def _kv_pool_size(self) -> int:
        if self.args.max_total_tokens is not None:
            return self.args.max_total_tokens
        per_token = KVPool.bytes_per_token_for(
            self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, self.dtype
        )
        budget = int(_available_memory_bytes(self.device) * self.args.mem_fraction_static)
        return max(1024, budget // per_token)

    def _make_attention_backend(self) -> AttentionBackend:
        name = self.args.attention_backend
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        scale = self.config.head_dim**-0.5
        if name == "triton":
            from radixlm_runtime.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(self.kv_pool, self.req_to_token_pool, scale)
        from radixlm_runtime.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(self.kv_pool, self.req_to_token_pool, scale)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch, self.attn_backend)
