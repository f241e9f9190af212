"""The storage room's records: its counters (``StorageTierStats``) and one request's prefetch in
flight (``PrefetchOp``), which the scheduler's thread and a worker thread share under the tier's
lock (``kvpool.cache.storage_tier``)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch

from kvpool.cache.node import TreeNode


@dataclasses.dataclass
class StorageTierStats:
    """What the storage tier did: pages stored by write-through, write batches that failed (False or
    raised), pages not written while backing off, prefetches started and failed, pages read, tokens
    that entered the host tier from storage, and fetched tokens dropped (in the tree already, their
    prefix gone meanwhile, or no host room)."""

    pages_written: int = 0
    write_failures: int = 0
    writes_skipped: int = 0
    prefetches: int = 0
    prefetch_failures: int = 0
    pages_read: int = 0
    tokens_loaded: int = 0
    tokens_dropped: int = 0


class PrefetchOp:
    """One request's prefetch: the whole key as bytes (``enc``, the match's host part then the new
    tokens), where the fetched part starts (``start``, bytes), its page keys, the held host copy of
    the node it continues, the pages the worker has read so far, and what a subclass's ``fetch``
    read beside them (``beside``: a hybrid model's state).

    A prefetch that reads straight into host pages holds them from its start (``slots``, one page
    per key, and their ``regions``, the memory each page's bytes go to): the worker counts the
    pages read into them (``read``), and ``reading`` is True while a storage call of its writes
    into them."""

    __slots__ = (
        "enc", "start", "keys", "extra", "node", "copy", "started", "pages", "beside", "finished", "terminated",
        "slots", "regions", "read", "reading",
    )  # fmt: skip

    def __init__(self, enc: bytes, start: int, keys: list[str], extra: Any, node: TreeNode, copy: Any) -> None:
        self.enc, self.start, self.keys, self.extra, self.node, self.copy = enc, start, keys, extra, node, copy
        self.started = time.monotonic()
        self.pages: list[torch.Tensor] = []
        self.beside: Optional[torch.Tensor] = None
        self.finished = False
        self.terminated = False
        self.slots: Optional[torch.Tensor] = None
        self.regions: list = []
        self.read = 0
        self.reading = False
