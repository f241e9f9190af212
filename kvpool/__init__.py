"""kvpool: KV-cache memory pools, allocators and a fused FP8 K/V write for LLM serving engines."""

from kvpool.kernels import (
    FusedPathUnavailable,
    fused_eligibility,
    fused_fp8_set_kv_buffer,
    quantize,
    reference_set_kv_buffer,
)
from kvpool.pools import (
    AllocatorState,
    BaseTokenToKVPoolAllocator,
    IntegrityError,
    KVGeometry,
    MHATokenToKVPool,
    MLATokenToKVPool,
    PagedTokenToKVPoolAllocator,
    PathStats,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    kv_bytes_per_token,
    max_pool_size,
    mla_kv_bytes_per_token,
)

__version__ = "0.1.0"

__all__ = [
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "FusedPathUnavailable",
    "IntegrityError",
    "KVGeometry",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "PagedTokenToKVPoolAllocator",
    "PathStats",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "kv_bytes_per_token",
    "max_pool_size",
    "mla_kv_bytes_per_token",
    "fused_eligibility",
    "fused_fp8_set_kv_buffer",
    "quantize",
    "reference_set_kv_buffer",
]
