"""KV cache storage, slot allocators and the radix prefix cache."""

from radixlm_runtime.kvcache.pool import KVPool, ReqToTokenPool, TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache, TreeNode

__all__ = ["KVPool", "RadixCache", "ReqToTokenPool", "TokenAllocator", "TreeNode"]
