"""The storage tier's part of a cache's integrity check: the page keys kept on the nodes are the
chain of their prefixes, and the prefetches in flight hold what they say."""

from __future__ import annotations

from typing import Any, Optional

from kvpool.cache.key import encoded
from kvpool.cache.node import TreeNode
from kvpool.cache.records import STORAGE
from kvpool.storage.keys import page_keys


def storage_problems(tier: Any, nodes: list[TreeNode]) -> list[str]:
    """``tier``'s (a ``StorageTier``) part of ``check_integrity`` over the tree's ``nodes`` (the
    root first, parents before children): a node's page keys are the chain of its prefix, one per page, and
    its parent has keys too; every prefetch in flight holds its node's host copy."""
    out = []
    root = tier.cache.root_node
    last_key: dict[int, Optional[str]] = {}
    for node in nodes[1:]:
        record = node.records.get(STORAGE)
        last_key[node.id] = None
        if record is None:
            continue
        prior = None if node.parent is root else last_key.get(node.parent.id)
        if node.parent is not root and prior is None:
            out.append(f"node {node.id} has storage keys but its parent {node.parent.id} has none")
            continue
        want = page_keys(tier.elements(encoded(node.key)), tier.page_size, node.key.extra_key, prior)
        if record.keys != want:
            out.append(f"node {node.id}'s storage keys are not the chain of its prefix ({len(record.keys)} keys, {len(want)} pages)")
        last_key[node.id] = want[-1]
    holds: dict[int, int] = {}
    for op in tier.ongoing_prefetch.values():
        holds[id(op.copy)] = holds.get(id(op.copy), 0) + 1
        if op.copy.holds < holds[id(op.copy)]:
            out.append("a prefetch in flight does not hold the host copy of the node it continues")
    in_flight = sum(len(op.keys) for op in tier.ongoing_prefetch.values())
    if tier.prefetch_pages != in_flight:
        out.append(f"the prefetches in flight count {tier.prefetch_pages} pages but have {in_flight}")
    return out
