"""The storage tier: KV pages below the host tier, kept across restarts and shared between engines
(SGLang's HiCache storage backends).

``base.py`` is the interface every backend implements (``HiCacheStorage``, its config and
counters), ``keys.py`` the page keys chained from a radix key and the namespace pages are stored
under, ``record.py`` the byte layout of a stored page, ``file.py`` the embedded backend
(``HiCacheFile``, one directory of page files; ``file_io.py`` its directory and I/O), ``mooncake.py`` the backend shared by engines on
several machines (``MooncakeStore``, over a Mooncake Store; its package is imported only when a
store connects), ``faults.py`` a failure injector around any backend.
The rules are docs/contract.md, "Storage tier".
"""

from kvpool.storage.base import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageStats
from kvpool.storage.file import HiCacheFile
from kvpool.storage.keys import key_namespace, page_keys, storage_digest
from kvpool.storage.mooncake import MooncakeStore
from kvpool.storage.mooncake_config import MooncakeConfig

__all__ = [
    "HiCacheFile",
    "HiCacheStorage",
    "HiCacheStorageConfig",
    "HiCacheStorageExtraInfo",
    "MooncakeConfig",
    "MooncakeStore",
    "StorageStats",
    "key_namespace",
    "page_keys",
    "storage_digest",
]
