"""The prefix cache: a radix tree of cached token prefixes over kvpool's allocators, with SGLang's
``RadixCache`` API, and its records, policies and events.

The rooms, each importing only those listed before it:
``key`` (``RadixKey`` and the bytes keys are compared in), ``records`` (each tier's per-node record:
``DeviceSlots``, ``HostCopy``, ``PageKeys``, ``StateSnapshot``), ``node`` (``TreeNode``), ``events``,
``evict_policy`` (the policies and the eviction queue), ``params`` (SGLang's argument and result
records), ``tree`` (``RadixTree``: structure, walks, its own consistency check), ``protocols`` (what
the request code and the integrity check need from a cache), ``requests`` and ``mamba_requests``
(what a request becomes: plans that change nothing), ``integrity`` (tree, allocator, table and
requests checked together), ``tree_cache`` (``TreeCache``, what every cache shares),
``radix_cache`` (``RadixCache``), ``write_through`` (an insert's host backups, staged before the
tree changes), ``host_tier`` (``HostTier``, what both caches with a host tier inherit: backups, the
transfers in flight, the tree's hooks for host-only nodes), ``storage_events`` (the storage tier's
KV events), ``storage_workers`` (its worker threads), ``storage_integrity`` (its part of the check),
``storage_tier`` (the storage tier's room: write-through to a storage backend and prefetch from
it), ``storage_setup`` (how a cache finds
its storage tier), ``hiradix_cache`` (the host tier's room, ``HiRadixCache``), ``mamba_radix_cache``
(the state tier's room, ``MambaRadixCache``), ``himamba_host`` (a hybrid model's host tier and its
parked states), ``himamba_moves`` (a hybrid node's moves between tiers), ``himamba_radix_cache``
(``HiMambaRadixCache``, both) and the sliding-window room: ``swa_plan`` (what an insertion does, and
the window rule), ``swa_windows`` (the SWA tier's books: records, window locks, sizes, queue),
``swa_integrity`` (the SWA part of the check) and ``swa_radix_cache`` (``SWARadixCache``).
"""

from kvpool.cache.events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_EXTERNAL, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvpool.cache.evict_policy import (
    EvictionStrategy,
    FIFOStrategy,
    FILOStrategy,
    LFUStrategy,
    LRUStrategy,
    MRUStrategy,
    PriorityStrategy,
)
from kvpool.cache.himamba_radix_cache import HiMambaRadixCache
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
from kvpool.cache.swa_radix_cache import SWARadixCache

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
    "HiMambaRadixCache",
    "HiRadixCache",
    "InsertParams",
    "InsertResult",
    "LFUStrategy",
    "LRUStrategy",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_EXTERNAL",
    "MEDIUM_GPU",
    "MRUStrategy",
    "MatchPrefixParams",
    "MambaRadixCache",
    "MatchResult",
    "PriorityStrategy",
    "RadixCache",
    "RadixKey",
    "SWARadixCache",
    "TreeNode",
]
