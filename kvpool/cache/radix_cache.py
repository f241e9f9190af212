"""``RadixCache``: the prefix cache over a slot allocator, with SGLang's API (its 0.5 releases).

The tree maps token prefixes to the device slots holding their KV. Every node's key is a whole
number of pages, so a match is too. Keys are compared as bytes (``kvpool.cache.key``): one
``startswith`` per node on the path, plus one search inside the node where a match ends. Eviction
takes leaves from a priority queue (``kvpool.cache.evict_policy``) and gives their slots back to the
allocator in one ``free`` per call. Requests go in and out through ``cache_finished_req`` and
``cache_unfinished_req`` (their plans are ``kvpool.cache.requests``'); ``check_integrity`` checks
tree, allocator and request table together (``kvpool.cache.integrity``).

Ownership: a slot in the tree belongs to the tree; ``insert`` takes the slots of the tokens the tree
did not hold (their count is ``len(key) - prefix_len``, page-aligned) and leaves the rest, and any
unaligned tail, to the caller; ``evict`` gives the tree's slots back to the allocator.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from kvpool.cache import requests
from kvpool.cache.key import RadixKey
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
from kvpool.cache.tree import Undo
from kvpool.cache.tree_cache import InsertJob, TreeCache
from kvpool.errors import IntegrityError

__all__ = ["RadixCache", "RadixKey", "TreeNode"]


class RadixCache(TreeCache):
    """A radix tree of cached token prefixes and the device slots of their KV.

    Parameters
    ----------
    params : CacheInitParams (SGLang 0.5's form). SGLang's earlier forms work too: the fields as
        arguments (``req_to_token_pool``, ``token_to_kv_pool_allocator``, ``page_size``,
        ``disable``, ``enable_kv_cache_events``, ``eviction_policy``, ``is_eagle`` positionally from
        ``params`` on, any field by keyword).
    validate : also check, on every insert, that each page of slots is one aligned page, and on a GPU
        the slots given to every call against the allocator and the tree (a CPU cache always checks
        those): reads them, a synchronisation on a GPU. ``KVPOOL_VALIDATE=1`` turns it on too.

    Raises
    ------
    ValueError
        For a page size that is not a positive int or differs from the allocator's, an unknown
        eviction policy, or an option this cache does not provide (sliding window, TTL, mamba state).
    TypeError
        For arguments that are neither a CacheInitParams nor its fields.

    Examples
    --------
    >>> cache = RadixCache.create_simulated(page_size=2)
    >>> cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=torch.arange(10, 15))).prefix_len
    0
    >>> m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 9])))
    >>> m.device_indices
    tensor([10, 11])
    """

    def __init__(
        self, params: Optional[CacheInitParams] = None, *legacy_args: Any, validate: bool = False, **legacy_fields: Any
    ) -> None:
        super().__init__(resolve_init_params(params, legacy_args, legacy_fields), validate=validate)

    # --- SGLang's API ---------------------------------------------------------------------------

    def match_prefix(self, params: Union[MatchPrefixParams, RadixKey], **kwargs: Any) -> MatchResult:
        """The longest cached prefix of ``params.key``, a whole number of pages.

        A match that ends inside a node splits it there, so that the returned node covers exactly the
        match. Every node on the path counts a hit and becomes the most recently used.

        Parameters
        ----------
        params : MatchPrefixParams (or, as SGLang's earlier releases, the RadixKey itself).

        Returns
        -------
        MatchResult: ``device_indices`` Tensor [M] int64 on the cache's device, M a multiple of
        ``page_size``; ``last_device_node`` (= ``last_host_node``) the node it ends on, the root for no
        match.

        Raises
        ------
        TypeError
            If the key is not a RadixKey of ints. Nothing changes.
        """
        walked = self._match_key(params)
        if walked is None:
            return self._empty_match()
        path, node = walked
        indices = torch.cat([n.device.value for n in path]) if path else self._empty_match().device_indices
        return MatchResult(device_indices=indices, last_device_node=node, last_host_node=node)

    def insert(
        self, params: Union[InsertParams, RadixKey], value: Optional[torch.Tensor] = None, chunked: bool = False,
        priority: int = 0,
    ) -> Union[InsertResult, int]:  # fmt: skip
        """Cache ``params.key``'s whole pages with their slots ``params.value``.

        The tree takes the slots of the pages it did not hold; the caller keeps (and frees) those of
        the ``prefix_len`` tokens it held already and of any unaligned tail.

        Parameters
        ----------
        params : InsertParams (or, as SGLang's earlier releases, the RadixKey, with ``value``,
            ``chunked`` and ``priority`` as arguments).

        Returns
        -------
        InsertResult with ``prefix_len`` (an int when called with a RadixKey): the tokens the tree
        held already, a multiple of ``page_size``; 0 for a disabled cache.

        Raises
        ------
        TypeError
            If the key is not a RadixKey of ints, or the value not a tensor.
        ValueError
            If the value is not a 1-D int32/int64 tensor on the cache's device with one slot per key
            token, is None in a cache with an allocator, the priority is not an int, or
            ``prev_prefix_len`` is not within the key; with a kvpool allocator (always on the CPU,
            under ``validate`` on a GPU) if a slot is not handed out, is listed twice or is the tree's
            already (other than the tree's own slots of the tokens it held); under ``validate`` if a
            page of it is not one aligned page of slots.
            Nothing changes; if the allocator's ``free`` of the duplicates (``prev_prefix_len``)
            raises, nothing changes either.
        """
        legacy = not isinstance(params, InsertParams)
        if legacy:
            params = InsertParams(key=params, value=value, chunked=chunked, priority=priority)
        job = self._prepare_insert(params, peek=False)
        prefix = 0 if job is None else self._run_insert(job)
        return prefix if legacy else InsertResult(prefix_len=prefix)

    def evict(self, params: Union[EvictParams, int]) -> EvictResult:
        """Free at least ``params.num_tokens`` device tokens (whole nodes, so possibly more), taking
        unlocked leaves in the policy's order, and give their slots back in one ``free`` call.

        A locked node and its ancestors are never evicted; fewer tokens are freed when not enough
        are evictable (see ``evictable_size()``).

        Returns
        -------
        EvictResult with ``num_tokens_evicted``.

        Raises
        ------
        ValueError
            If ``num_tokens`` is not a non-negative int, ``swa_num_tokens`` or ``mamba_num`` is not 0
            (this cache holds neither), or the cache is disabled. Nothing changes; if the allocator's
            ``free`` raises, the evicted nodes are put back and the error propagates.
        """
        num = self._evict_amount(params)
        undo = Undo()
        freed = self._evict_leaves(num, undo)
        count = sum(len(v) for v in freed)
        allocator = self.token_to_kv_pool_allocator
        if freed and allocator is not None:
            try:
                allocator.free(torch.cat(freed) if len(freed) > 1 else freed[0])
            except BaseException:
                undo.run()  # the leaves go back: the tree still owns their slots
                raise
        return EvictResult(num_tokens_evicted=count)

    def total_size(self) -> int:
        """Device tokens in the tree."""
        return self.evictable_size_ + self.protected_size_

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """A finished (``is_insert``) or retracted (``is_insert=False``) request's slots go into the
        tree or back to the allocator, and its lock is released; see ``kvpool.cache.requests``.

        Everything is checked first (the request, its ``last_node``, the insertion; that its slots
        are its own, see ``validate``); the allocator's ``free`` comes before the tree
        changes, so a refused or failed call changes nothing.
        """
        plan = requests.plan_finished(self, req, is_insert)
        job = None
        if plan.last_node is not None:
            self._check_locked(self._path(plan.last_node, "cache_finished_req: req.last_node"), "cache_finished_req: req.last_node")
            if plan.insert is not None:
                job = self._prepare_insert(plan.insert, "cache_finished_req")
            if self._checks_slots():
                self._check_request_slots(plan.kv, plan.protected, plan.last_node, "cache_finished_req")
        end = plan.aligned if job is None else job.cached
        kv, protected = plan.kv, plan.protected
        staged = None if job is None else self._stage_insert(job)
        try:
            self._free_slots([kv[protected:end], kv[plan.aligned :]])
        except BaseException:
            self._unstage_insert(staged)
            raise
        if job is not None:
            self._complete_insert(job, staged)
        if plan.last_node is not None:
            self.dec_lock_ref(plan.last_node)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """A running request's computed pages go into the tree and it continues on the tree's slots;
        see ``kvpool.cache.requests``. Checked first, and the allocator's ``free`` comes first, as
        ``cache_finished_req``."""
        plan = requests.plan_unfinished(self, req, chunked)
        if plan is None:
            return
        self._check_locked(self._path(plan.last_node, "cache_unfinished_req: req.last_node"), "cache_unfinished_req: req.last_node")
        job = self._prepare_insert(plan.insert, "cache_unfinished_req")
        if self._checks_slots():
            self._check_request_slots(plan.kv, plan.protected, plan.last_node, "cache_unfinished_req")
        kv, protected, aligned = plan.kv, plan.protected, plan.aligned
        if job is not None:
            staged = self._stage_insert(job)
            try:
                self._free_slots([kv[protected : job.cached]])
            except BaseException:
                self._unstage_insert(staged)
                raise
            self._complete_insert(job, staged)
        match = self.match_prefix(MatchPrefixParams(key=plan.insert.key))
        indices, last = match.device_indices, match.last_device_node
        if len(indices) != aligned:
            raise IntegrityError(f"cache_unfinished_req: the tree returned {len(indices)} slots for the {aligned} it was just given")
        self.req_to_token_pool.write((plan.row, slice(protected, aligned)), indices[protected:].to(kv.dtype))
        req.cache_protected_len = aligned
        self.inc_lock_ref(last)
        self.dec_lock_ref(plan.last_node)
        req.prefix_indices = torch.cat((indices, kv[aligned:].to(indices.dtype))) if aligned < len(kv) else indices
        req.last_node = last

    # --- internals ------------------------------------------------------------------------------

    def _run_insert(self, job: InsertJob) -> int:
        """Carry out a checked insertion; returns its ``prefix_len``. With ``prev_prefix_len`` the
        caller's slots of the tokens from there to ``prefix_len`` are freed first."""
        staged = self._stage_insert(job)
        try:
            if job.prev is not None and job.prev < job.cached:
                self._free_slots([job.value[job.prev : job.cached]])
        except BaseException:
            self._unstage_insert(staged)
            raise
        return self._complete_insert(job, staged)

    def _stage_insert(self, job: InsertJob) -> Any:
        """The part of an insertion that can fail, done before the tree changes (a tier below the
        device backs the pages up here); ``_unstage_insert`` takes it back."""
        return None

    def _unstage_insert(self, staged: Any) -> None:
        """Take back ``_stage_insert`` when a later step raised before the tree changed."""

    def _complete_insert(self, job: InsertJob, staged: Any) -> int:
        """The tree's part of an insertion (it cannot fail once checked); returns ``prefix_len``."""
        cached, _ = self._insert(job.enc, job.n, job.value, job.priority, job.extra)
        return cached // self.elem_bytes

    def _evict_amount(self, params: Union[EvictParams, int]) -> int:
        """``params``' device tokens to evict, checked."""
        return evict_counts(params, type(self).__name__, "it holds full-attention KV only", None, self.disable)[0]
