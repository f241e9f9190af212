"""``TreeNode``: one edge of the radix tree, and the records of the tiers it is in (SGLang's names).

A node holds what every tier shares (its tokens, its place in the tree, its access bookkeeping) and
one record per tier (``kvpool.cache.records``): ``device`` on the device, ``records[HOST]`` on the
host, ``records[STATE]`` with a state snapshot. SGLang's attributes (``value``, ``host_value``,
``lock_ref``, ``mamba_value``, ...) read and write those records.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from kvpool.cache.key import RadixKey
from kvpool.cache.records import HOST, STATE, SWA, DeviceSlots, HostCopy


class TreeNode:
    """A run of tokens shared by every sequence below it, and where their KV (and state) lives.

    Attributes
    ----------
    children : dict, child key (see ``kvpool.cache.key``) -> TreeNode.
    parent : TreeNode or None (the root, or a node made outside a tree).
    key : RadixKey, this node's tokens (a whole number of pages in a tree).
    child_key : the key this node is filed under in ``parent.children``.
    device : DeviceSlots or None (not on the device: evicted).
    records : dict, tier name -> that tier's record (``HostCopy``, ``StateSnapshot``).
    hit_count : matches that reached this node (the LFU policy's count).
    hash_value : list of str, one SHA-256 hex digest per page (KV events), or None until computed.
    priority : the highest priority inserted through this node (the priority policy).
    last_access_time, creation_time : ``time.monotonic()`` of the last access and of creation.
    access_tick, creation_tick : the same on the tree's logical clock, which orders operations
        exactly where ``time.monotonic()`` can tie (the eviction policies read these).
    id : a number unique per process (``TreeNode.counter``).

    SGLang's attributes over the records: ``value`` (device slots, Tensor [len(key)] int64, or None),
    ``lock_ref`` (requests holding the node and the nodes below it; a locked node is never evicted),
    ``host_value`` and ``host_ref_counter`` (the host copy and its holders), ``mamba_value``
    (Tensor [1] int64, the state slot after this node's last token) and ``mamba_lock_ref``; in an
    ``SWARadixCache``, ``full_lock_ref`` (= ``lock_ref``), ``swa_lock_ref``, ``swa_uuid`` and
    ``swa_tombstone`` (its SWA KV freed, its full KV kept).

    Examples
    --------
    >>> node = TreeNode()
    >>> node.evicted, node.backuped
    (True, False)
    """

    counter = 0

    __slots__ = (
        "children", "parent", "key", "child_key", "device", "records", "hit_count", "hash_value", "priority",
        "id", "last_access_time", "creation_time", "access_tick", "creation_tick",
    )  # fmt: skip

    def __init__(self, id: Optional[int] = None, priority: int = 0) -> None:
        now = time.monotonic()
        self.children: dict[Any, TreeNode] = {}
        self.parent: Optional[TreeNode] = None
        self.key: Optional[RadixKey] = None
        self.child_key: Any = None
        self.device: Optional[DeviceSlots] = None
        self.records: dict[str, Any] = {}
        self.hit_count = 0
        self.hash_value: Optional[list[str]] = None
        self.priority = priority
        self.id = TreeNode.counter if id is None else id
        TreeNode.counter += 1
        self.last_access_time = now
        self.creation_time = now
        self.access_tick = 0
        self.creation_tick = 0

    # --- SGLang's attributes over the tier records ------------------------------------------------

    @property
    def value(self) -> Optional[torch.Tensor]:
        """The device slots (Tensor [len(key)] int64), or None when not on the device."""
        return None if self.device is None else self.device.value

    @value.setter
    def value(self, value: Optional[torch.Tensor]) -> None:
        if value is None:
            self.device = None
        elif self.device is None:
            self.device = DeviceSlots(value)
        else:
            self.device.value = value

    @property
    def lock_ref(self) -> int:
        """Requests holding this node's device KV (0 when not on the device)."""
        return 0 if self.device is None else self.device.lock_ref

    @property
    def evicted(self) -> bool:
        """No device copy (``value is None``)."""
        return self.device is None

    @property
    def host_value(self) -> Optional[torch.Tensor]:
        """The host slots of the host copy, or None when not backed up."""
        copy = self.records.get(HOST)
        return None if copy is None else copy.slots

    @host_value.setter
    def host_value(self, slots: Optional[torch.Tensor]) -> None:
        if slots is None:
            self.records.pop(HOST, None)
        else:
            self.records[HOST] = HostCopy(slots)

    @property
    def backuped(self) -> bool:
        """A host copy exists (``host_value is not None``)."""
        return HOST in self.records

    @property
    def host_ref_counter(self) -> int:
        """Holders of the host copy (``protect_host`` / ``release_host``); 0 without one."""
        copy = self.records.get(HOST)
        return 0 if copy is None else copy.holds

    def protect_host(self) -> None:
        """Hold the host copy: it is not released while held.

        Raises
        ------
        RuntimeError
            If the node has no host copy.
        """
        copy = self.records.get(HOST)
        if copy is None:
            raise RuntimeError(f"protect_host: node {self.id} has no host copy (host_value is None)")
        copy.holds += 1

    def release_host(self) -> None:
        """Drop one hold of the host copy.

        Raises
        ------
        RuntimeError
            If the host copy is not held (SGLang raises the same).
        """
        copy = self.records.get(HOST)
        if copy is None or copy.holds <= 0:
            raise RuntimeError(f"release_host: node {self.id}'s host copy is not held (host_ref_counter = 0)")
        copy.holds -= 1

    @property
    def mamba_value(self) -> Optional[torch.Tensor]:
        """The state slot (Tensor [1] int64) after this node's last token, or None."""
        snapshot = self.records.get(STATE)
        return None if snapshot is None else snapshot.slot

    @property
    def mamba_lock_ref(self) -> int:
        """Requests holding this node's state snapshot (0 without one)."""
        snapshot = self.records.get(STATE)
        return 0 if snapshot is None else snapshot.lock_ref

    @property
    def full_lock_ref(self) -> int:
        """``lock_ref`` under ``SWARadixCache``'s name: requests holding the node's full KV."""
        return self.lock_ref

    @property
    def swa_lock_ref(self) -> int:
        """Requests whose sliding window holds this node's SWA KV (0 without any)."""
        window = self.records.get(SWA)
        return 0 if window is None else window.lock_ref

    @property
    def swa_uuid(self) -> Optional[int]:
        """The id a lock whose window ended at this node returned (``SWARadixCache.inc_lock_ref``)."""
        window = self.records.get(SWA)
        return None if window is None else window.uuid

    @property
    def swa_tombstone(self) -> bool:
        """In an ``SWARadixCache``: on the device without SWA KV (freed by ``evict``; the full KV
        stays). Only that cache's nodes carry SWA KV, so for another cache's nodes this is True."""
        return self.device is not None and SWA not in self.records

    # --- KV events ------------------------------------------------------------------------------

    def get_last_hash_value(self) -> Optional[str]:
        """The hash of this node's last page, or None when not computed."""
        return self.hash_value[-1] if self.hash_value else None

    def get_prefix_hash_values(self, node: Optional["TreeNode"]) -> list[str]:
        """The page hashes from the root down to ``node`` included (a new list on every call)."""
        chain = []
        while node is not None and node.hash_value is not None:
            chain.append(node.hash_value)
            node = node.parent
        return [h for hashes in reversed(chain) for h in hashes]

    def __lt__(self, other: "TreeNode") -> bool:
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        n = 0 if self.key is None else len(self.key)
        return f"TreeNode(id={self.id}, tokens={n}, lock_ref={self.lock_ref}, evicted={self.evicted})"
