"""The prefix cache: a radix tree of cached token prefixes over kvpool's allocators, with SGLang's
``RadixCache`` API (``kvpool.cache.radix_cache``) and its records, policies and events."""

from kvpool.cache.events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.cache.evict_policy import (
    EvictionStrategy,
    FIFOStrategy,
    FILOStrategy,
    LFUStrategy,
    LRUStrategy,
    MRUStrategy,
    PriorityStrategy,
)
from kvpool.cache.hiradix_cache import HiRadixCache
from kvpool.cache.key import RadixKey
from kvpool.cache.mamba_radix_cache import MambaRadixCache
from kvpool.cache.node import TreeNode
from kvpool.cache.params import (
    CacheInitParams,
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from kvpool.cache.radix_cache import RadixCache

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheInitParams",
    "EvictParams",
    "EvictResult",
    "EvictionStrategy",
    "FIFOStrategy",
    "FILOStrategy",
    "HiRadixCache",
    "InsertParams",
    "InsertResult",
    "LFUStrategy",
    "LRUStrategy",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MRUStrategy",
    "MatchPrefixParams",
    "MambaRadixCache",
    "MatchResult",
    "PriorityStrategy",
    "RadixCache",
    "RadixKey",
    "TreeNode",
]
