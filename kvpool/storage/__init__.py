"""The storage tier: KV pages below the host tier, shared across restarts and engines (SGLang's
HiCache storage backends).

``base.py`` is the interface every backend implements (``HiCacheStorage``, its config and
counters); the rules are docs/contract.md, "Storage tier".
"""

from kvpool.storage.base import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageStats

__all__ = ["HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo", "StorageStats"]
