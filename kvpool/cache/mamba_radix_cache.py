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
from kvpool.cache.params import (
    CacheInitParams,
    EvictParams,
    EvictResult,
    evict_counts,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    resolve_init_params,
)
from kvpool.cache.records import STATE, StateSnapshot
from kvpool.cache.tree import Undo
from kvpool.cache.tree_cache import TreeCache
from kvpool.checks import check_index, positive_int
from kvpool.errors import IntegrityError


class MambaRadixCache(TreeCache):
    """A prefix cache whose nodes carry linear-attention state snapshots (their ``StateSnapshot``
    records) beside their KV.

    Parameters
    ----------
    params : CacheInitParams (or its fields by keyword); ``req_to_token_pool`` a ``HybridReqToTokenPool`` (its
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

    def __init__(
        self, params: Optional[CacheInitParams] = None, *, mamba_cache_chunk_size: int = 64, validate: bool = False,
        **legacy_fields: Any,
    ) -> None:  # fmt: skip
        super().__init__(resolve_init_params(params, (), legacy_fields), validate=validate)
        if not self.enable_mamba_extra_buffer and self.page_size != 1:
            raise ValueError(
                f"page_size must be 1 without enable_mamba_extra_buffer (a state is known at a request's last "
                f"token only), got {self.page_size}"
            )
        self.mamba_pool = getattr(self.req_to_token_pool, "mamba_pool", None)
        self.mamba_cache_chunk_size = positive_int(mamba_cache_chunk_size, "mamba_cache_chunk_size")
        self._reset_states()

    # --- SGLang's API ---------------------------------------------------------------------------

    def supports_mamba(self) -> bool:
        """True: the tree keeps linear-attention state snapshots (SGLang callers check it for a hybrid
        cache)."""
        return True

    def reset(self) -> None:
        """Forget every node (its KV and state slots are not freed: clear the pools too)."""
        super().reset()
        self._reset_states()

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

        Raises
        ------
        TypeError, ValueError
            For a bad key, or (``cow_mamba``) a ``req.mamba_pool_idx`` that is not None, an int or a
            one-entry integer tensor, or names a slot the state pool has not handed out. Nothing
            changes.
        """
        cow = isinstance(params, MatchPrefixParams) and params.cow_mamba and params.req is not None
        dst = mamba_requests.request_state_slot(self.mamba_pool, params.req) if cow else None
        walked = self._match_key(params)
        if walked is None:
            return self._empty_match()
        path, _ = walked
        best = max((i for i, nd in enumerate(path) if STATE in nd.records), default=-1)
        last = path[best] if best >= 0 else self.root_node
        for nd in path:
            if self._is_mamba_evictable(nd):
                self._mamba_queue.push(nd)  # their priority changed (root side first on ties)
        branching = None
        if len(path) > best + 1:
            matched = sum(len(nd.device.value) for nd in path)
            aligned = matched // self.mamba_cache_chunk_size * self.mamba_cache_chunk_size
            branching = aligned if aligned > 0 else None
        if cow and best >= 0 and not self._fork_into(last, params.req, dst):
            return self._empty_match()
        kv = [nd.device.value for nd in path[: best + 1]]
        indices = torch.cat(kv) if kv else self._empty_match().device_indices
        return MatchResult(indices, last, last, mamba_branching_seqlen=branching)

    def insert(self, params: InsertParams, *legacy_args: Any) -> InsertResult:
        """Cache ``params.key``'s KV (``params.value``) with the state after its last token
        (``params.mamba_value``, Tensor [1], a state slot the tree takes unless it has one there).

        Returns
        -------
        InsertResult: ``prefix_len`` as ``RadixCache.insert``; ``mamba_exist`` True when the tree
        kept a snapshot it had (or the key has no whole page): the caller keeps ``mamba_value``.

        Raises
        ------
        TypeError, ValueError
            As ``RadixCache.insert``; for SGLang's earlier ``insert(key, value)`` form (a hybrid
            insert needs ``mamba_value``); for ``mamba_value`` not a [1] int32/int64 tensor on the
            state pool's device or the CPU, or (slots checked as ``RadixCache``'s ``validate`` says) a
            state slot the pool has not handed out or the tree holds already. Nothing changes.
        """
        if not isinstance(params, InsertParams) or legacy_args:
            raise TypeError(f"params must be an InsertParams (with mamba_value), got {type(params).__name__}")
        job = self._prepare_insert(params)
        state = self._checked_state(params.mamba_value, "mamba_value", job)
        if self.disable:
            return InsertResult(prefix_len=0, mamba_exist=False)
        if job is None:
            return InsertResult(prefix_len=0, mamba_exist=True)
        return self._run_state_insert(job, state)

    def evict(self, params: Union[EvictParams, int]) -> EvictResult:
        """Free at least ``params.num_tokens`` KV tokens (leaves with their snapshots, and the
        tombstones they leave as leaves) and, apart from that, at least ``params.mamba_num`` state
        snapshots (least recently used unlocked ones), as far as there are; slots go back in one
        ``free`` per pool. Returns both counts.

        Raises
        ------
        ValueError
            For a bad count, ``swa_num_tokens``, or a disabled cache: nothing changes. If the
            allocator's ``free`` raises, the nodes and snapshots are put back and the error
            propagates; if the state pool's ``free`` raises after it, the KV part stands.
        """
        num, states = evict_counts(params, "MambaRadixCache", "it holds no sliding-window KV", "mamba_num", self.disable)
        kv: list[torch.Tensor] = []
        freed_states: list[torch.Tensor] = []
        undo = Undo()
        count = 0
        while count < num:
            node = self._pop_evictable()
            if node is None:
                break
            count += self._remove_with_tombstones(node, kv, freed_states, undo)
        dropped = 0
        locked_leaves = []
        while dropped < states:
            node = self._mamba_queue.pop()
            if node is None:
                break
            if not self._is_mamba_evictable(node):
                continue
            if node.children:
                freed_states.append(self._forget_state(node, undo))  # a tombstone now
            elif node.device.lock_ref:
                locked_leaves.append(node)  # a locked leaf keeps its state: a leaf cannot be a tombstone
                continue
            else:
                count += self._remove_with_tombstones(node, kv, freed_states, undo)
            dropped += 1
        for node in locked_leaves:
            self._mamba_queue.push(node)
        try:
            if kv and self.token_to_kv_pool_allocator is not None:
                self.token_to_kv_pool_allocator.free(torch.cat(kv))
        except BaseException:
            undo.run()  # the nodes and snapshots go back: the tree still owns their slots
            raise
        if freed_states and self.mamba_pool is not None:
            self.mamba_pool.free(torch.cat(freed_states))
        return EvictResult(num_tokens_evicted=count, mamba_num_evicted=len(freed_states))

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the KV of ``node``'s path (as ``RadixCache``) and ``node``'s own snapshot."""
        delta = super().inc_lock_ref(node)
        snapshot = node.records.get(STATE)
        if not self.disable and snapshot is not None:
            if snapshot.lock_ref == 0:
                self.mamba_evictable_size_ -= 1
                self.mamba_protected_size_ += 1
            snapshot.lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode, swa_uuid_for_lock: Optional[str] = None) -> int:
        """Undo one ``inc_lock_ref(node)``."""
        delta = super().dec_lock_ref(node)
        snapshot = node.records.get(STATE)
        if not self.disable and snapshot is not None and snapshot.lock_ref > 0:
            snapshot.lock_ref -= 1
            if snapshot.lock_ref == 0:
                self.mamba_evictable_size_ += 1
                self.mamba_protected_size_ -= 1
                if self._is_mamba_evictable(node):
                    self._mamba_queue.push(node)
        return delta

    def total_size(self) -> tuple[int, int]:
        """(KV tokens, state snapshots) in the tree (SGLang's pair)."""
        return self.evictable_size_ + self.protected_size_, self.mamba_evictable_size_ + self.mamba_protected_size_

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
        parts = [n.records[STATE].slot for n in self._nodes() if STATE in n.records]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """As ``RadixCache.cache_finished_req``, with the request's state: see
        ``kvpool.cache.mamba_requests``. Everything is checked first; the frees (allocator, then
        the request table's ``free_mamba_cache``) come before the tree changes."""
        plan = mamba_requests.plan_finished(self, req, is_insert)
        table = self.req_to_token_pool
        kv, protected = plan.kv, plan.protected
        job = state = None
        if plan.last_node is not None:
            self._check_locked(self._path(plan.last_node, "cache_finished_req: req.last_node"), "cache_finished_req: req.last_node")
            if plan.insert is not None:
                job = self._prepare_insert(plan.insert, "cache_finished_req")
                state = self._checked_state(plan.insert.mamba_value, "the request's state slot", job)
            if self._checks_slots():
                self._check_request_slots(kv, protected, plan.last_node, "cache_finished_req")
        end, exist = protected, True
        if job is not None:
            end, exist = max(job.cached, protected), STATE in getattr(job.end, "records", {})
        self._free_slots([kv[protected:end], kv[max(plan.known, protected) :]])
        if exist:
            table.free_mamba_cache(req)
        elif plan.keep is not None:
            table.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=plan.keep)
        if job is not None:
            self._run_state_insert(job, state)
            if not exist and plan.keep is None:
                req.mamba_pool_idx = None  # its state slot is the tree's now
        if plan.last_node is not None:
            self.dec_lock_ref(plan.last_node)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """As ``RadixCache.cache_unfinished_req``, with a copy of the request's state (``fork_from``:
        the request keeps its own): see ``kvpool.cache.mamba_requests``. Checked first; the fork
        (when the tree has no snapshot there yet) comes first of the changes and is freed again if
        the allocator's ``free`` raises."""
        plan = mamba_requests.plan_unfinished(self, req, chunked)
        kv = plan.kv
        if plan.insert is None:
            req.prefix_indices = kv.to(torch.int64, copy=True)
            return
        self._check_locked(self._path(plan.last_node, "cache_unfinished_req: req.last_node"), "cache_unfinished_req: req.last_node")
        job = self._prepare_insert(plan.insert, "cache_unfinished_req")
        self._checked_state(plan.state, "the request's state slot", None)
        if self._checks_slots():
            self._check_request_slots(kv, plan.protected, plan.last_node, "cache_unfinished_req")
        protected, known = plan.protected, plan.known
        pool = self.mamba_pool
        forked = None
        if STATE not in getattr(job.end, "records", {}):  # the tree takes a copy of the state
            forked = pool.fork_from(plan.state)
            if forked is None:
                self.evict(EvictParams(num_tokens=0, mamba_num=1))
                job = self._prepare_insert(plan.insert, "cache_unfinished_req")  # the eviction may have changed the path
                forked = pool.fork_from(plan.state)
                if forked is None:
                    req.prefix_indices = kv.to(torch.int64, copy=True)
                    return
        try:
            self._free_slots([kv[protected : job.cached]])
        except BaseException:
            if forked is not None:
                pool.free(forked)
            raise
        self._run_state_insert(job, forked)
        match = self.match_prefix(MatchPrefixParams(key=plan.insert.key))
        indices, last = match.device_indices, match.last_device_node
        if len(indices) != known:
            raise IntegrityError(f"cache_unfinished_req: the tree returned {len(indices)} slots for the {known} it was just given")
        self.req_to_token_pool.write((plan.row, slice(protected, known)), indices[protected:].to(kv.dtype))
        self.inc_lock_ref(last)
        self.dec_lock_ref(plan.last_node)
        req.prefix_indices = torch.cat((indices, kv[known:].to(indices.dtype)))
        req.cache_protected_len = known
        req.mamba_last_track_seqlen = None
        req.last_node = last

    # --- internals ------------------------------------------------------------------------------

    def _checked_state(self, state: Any, name: str, job: Any) -> torch.Tensor:
        """A state slot given to the tree, checked: [1] int32/int64 on the state pool's device or the
        CPU; handed out by the pool and not the tree's already (see ``_checks_slots``)."""
        devices = (torch.device("cpu"),) if self.mamba_pool is None else (torch.device(self.mamba_pool.device), torch.device("cpu"))
        state = check_index(state, name, dims="[1]", length=1, device=devices, where=" or ".join(map(str, devices)))
        if self._checks_slots() and self.mamba_pool is not None:
            slot = int(state[0])
            if not self.mamba_pool.is_held(slot):
                raise ValueError(f"{name} must be a state slot the pool has handed out, got {slot}, which is free or out of range")
            if slot in self.all_mamba_values_flatten().tolist():
                raise ValueError(f"{name} must be a state slot the tree does not hold, got {slot}, a snapshot in the tree")
        return state

    def _run_state_insert(self, job: Any, state: Optional[torch.Tensor]) -> InsertResult:
        """Carry out a checked insertion with its state slot (as ``RadixCache._run_insert``)."""
        if job.prev is not None and job.prev < job.cached:
            self._free_slots([job.value[job.prev : job.cached]])
        cached, last = self._insert(job.enc, job.n, job.value, job.priority, job.extra)
        exist = STATE in last.records
        if not exist:
            last.records[STATE] = StateSnapshot(state.to(torch.int64, copy=True))
            self.mamba_evictable_size_ += 1
        path = []
        node = last
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        for node in reversed(path):  # every node on the path was touched: new priorities
            if self._is_mamba_evictable(node):
                self._mamba_queue.push(node)
        return InsertResult(prefix_len=cached // self.elem_bytes, mamba_exist=exist)

    def _reset_states(self) -> None:
        self._mamba_queue = EvictionQueue(self.eviction_strategy, STATE)
        self.mamba_evictable_size_ = 0
        self.mamba_protected_size_ = 0

    def _touched(self, node: TreeNode) -> None:
        super()._touched(node)
        if self._is_mamba_evictable(node):
            self._mamba_queue.push(node)

    def _is_mamba_evictable(self, node: TreeNode) -> bool:
        snapshot = node.records.get(STATE)
        return snapshot is not None and snapshot.lock_ref == 0 and node.parent is not None and node.device is not None

    def _forget_state(self, node: TreeNode, undo: Optional[Undo] = None) -> torch.Tensor:
        """Take ``node``'s (unlocked) snapshot out of the tree; returns its slot."""
        self.mamba_evictable_size_ -= 1
        snapshot = node.records.pop(STATE)
        if undo is not None:
            undo.add(lambda: self._restore_state(node, snapshot))
        return snapshot.slot

    def _restore_state(self, node: TreeNode, snapshot: StateSnapshot) -> None:
        node.records[STATE] = snapshot
        self.mamba_evictable_size_ += 1
        if self._is_mamba_evictable(node):
            self._mamba_queue.push(node)

    def _remove_with_tombstones(self, node: TreeNode, kv: list, states: list, undo: Undo) -> int:
        """Evict leaf ``node`` (KV and snapshot) and the tombstones above it that become leaves;
        their slots go into ``kv``/``states``. Returns the KV tokens freed."""
        freed = len(node.device.value)
        kv.append(node.device.value)
        if STATE in node.records:
            states.append(self._forget_state(node, undo))
        self._remove_leaf(node, undo)
        parent = node.parent
        while (
            parent is not self.root_node and STATE not in parent.records and not parent.children and parent.lock_ref == 0
        ):  # fmt: skip
            freed += len(parent.device.value)
            kv.append(parent.device.value)
            self._remove_leaf(parent, undo)
            parent = parent.parent
        return freed

    def _fork_into(self, node: TreeNode, req: Any, dst: Optional[torch.Tensor]) -> bool:
        """Copy ``node``'s snapshot into ``req``'s state slot ``dst`` (a new one if it has none)."""
        pool = self.mamba_pool
        if pool is None:
            return True
        src = node.records[STATE].slot.to(pool.device)
        if dst is None:
            dst = pool.alloc(1)
            if dst is None:
                self.inc_lock_ref(node)  # the snapshot we copy must not be the one evicted for room
                try:
                    self.evict(EvictParams(num_tokens=0, mamba_num=1))
                finally:
                    self.dec_lock_ref(node)
                dst = pool.alloc(1)
            if dst is None:
                return False
            try:
                pool.copy_from(src, dst)
            except BaseException:
                pool.free(dst)
                raise
            req.mamba_pool_idx = dst[0]
        else:
            pool.copy_from(src, dst)
        return True

    def _tier_problems(self) -> list[str]:
        problems = []
        slots = []
        evictable = protected = 0
        for node in self._nodes():
            if node is self.root_node:
                continue
            snapshot = node.records.get(STATE)
            if snapshot is None:
                if not node.children:
                    problems.append(f"node {node.id} is a leaf without a state snapshot (a tombstone leaf)")
                continue
            slots += snapshot.slot.tolist()
            if snapshot.lock_ref > node.lock_ref:
                problems.append(f"node {node.id} has mamba_lock_ref {snapshot.lock_ref} above lock_ref {node.lock_ref}")
            if snapshot.lock_ref:
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
