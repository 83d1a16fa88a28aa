"""radixlm_runtime: a prefix-caching LLM runtime (paged KV, radix tree, cache-aware scheduling)."""

from radixlm_runtime.engine.engine import Engine
from radixlm_runtime.sampling.params import SamplingParams
from radixlm_runtime.server_args import ServerArgs

__all__ = ["Engine", "SamplingParams", "ServerArgs"]
