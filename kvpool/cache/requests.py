"""How a scheduler's requests enter and leave the prefix cache (SGLang's ``cache_finished_req`` and
``cache_unfinished_req``), and the small request protocol they read.

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

from typing import TYPE_CHECKING, Any

import torch

from kvpool.cache.key import RadixKey
from kvpool.cache.params import InsertParams, MatchPrefixParams
from kvpool.errors import IntegrityError

if TYPE_CHECKING:
    from kvpool.cache.radix_cache import RadixCache


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
    cpl = getattr(req, "cache_protected_len", None)
    return int(cpl) if cpl is not None else len(req.prefix_indices)


def _key_extent(cache: "RadixCache", num_tokens: int) -> tuple[int, int]:
    """(elements the tree can take, tokens of the key that yields them): whole pages, and for EAGLE
    one token more than the bigram elements."""
    extra = 1 if cache.is_eagle else 0
    aligned = max(num_tokens - extra, 0) // cache.page_size * cache.page_size
    return aligned, aligned + extra if aligned else 0


def _check_protected(cpl: int, aligned: int, what: str) -> None:
    if not 0 <= cpl <= aligned:
        raise ValueError(
            f"{what}: req.cache_protected_len must be in 0..{aligned} (the tree's whole pages of its "
            f"committed tokens), got {cpl}"
        )


def _free(cache: "RadixCache", parts: list[torch.Tensor]) -> None:
    parts = [p for p in parts if p.numel()]
    if parts:
        cache.token_to_kv_pool_allocator.free(torch.cat(parts) if len(parts) > 1 else parts[0])


def cache_finished_req(cache: "RadixCache", req: Any, is_insert: bool = True) -> None:
    """A request leaves: with ``is_insert`` its whole pages go into the tree (finished), without it
    (retracted, or ``disable_finished_insert``) back to the allocator; the slots the tree held
    already and the unaligned tail go back to the allocator, in one ``free``; its lock is released.

    Raises
    ------
    ValueError
        If ``req.cache_protected_len`` is past the request's whole committed pages.
    """
    committed = committed_len(req)
    row = req.req_pool_idx
    table = cache.req_to_token_pool.req_to_token
    if cache.disable:
        _free(cache, [table[row, :committed]])
        return
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[:committed]
    kv = table[row, : len(tokens)]
    aligned, raw = _key_extent(cache, len(tokens))
    cpl = protected_len(req)
    _check_protected(cpl, aligned, "cache_finished_req")
    end = aligned
    if is_insert and not cache.disable_finished_insert and aligned:
        key = RadixKey(tokens[:raw], getattr(req, "extra_key", None))
        priority = getattr(req, "priority", 0) or 0
        end = cache.insert(InsertParams(key=key, value=kv[:raw], priority=priority)).prefix_len
    _free(cache, [kv[cpl:end], kv[aligned:]])
    cache.dec_lock_ref(req.last_node)


def cache_unfinished_req(cache: "RadixCache", req: Any, chunked: bool = False) -> None:
    """A running request's whole computed pages (``fill_ids``) go into the tree; the slots of pages
    the tree held already go back to the allocator, and the request continues on the tree's slots:
    its table row, ``prefix_indices``, ``cache_protected_len`` and ``last_node`` (locked) are updated.

    Raises
    ------
    ValueError
        If ``req.cache_protected_len`` is past the request's whole computed pages.
    """
    if cache.disable:
        return
    tokens = list(req.fill_ids)
    row = req.req_pool_idx
    pool = cache.req_to_token_pool
    kv = pool.req_to_token[row, : len(tokens)]
    aligned, raw = _key_extent(cache, len(tokens))
    cpl = protected_len(req)
    _check_protected(cpl, aligned, "cache_unfinished_req")
    key = RadixKey(tokens[:raw], getattr(req, "extra_key", None))
    priority = getattr(req, "priority", 0) or 0
    end = cache.insert(InsertParams(key=key, value=kv[:raw], chunked=chunked, priority=priority)).prefix_len
    _free(cache, [kv[cpl:end]])
    match = cache.match_prefix(MatchPrefixParams(key=key))
    indices, last = match.device_indices, match.last_device_node
    if len(indices) != aligned:
        raise IntegrityError(f"cache_unfinished_req: the tree returned {len(indices)} slots for the {aligned} it was just given")
    pool.write((row, slice(cpl, aligned)), indices[cpl:].to(kv.dtype))
    req.cache_protected_len = aligned
    cache.inc_lock_ref(last)
    cache.dec_lock_ref(req.last_node)
    req.prefix_indices = torch.cat((indices, kv[aligned:].to(indices.dtype))) if aligned < len(kv) else indices
    req.last_node = last
