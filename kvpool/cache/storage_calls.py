"""SGLang's storage-tier calls of the caches with a host tier (``HiRadixCache``,
``HiMambaRadixCache``): start a prefetch, poll it, stop it, end it for an aborted request, the tokens
it loaded, ``close``, and the tree walks the storage tier uses (how far the tree holds a prefetch's
tokens, and the hook it hangs fetched pages with). Each call hands on to the cache's
``storage_tier`` (``kvpool.cache.storage_tier``), and does nothing without one. Mixed into both
caches, whose tree and host queue it uses.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvpool.cache.key import RadixKey
from kvpool.cache.node import TreeNode
from kvpool.cache.records import HOST, HostCopy
from kvpool.checks import non_negative_seconds


class StorageCalls:
    """The storage tier's calls of a cache with a host tier (see the module); the cache sets
    ``storage_tier`` (None without storage)."""

    def prefetch_from_storage(
        self, req_id: Any, last_host_node: TreeNode, new_input_tokens: Any, last_hash: Optional[str] = None,
        prefix_keys: Any = None, *, extra_key: Any = None,
    ) -> None:  # fmt: skip
        """Start fetching from storage the whole pages of ``new_input_tokens`` (a token list or
        tensor, or a ``RadixKey``), the tokens that follow ``last_host_node``'s prefix (a match's
        ``last_host_node``, or the root with ``extra_key`` or a ``RadixKey``'s); ``last_hash`` and
        ``prefix_keys`` are SGLang's and not needed. The pages the tree holds already below
        ``last_host_node`` (on the device or the host) are not read. In an EAGLE cache the tokens
        may be plain (turned into bigrams as a key is) or ``(int, int)`` bigrams. Nothing starts
        below ``prefetch_threshold`` tokens to read, while storage backs off, or without storage.
        Raises ``TypeError``/``ValueError`` for a node not of this tree, bad tokens, or a ``req_id``
        with a prefetch in flight, and ``RuntimeError`` once the storage tier is closed."""
        if self.storage_tier is not None:
            self.storage_tier.prefetch(req_id, last_host_node, new_input_tokens, extra_key)

    def check_prefetch_progress(self, req_id: Any) -> bool:
        """Whether ``req_id`` may be scheduled now under the prefetch policy (True when it has no
        prefetch); when True, the pages fetched so far are host-only nodes of the tree."""
        return True if self.storage_tier is None else self.storage_tier.progress(req_id)

    def terminate_prefetch(self, req_id: Any) -> None:
        """Stop reading further pages for ``req_id``; ``check_prefetch_progress`` still ends it."""
        if self.storage_tier is not None:
            self.storage_tier.terminate(req_id)

    def release_aborted_request(self, req_id: Any) -> None:
        """End ``req_id``'s prefetch for a request aborted before it was scheduled (SGLang's scheduler
        calls it instead of ``check_prefetch_progress``): the pages fetched are dropped, further reads
        stop and the hold on ``last_host_node``'s host copy is released. Nothing for a request
        without a prefetch."""
        if self.storage_tier is not None:
            self.storage_tier.abort(req_id)

    def pop_prefetch_loaded_tokens(self, req_id: Any) -> int:
        """Tokens ``req_id``'s prefetch brought into the host tier (0 for none), once."""
        return 0 if self.storage_tier is None else self.storage_tier.loaded_tokens.pop(req_id, 0)

    def close(self, timeout_s: float = 30.0) -> None:
        """End the storage tier (idempotent; nothing without one): the host copies whose backup is
        complete are written, prefetches in flight are dropped (their holds released), the worker
        threads finish what was queued and are joined, the pages announced in storage are withdrawn
        (``BlockRemoved`` of the storage medium), and a backend the cache made from its server
        arguments is closed. The device and host tiers work on; afterwards ``prefetch_from_storage``
        raises ``RuntimeError``, host copies are no longer written to storage and ``enable_storage``
        is False.

        Raises
        ------
        ValueError
            ``timeout_s`` is not a number of seconds >= 0 (nothing is closed).
        TimeoutError
            A worker still runs a storage call after ``timeout_s`` seconds (the tier is closed all the
            same; call again to wait for it).
        """
        non_negative_seconds(timeout_s, "timeout_s")  # before anything closes
        self.enable_storage = False
        if self.storage_tier is not None:
            self.storage_tier.close(timeout_s)

    def held_below(self, node: TreeNode, enc: bytes, pos: int, extra: Any) -> tuple[TreeNode, int, int]:
        """How far the tree holds ``enc`` (the tree's key bytes) below ``node``, whose prefix ends at
        ``pos``, on any tier: the deepest node whose whole key it holds, where that node ends, and
        where the held part ends (whole pages, inside a child of that node when it goes on past
        it). Reads the tree only."""
        node, end, _, shared = self.deepest_held(node, pos, enc, len(enc), extra)
        return node, end, end + shared

    def hang_host_leaf(self, node: TreeNode, enc: bytes, pos: int, end: int, extra: Any, host_slots: torch.Tensor) -> TreeNode:
        """Hang ``enc[pos:end]`` below ``node`` (where ``branch_point`` left the walk) as a host-only
        leaf holding ``host_slots`` (the storage tier's fetched pages); returns the leaf."""
        leaf = TreeNode()
        leaf.parent, leaf.child_key = node, self._child_key(enc, pos, extra)
        leaf.key = RadixKey.from_encoded(enc[pos:end], extra, self.is_eagle)
        leaf.records[HOST] = HostCopy(host_slots.to(torch.int64, copy=True))
        self._clock += 1
        leaf.access_tick = leaf.creation_tick = self._clock
        node.children[leaf.child_key] = leaf
        self._host_queue.push(leaf)
        return leaf
