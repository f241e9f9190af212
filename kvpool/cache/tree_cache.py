"""``TreeCache``: what every prefix cache of kvpool shares over its ``RadixTree`` (SGLang's
``BasePrefixCache`` part): the construction from ``CacheInitParams``, the checks of keys and values,
locks, sizes, events, the integrity check and SGLang's small queries. ``RadixCache`` (and its
``HiRadixCache``) and ``MambaRadixCache`` build their ``match_prefix``, ``insert``, ``evict`` and
request calls on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import torch

from kvpool.cache import integrity
from kvpool.cache.events import AllBlocksCleared
from kvpool.cache.evict_policy import make_strategy
from kvpool.cache.key import RadixKey, encoded, to_bigram
from kvpool.cache.node import TreeNode
from kvpool.cache.params import CacheInitParams, InsertParams, MatchPrefixParams, MatchResult
from kvpool.cache.tree import RadixTree
from kvpool.checks import check_index, positive_int
from kvpool.config import validate_enabled


class TreeCache(RadixTree):
    """A radix tree of cached token prefixes over a slot allocator (the base of kvpool's caches).

    Parameters
    ----------
    params : CacheInitParams.
    validate : also check, on every insert, that each page of slots is one aligned page, and on a GPU
        the slots given to every call against the allocator and the tree (a CPU cache always checks
        those): reads them, a synchronisation on a GPU. ``KVPOOL_VALIDATE=1`` turns it on too.

    Raises
    ------
    ValueError
        For a page size that is not a positive int or differs from the allocator's, an unknown
        eviction policy, or an option this cache does not provide (sliding window, TTL, mamba state).
    """

    def __init__(self, params: CacheInitParams, validate: bool = False) -> None:
        p = params
        self.disable = bool(p.disable)
        self.req_to_token_pool = p.req_to_token_pool
        self.token_to_kv_pool_allocator = p.token_to_kv_pool_allocator
        self.page_size = positive_int(p.page_size, "page_size")
        alloc_page = getattr(self.token_to_kv_pool_allocator, "page_size", None)
        if isinstance(alloc_page, int) and alloc_page != self.page_size:
            raise ValueError(f"page_size must be the allocator's page_size = {alloc_page}, got {self.page_size}")
        unsupported = [("cache_ttl_seconds", None)]
        if not self.supports_swa():
            unsupported.append(("sliding_window_size", None))
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
        self.device = _device_of(self.token_to_kv_pool_allocator)
        self.validate = validate_enabled(validate)
        self.kv_event_queue: list[Any] = []
        self.metrics_collector = None
        RadixTree.__init__(self, self.page_size, self.is_eagle, self.eviction_strategy, self.device)
        TreeCache.reset(self)  # the tree only: a subclass sets up its own tiers after this

    @classmethod
    def create_simulated(
        cls,
        disable: bool = False,
        mock_allocator: Optional[Any] = None,
        page_size: int = 1,
        enable_kv_cache_events: bool = False,
        **kwargs: Any,
    ) -> Any:
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
            device = n.device
            if device.lock_ref == 0:
                size = len(device.value)
                self.evictable_size_ -= size
                self.protected_size_ += size
                delta -= size
            device.lock_ref += 1
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
        self._check_locked(path)
        delta = 0
        for n in path:
            device = n.device
            device.lock_ref -= 1
            if device.lock_ref == 0:
                size = len(device.value)
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

    def check_integrity(self, requests: Iterable[Any] = ()) -> None:
        """Check the tree, its allocator and request table, and ``requests`` (the running requests)
        together: every handed-out slot owned by exactly one of the tree and the requests.

        Raises
        ------
        IntegrityError
            Listing every inconsistency found.
        """
        problems, slots = self.tree_problems()
        problems += self._tier_problems()
        integrity.check_integrity(self, requests, problems, slots, self._table_check_args())

    def sanity_check(self) -> None:
        """``check_integrity()`` without running requests (SGLang's name)."""
        self.check_integrity(())

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
        print(f"#tokens: {self.evictable_size_ + self.protected_size_}")

    def all_values_flatten(self) -> torch.Tensor:
        """Every device slot in the tree, Tensor [device tokens] int64."""
        values = [n.device.value for n in self._nodes() if n is not self.root_node and n.device is not None]
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

    # --- checks and helpers shared by the caches --------------------------------------------------

    def _check_locked(self, path: list[TreeNode], what: str = "dec_lock_ref") -> None:
        for n in path:
            if n.device.lock_ref < 1:
                raise ValueError(
                    f"{what}: node {n.id} is not locked (lock_ref = {n.device.lock_ref}); each dec_lock_ref "
                    "undoes one earlier inc_lock_ref of the node or of a node below it"
                )

    def _check_request_slots(self, kv: torch.Tensor, protected: int, last_node: TreeNode, what: str) -> None:
        """A request's first ``protected`` slots are its ``last_node``'s path in the tree, and the rest
        its own: handed out, each once, none in the tree (reads them: see ``_checks_slots``)."""
        path = [n.device.value for n in reversed(self._path(last_node, what))]
        tree = torch.cat(path).cpu() if path else kv[:0].cpu().to(torch.int64)
        if tree.numel() != protected or not torch.equal(tree, kv[:protected].cpu().to(torch.int64)):
            raise ValueError(
                f"{what}: req's first {protected} slots (cache_protected_len) must be the {tree.numel()} slots of its "
                "last_node's path in the tree"
            )
        self._check_given_slots(kv[protected:], 0, [], f"{what}: the request's own slots")

    def _match_key(self, params: Any) -> Optional[tuple[list[TreeNode], TreeNode]]:
        """``_match`` of ``params``' key (MatchPrefixParams or a RadixKey), checked; None when there is
        nothing to match (a disabled cache, no whole page)."""
        key = params.key if isinstance(params, MatchPrefixParams) else params
        enc = self._key_bytes(key)
        n = len(enc) // self.page_bytes * self.page_bytes
        if self.disable or n == 0:
            return None
        return self._match(enc, n, key.extra_key)

    def _key_bytes(self, key: Any) -> bytes:
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        if key.is_bigram and not self.is_eagle:
            raise ValueError("key must be a plain key (is_bigram=False): this cache was built with is_eagle=False")
        try:
            hash(key.extra_key)
        except TypeError:
            raise TypeError(
                f"key.extra_key must be hashable (None, a str, an int, a tuple, ...), got {type(key.extra_key).__name__}"
            ) from None
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
            self._check_pages(value[: len(enc) // self.page_bytes * self.page_size])
        return value

    def _prepare_insert(self, params: InsertParams, what: str = "insert", peek: bool = True) -> Optional["InsertJob"]:
        """``params`` checked, and what inserting it will find, changing nothing; None when there is
        nothing to insert (a disabled cache, no whole page).

        Raises
        ------
        TypeError, ValueError
            For a bad key, value, priority or prev_prefix_len, and (``_checks_slots``, over a kvpool
            allocator) slots that are not handed out, repeated, or already in the tree elsewhere.
        """
        key = params.key
        enc = self._key_bytes(key)
        value = self._checked_value(key, enc, params.value)
        priority = params.priority
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"{what}: priority must be an int, got {priority!r} ({type(priority).__name__})")
        prev = params.prev_prefix_len
        if prev is not None and (isinstance(prev, bool) or not isinstance(prev, int) or not 0 <= prev <= len(value)):
            raise ValueError(f"{what}: prev_prefix_len must be None or an int in 0..{len(value)} (the key's tokens), got {prev!r}")
        n = len(enc) // self.page_bytes * self.page_bytes
        if self.disable or n == 0:
            return None
        owners = self._owners() if self._checks_slots() else None
        cached, tree_slots, end = 0, [], None
        if peek or owners is not None or prev is not None:
            cached, tree_slots, end = self._peek(enc, n, key.extra_key)
        if owners is not None:
            elems = n // self.elem_bytes
            self._check_given_slots(value[:elems], cached // self.elem_bytes, tree_slots, f"{what}: value", owners)
        return InsertJob(enc, n, value, priority, key.extra_key, bool(params.chunked), cached // self.elem_bytes, prev, end)

    def _checks_slots(self) -> bool:
        """Whether calls check the slots they are given against the allocator and the tree: always on
        the CPU, under ``validate`` on a GPU (where reading them is a synchronisation)."""
        return self.validate or self.device.type == "cpu"

    def _owners(self) -> Optional[torch.Tensor]:
        """The allocator's holders per slot (a kvpool allocator's ``backup_state().owners``, on the
        host), or None for an allocator that does not say (a test double, a simulated cache)."""
        backup = getattr(self.token_to_kv_pool_allocator, "backup_state", None)
        owners = getattr(backup(), "owners", None) if callable(backup) else None
        return owners.cpu().to(torch.int64) if isinstance(owners, torch.Tensor) else None

    def _check_given_slots(
        self, slots: torch.Tensor, shared: int, tree_slots: list[torch.Tensor], what: str, owners: Optional[torch.Tensor] = None
    ) -> None:
        """Each of ``slots`` handed out by the allocator and listed once; none in the tree except the
        first ``shared``, where they may be the tree's own slots for the same tokens (reads the slots
        and the tree: see ``_checks_slots``). ``owners``: the allocator's, if read already."""
        owners = self._owners() if owners is None else owners
        if owners is None or slots.numel() == 0:
            return
        v = slots.cpu().to(torch.int64)
        n_slots = owners.numel()
        outside = ((v < 0) | (v >= n_slots)).nonzero()
        if outside.numel():
            i = int(outside[0])
            raise ValueError(f"{what} must hold slots in 0..{n_slots - 1} handed out by the allocator, got {int(v[i])} at position {i}")
        free = (owners[v] == 0).nonzero()
        if free.numel():
            i = int(free[0])
            raise ValueError(
                f"{what} must hold slots handed out by the allocator, got slot {int(v[i])} at position {i}, which is free "
                "(never allocated, freed, or reserved)"
            )
        own = torch.zeros(v.numel(), dtype=torch.bool)
        if shared:
            held = torch.cat(tree_slots).cpu()[:shared] if tree_slots else v[:0]
            own[: held.numel()] = v[: held.numel()] == held
        mine = v[~own]
        uniq, counts = torch.unique(mine, return_counts=True)
        if bool((counts > 1).any()):
            raise ValueError(f"{what} must list each slot once, got slot {int(uniq[counts > 1][0])} more than once")
        in_tree = torch.isin(mine, self.all_values_flatten().cpu())
        if bool(in_tree.any()):
            raise ValueError(f"{what} must hold slots the tree does not own, got slot {int(mine[in_tree][0])}, already in the tree")

    def _check_pages(self, slots: torch.Tensor) -> None:
        p = self.page_size
        pages = slots.view(-1, p).cpu()
        bad = ((pages[:, 0] % p != 0) | ((pages[:, 1:] - pages[:, :-1]) != 1).any(1)).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"value must hold whole aligned pages of {p} consecutive slots, got {pages[i].tolist()} for page {i}"
            )

    def _free_slots(self, parts: list[torch.Tensor]) -> None:
        """Give ``parts`` (device slots) back to the allocator in one ``free`` (a simulated cache
        without one has nothing to give back)."""
        parts = [p for p in parts if p.numel()]
        if parts and self.token_to_kv_pool_allocator is not None:
            self.token_to_kv_pool_allocator.free(torch.cat(parts) if len(parts) > 1 else parts[0])

    def _tier_problems(self) -> list[str]:
        """What ``check_integrity`` should add for tiers below the device or state (none here)."""
        return []

    def _table_check_args(self) -> dict:
        """Keywords for the request table's own ``check_integrity`` (slots the cache owns there)."""
        return {}

    def _empty_match(self) -> MatchResult:
        root = self.root_node
        return MatchResult(torch.empty(0, dtype=torch.int64, device=self.device), root, root)


@dataclasses.dataclass
class InsertJob:
    """An insertion checked by ``_prepare_insert``: the key's bytes and whole-page length ``n``, its
    slots, priority and namespace, the ``cached`` elements the tree holds of it already, and the
    node that ends where it ends (None: the insertion makes it)."""

    enc: bytes
    n: int
    value: torch.Tensor
    priority: int
    extra: Any
    chunked: bool
    cached: int
    prev: Optional[int]
    end: Optional[TreeNode]


def _device_of(allocator: Any) -> torch.device:
    """The allocator's device; the CPU without an allocator or for a test double whose ``device`` is
    not one (SGLang keeps such a value as it is and the tensors it makes are on the CPU)."""
    device = getattr(allocator, "device", None) if allocator is not None else None
    if isinstance(device, (torch.device, str, int)):
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            pass
    return torch.device("cpu")
