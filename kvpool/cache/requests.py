"""What a scheduler's request becomes when it enters or leaves the prefix cache (SGLang's
``cache_finished_req`` and ``cache_unfinished_req``), and the small request protocol that is read.

``plan_finished`` and ``plan_unfinished`` read a request and the cache's request table, check them,
and return a plan: the slots, the insertion and the lengths the cache's call then carries out. They
change nothing and never call the cache (it is typed as ``kvpool.cache.protocols.RequestCache``).

A request is any object with these attributes (SGLang's ``Req`` has them all):

``req_pool_idx``
    its row in the cache's ``req_to_token_pool``; ``req_to_token[row, i]`` is token i's slot.
``origin_input_ids``, ``output_ids``
    lists of token ids: the prompt, the tokens generated so far.
``fill_ids``
    (``cache_unfinished_req``) the tokens whose KV is computed: prompt and outputs so far, or the
    prefix a chunked prefill reached.
``last_node``
    the node it holds locked (``inc_lock_ref``): its matched prefix's last node, the root if none.
``cache_protected_len``
    how many of its leading slots belong to the tree (its matched prefix, page-aligned); read as
    ``len(prefix_indices)`` when absent. The slots after it, up to its committed length, are its own.
``prefix_indices``
    written by ``cache_unfinished_req``: its slots from the tree, then its own unaligned tail.
``extra_key``, ``priority``
    optional: the key's namespace (default None) and its eviction priority (default 0).
the committed length
    how many tokens have KV: ``pop_committed_kv_cache()`` if the request has it (SGLang's), else
    ``kv_committed_len``, else ``len(origin_input_ids) + len(output_ids) - 1`` (the last generated token
    has no KV yet, as in SGLang's earlier releases).

``check_integrity`` reads ``kv_allocated_len`` (else the committed length) as the end of the slots a
running request holds. Slots past the committed length (a speculative over-allocation) stay the
caller's; so does the request's row, which the caller frees after ``cache_finished_req``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from kvpool.cache.key import RadixKey
from kvpool.cache.params import InsertParams
from kvpool.cache.protocols import RequestCache


def committed_len(req: Any) -> int:
    """Tokens of ``req`` whose KV is computed (see the module docstring)."""
    pop = getattr(req, "pop_committed_kv_cache", None)
    if callable(pop):
        return int(pop())
    if hasattr(req, "kv_committed_len"):
        return int(req.kv_committed_len)
    return max(len(req.origin_input_ids) + len(req.output_ids) - 1, 0)


def protected_len(req: Any) -> int:
    """Leading slots of ``req`` that belong to the tree."""
    protected = getattr(req, "cache_protected_len", None)
    return int(protected) if protected is not None else len(req.prefix_indices)


def key_extent(cache: RequestCache, num_tokens: int) -> tuple[int, int]:
    """(elements the tree can take, tokens of the key that yields them): whole pages, and for EAGLE
    one token more than the bigram elements."""
    extra = 1 if cache.is_eagle else 0
    aligned = max(num_tokens - extra, 0) // cache.page_size * cache.page_size
    return aligned, aligned + extra if aligned else 0


def check_protected(protected: int, aligned: int, what: str) -> None:
    """``req.cache_protected_len`` must lie within the ``aligned`` tokens the tree can take.

    Raises
    ------
    ValueError
        If it does not.
    """
    if not 0 <= protected <= aligned:
        raise ValueError(
            f"{what}: req.cache_protected_len must be in 0..{aligned} (the tree's whole pages of its "
            f"committed tokens), got {protected}"
        )


@dataclasses.dataclass
class FinishedPlan:
    """What ``cache_finished_req`` does with a request.

    ``kv``: its committed slots (a view of its table row); ``protected``: the leading ones the tree
    owns; ``aligned``: the whole pages the tree can take; ``insert``: what goes into the tree (None:
    nothing); ``last_node``: the node to unlock (None for a disabled cache). The cache frees
    ``kv[protected:prefix_len]`` and ``kv[aligned:]`` after the insertion (all of ``kv[protected:]``
    without one).
    """

    kv: torch.Tensor
    protected: int
    aligned: int
    insert: Optional[InsertParams]
    last_node: Any


@dataclasses.dataclass
class UnfinishedPlan:
    """What ``cache_unfinished_req`` does with a request: ``insert`` its ``aligned`` whole computed
    pages, free ``kv[protected:prefix_len]``, then continue on the tree's slots."""

    row: Any
    kv: torch.Tensor
    protected: int
    aligned: int
    insert: InsertParams
    last_node: Any


def request_key(req: Any, tokens: list) -> RadixKey:
    """The request's ``tokens`` as a key in its namespace (``req.extra_key``)."""
    return RadixKey(tokens, getattr(req, "extra_key", None))


def plan_finished(cache: RequestCache, req: Any, is_insert: bool = True) -> FinishedPlan:
    """A request leaves: with ``is_insert`` its whole pages go into the tree (finished), without it
    (retracted, or ``disable_finished_insert``) back to the allocator; the slots the tree held
    already and the unaligned tail go back to the allocator; its lock is released.

    Raises
    ------
    ValueError
        If ``req.cache_protected_len`` is past the request's whole committed pages.
    """
    committed = committed_len(req)
    table = cache.req_to_token_pool.req_to_token
    if cache.disable:
        return FinishedPlan(table[req.req_pool_idx, :committed], 0, 0, None, None)
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[:committed]
    kv = table[req.req_pool_idx, : len(tokens)]
    aligned, raw = key_extent(cache, len(tokens))
    protected = protected_len(req)
    check_protected(protected, aligned, "cache_finished_req")
    insert = None
    if is_insert and not cache.disable_finished_insert and aligned:
        insert = InsertParams(key=request_key(req, tokens[:raw]), value=kv[:raw], priority=getattr(req, "priority", 0) or 0)
    return FinishedPlan(kv, protected, aligned, insert, req.last_node)


def plan_unfinished(cache: RequestCache, req: Any, chunked: bool = False) -> Optional[UnfinishedPlan]:
    """A running request's whole computed pages (``fill_ids``) go into the tree; the slots of pages
    the tree held already go back to the allocator, and the request continues on the tree's slots:
    its table row, ``prefix_indices``, ``cache_protected_len`` and ``last_node`` (locked) are updated.
    None for a disabled cache (nothing to do).

    Raises
    ------
    ValueError
        If ``req.cache_protected_len`` is past the request's whole computed pages.
    """
    if cache.disable:
        return None
    tokens = list(req.fill_ids)
    row = req.req_pool_idx
    kv = cache.req_to_token_pool.req_to_token[row, : len(tokens)]
    aligned, raw = key_extent(cache, len(tokens))
    protected = protected_len(req)
    check_protected(protected, aligned, "cache_unfinished_req")
    priority = getattr(req, "priority", 0) or 0
    insert = InsertParams(key=request_key(req, tokens[:raw]), value=kv[:raw], chunked=chunked, priority=priority)
    return UnfinishedPlan(row, kv, protected, aligned, insert, req.last_node)
