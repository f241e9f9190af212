"""The argument and result records of the prefix cache, under SGLang's names and fields
(``base_prefix_cache.py`` and ``cache_init_params.py`` of its 0.5 releases)."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch

from kvpool.cache.key import RadixKey
from kvpool.checks import non_negative_int


@dataclasses.dataclass
class CacheInitParams:
    """What a prefix cache is built from.

    ``disable``: the cache holds nothing (matches are empty, inserts return 0).
    ``req_to_token_pool``: the request table (``ReqToTokenPool``), or None for a simulated cache.
    ``token_to_kv_pool_allocator``: the slot allocator evicted slots go back to, or None.
    ``page_size``: tokens per page; matches and insertions cover whole pages.
    ``is_eagle``: keys are EAGLE bigrams (element i = tokens i and i + 1).
    ``eviction_policy``: ``"lru"`` (default), ``"lfu"``, ``"fifo"``, ``"mru"``, ``"filo"``,
    ``"priority"``.
    ``disable_finished_insert``: finished requests give their slots back instead of caching them.
    ``enable_kv_cache_events``: record ``BlockStored``/``BlockRemoved`` events (``take_events``).
    The other fields are accepted for SGLang's call sites; docs/contract.md says which have no effect.
    """

    disable: bool
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int

    is_eagle: bool = False
    tp_cache_group: Any = None
    eviction_policy: str = "lru"
    disable_finished_insert: bool = False

    enable_metrics: bool = False
    enable_kv_cache_events: bool = False

    enable_mamba_extra_buffer: bool = False

    pp_rank: int = 0
    pp_size: int = 1

    chunked_prefill_size: Optional[int] = None
    sliding_window_size: Optional[int] = None
    cache_ttl_seconds: Optional[float] = None


@dataclasses.dataclass
class MatchPrefixParams:
    """``match_prefix``'s arguments: the key, and (hybrid caches) whether to fork the matched state."""

    key: RadixKey
    cow_mamba: bool = False
    req: Any = None


@dataclasses.dataclass
class InsertParams:
    """``insert``'s arguments.

    ``key``: the tokens; ``value``: Tensor [len(key)] of their device slots (None in a simulated cache:
    the token ids stand in); ``priority``: an int for the priority policy (kept as the maximum along
    the path). ``prev_prefix_len``: None (the caller frees the slots
    of the ``prefix_len`` tokens the tree held, SGLang's ``RadixCache``), or the tokens at the start
    of ``value`` that are the tree's own slots from the caller's match: the insert then frees the
    caller's slots of the tokens from there to ``prefix_len`` itself (SGLang's ``SWARadixCache``).
    ``chunked``, ``mamba_value`` and ``swa_evicted_seqlen`` are SGLang's fields for chunked prefill and
    the hybrid caches (``swa_evicted_seqlen``: ``SWARadixCache``'s, the caller's slots before it have
    no SWA KV).
    """

    key: RadixKey
    value: Optional[torch.Tensor] = None
    mamba_value: Optional[torch.Tensor] = None
    prev_prefix_len: Optional[int] = None
    swa_evicted_seqlen: int = 0
    chunked: bool = False
    priority: int = 0


@dataclasses.dataclass
class InsertResult:
    """``prefix_len``: tokens of the key the tree held already (their slots stay the caller's to free)."""

    prefix_len: int
    mamba_exist: bool = False


@dataclasses.dataclass
class EvictParams:
    """``num_tokens``: device tokens to free at least (whole nodes go, so more may be freed);
    ``swa_num_tokens``: ``SWARadixCache``'s SWA tokens, ``mamba_num``: ``MambaRadixCache``'s states."""

    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


def evict_counts(params: object, cache: str, holds: str, also: Optional[str], disabled: bool) -> tuple[int, int]:
    """What ``evict(params)`` asks of cache ``cache`` (which ``holds`` what the message says):
    ``params`` is an ``EvictParams`` or a number of device tokens. Returns ``(num_tokens, the count
    of field also)`` (0 without ``also``: ``"swa_num_tokens"`` or ``"mamba_num"``), each checked to
    be a non-negative int; a non-zero count of a field the cache does not take, or any call on a
    ``disabled`` cache, raises ``ValueError`` naming it."""
    num, other = params, 0
    if isinstance(params, EvictParams):
        for name in ("swa_num_tokens", "mamba_num"):
            if name != also and getattr(params, name):
                raise ValueError(f"{name} must be 0 for {cache} ({holds}), got {getattr(params, name)!r}")
        num, other = params.num_tokens, getattr(params, also) if also else 0
    num = non_negative_int(num, "num_tokens")
    if also:
        other = non_negative_int(other, also)
    if disabled:
        raise ValueError(f"evict: this cache was built with disable=True and holds nothing to evict (num_tokens = {num})")
    return num, other


@dataclasses.dataclass
class EvictResult:
    """``num_tokens_evicted``: device slots given back to the allocator."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


class MatchResult(NamedTuple):
    """``match_prefix``'s answer.

    device_indices : Tensor [M] int64, the device slots of the longest cached prefix (M a multiple of
        the page size; may be 0).
    last_device_node : the node the match ends on (the root for no match); lock it to keep the
        prefix from eviction.
    last_host_node : the last node whose KV is on the host (the same node without a host tier).
    host_hit_length : tokens past the device match whose KV is on the host only (0 without one).
    mamba_branching_seqlen : hybrid caches' branching point, None otherwise.
    """

    device_indices: torch.Tensor
    last_device_node: Any
    last_host_node: Any
    host_hit_length: int = 0
    mamba_branching_seqlen: Optional[int] = None


# SGLang's RadixCache took these positionally before CacheInitParams existed.
_LEGACY_ORDER = (
    "req_to_token_pool", "token_to_kv_pool_allocator", "page_size", "disable", "enable_kv_cache_events",
    "eviction_policy", "is_eagle",
)  # fmt: skip


def resolve_init_params(params: Any, args: tuple, kwargs: dict) -> CacheInitParams:
    """A cache constructor's arguments as ``CacheInitParams``: either one ``CacheInitParams`` as
    ``params`` (SGLang's later 0.5 releases, positionally or as ``params=``) or its fields as keywords,
    the first seven also positionally from ``params`` on (earlier ones).

    Raises
    ------
    TypeError
        For an unknown or repeated argument, too many positional ones, or a missing pool/page size.
    """
    if isinstance(params, CacheInitParams):
        if args or kwargs:
            raise TypeError("a cache takes either one CacheInitParams or its fields, not both")
        return params
    if params is not None or args:
        args = (params, *args)
    if len(args) > len(_LEGACY_ORDER):
        raise TypeError(f"a cache takes at most {len(_LEGACY_ORDER)} positional arguments, got {len(args)}")
    named = dict(zip(_LEGACY_ORDER, args))
    twice = sorted(set(named) & set(kwargs))
    if twice:
        raise TypeError(f"got multiple values for argument {twice[0]!r}")
    named.update(kwargs)
    fields = {f.name for f in dataclasses.fields(CacheInitParams)}
    unknown = sorted(set(named) - fields)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (CacheInitParams has no such field)")
    missing = [f for f in ("req_to_token_pool", "token_to_kv_pool_allocator", "page_size") if f not in named]
    if missing:
        raise TypeError(f"missing argument {missing[0]!r} (pass None for a cache without pools)")
    named.setdefault("disable", False)
    return CacheInitParams(**named)
