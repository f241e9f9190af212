"""What a hybrid model's request becomes when it enters or leaves the ``MambaRadixCache`` (SGLang's
``cache_finished_req`` / ``cache_unfinished_req`` of its ``MambaRadixCache``): plans, as
``kvpool.cache.requests``, which change nothing and never call the cache.

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

import dataclasses
from typing import Any, Optional

import torch

from kvpool.cache.params import InsertParams
from kvpool.cache.protocols import RequestCache
from kvpool.cache.requests import check_protected, committed_len, key_extent, protected_len, request_key


def known_state(cache: RequestCache, req: Any, length: int) -> tuple[int, torch.Tensor, Optional[int]]:
    """(tokens whose state is known, the slot holding that state [1], the track slot number it is)."""
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
    keep = cache.req_to_token_pool.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)
    return tracked, req.mamba_ping_pong_track_buffer[keep].reshape(1), keep


@dataclasses.dataclass
class HybridFinishedPlan:
    """What ``MambaRadixCache.cache_finished_req`` does with a request.

    ``kv``: its committed slots; ``protected``: the leading ones the tree owns; ``known``: the tokens
    whose state is known (what may go into the tree); ``insert``: the insertion with that state's slot
    (None: nothing goes in, all of the request's own KV and state go back); ``keep``: the track slot
    holding the state (None: its own state slot); ``last_node``: the node to unlock (None for a
    disabled cache).
    """

    kv: torch.Tensor
    protected: int
    known: int
    insert: Optional[InsertParams]
    keep: Optional[int]
    last_node: Any


@dataclasses.dataclass
class HybridUnfinishedPlan:
    """What ``MambaRadixCache.cache_unfinished_req`` does with a request: fork ``state`` into a new
    slot, insert the ``known`` tokens with it (``insert``, its ``mamba_value`` set at the fork),
    free ``kv[protected:prefix_len]`` and continue on the tree's slots. ``state`` None: nothing is
    known, only ``prefix_indices`` is refreshed."""

    row: Any
    kv: torch.Tensor
    protected: int
    known: int
    state: Optional[torch.Tensor]
    insert: Optional[InsertParams]
    last_node: Any


def plan_finished(cache: RequestCache, req: Any, is_insert: bool = True) -> HybridFinishedPlan:
    """A request leaves: its KV up to its known state goes into the tree with that state's slot
    (the tree takes the slot unless it holds a snapshot there already); duplicates and the rest go
    back to the allocator; the request's state slots the tree did not take are freed
    (``free_mamba_cache``); its lock is released. Retracted (``is_insert=False``): all its own KV
    and state go back.

    Raises
    ------
    ValueError
        If ``req.cache_protected_len`` is past its committed tokens, or its tracked length is not
        whole pages within them.
    """
    committed = committed_len(req)
    table = cache.req_to_token_pool
    kv = table.req_to_token[req.req_pool_idx, :committed]
    if cache.disable:
        return HybridFinishedPlan(kv, 0, 0, None, None, None)
    protected = protected_len(req)
    if not is_insert or cache.disable_finished_insert:
        check_protected(protected, committed, "cache_finished_req")
        return HybridFinishedPlan(kv, protected, 0, None, None, req.last_node)
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[:committed]
    known, state, keep = known_state(cache, req, len(tokens))
    check_protected(protected, committed, "cache_finished_req")
    insert = None
    if known:
        insert = InsertParams(
            key=request_key(req, tokens[:known]), value=kv[:known], mamba_value=state,
            priority=getattr(req, "priority", 0) or 0,
        )  # fmt: skip
    return HybridFinishedPlan(kv, protected, known, insert, keep, req.last_node)


def plan_unfinished(cache: RequestCache, req: Any, chunked: bool = False) -> HybridUnfinishedPlan:
    """A running request's KV up to its known state goes into the tree with a copy of that state
    (the request keeps its own), and it continues on the tree's slots, as
    ``kvpool.cache.requests.plan_unfinished``. Without a known state it only refreshes
    ``prefix_indices``.

    Raises
    ------
    ValueError
        As ``plan_finished``.
    """
    tokens = list(req.fill_ids)
    row = req.req_pool_idx
    kv = cache.req_to_token_pool.req_to_token[row, : len(tokens)]
    if cache.disable:
        return HybridUnfinishedPlan(row, kv, 0, 0, None, None, None)
    known, state, _ = known_state(cache, req, len(tokens))
    protected = protected_len(req)
    if known == 0:  # nothing to cache; the request's tree part is still within its whole pages
        check_protected(protected, key_extent(cache, len(tokens))[0], "cache_unfinished_req")
        return HybridUnfinishedPlan(row, kv, 0, 0, None, None, None)
    check_protected(protected, known, "cache_unfinished_req")
    insert = InsertParams(
        key=request_key(req, tokens[:known]), value=kv[:known], chunked=chunked, priority=getattr(req, "priority", 0) or 0
    )
    return HybridUnfinishedPlan(row, kv, protected, known, state, insert, req.last_node)


def request_state_slot(pool: Any, req: Any) -> Optional[torch.Tensor]:
    """``req.mamba_pool_idx`` (None, an int, or a one-entry integer tensor) as Tensor [1] on the state
    pool's device, checked to be a slot ``pool`` has handed out; None when it has none (or there is
    no pool).

    Raises
    ------
    TypeError, ValueError
        For another type, a tensor of another shape or dtype (or on meta), or a free slot.
    """
    idx = getattr(req, "mamba_pool_idx", None)
    if idx is None or pool is None:
        return None
    if isinstance(idx, torch.Tensor):
        if idx.numel() != 1 or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(
                f"match_prefix: req.mamba_pool_idx must be an int or a one-entry integer tensor, got {idx.dtype} of "
                f"shape {tuple(idx.shape)}"
            )
        if idx.device.type == "meta":
            raise ValueError("match_prefix: req.mamba_pool_idx must be on the state pool's device or the CPU, got meta")
        slot = int(idx.reshape(()))
    elif isinstance(idx, int) and not isinstance(idx, bool):
        slot = idx
    else:
        raise TypeError(f"match_prefix: req.mamba_pool_idx must be None, an int or a one-entry integer tensor, got {type(idx).__name__}")
    if not pool.is_held(slot):
        raise ValueError(
            f"match_prefix: req.mamba_pool_idx must be a state slot the pool has handed out, got {slot}, which is free "
            "or out of range"
        )
    return torch.tensor([slot], dtype=torch.int64, device=pool.device)
