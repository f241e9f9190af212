"""How the storage tier's fetched pages enter the tree when a prefetch ends
(``kvpool.cache.storage_tier``): read into pages of its own, they are copied to new host pages;
read straight into host pages, those pages are used as they are. Either way the pages the tree lacks
hang below the part of their prefix it holds now, as one host-only leaf, and the rest are freed.
Mixed into ``StorageTier``, whose cache, host pool, page sizes and counters it uses.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvpool.cache.node import TreeNode
from kvpool.cache.storage_records import PrefetchOp


class FetchedPages:
    """The storage tier's taking of fetched pages (see the module)."""

    def _take(self, op: PrefetchOp, pages: list[torch.Tensor]) -> int:
        """Copy the fetched pages to new host pages and hang the ones the tree lacks below the
        prefix they continue; returns the tokens that entered the host tier."""
        tokens = len(pages) * self.page_size
        if not tokens:
            return 0
        slots = self.host.alloc(tokens)
        if slots is None:
            self.cache.evict_host(tokens)
            slots = self.host.alloc(tokens)
        if slots is None:
            self._count(0, tokens)
            return 0
        return self._place(op, slots, pages)

    def _take_read(self, op: PrefetchOp, slots: torch.Tensor) -> int:
        """``_take`` of pages read straight into host pages (``slots``, now the caller's)."""
        return self._place(op, slots, None) if len(slots) else 0

    def _place(self, op: PrefetchOp, slots: torch.Tensor, pages: Optional[list[torch.Tensor]]) -> int:
        """Hang the pages of ``slots`` the tree lacks below the prefix they continue, after copying
        ``pages`` into them (None: they hold the bytes already), and free the rest of ``slots``."""
        host, cache = self.host, self.cache
        tokens = len(slots)
        try:
            reserved = self.reserve(op)
        except BaseException:
            host.free(slots)
            raise
        if reserved is False:
            host.free(slots)
            self._count(0, tokens)
            return 0
        n = tokens // self.page_size
        end = op.start + n * self.page_enc_bytes
        node, pos = cache.branch_point(op.enc, end, op.extra)  # where the tree's copy of the prefix ends now
        skip = max(0, (pos - op.start) // self.page_enc_bytes)
        if pos < op.start or skip >= n:  # the prefix left the tree meanwhile, or it has every page
            host.free(slots)
            if pos < end or not self.adopt(node, op, reserved):
                self.release(reserved)
            self._count(0, tokens)
            return 0
        kept = slots[skip * self.page_size :]
        if pages is not None:
            try:
                dtype = host.store_dtype
                for start, page in zip(kept[:: self.page_size].tolist(), pages[skip:]):
                    host.set_from_flat_data_page(start, page.view(dtype))
            except BaseException:
                host.free(slots)
                self.release(reserved)
                raise
        if skip:
            host.free(slots[: skip * self.page_size])
        self.hang(cache.hang_host_leaf(node, op.enc, pos, end, op.extra, kept), op, reserved)
        loaded = len(kept)
        self._count(loaded, tokens - loaded)
        return loaded

    def _count(self, loaded: int, dropped: int) -> None:
        """Count a taken prefetch's tokens (under the lock: a worker counts beside the scheduler)."""
        with self._lock:
            self.stats.tokens_loaded += loaded
            self.stats.tokens_dropped += dropped

    # A subclass's hooks for what a leaf needs besides its host pages (a hybrid model's state):
    # ``reserve`` takes it before the tree is looked at (False: no room, the pages are dropped),
    # ``hang`` gives it to the new leaf, ``adopt`` to ``node`` when the tree holds every fetched
    # page up to it already (False: not taken), ``release`` gives back what nothing took.

    def reserve(self, op: PrefetchOp) -> Any:
        """What ``op``'s leaf needs besides its host pages (None here)."""
        return None

    def release(self, reserved: Any) -> None:
        """Give back what ``reserve`` took and nothing took."""

    def hang(self, leaf: TreeNode, op: PrefetchOp, reserved: Any) -> None:
        """``op``'s fetched pages hang in the tree as ``leaf``, with what ``reserve`` took."""

    def adopt(self, node: TreeNode, op: PrefetchOp, reserved: Any) -> bool:
        """Whether ``node`` takes what ``reserve`` took (False here)."""
        return False
