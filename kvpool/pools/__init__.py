"""Pools (the K/V buffers) and the allocators a scheduler uses to hand out their slots."""

from kvpool.pools.allocator import (
    AllocatorState,
    IntegrityError,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from kvpool.pools.host_pool import MHATokenToKVPoolHost
from kvpool.pools.kv_moves import KVCpuCopy
from kvpool.pools.layer_transfer import LayerTransferCounter
from kvpool.pools.mha_pool import MHATokenToKVPool, PathStats
from kvpool.pools.req_to_token import ReqToTokenPool
from kvpool.pools.sizing import KVGeometry, kv_bytes_per_token, max_pool_size

__all__ = [
    "AllocatorState",
    "IntegrityError",
    "KVCpuCopy",
    "KVGeometry",
    "LayerTransferCounter",
    "MHATokenToKVPool",
    "MHATokenToKVPoolHost",
    "PagedTokenToKVPoolAllocator",
    "PathStats",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "kv_bytes_per_token",
    "max_pool_size",
]
