"""Prefetches that read straight into host pages (``kvpool.cache.storage_tier``): for a backend that
reads into caller-given memory (``reads_into_regions``) and a host pool that lets host code write
its pages (``sync_pages_for_write``), a prefetch takes its host pages when it starts, on the
scheduler's thread: it allocates them, waits for the transfers still using them, and works out the
memory each page's bytes go to. The worker thread then reads the pages there (it never calls the
host pool, which is not thread-safe), and the pages read enter the tree as they are, with no second
copy.

Until the prefetch ends its host pages are its own (the integrity check counts them beside the
tree's). When it ends (taken, dropped, aborted, closed), the pages it does not hand to the tree are
freed at once if the worker is done with it, else parked until the worker is, and freed at the next
``free_parked`` (the tier's poll, progress, drain and close). A reset (the host pool is cleared)
waits for a storage call still writing into them, then forgets them without freeing them.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from kvpool.cache.storage_records import PrefetchOp

#: Pages one storage call of a worker reads (a stopped prefetch waits for at most these): one, as
#: the tensor path's ``get`` reads, so a backend sees one call per page either way.
READ_BATCH = 1


class HostReads:
    """The host pages of the storage tier's prefetches that read into host pages (see the module).

    Parameters
    ----------
    host : the cache's host pool (with ``sync_pages_for_write``).
    storage : the backend (``reads_into_regions`` True).
    lock : the tier's lock, under which the worker and the scheduler share a ``PrefetchOp``.
    """

    def __init__(self, host: Any, storage: Any, lock: threading.Lock) -> None:
        self.host, self.storage, self.lock = host, storage, lock
        self.page_size = host.page_size
        self.read_done = threading.Condition(lock)  # notified when a worker's storage call returns
        self.parked: list[tuple[PrefetchOp, torch.Tensor]] = []  # (ended op its worker may still use, its slots)

    # --- the scheduler's side -----------------------------------------------------------------------

    def give(self, op: PrefetchOp) -> bool:
        """Give ``op`` host pages for its keys, ready for the worker to write; False (nothing
        allocated) when the host has no free room for them, or they could not be made ready (a
        failed transfer: the pages are read into pages of their own, whose copy meets it)."""
        slots = self.host.alloc(len(op.keys) * self.page_size)
        if slots is None:
            return False
        try:
            self.host.sync_pages_for_write(slots)
            regions = self.storage.host_page_regions(op.keys, slots)
        except BaseException as e:
            self.host.free(slots)
            if isinstance(e, Exception):
                return False
            raise
        op.slots, op.regions = slots, regions
        return True

    def end(self, op: PrefetchOp, keep: int) -> Optional[torch.Tensor]:
        """``op`` ended (its worker stops before its next call): its first ``keep`` pages' slots
        (read, and the worker's no longer), returned to the caller; the rest freed now if the worker
        is done with ``op``, else parked. None when ``op`` holds no host pages."""
        slots, op.slots, op.regions = op.slots, None, []
        if slots is None:
            return None
        n = keep * self.page_size
        rest = slots[n:]
        if rest.numel():
            with self.lock:
                finished = op.finished
            if finished:
                self.host.free(rest)
            else:
                self.parked.append((op, rest))
        return slots[:n]

    def free_parked(self) -> None:
        """Free the parked pages whose worker is done with them."""
        if not self.parked:
            return
        with self.lock:
            done = [s for op, s in self.parked if op.finished]
            self.parked = [(op, s) for op, s in self.parked if not op.finished]
        if done:
            self.host.free(torch.cat(done))

    def forget(self, ops: list[PrefetchOp]) -> None:
        """The host pool was cleared: stop ``ops``' workers, wait for a storage call still writing
        into their pages, and forget those and the parked pages (freed already)."""
        ops = ops + [op for op, _ in self.parked]
        with self.lock:
            for op in ops:
                op.terminated = True
            while any(op.reading for op in ops):
                self.read_done.wait()
        for op in ops:
            op.slots, op.regions = None, []
        self.parked = []

    def held(self, ops: list[PrefetchOp]) -> list[torch.Tensor]:
        """The host slots ``ops`` (the prefetches in flight) and the parked ones hold."""
        return [op.slots for op in ops if op.slots is not None] + [s for _, s in self.parked]

    # --- the worker's side ----------------------------------------------------------------------------

    def fetch(self, op: PrefetchOp, hits: int) -> Optional[str]:
        """Read ``op``'s first ``hits`` pages in order into its host pages (on a worker thread),
        counting in ``op.read`` those read in a row, until one misses or ``op`` is stopped; returns
        the key that missed (None: none did)."""
        at = 0
        while at < hits:
            with self.lock:
                if op.terminated or op.slots is None:
                    return None
                op.reading = True
                stop = min(hits, at + READ_BATCH)
                keys, regions = op.keys[at:stop], op.regions[at:stop]
            try:
                got = self.storage.batch_get_regions(keys, regions)
            finally:
                with self.lock:
                    op.reading = False
                    self.read_done.notify_all()
            n = next((i for i, ok in enumerate(got) if ok is not True), len(keys))
            with self.lock:
                if op.terminated:  # ended meanwhile: its pages are not taken
                    return None
                op.read += n
            if n < len(keys):
                return keys[n]
            at += n
        return None
