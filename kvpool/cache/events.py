"""KV-cache events (SGLang's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``) and the
sequence-aware page hashes they carry.

A page's hash is SHA-256 over the previous page's digest (none for a sequence's first page) and the
page's token ids as 4-byte little-endian unsigned integers, SGLang's scheme, so that a router
hashing a request's pages the same way finds them. A key with an ``extra_key`` seeds its first
page with the digest of ``"extra_key:" + str(extra_key)``: pages of different namespaces never share a
hash (SGLang's hashes ignore ``extra_key``). An event's block hash is the digest's first 64 bits as a
signed integer.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from kvpool.cache.key import decode, encoded

if TYPE_CHECKING:
    from kvpool.cache.node import TreeNode

#: Storage tiers an event names (SGLang's ``StorageMedium`` values): the device, pinned host memory,
#: a store on this machine's disks (``HiCacheFile``) and one shared across machines (``MooncakeStore``).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU_PINNED"
MEDIUM_DISK = "DISK"
MEDIUM_EXTERNAL = "EXTERNAL"


@dataclasses.dataclass
class BlockStored:
    """Pages that entered the cache: ``block_hashes`` (one per page), the hash of the page before the
    first one (None at a sequence's start), the pages' token ids and tokens per page."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[Any]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = MEDIUM_GPU


@dataclasses.dataclass
class BlockRemoved:
    """Pages that left the cache (one event per evicted node, every page of it)."""

    block_hashes: list[int]
    medium: Optional[str] = MEDIUM_GPU


@dataclasses.dataclass
class AllBlocksCleared:
    """The cache was reset."""


def hash_str_to_int64(hex_digest: str) -> int:
    """The digest's first 64 bits as a signed integer (the events' block hash)."""
    value = int(hex_digest[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def namespace_seed(extra_key: Any) -> Optional[str]:
    """The digest a key's first page is chained to: None without an ``extra_key``."""
    if extra_key is None:
        return None
    return hashlib.sha256(f"extra_key:{extra_key}".encode()).hexdigest()


def page_hashes(enc: bytes, page_elems: int, elem_bytes: int, prior: Optional[str]) -> list[str]:
    """Hex digests of each page of ``enc`` (the tree's key bytes), chained from ``prior``."""
    tokens = np.frombuffer(enc, dtype="<i8").astype("<u4").tobytes()
    step = page_elems * (elem_bytes // 8) * 4
    out = []
    for start in range(0, len(tokens), step):
        h = hashlib.sha256()
        if prior is not None:
            h.update(bytes.fromhex(prior))
        h.update(tokens[start : start + step])
        prior = h.hexdigest()
        out.append(prior)
    return out


def node_hashes(node: "TreeNode", root: "TreeNode", page_size: int, elem_bytes: int) -> list[str]:
    """``node.hash_value``, computed (and kept on the node) from its parent's last page hash; the
    ancestors that have none yet (host-only nodes hung from storage) get theirs first."""
    chain, n = [], node
    while n is not None and n is not root and n.hash_value is None:
        chain.append(n)
        n = n.parent
    for n in reversed(chain):
        parent = n.parent
        prior = parent.get_last_hash_value() if parent is not None and parent is not root else None
        if prior is None:
            prior = namespace_seed(n.key.extra_key)
        n.hash_value = page_hashes(encoded(n.key), page_size, elem_bytes, prior)
    return node.hash_value


def stored_events(node: "TreeNode", root: "TreeNode", page_size: int, elem_bytes: int, medium: str) -> list[BlockStored]:
    """One ``BlockStored`` per page of a node that entered the cache."""
    hashes = node_hashes(node, root, page_size, elem_bytes)
    parent = node.parent
    last = parent.get_last_hash_value() if parent is not None and parent is not root else None
    prev = hash_str_to_int64(last) if last is not None else None
    tokens = decode(encoded(node.key), node.key.is_bigram)
    events = []
    for i, digest in enumerate(hashes):
        h = hash_str_to_int64(digest)
        page = tokens[i * page_size : (i + 1) * page_size]
        events.append(BlockStored(block_hashes=[h], parent_block_hash=prev, token_ids=page, block_size=len(page), medium=medium))
        prev = h
    return events


def removed_event(node: "TreeNode", root: "TreeNode", page_size: int, elem_bytes: int, medium: str) -> BlockRemoved:
    """The ``BlockRemoved`` of every page of a node that left the cache."""
    hashes = node_hashes(node, root, page_size, elem_bytes)
    return BlockRemoved(block_hashes=[hash_str_to_int64(d) for d in hashes], medium=medium)
