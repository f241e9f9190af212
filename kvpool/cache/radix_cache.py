"""``RadixCache``: the prefix cache over a slot allocator, with SGLang's API (its 0.5 releases).

The tree maps token prefixes to the device slots holding their KV. Every node's key is a whole
number of pages, so a match is too. Keys are compared as bytes (``kvpool.cache.key``): one
``startswith`` per node on the path, plus one search inside the node where a match ends. Eviction
takes leaves from a priority queue (``kvpool.cache.evict_policy``) and gives their slots back to the
allocator in one ``free`` per call. Requests go in and out through ``cache_finished_req`` and
``cache_unfinished_req`` (``kvpool.cache.requests``); ``check_integrity`` checks tree, allocator and
request table together (``kvpool.cache.integrity``).

Ownership: a slot in the tree belongs to the tree; ``insert`` takes the slots of the tokens the tree
did not hold (their count is ``len(key) - prefix_len``, page-aligned) and leaves the rest, and any
unaligned tail, to the caller; ``evict`` gives the tree's slots back to the allocator.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from kvpool.cache import integrity, requests
from kvpool.cache.events import AllBlocksCleared
from kvpool.cache.evict_policy import make_strategy
from kvpool.cache.key import RadixKey, encoded, to_bigram
from kvpool.cache.node import TreeNode
from kvpool.cache.params import (
    CacheInitParams,
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    resolve_init_params,
)
from kvpool.cache.tree import RadixTree
from kvpool.checks import check_index, non_negative_int, positive_int
from kvpool.config import validate_enabled

__all__ = ["RadixCache", "RadixKey", "TreeNode"]


class RadixCache(RadixTree):
    """A radix tree of cached token prefixes and the device slots of their KV.

    Parameters
    ----------
    params : CacheInitParams, or its fields as arguments (``req_to_token_pool``,
        ``token_to_kv_pool_allocator``, ``page_size``, ``disable``, ``enable_kv_cache_events``,
        ``eviction_policy``, ``is_eagle`` positionally, the rest by keyword), as SGLang's releases
        took them.
    validate : also check, on every insert, that each page of slots is one aligned page (reads the
        slots, a synchronisation on a GPU); ``KVPOOL_VALIDATE=1`` turns it on too.

    Raises
    ------
    ValueError
        For a page size that is not a positive int or differs from the allocator's, an unknown
        eviction policy, or an option this cache does not provide (sliding window, TTL, mamba state).

    Examples
    --------
    >>> cache = RadixCache.create_simulated(page_size=2)
    >>> cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5]), value=torch.arange(10, 15))).prefix_len
    0
    >>> m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 9])))
    >>> m.device_indices
    tensor([10, 11])
    """

    def __init__(self, *args: Any, validate: bool = False, **kwargs: Any) -> None:
        p = resolve_init_params(args, kwargs)
        self.disable = bool(p.disable)
        self.req_to_token_pool = p.req_to_token_pool
        self.token_to_kv_pool_allocator = p.token_to_kv_pool_allocator
        self.page_size = positive_int(p.page_size, "page_size")
        alloc_page = getattr(self.token_to_kv_pool_allocator, "page_size", None)
        if isinstance(alloc_page, int) and alloc_page != self.page_size:
            raise ValueError(f"page_size must be the allocator's page_size = {alloc_page}, got {self.page_size}")
        unsupported = [("sliding_window_size", None), ("cache_ttl_seconds", None)]
        if not self.supports_mamba():
            unsupported.append(("enable_mamba_extra_buffer", False))
        for name, off in unsupported:
            if getattr(p, name) not in (off, None):
                raise ValueError(f"{name} must be {off} for {type(self).__name__}, got {getattr(p, name)!r}")
        self.enable_kv_cache_events = bool(p.enable_kv_cache_events)
        self.is_eagle = bool(p.is_eagle)
        self.disable_finished_insert = bool(p.disable_finished_insert)
        self.enable_mamba_extra_buffer = bool(p.enable_mamba_extra_buffer)
        self.eviction_strategy = make_strategy(p.eviction_policy)
        self.eviction_policy = p.eviction_policy.lower()
        allocator = self.token_to_kv_pool_allocator
        self.device = torch.device(allocator.device) if allocator is not None else torch.device("cpu")
        self.validate = validate_enabled(validate)
        self.kv_event_queue: list[Any] = []
        self.metrics_collector = None
        RadixTree.__init__(self, self.page_size, self.is_eagle, self.eviction_strategy, self.device)
        self.reset()

    @classmethod
    def create_simulated(
        cls,
        disable: bool = False,
        mock_allocator: Optional[Any] = None,
        page_size: int = 1,
        enable_kv_cache_events: bool = False,
        **kwargs: Any,
    ) -> "RadixCache":
        """A cache without pools, for tests and simulations: inserts without a value store the token
        ids as the "slots", and evicted slots go to ``mock_allocator`` (if any). ``kwargs`` are further
        ``CacheInitParams`` fields (``eviction_policy``, ``is_eagle``, ...)."""
        return cls(
            CacheInitParams(
                disable=disable, req_to_token_pool=None, token_to_kv_pool_allocator=mock_allocator,
                page_size=page_size, enable_kv_cache_events=enable_kv_cache_events, **kwargs,
            )
        )  # fmt: skip

    # --- SGLang's API ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every node (the slots they held are not freed: clear the allocator too)."""
        self._reset_tree()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())

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
        values, node = walked
        indices = torch.cat(values) if values else self._empty_match().device_indices
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
            token, is None in a cache with an allocator, or (``validate``) a page of it is not one
            aligned page of slots. Nothing changes.
        """
        legacy = not isinstance(params, InsertParams)
        if not legacy:
            key, value, priority = params.key, params.value, params.priority
        else:
            key = params
        enc = self._key_bytes(key)
        value = self._checked_value(key, enc, value)
        n = len(enc) // self._page_bytes * self._page_bytes
        prefix = 0
        if not self.disable and n:
            held, last = self._insert(enc, n, value, priority or 0, key.extra_key)
            prefix = held // self._elem
            self._inserted(last, chunked if legacy else params.chunked)
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
            (this cache holds neither), or the cache is disabled. Nothing changes.
        """
        if isinstance(params, EvictParams):
            for name in ("swa_num_tokens", "mamba_num"):
                if getattr(params, name):
                    raise ValueError(f"{name} must be 0 for RadixCache (it holds full-attention KV only), got {getattr(params, name)!r}")
            num = params.num_tokens
        else:
            num = params
        num = non_negative_int(num, "num_tokens")
        if self.disable:
            raise ValueError(f"evict: this cache was built with disable=True and holds nothing to evict (num_tokens = {num})")
        freed = self._evict_leaves(num)
        count = sum(len(v) for v in freed)
        allocator = self.token_to_kv_pool_allocator
        if freed and allocator is not None:
            allocator.free(torch.cat(freed) if len(freed) > 1 else freed[0])
        return EvictResult(num_tokens_evicted=count)

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors against eviction; returns minus the tokens that became
        protected (0 for the root or a disabled cache).

        Raises
        ------
        TypeError, ValueError
            If ``node`` is not a node of this tree (evicted, split off another tree, never inserted).
        """
        if self.disable:
            return 0
        delta = 0
        for n in self._path(node, "inc_lock_ref"):
            if n.lock_ref == 0:
                size = len(n.value)
                self.evictable_size_ -= size
                self.protected_size_ += size
                delta -= size
            n.lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode, swa_uuid_for_lock: Optional[str] = None) -> int:
        """Undo one ``inc_lock_ref(node)``; returns the tokens that became evictable.

        Raises
        ------
        TypeError, ValueError
            If ``node`` is not a node of this tree, or is not locked (lock_ref 0). Nothing changes.
        """
        if self.disable:
            return 0
        path = self._path(node, "dec_lock_ref")
        for n in path:
            if n.lock_ref < 1:
                raise ValueError(
                    f"dec_lock_ref: node {n.id} is not locked (lock_ref = {n.lock_ref}); each dec_lock_ref "
                    "undoes one earlier inc_lock_ref of the node or of a node below it"
                )
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                size = len(n.value)
                self.evictable_size_ += size
                self.protected_size_ -= size
                delta += size
                if self._is_evictable(n):
                    self._queue.push(n)
        return delta

    def evictable_size(self) -> int:
        """Device tokens in unlocked nodes."""
        return self.evictable_size_

    def protected_size(self) -> int:
        """Device tokens in locked nodes."""
        return self.protected_size_

    def total_size(self) -> int:
        """Device tokens in the tree."""
        return self.evictable_size_ + self.protected_size_

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """A finished (``is_insert``) or retracted (``is_insert=False``) request's slots go into the
        tree or back to the allocator, and its lock is released; see ``kvpool.cache.requests``."""
        requests.cache_finished_req(self, req, is_insert)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """A running request's computed pages go into the tree and it continues on the tree's slots;
        see ``kvpool.cache.requests``."""
        requests.cache_unfinished_req(self, req, chunked)

    def check_integrity(self, requests: Iterable[Any] = ()) -> None:
        """Check the tree, its allocator and request table, and ``requests`` (the running requests)
        together: every handed-out slot owned by exactly one of the tree and the requests.

        Raises
        ------
        IntegrityError
            Listing every inconsistency found.
        """
        integrity.check_integrity(self, requests)

    def sanity_check(self) -> None:
        """``check_integrity()`` without running requests (SGLang's name)."""
        integrity.check_integrity(self, ())

    def take_events(self) -> list[Any]:
        """The KV events recorded since the last call (empty unless ``enable_kv_cache_events``)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def pretty_print(self) -> None:
        """Print the tree, a node per line: tokens, the first ten token ids, lock_ref."""
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            print(" " * depth, len(node.key), list(node.key.token_ids[:10]), f"r={node.lock_ref}")
            stack.extend((c, depth + 2) for c in node.children.values())
        print(f"#tokens: {self.total_size()}")

    def all_values_flatten(self) -> torch.Tensor:
        """Every device slot in the tree, Tensor [total_size()] int64."""
        values = [n.value for n in self._nodes() if n is not self.root_node and n.value is not None]
        return torch.cat(values) if values else self._empty_match().device_indices

    def maybe_bigram_convert(self, key: RadixKey, value: Optional[torch.Tensor] = None) -> tuple[RadixKey, Any]:
        """The key as this cache compares it (EAGLE's bigrams when ``is_eagle``) and the value cut to it;
        a new key, the argument is left as it is."""
        if not self.is_eagle or key.is_bigram:
            return key, value
        converted = RadixKey.from_encoded(to_bigram(encoded(key)), key.extra_key, True)
        return converted, None if value is None else value[: len(converted)]

    def available_and_evictable_str(self) -> str:
        """One log line: the tokens an allocation can get, the allocator's free slots plus the tree's
        evictable tokens, and each part."""
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.evictable_size()
        return f"Available tokens: {available + evictable} ({available=} + {evictable=})\n"

    def supports_swa(self) -> bool:
        """False: no sliding-window layers (SGLang callers check it for an SWA cache)."""
        return False

    def supports_mamba(self) -> bool:
        """False: no linear-attention states (``MambaRadixCache`` keeps them)."""
        return False

    def is_chunk_cache(self) -> bool:
        """False: this cache keeps prefixes (SGLang's ``ChunkCache``, which keeps none, says True)."""
        return False

    def is_tree_cache(self) -> bool:
        """True: a prefix tree, which SGLang callers match prefixes in, insert into and evict from."""
        return True

    # --- the tree -------------------------------------------------------------------------------

    def _match_key(self, params: Any) -> Optional[tuple[list, TreeNode]]:
        """``_match`` of ``params``' key (MatchPrefixParams or a RadixKey), checked; None when there is
        nothing to match (a disabled cache, no whole page)."""
        key = params.key if isinstance(params, MatchPrefixParams) else params
        enc = self._key_bytes(key)
        n = len(enc) // self._page_bytes * self._page_bytes
        if self.disable or n == 0:
            return None
        return self._match(enc, n, key.extra_key)

    def _key_bytes(self, key: Any) -> bytes:
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        if key.is_bigram and not self.is_eagle:
            raise ValueError("key must be a plain key (is_bigram=False): this cache was built with is_eagle=False")
        enc = encoded(key)
        return to_bigram(enc) if self.is_eagle and not key.is_bigram else enc

    def _checked_value(self, key: RadixKey, enc: bytes, value: Optional[torch.Tensor]) -> torch.Tensor:
        """``value`` checked against the key (one slot per token as given); in a simulated cache a
        missing value becomes the token ids."""
        raw = len(key)  # tokens as given; a converted bigram key drops the last one
        if value is None:
            if self.token_to_kv_pool_allocator is not None:
                raise ValueError("value must be the key's device slots (a tensor) in a cache with an allocator, got None")
            plain = encoded(key)
            if key.is_bigram or not plain:
                value = torch.zeros(raw, dtype=torch.int64)
            else:
                value = torch.frombuffer(bytearray(plain), dtype=torch.int64)
        check_index(value, "value", device=self.device, dims="[T]")
        if value.shape[0] != raw:
            raise ValueError(f"value must have one slot per key token ({raw}), got {value.shape[0]}")
        if self.validate and self.page_size > 1:
            self._check_pages(value[: len(enc) // self._page_bytes * self.page_size])
        return value

    def _check_pages(self, slots: torch.Tensor) -> None:
        p = self.page_size
        pages = slots.view(-1, p).cpu()
        bad = ((pages[:, 0] % p != 0) | ((pages[:, 1:] - pages[:, :-1]) != 1).any(1)).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"value must hold whole aligned pages of {p} consecutive slots, got {pages[i].tolist()} for page {i}"
            )

    def _inserted(self, last: TreeNode, chunked: bool) -> None:
        """After an insert that ended on ``last`` (a hook for caches with a host tier)."""

    def _integrity_problems(self) -> list[str]:
        """What ``check_integrity`` should add for tiers below the device or state (none here)."""
        return []

    def _table_check_args(self) -> dict:
        """Keywords for the request table's own ``check_integrity`` (slots the cache owns there)."""
        return {}

    def _empty_match(self) -> MatchResult:
        root = self.root_node
        return MatchResult(torch.empty(0, dtype=torch.int64, device=self.device), root, root)
