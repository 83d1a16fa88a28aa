"""KV cache storage (device tensors), the host free lists that hand it out, and the radix prefix cache."""

from radixlm_runtime.kvcache.allocator import RowAllocator, TokenAllocator
from radixlm_runtime.kvcache.radix_cache import RadixCache, TreeNode

__all__ = ["RadixCache", "RowAllocator", "TokenAllocator", "TreeNode"]
