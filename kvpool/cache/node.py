"""``TreeNode``: one edge of the radix tree, its slots and its bookkeeping (SGLang's names)."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from kvpool.cache.key import RadixKey


class TreeNode:
    """A run of tokens shared by every sequence below it, and the device slots holding their KV.

    Attributes
    ----------
    children : dict, child key (see ``kvpool.cache.key``) -> TreeNode.
    parent : TreeNode or None (the root, or a node made outside a tree).
    key : RadixKey, this node's tokens (a whole number of pages in a tree).
    value : Tensor [len(key)] int64 device slots, or None once evicted.
    host_value : Tensor of host slots, or None when not backed up.
    lock_ref : requests (and their descendants' requests) holding this node; a node with
        ``lock_ref > 0`` is never evicted.
    hit_count : matches that reached this node (the LFU policy's count).
    host_ref_counter : holders of the host copy (``protect_host`` / ``release_host``).
    mamba_value : Tensor [1] int64, the state slot holding the linear layers' state after this
        node's last token (hybrid models), or None.
    mamba_lock_ref : requests holding this node's state (hybrid models).
    hash_value : list of str, one SHA-256 hex digest per page (KV events), or None until computed.
    priority : the highest priority inserted through this node (the priority policy).
    last_access_time, creation_time : ``time.monotonic()`` of the last access and of creation.
    id : a number unique per process (``TreeNode.counter``).

    Examples
    --------
    >>> node = TreeNode()
    >>> node.evicted, node.backuped
    (True, False)
    """

    counter = 0

    __slots__ = (
        "children", "parent", "key", "value", "lock_ref", "last_access_time", "creation_time",
        "hit_count", "host_ref_counter", "host_value", "hash_value", "priority", "id", "mamba_value",
        "mamba_lock_ref",
        "_ck", "_tick", "_born", "_entry", "_host_entry", "_mamba_entry", "_dev_children",
    )  # fmt: skip

    def __init__(self, id: Optional[int] = None, priority: int = 0) -> None:
        now = time.monotonic()
        self.children: dict[Any, TreeNode] = {}
        self.parent: Optional[TreeNode] = None
        self.key: Optional[RadixKey] = None
        self.value: Optional[torch.Tensor] = None
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.host_ref_counter = 0
        self.host_value: Optional[torch.Tensor] = None
        self.mamba_value: Optional[torch.Tensor] = None
        self.mamba_lock_ref = 0
        self.hash_value: Optional[list[str]] = None
        self.priority = priority
        self.id = TreeNode.counter if id is None else id
        TreeNode.counter += 1
        # The tree's own bookkeeping: the key this node is filed under in its parent, the logical
        # times of its last access and of its creation (the eviction order), its live entries in the
        # eviction queues (device, host, state), and how many of its children are on the device (a device leaf has
        # none, whatever host-only children it has).
        self._ck: Any = None
        self._tick = 0
        self._born = 0
        self._entry: Optional[tuple] = None
        self._host_entry: Optional[tuple] = None
        self._mamba_entry: Optional[tuple] = None
        self._dev_children = 0

    @property
    def evicted(self) -> bool:
        """No device copy (``value is None``)."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """A host copy exists (``host_value is not None``)."""
        return self.host_value is not None

    def protect_host(self) -> None:
        """Hold the host copy: it is not released while held."""
        self.host_ref_counter += 1

    def release_host(self) -> None:
        """Drop one hold of the host copy.

        Raises
        ------
        RuntimeError
            If the host copy is not held (SGLang raises the same).
        """
        if self.host_ref_counter <= 0:
            raise RuntimeError(f"release_host: node {self.id}'s host copy is not held (host_ref_counter = 0)")
        self.host_ref_counter -= 1

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
