"""The storage tier's KV events: which pages a cache tells its listeners (``take_events``) it holds
in storage, under the storage's medium (``MEDIUM_DISK`` for ``HiCacheFile`` and other backends,
``MEDIUM_EXTERNAL`` for ``MooncakeStore``, a store shared across machines).

A page written through to storage is announced with a ``BlockStored`` of that medium, once the write
has succeeded, carrying the same block hash, parent hash and tokens as the device's ``BlockStored`` of
that page; a page announced once is not announced again until it is withdrawn. A page announced
that a prefetch then finds missing (the backend evicted it, or it reads as a miss) is withdrawn with
a ``BlockRemoved`` of that medium. A backend drops pages without telling anyone, so a miss is
where the cache learns of it. Closing the storage tier withdraws every page it announced; a reset of
the cache (``AllBlocksCleared``) forgets them.

Workers only record what happened (under a lock); the events enter the cache's queue on the
caller's thread, at ``check_hicache_events`` and at ``close``, so they never race the device tier's
events or a call that takes its own events back.
"""

from __future__ import annotations

import threading
from typing import Any

from kvpool.cache.events import MEDIUM_DISK, MEDIUM_EXTERNAL, BlockRemoved, BlockStored, stored_events
from kvpool.cache.node import TreeNode
from kvpool.storage.base import HiCacheStorage
from kvpool.storage.faults import FaultyStorage
from kvpool.storage.mooncake import MooncakeStore


def storage_medium(storage: HiCacheStorage) -> str:
    """The medium a backend's pages are announced under: ``MEDIUM_EXTERNAL`` for a ``MooncakeStore``
    (also behind a ``FaultyStorage``), ``MEDIUM_DISK`` for every other backend."""
    while isinstance(storage, FaultyStorage):
        storage = storage.storage
    return MEDIUM_EXTERNAL if isinstance(storage, MooncakeStore) else MEDIUM_DISK


class StorageEvents:
    """The pages one storage tier has announced, and the outcomes its workers saw since the last
    ``publish`` (see the module).

    Parameters
    ----------
    cache : the cache whose ``kv_event_queue`` receives the events (only while its
        ``enable_kv_cache_events`` is set).
    medium : the storage's medium (:func:`storage_medium`).
    """

    def __init__(self, cache: Any, medium: str) -> None:
        self.cache, self.medium = cache, medium
        #: Page key -> block hash of every page announced stored and not withdrawn since.
        self.announced: dict[str, int] = {}
        self._lock = threading.Lock()
        self._seen: list[tuple[str, Any]] = []  # ("stored", [(key, BlockStored)]) or ("missing", key), in order

    @property
    def enabled(self) -> bool:
        """Whether the cache records KV events."""
        return bool(self.cache.enable_kv_cache_events)

    def pages_of(self, node: TreeNode, keys: list[str]) -> list[tuple[str, BlockStored]]:
        """``node``'s page keys paired with their ``BlockStored`` of this medium (on the caller's
        thread: it reads the tree); empty while events are off."""
        if not self.enabled:
            return []
        c = self.cache
        return list(zip(keys, stored_events(node, c.root_node, c.page_size, c.elem_bytes, self.medium)))

    def stored(self, pages: list[tuple[str, BlockStored]]) -> None:
        """A worker wrote ``pages`` (from :meth:`pages_of`) to storage."""
        if pages:
            with self._lock:
                self._seen.append(("stored", pages))

    def missing(self, key: str) -> None:
        """A worker found page ``key`` missing from storage."""
        if self.enabled:
            with self._lock:
                self._seen.append(("missing", key))

    def publish(self) -> None:
        """Turn what the workers saw into events, in order (on the caller's thread)."""
        with self._lock:
            seen, self._seen = self._seen, []
        if not self.enabled:
            return
        queue = self.cache.kv_event_queue
        for what, item in seen:
            if what == "stored":
                for key, event in item:
                    if key not in self.announced:
                        self.announced[key] = event.block_hashes[0]
                        queue.append(event)
            else:
                block = self.announced.pop(item, None)
                if block is not None:
                    queue.append(BlockRemoved(block_hashes=[block], medium=self.medium))

    def withdraw_all(self) -> None:
        """Publish, then withdraw every announced page in one ``BlockRemoved`` (the tier closes)."""
        self.publish()
        if self.announced and self.enabled:
            self.cache.kv_event_queue.append(BlockRemoved(block_hashes=list(self.announced.values()), medium=self.medium))
        self.announced = {}

    def forget(self) -> None:
        """The cache was reset (its ``AllBlocksCleared`` withdraws everything): nothing is announced."""
        with self._lock:
            self._seen = []
        self.announced = {}
