"""How a hybrid model's requests enter and leave the ``MambaRadixCache`` (SGLang's
``cache_finished_req`` / ``cache_unfinished_req`` of its ``MambaRadixCache``).

The request protocol is ``kvpool.cache.requests``' plus the state a ``HybridReqToTokenPool`` gives
a request: ``mamba_pool_idx`` (its state slot, a 0-D tensor) and, with the extra buffer,
``mamba_ping_pong_track_buffer`` (its track slots), ``mamba_next_track_idx`` and
``mamba_last_track_seqlen`` (the length at which a track slot last snapshotted its state, or None).

The state cached with a request's tokens must be the state after exactly those tokens: its own
state slot after its last token (page size 1), or, with the extra buffer, the track slot written at
``mamba_last_track_seqlen`` (a whole number of pages), and only the tokens up to that length are
cached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from kvpool.cache.key import RadixKey
from kvpool.cache.params import EvictParams, InsertParams, MatchPrefixParams
from kvpool.cache.requests import _check_protected, _free, committed_len, protected_len
from kvpool.errors import IntegrityError

if TYPE_CHECKING:
    from kvpool.cache.mamba_radix_cache import MambaRadixCache


def _state_to_cache(cache: "MambaRadixCache", req: Any, length: int) -> tuple[int, torch.Tensor, Optional[int]]:
    """(tokens whose state is known, the slot holding that state [1], the track slot number it is)."""
    table = cache.req_to_token_pool
    if not cache.enable_mamba_extra_buffer:
        return length, req.mamba_pool_idx.reshape(1), None
    tracked = req.mamba_last_track_seqlen
    if tracked is None:
        return 0, req.mamba_pool_idx.reshape(1), None
    if tracked % cache.page_size or tracked > length:
        raise ValueError(
            f"req.mamba_last_track_seqlen must be a multiple of page_size = {cache.page_size} and at most the "
            f"request's {length} tokens, got {tracked}"
        )
    keep = table.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)
    return tracked, req.mamba_ping_pong_track_buffer[keep].reshape(1), keep


def cache_finished_req(cache: "MambaRadixCache", req: Any, is_insert: bool = True) -> None:
    """A request leaves: its KV up to its known state goes into the tree with that state's slot
    (the tree takes the slot unless it holds a snapshot there already); duplicates and the rest go
    back to the allocator in one ``free``; the request's state slots the tree did not take are freed
    (``free_mamba_cache``); its lock is released. Retracted (``is_insert=False``): all its own KV
    and state go back."""
    committed = committed_len(req)
    table = cache.req_to_token_pool
    kv = table.req_to_token[req.req_pool_idx, :committed]
    if cache.disable:
        _free(cache, [kv])
        table.free_mamba_cache(req)
        return
    cpl = protected_len(req)
    if not is_insert or cache.disable_finished_insert:
        _check_protected(cpl, committed, "cache_finished_req")
        _free(cache, [kv[cpl:]])
        table.free_mamba_cache(req)
        cache.dec_lock_ref(req.last_node)
        return
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[:committed]
    known, state, keep = _state_to_cache(cache, req, len(tokens))
    _check_protected(cpl, committed, "cache_finished_req")
    end, exist = cpl, True
    if known:
        result = cache.insert(
            InsertParams(key=RadixKey(tokens[:known], getattr(req, "extra_key", None)), value=kv[:known],
                         mamba_value=state, priority=getattr(req, "priority", 0) or 0)
        )  # fmt: skip
        end, exist = max(result.prefix_len, cpl), result.mamba_exist
    _free(cache, [kv[cpl:end], kv[max(known, cpl):]])
    if exist:
        table.free_mamba_cache(req)
    elif keep is not None:
        table.free_mamba_cache(req, mamba_ping_pong_track_buffer_to_keep=keep)
    else:
        req.mamba_pool_idx = None  # its state slot is the tree's now
    cache.dec_lock_ref(req.last_node)


def cache_unfinished_req(cache: "MambaRadixCache", req: Any, chunked: bool = False) -> None:
    """A running request's KV up to its known state goes into the tree with a copy of that state
    (``fork_from``: the request keeps its own), and it continues on the tree's slots, as
    ``kvpool.cache.requests.cache_unfinished_req``. Without a known state it only refreshes
    ``prefix_indices``."""
    tokens = list(req.fill_ids)
    table = cache.req_to_token_pool
    kv = table.req_to_token[req.req_pool_idx, : len(tokens)]
    known = 0
    if not cache.disable:
        known, state, _ = _state_to_cache(cache, req, len(tokens))
    if known == 0:
        req.prefix_indices = kv.to(torch.int64, copy=True)
        return
    cpl = protected_len(req)
    _check_protected(cpl, known, "cache_unfinished_req")
    pool = cache.mamba_pool
    forked = pool.fork_from(state)
    if forked is None:
        cache.evict(EvictParams(num_tokens=0, mamba_num=1))
        forked = pool.fork_from(state)
        if forked is None:
            req.prefix_indices = kv.to(torch.int64, copy=True)
            return
    key = RadixKey(tokens[:known], getattr(req, "extra_key", None))
    result = cache.insert(
        InsertParams(key=key, value=kv[:known], mamba_value=forked, chunked=chunked, priority=getattr(req, "priority", 0) or 0)
    )
    _free(cache, [kv[cpl : result.prefix_len]])
    if result.mamba_exist:
        pool.free(forked)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    indices, last = match.device_indices, match.last_device_node
    if len(indices) != known:
        raise IntegrityError(f"cache_unfinished_req: the tree returned {len(indices)} slots for the {known} it was just given")
    table.write((req.req_pool_idx, slice(cpl, known)), indices[cpl:].to(kv.dtype))
    cache.inc_lock_ref(last)
    cache.dec_lock_ref(req.last_node)
    req.prefix_indices = torch.cat((indices, kv[known:].to(indices.dtype)))
    req.cache_protected_len = known
    req.mamba_last_track_seqlen = None
    req.last_node = last
