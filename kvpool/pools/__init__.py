"""Pools (the K/V buffers) and the allocators a scheduler uses to hand out their slots."""

from kvpool.pools.allocator import (
    AllocatorState,
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    alloc_extend_naive,
)
from kvpool.pools.allocator.swa import SWATokenToKVPoolAllocator
from kvpool.pools.cpu_copy import KVCpuCopy
from kvpool.pools.hybrid_kv_pool import HybridLinearKVPool
from kvpool.pools.hybrid_req_pool import HybridReqToTokenPool
from kvpool.pools.mamba_pool import MambaCpuCopy, MambaPool
from kvpool.pools.mla_pool import MLATokenToKVPool
from kvpool.kernels.store_kv.writer import PathStats
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.req_to_token import ReqToTokenPool
from kvpool.pools.sizing import (
    HybridSizing,
    KVGeometry,
    SWASizing,
    kv_bytes_per_token,
    max_pool_size,
    mla_kv_bytes_per_token,
    plan_hybrid_pools,
    plan_swa_pools,
)
from kvpool.pools.state_params import MambaCacheParams, MambaStateDType, MambaStateShape
from kvpool.pools.swa_pool import SWAKVPool

__all__ = [
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "HybridLinearKVPool",
    "HybridReqToTokenPool",
    "HybridSizing",
    "KVCpuCopy",
    "KVGeometry",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "MambaCacheParams",
    "MambaCpuCopy",
    "MambaPool",
    "MambaStateDType",
    "MambaStateShape",
    "PagedTokenToKVPoolAllocator",
    "PathStats",
    "ReqToTokenPool",
    "SWAKVPool",
    "SWASizing",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "alloc_extend_naive",
    "kv_bytes_per_token",
    "max_pool_size",
    "mla_kv_bytes_per_token",
    "plan_hybrid_pools",
    "plan_swa_pools",
]
