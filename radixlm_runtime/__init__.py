"""radixlm_runtime: a prefix-caching LLM runtime (paged KV, radix tree, cache-aware scheduling).

Exports load lazily so light users (the frontend language's HTTP client, the CLI's --help) do not
pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm_runtime.entrypoints.engine import Engine
    from radixlm_runtime.sampling.params import SamplingParams
    from radixlm_runtime.server_args import ServerArgs

_EXPORTS = {
    "Engine": "radixlm_runtime.entrypoints.engine",
    "SamplingParams": "radixlm_runtime.sampling.params",
    "ServerArgs": "radixlm_runtime.server_args",
}

__all__ = ["Engine", "SamplingParams", "ServerArgs"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'radixlm_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
