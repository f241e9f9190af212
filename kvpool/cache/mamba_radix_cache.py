"""``MambaRadixCache``: the prefix cache for hybrid linear-attention models (SGLang's names).

A hybrid model needs, to continue a cached prefix, both its full-attention layers' KV (per token,
in the tree's nodes) and its linear layers' state after the prefix's last token (one state slot of
the ``MambaPool``). A node may carry such a snapshot (``mamba_value``) of the state at its end. A
match returns KV only up to the deepest node on its path that has a snapshot, so it never returns KV
without the state it needs; with ``cow_mamba`` it copies that snapshot into the request's own state
slot (copy on write: the tree's snapshot stays as it was).

States are evicted apart from KV: ``evict(EvictParams(mamba_num=n))`` drops the least recently used
unlocked snapshots; a node that loses its snapshot but keeps children stays as a tombstone (KV
without state, still a path to deeper snapshots), a leaf goes with its KV. Evicting KV takes leaves
with their snapshots, and with them the tombstones above that become leaves: no leaf is a tombstone.
Locking a node locks the KV of its path and its own snapshot.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from kvpool.cache import mamba_requests
from kvpool.cache.evict_policy import EvictionQueue
from kvpool.cache.node import TreeNode
from kvpool.cache.params import EvictParams, EvictResult, InsertParams, InsertResult, MatchPrefixParams, MatchResult
from kvpool.cache.radix_cache import RadixCache
from kvpool.checks import check_index, non_negative_int, positive_int


class MambaRadixCache(RadixCache):
    """A ``RadixCache`` whose nodes carry linear-attention state snapshots.

    Parameters
    ----------
    params : CacheInitParams (or its fields); ``req_to_token_pool`` a ``HybridReqToTokenPool`` (its
        ``mamba_pool`` holds the snapshots), or None for a simulated cache. Without
        ``enable_mamba_extra_buffer`` (track slots) the page size must be 1: a request's state is
        known only at its last token.
    mamba_cache_chunk_size : the chunk ``mamba_branching_seqlen`` is aligned to (SGLang's
        ``mamba_cache_chunk_size``).
    validate : as for ``RadixCache``.

    Raises
    ------
    ValueError
        As ``RadixCache``, and for a page size above 1 without the extra buffer.
    """

    def __init__(self, *args: Any, mamba_cache_chunk_size: int = 64, validate: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, validate=validate, **kwargs)
        if not self.enable_mamba_extra_buffer and self.page_size != 1:
            raise ValueError(
                f"page_size must be 1 without enable_mamba_extra_buffer (a state is known at a request's last "
                f"token only), got {self.page_size}"
            )
        self.mamba_pool = getattr(self.req_to_token_pool, "mamba_pool", None)
        self.mamba_cache_chunk_size = positive_int(mamba_cache_chunk_size, "mamba_cache_chunk_size")

    # --- SGLang's API ---------------------------------------------------------------------------

    def supports_mamba(self) -> bool:
        """True: the tree keeps linear-attention state snapshots (SGLang callers check it for a hybrid
        cache)."""
        return True

    def reset(self) -> None:
        """Forget every node (its KV and state slots are not freed: clear the pools too)."""
        super().reset()
        self._mamba_queue = EvictionQueue(self.eviction_strategy, self._is_mamba_evictable, "_mamba_entry")
        self.mamba_evictable_size_ = 0
        self.mamba_protected_size_ = 0

    def match_prefix(self, params: Union[MatchPrefixParams, Any], **kwargs: Any) -> MatchResult:
        """The longest cached prefix that ends on a state snapshot, and that node.

        With ``params.cow_mamba`` and ``params.req``, the snapshot is copied into the request's
        state slot (``req.mamba_pool_idx``; a new slot when it has none, evicting a state for room).
        ``mamba_branching_seqlen`` is set when the match went deeper than the last snapshot: the
        matched length aligned down to ``mamba_cache_chunk_size`` (None if that is 0).

        Returns
        -------
        MatchResult: ``device_indices`` Tensor [M] int64 (KV up to the snapshot), ``last_device_node``
        = ``last_host_node`` the node holding it (the root for none). If the state cannot be copied
        (no slot even after eviction) the result is empty: no KV without its state.
        """
        walked = self._match_key(params)
        if walked is None:
            return self._empty_match()
        values, node = walked
        path = []
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        path.reverse()
        best = max((i for i, nd in enumerate(path) if nd.mamba_value is not None), default=-1)
        last = path[best] if best >= 0 else self.root_node
        for nd in path:
            if self._is_mamba_evictable(nd):
                self._mamba_queue.push(nd)  # their priority changed (root side first on ties)
        branching = None
        if len(path) > best + 1:
            aligned = sum(len(v) for v in values) // self.mamba_cache_chunk_size * self.mamba_cache_chunk_size
            branching = aligned if aligned > 0 else None
        if isinstance(params, MatchPrefixParams) and params.cow_mamba and params.req is not None and best >= 0:
            if not self._fork_into(last, params.req):
                return self._empty_match()
        kv = values[: best + 1]
        indices = torch.cat(kv) if kv else self._empty_match().device_indices
        return MatchResult(indices, last, last, mamba_branching_seqlen=branching)

    def insert(self, params: InsertParams, *args: Any, **kwargs: Any) -> InsertResult:  # type: ignore[override]
        """Cache ``params.key``'s KV (``params.value``) with the state after its last token
        (``params.mamba_value``, Tensor [1], a state slot the tree takes unless it has one there).

        Returns
        -------
        InsertResult: ``prefix_len`` as ``RadixCache.insert``; ``mamba_exist`` True when the tree
        kept a snapshot it had (or the key has no whole page): the caller keeps ``mamba_value``.

        Raises
        ------
        TypeError, ValueError
            As ``RadixCache.insert``; and for ``mamba_value`` not a [1] int32/int64 tensor.
        """
        if not isinstance(params, InsertParams):
            raise TypeError(f"params must be an InsertParams (with mamba_value), got {type(params).__name__}")
        key = params.key
        enc = self._key_bytes(key)
        value = self._checked_value(key, enc, params.value)
        state = check_index(params.mamba_value, "mamba_value", dims="[1]", length=1)
        n = len(enc) // self._page_bytes * self._page_bytes
        if self.disable:
            return InsertResult(prefix_len=0, mamba_exist=False)
        if n == 0:
            return InsertResult(prefix_len=0, mamba_exist=True)
        held, last = self._insert(enc, n, value, params.priority or 0, key.extra_key)
        exist = last.mamba_value is not None
        if not exist:
            last.mamba_value = state.to(torch.int64, copy=True)
            if last.mamba_lock_ref:
                self.mamba_protected_size_ += 1
            else:
                self.mamba_evictable_size_ += 1
        path = []
        node = last
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        for node in reversed(path):  # every node on the path was touched: new priorities
            if self._is_mamba_evictable(node):
                self._mamba_queue.push(node)
        return InsertResult(prefix_len=held // self._elem, mamba_exist=exist)

    def evict(self, params: Union[EvictParams, int]) -> EvictResult:
        """Free at least ``params.num_tokens`` KV tokens (leaves with their snapshots, and the
        tombstones they leave as leaves) and, apart from that, at least ``params.mamba_num`` state
        snapshots (least recently used unlocked ones), as far as there are; slots go back in one
        ``free`` per pool. Returns both counts."""
        if isinstance(params, EvictParams):
            if params.swa_num_tokens:
                raise ValueError(f"swa_num_tokens must be 0 for MambaRadixCache, got {params.swa_num_tokens!r}")
            num, states = params.num_tokens, params.mamba_num
        else:
            num, states = params, 0
        num = non_negative_int(num, "num_tokens")
        states = non_negative_int(states, "mamba_num")
        if self.disable:
            raise ValueError(f"evict: this cache was built with disable=True and holds nothing to evict (num_tokens = {num})")
        kv: list[torch.Tensor] = []
        freed_states: list[torch.Tensor] = []
        count = 0
        while count < num:
            node = self._queue.pop()
            if node is None:
                break
            count += self._remove_with_tombstones(node, kv, freed_states)
        dropped = 0
        held = []
        while dropped < states:
            node = self._mamba_queue.pop()
            if node is None:
                break
            if node.children:
                freed_states.append(self._forget_state(node))  # a tombstone now
            elif node.lock_ref:
                held.append(node)  # a locked leaf keeps its state: a leaf cannot be a tombstone
                continue
            else:
                count += self._remove_with_tombstones(node, kv, freed_states)
            dropped += 1
        for node in held:
            self._mamba_queue.push(node)
        if kv and self.token_to_kv_pool_allocator is not None:
            self.token_to_kv_pool_allocator.free(torch.cat(kv))
        if freed_states and self.mamba_pool is not None:
            self.mamba_pool.free(torch.cat(freed_states))
        return EvictResult(num_tokens_evicted=count, mamba_num_evicted=len(freed_states))

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the KV of ``node``'s path (as ``RadixCache``) and ``node``'s own snapshot."""
        delta = super().inc_lock_ref(node)
        if not self.disable and node.mamba_value is not None:
            if node.mamba_lock_ref == 0:
                self.mamba_evictable_size_ -= 1
                self.mamba_protected_size_ += 1
            node.mamba_lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode, swa_uuid_for_lock: Optional[str] = None) -> int:
        """Undo one ``inc_lock_ref(node)``."""
        delta = super().dec_lock_ref(node)
        if not self.disable and node.mamba_value is not None and node.mamba_lock_ref > 0:
            node.mamba_lock_ref -= 1
            if node.mamba_lock_ref == 0:
                self.mamba_evictable_size_ += 1
                self.mamba_protected_size_ -= 1
                if self._is_mamba_evictable(node):
                    self._mamba_queue.push(node)
        return delta

    def total_size(self) -> tuple[int, int]:  # type: ignore[override]
        """(KV tokens, state snapshots) in the tree."""
        return super().total_size(), self.mamba_evictable_size_ + self.mamba_protected_size_

    def full_evictable_size(self) -> int:
        """KV tokens in unlocked nodes, ``evictable_size()`` under SGLang's name for a hybrid cache."""
        return self.evictable_size_

    def full_protected_size(self) -> int:
        """KV tokens in locked nodes, ``protected_size()`` under SGLang's name for a hybrid cache."""
        return self.protected_size_

    def mamba_evictable_size(self) -> int:
        """State snapshots in the tree that no lock holds: what ``evict(EvictParams(mamba_num=n))`` may
        drop."""
        return self.mamba_evictable_size_

    def mamba_protected_size(self) -> int:
        """State snapshots held by a lock (``inc_lock_ref`` on their node)."""
        return self.mamba_protected_size_

    def all_mamba_values_flatten(self) -> torch.Tensor:
        """Every state slot the tree holds, Tensor [snapshots] int64."""
        parts = [n.mamba_value for n in self._nodes() if n.mamba_value is not None]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """As ``RadixCache.cache_finished_req``, with the request's state: see ``kvpool.cache.mamba_requests``."""
        mamba_requests.cache_finished_req(self, req, is_insert)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """As ``RadixCache.cache_unfinished_req``, with a copy of the request's state: see
        ``kvpool.cache.mamba_requests``."""
        mamba_requests.cache_unfinished_req(self, req, chunked)

    # --- internals ------------------------------------------------------------------------------

    def _is_mamba_evictable(self, node: TreeNode) -> bool:
        return node.mamba_value is not None and node.mamba_lock_ref == 0 and node.parent is not None and node.value is not None

    def _forget_state(self, node: TreeNode) -> torch.Tensor:
        """Take ``node``'s (unlocked) snapshot out of the tree; returns its slot."""
        slot = node.mamba_value
        node.mamba_value = None
        self.mamba_evictable_size_ -= 1
        return slot

    def _remove_with_tombstones(self, node: TreeNode, kv: list, states: list) -> int:
        """Evict leaf ``node`` (KV and snapshot) and the tombstones above it that become leaves;
        their slots go into ``kv``/``states``. Returns the KV tokens freed."""
        freed = len(node.value)
        kv.append(node.value)
        if node.mamba_value is not None:
            states.append(self._forget_state(node))
        self._remove_leaf(node)
        parent = node.parent
        while (
            parent is not self.root_node and parent.mamba_value is None and not parent.children and parent.lock_ref == 0
        ):  # fmt: skip
            freed += len(parent.value)
            kv.append(parent.value)
            self._remove_leaf(parent)
            parent = parent.parent
        return freed

    def _fork_into(self, node: TreeNode, req: Any) -> bool:
        """Copy ``node``'s snapshot into ``req``'s state slot (a new one if it has none)."""
        pool = self.mamba_pool
        if pool is None:
            return True
        src = node.mamba_value.to(pool.device)
        if getattr(req, "mamba_pool_idx", None) is None:
            dst = pool.alloc(1)
            if dst is None:
                self.inc_lock_ref(node)  # the snapshot we copy must not be the one evicted for room
                self.evict(EvictParams(num_tokens=0, mamba_num=1))
                dst = pool.alloc(1)
                self.dec_lock_ref(node)
            if dst is None:
                return False
            pool.copy_from(src, dst)
            req.mamba_pool_idx = dst[0]
        else:
            pool.copy_from(src, req.mamba_pool_idx.reshape(1).to(pool.device))
        return True

    def _integrity_problems(self) -> list[str]:
        problems = []
        slots = []
        evictable = protected = 0
        for node in self._nodes():
            if node is self.root_node:
                continue
            if node.mamba_value is None:
                if not node.children:
                    problems.append(f"node {node.id} is a leaf without a state snapshot (a tombstone leaf)")
                if node.mamba_lock_ref:
                    problems.append(f"node {node.id} has its snapshot locked {node.mamba_lock_ref} times but none")
                continue
            slots += node.mamba_value.tolist()
            if node.mamba_lock_ref > node.lock_ref:
                problems.append(f"node {node.id} has mamba_lock_ref {node.mamba_lock_ref} above lock_ref {node.lock_ref}")
            if node.mamba_lock_ref:
                protected += 1
            else:
                evictable += 1
                if not self._mamba_queue.holds(node):
                    problems.append(f"node {node.id}'s snapshot is evictable but missing from the state queue")
        if len(set(slots)) != len(slots):
            problems.append(f"{len(slots) - len(set(slots))} state slots held by two nodes")
        if (evictable, protected) != (self.mamba_evictable_size_, self.mamba_protected_size_):
            problems.append(
                f"state evictable/protected counts are recorded as {self.mamba_evictable_size_}/"
                f"{self.mamba_protected_size_} but the nodes hold {evictable}/{protected}"
            )
        return problems

    def _table_check_args(self) -> dict:
        if self.mamba_pool is None:
            return {}
        return {"external_slots": self.all_mamba_values_flatten().tolist()}
