"""Attention backends by name, and the choice `auto` makes: the first one, in order of speed on the
device, whose kernels serve every layer of the model (its sliding windows, soft-caps). An explicitly
named backend that cannot serve the model is a ValueError naming what it lacks, never a silent swap."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from radixlm_runtime.attention.base import AttentionBackend, AttentionLayer
from radixlm_runtime.kernels.native import KernelBuildError
from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenTable
from radixlm_runtime.utils.logging import get_logger

logger = get_logger(__name__)

# name -> (module, class), imported on demand: the Triton and C++ backends pull in their compilers.
_BACKENDS = {
    "triton": ("radixlm_runtime.attention.triton_backend", "TritonAttentionBackend"),
    "cpu": ("radixlm_runtime.attention.cpu_backend", "CpuAttentionBackend"),
    "torch": ("radixlm_runtime.attention.torch_backend", "TorchAttentionBackend"),
}


def _backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be 'auto' or one of {sorted(_BACKENDS)}, got {name!r}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def _candidates(device: torch.device, dtype: torch.dtype) -> list[str]:
    if device.type == "cuda":
        return ["triton", "torch"]
    return ["cpu", "torch"] if dtype in (torch.float32, torch.bfloat16, torch.int8) else ["torch"]


def create_attention_backend(
    name: str, pool: KVPool, table: ReqToTokenTable, layers: Sequence[AttentionLayer]
) -> AttentionBackend:
    """The backend `name` names, or for `auto` the fastest on the pool's device that serves `layers`
    (the torch backend serves every layer feature and runs anywhere)."""
    if name != "auto":
        return _backend_class(name)(pool, table, layers)
    for candidate in _candidates(pool.device, pool.dtype):
        cls = _backend_class(candidate)
        lacking = cls.unsupported(layers)
        if lacking is not None:
            logger.info("attention backend %s does not serve %s; trying the next", candidate, lacking)
            continue
        try:
            return cls(pool, table, layers)
        except KernelBuildError as e:
            logger.warning("attention backend %s is unavailable (%s); trying the next", candidate, e)
    raise ValueError(f"no attention backend serves this model on {pool.device} ({pool.dtype})")
