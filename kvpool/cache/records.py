"""Each tier's record on a tree node: the node carries one record per tier it is in.

``DeviceSlots`` (the device tier, every cache), ``HostCopy`` (the host tier of ``HiRadixCache``),
``PageKeys`` (the storage tier's keys of a node's pages), ``StateSnapshot`` (the linear-attention
state of ``MambaRadixCache``) and ``SWAWindow`` (the sliding-window layers' KV of
``SWARadixCache``). A node is on the device when it has a ``DeviceSlots`` record (``node.device``);
the other tiers file their records in ``node.records`` under their room's name (``HOST``,
``STORAGE``, ``STATE``, ``SWA``), so that a further tier is a further record type and name, not
more fields on every node.

Every record can be split when the tree cuts its node after ``tokens`` tokens: ``split`` returns the
record of the first part (or None when that part has none) and keeps the rest. ``queue_entry`` is
the record's live entry in its tier's eviction queue (``kvpool.cache.evict_policy``), None when it
has none.
"""

from __future__ import annotations

from typing import Optional

import torch

#: The names the host, storage, state and sliding-window tiers file their records under in ``node.records``.
HOST = "host"
STORAGE = "storage"
STATE = "state"
SWA = "swa"


class DeviceSlots:
    """A node's KV on the device: ``value`` Tensor [tokens] int64 slots, and the requests holding it
    (``lock_ref``; a locked node is never evicted)."""

    __slots__ = ("value", "lock_ref", "queue_entry")

    def __init__(self, value: torch.Tensor, lock_ref: int = 0) -> None:
        self.value = value
        self.lock_ref = lock_ref
        self.queue_entry: Optional[tuple] = None

    def split(self, tokens: int) -> "DeviceSlots":
        """The first ``tokens`` slots as a new record (with the same locks: the requests below hold
        both parts); this one keeps the rest."""
        head = DeviceSlots(self.value[:tokens].clone(), self.lock_ref)
        self.value = self.value[tokens:].clone()
        return head


class HostCopy:
    """A node's KV backed up on the host: ``slots`` Tensor [tokens] int64 host slots, and the holders
    of the copy (``holds``, SGLang's ``host_ref_counter``: a held copy is not released)."""

    __slots__ = ("slots", "holds", "queue_entry")

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        self.holds = 0
        self.queue_entry: Optional[tuple] = None

    def split(self, tokens: int) -> "HostCopy":
        """The first ``tokens`` host slots as a new, unheld record; this one keeps the rest."""
        head = HostCopy(self.slots[:tokens].clone())
        self.slots = self.slots[tokens:].clone()
        return head


class PageKeys:
    """The storage keys of a node's pages (``kvpool.storage.keys.page_keys`` of its whole prefix, one
    per page of the node), computed once for the node's path."""

    __slots__ = ("keys", "page_size", "queue_entry")

    def __init__(self, keys: list[str], page_size: int) -> None:
        self.keys = keys
        self.page_size = page_size
        self.queue_entry: Optional[tuple] = None

    def split(self, tokens: int) -> "PageKeys":
        """The keys of the first ``tokens`` tokens' pages as a new record; this one keeps the rest
        (each key names its whole prefix, so the parts' keys are the same ones)."""
        pages = tokens // self.page_size
        head = PageKeys(self.keys[:pages], self.page_size)
        self.keys = self.keys[pages:]
        return head


class StateSnapshot:
    """The linear layers' state after a node's last token: ``slot`` Tensor [1] int64 (a state slot of
    the ``MambaPool``), and the requests holding it (``lock_ref``, SGLang's ``mamba_lock_ref``)."""

    __slots__ = ("slot", "lock_ref", "queue_entry")

    def __init__(self, slot: torch.Tensor) -> None:
        self.slot = slot
        self.lock_ref = 0
        self.queue_entry: Optional[tuple] = None

    def split(self, tokens: int) -> None:
        """None: the state is the one after the node's last token, so it stays with the second part."""
        return None


class SWAWindow:
    """A node's KV in the sliding-window layers: the SWA slots its device slots map to (through the
    ``SWATokenToKVPoolAllocator``'s full-to-SWA mapping) are the tree's. A node without one in an
    ``SWARadixCache`` is a tombstone (its SWA KV was freed, its full KV stays). ``lock_ref``: the
    requests whose window holds it (SGLang's ``swa_lock_ref``); ``uuid``: set on the node where a
    lock's window ended (SGLang's ``swa_uuid``), so that the unlock stops there."""

    __slots__ = ("lock_ref", "uuid", "queue_entry")

    def __init__(self, lock_ref: int = 0, uuid: Optional[int] = None) -> None:
        self.lock_ref = lock_ref
        self.uuid = uuid
        self.queue_entry: Optional[tuple] = None

    def split(self, tokens: int) -> "SWAWindow":
        """The first part's record: the same locks (a window that held the node holds both parts),
        and the ``uuid``, since a lock's window ends at the part nearer the root; this one keeps the
        rest."""
        head = SWAWindow(self.lock_ref, self.uuid)
        self.uuid = None
        return head
