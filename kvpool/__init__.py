"""kvpool: KV-cache memory pools, allocators and a fused FP8 K/V write for LLM serving engines."""

from kvpool.cache import (
    CacheInitParams,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
    TreeNode,
)
from kvpool.errors import FusedPathUnavailable, IntegrityError
from kvpool.kernels import (
    fused_eligibility,
    fused_fp8_set_kv_buffer,
    quantize,
    reference_set_kv_buffer,
)
from kvpool.host import LayerTransferCounter, MHATokenToKVPoolHost, MLATokenToKVPoolHost
# Imported from the module, not re-exported by kvpool.kernels, so that the package attribute
# kvpool.kernels.copy_rows stays the module.
from kvpool.kernels.copy_rows import RowTable, copy_rows
from kvpool.pools import (
    AllocatorState,
    BaseTokenToKVPoolAllocator,
    HybridLinearKVPool,
    HybridReqToTokenPool,
    HybridSizing,
    KVCpuCopy,
    KVGeometry,
    MHATokenToKVPool,
    MLATokenToKVPool,
    MambaCacheParams,
    MambaCpuCopy,
    MambaPool,
    MambaStateDType,
    MambaStateShape,
    PagedTokenToKVPoolAllocator,
    PathStats,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    alloc_extend_naive,
    kv_bytes_per_token,
    max_pool_size,
    mla_kv_bytes_per_token,
    plan_hybrid_pools,
)
from kvpool.pools.mamba_host import HybridPoolHost, MambaPoolHost
from kvpool.transfer import KVPoll, KVReceiver, KVSender, KVTransfer, StateShard, recv_kv, send_kv

__version__ = "0.1.0"

__all__ = [
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "CacheInitParams",
    "EvictParams",
    "FusedPathUnavailable",
    "HybridLinearKVPool",
    "HybridPoolHost",
    "HybridReqToTokenPool",
    "HybridSizing",
    "InsertParams",
    "IntegrityError",
    "KVCpuCopy",
    "KVGeometry",
    "LayerTransferCounter",
    "MHATokenToKVPool",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPool",
    "MLATokenToKVPoolHost",
    "MambaCacheParams",
    "MambaCpuCopy",
    "MambaPool",
    "MambaPoolHost",
    "MambaStateDType",
    "MambaStateShape",
    "MatchPrefixParams",
    "PagedTokenToKVPoolAllocator",
    "PathStats",
    "RadixCache",
    "RadixKey",
    "ReqToTokenPool",
    "RowTable",
    "StateShard",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransfer",
    "alloc_extend_naive",
    "kv_bytes_per_token",
    "max_pool_size",
    "mla_kv_bytes_per_token",
    "plan_hybrid_pools",
    "copy_rows",
    "fused_eligibility",
    "fused_fp8_set_kv_buffer",
    "quantize",
    "recv_kv",
    "reference_set_kv_buffer",
    "send_kv",
]
