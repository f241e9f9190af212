"""kvpool: KV-cache memory pools, allocators and a fused FP8 K/V write for LLM serving engines."""

from kvpool.cache import (
    CacheInitParams,
    EvictParams,
    HiMambaRadixCache,
    HiRadixCache,
    InsertParams,
    MambaRadixCache,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
    SWARadixCache,
    TreeNode,
)
from kvpool.errors import FusedPathUnavailable, IntegrityError
from kvpool.kernels import (
    fused_eligibility,
    fused_fp8_set_kv_buffer,
    quantize,
    reference_set_kv_buffer,
)
from kvpool.host import HybridPoolHost, LayerTransferCounter, MambaPoolHost, MHATokenToKVPoolHost, MLATokenToKVPoolHost
from kvpool.host import SWAKVPoolHost
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
    SWAKVPool,
    SWASizing,
    SWATokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    alloc_extend_naive,
    kv_bytes_per_token,
    max_pool_size,
    mla_kv_bytes_per_token,
    plan_hybrid_pools,
    plan_swa_pools,
)
from kvpool.kernels.store_fp4 import dequantize_fp4, quantize_fp4
from kvpool.kernels.store_nvfp4 import dequantize_nvfp4, quantize_nvfp4
from kvpool.pools.fp4_base import Fp4CpuCopy
from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4
from kvpool.pools.mla_fp4_pool import MLATokenToKVPoolFP4
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead
from kvpool.pools.row_parts import PartsCpuCopy
from kvpool.transfer import KVPoll, KVReceiver, KVSender, KVTransfer, StateShard, recv_kv, send_kv
from kvpool.transfer import SWAKVReceiver, SWAKVSender, SWAKVTransfer

__version__ = "0.1.0"

__all__ = [
    "AllocatorState",
    "BaseTokenToKVPoolAllocator",
    "CacheInitParams",
    "EvictParams",
    "Fp4CpuCopy",
    "FusedPathUnavailable",
    "HiMambaRadixCache",
    "HiRadixCache",
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
    "MHATokenToKVPoolFP4",
    "MHATokenToKVPoolFP8PerTokenHead",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPool",
    "MLATokenToKVPoolFP4",
    "MLATokenToKVPoolHost",
    "MambaCacheParams",
    "MambaCpuCopy",
    "MambaPool",
    "MambaPoolHost",
    "MambaRadixCache",
    "MambaStateDType",
    "MambaStateShape",
    "MatchPrefixParams",
    "PagedTokenToKVPoolAllocator",
    "PartsCpuCopy",
    "PathStats",
    "RadixCache",
    "RadixKey",
    "ReqToTokenPool",
    "RowTable",
    "SWAKVPool",
    "SWAKVPoolHost",
    "SWAKVReceiver",
    "SWAKVSender",
    "SWAKVTransfer",
    "SWARadixCache",
    "SWASizing",
    "SWATokenToKVPoolAllocator",
    "StateShard",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransfer",
    "alloc_extend_naive",
    "dequantize_fp4",
    "dequantize_nvfp4",
    "kv_bytes_per_token",
    "max_pool_size",
    "mla_kv_bytes_per_token",
    "plan_hybrid_pools",
    "plan_swa_pools",
    "quantize_fp4",
    "quantize_nvfp4",
    "copy_rows",
    "fused_eligibility",
    "fused_fp8_set_kv_buffer",
    "quantize",
    "recv_kv",
    "reference_set_kv_buffer",
    "send_kv",
]
