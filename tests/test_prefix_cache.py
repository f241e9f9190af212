"""The prefix cache (``kvpool.cache``): SGLang's ``RadixCache`` API, page-aligned matching, eviction
order and its bound, locks, KV events, requests entering and leaving through both allocators and the
request table, ``check_integrity``, bad input, and a state machine that drives all of it."""

from __future__ import annotations

import doctest
import hashlib
import random
import unittest.mock
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool import (
    IntegrityError,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from kvpool.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheInitParams,
    EvictParams,
    EvictResult,
    HiRadixCache,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    RadixCache,
    RadixKey,
    TreeNode,
)

PAGE_SIZES = [1, 16, 64]


@pytest.mark.parametrize("module", ["key", "node", "radix_cache"])
def test_docstring_examples_run(module):
    import importlib

    result = doctest.testmod(importlib.import_module(f"kvpool.cache.{module}"))
    assert result.attempted > 0 and result.failed == 0


def T(xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype)


def sim(page_size=1, **kwargs) -> RadixCache:
    return RadixCache.create_simulated(page_size=page_size, **kwargs)


def insert(cache, tokens, values=None, extra=None, priority=0) -> int:
    v = None if values is None else T(values)
    return cache.insert(InsertParams(key=RadixKey(list(tokens), extra), value=v, priority=priority)).prefix_len


def match(cache, tokens, extra=None):
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens), extra)))


def tree_state(cache: RadixCache) -> tuple:
    """Everything the tree holds, as plain values (to prove that a call changed nothing)."""
    rows = []
    stack = [cache.root_node]
    while stack:
        n = stack.pop()
        value = None if n.value is None else tuple(n.value.tolist())
        parent = None if n.parent is None else n.parent.id
        rows.append((n.id, parent, tuple(n.key.token_ids), n.key.extra_key, value, n.lock_ref, n.hit_count, n.priority))
        stack.extend(n.children.values())
    return (sorted(rows, key=repr), cache.evictable_size(), cache.protected_size(), len(cache.kv_event_queue))


def seq(n, start=1000, step=1):
    return list(range(start, start + n * step, step))


# --- keys and nodes -----------------------------------------------------------------------------------


def test_radix_key_slices_iterates_and_keeps_its_namespace():
    key = RadixKey([5, 6, 7, 8], "lora-3")
    assert len(key) == 4 and list(key) == [5, 6, 7, 8]
    assert key[1:3].token_ids == [6, 7] and key[1:3].extra_key == "lora-3"
    assert key[-1].token_ids == [8] and key[-1].extra_key == "lora-3"
    assert "extra_key='lora-3'" in repr(key) and "[5, 6, 7, 8]" in repr(key)
    assert "..." in repr(RadixKey(list(range(11))))
    with pytest.raises(IndexError):
        key[9]


def test_tree_node_fields_and_host_holds():
    node = TreeNode()
    assert (node.lock_ref, node.hit_count, node.host_ref_counter) == (0, 0, 0)
    assert node.evicted and not node.backuped
    node.value, node.host_value = T([1]), T([2])
    assert not node.evicted and node.backuped
    node.protect_host()
    node.release_host()
    with pytest.raises(RuntimeError, match="host copy is not held"):
        node.release_host()
    a, b = TreeNode(), TreeNode()
    a.parent, a.hash_value, b.parent, b.hash_value = None, ["h1"], a, ["h2", "h3"]
    chain = b.get_prefix_hash_values(b)
    assert chain == ["h1", "h2", "h3"] and b.get_prefix_hash_values(b) is not chain
    assert b.get_last_hash_value() == "h3"


# --- insert and match ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_match_is_the_longest_whole_page_prefix(page):
    cache = sim(page)
    tokens = seq(3 * page + page // 2)  # three pages and (page size > 1) a partial one
    assert insert(cache, tokens, seq(len(tokens), 10)) == 0
    assert cache.total_size() == cache.evictable_size() == 3 * page  # the partial page is not taken
    for n in (0, 1, page, 2 * page + 1, len(tokens)):
        got = match(cache, tokens[:n] + [7] * 5).device_indices  # the cached tokens hold no 7
        assert got.tolist() == seq(len(tokens), 10)[: min(n // page, 3) * page], n
        assert got.dtype == torch.int64
    # A query that leaves the cached key inside a page matches only the pages before it.
    diverge = tokens[: page + page // 2] + [1] + tokens[page + page // 2 + 1 :]
    assert len(match(cache, diverge).device_indices) == page


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_insert_returns_what_the_tree_held_and_takes_only_the_rest(page):
    cache = sim(page)
    a = seq(4 * page)
    b = a[: 2 * page] + seq(2 * page, start=5000)
    assert insert(cache, a, seq(4 * page, 100)) == 0
    assert insert(cache, b, seq(4 * page, 900)) == 2 * page
    assert cache.total_size() == 6 * page
    # b's first two pages keep a's slots; its own copies of them stay the caller's
    assert match(cache, b).device_indices.tolist() == seq(2 * page, 100) + seq(4 * page, 900)[2 * page :]
    assert insert(cache, a, seq(4 * page, 1)) == 4 * page
    assert cache.total_size() == 6 * page


def test_a_match_ending_inside_a_node_splits_it_and_returns_that_node():
    cache = sim(2)
    insert(cache, [1, 2, 3, 4, 5, 6], [10, 20, 30, 40, 50, 60])
    m = match(cache, [1, 2, 3, 4, 9, 9])
    assert m.device_indices.tolist() == [10, 20, 30, 40]
    node = m.last_device_node
    assert node.key.token_ids == [1, 2, 3, 4] and node.value.tolist() == [10, 20, 30, 40]
    (child,) = node.children.values()
    assert child.key.token_ids == [5, 6] and child.parent is node
    assert set(cache.root_node.children) == {(1, 2)} and set(node.children) == {(5, 6)}
    assert m.last_host_node is node and cache.total_size() == 6
    cache.sanity_check()


def test_children_are_filed_under_sglangs_child_keys():
    for page, extra, want in ((1, None, 7), (2, None, (7, 8)), (1, "t", ("t", 7)), (2, "t", ("t", (7, 8)))):
        cache = sim(page)
        insert(cache, [7, 8, 9, 10], extra=extra)
        assert list(cache.root_node.children) == [want]


def test_extra_keys_never_share_a_prefix():
    cache = sim(1)
    for extra, base in ((None, 10), ("lora-1", 40), ("tenant-b", 70)):
        assert insert(cache, [1, 2, 3], [base, base + 1, base + 2], extra=extra) == 0
    assert match(cache, [1, 2, 3], "lora-1").device_indices.tolist() == [40, 41, 42]
    assert match(cache, [1, 2, 3], "tenant-b").device_indices.tolist() == [70, 71, 72]
    assert match(cache, [1, 2, 3]).device_indices.tolist() == [10, 11, 12]
    assert len(match(cache, [1, 2, 3], "other").device_indices) == 0
    assert cache.total_size() == 9


def test_token_ids_may_be_lists_tuples_arrays_ranges_and_tensors():
    from array import array

    cache = sim(1)
    insert(cache, [3, 4, 5, 6], [1, 2, 3, 4])
    for tokens in ([3, 4, 5], (3, 4, 5), array("q", [3, 4, 5]), range(3, 6), torch.tensor([3, 4, 5])):
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices.tolist() == [1, 2, 3]
    big = 2**40 + 7  # token ids are compared as int64, not truncated
    insert(cache, [big, 1], [9, 9])
    assert len(match(cache, [2**40 + 8, 1]).device_indices) == 0


def test_sglangs_earlier_call_forms():
    """RadixCache(req_to_token_pool=..., ...), insert(key, value) -> int, match_prefix(key), evict(n)."""
    alloc = unittest.mock.Mock()
    alloc.device = torch.device("cpu")
    cache = RadixCache(None, alloc, 1, eviction_policy="lru")
    assert cache.insert(RadixKey([1, 2, 3]), T([7, 8, 9])) == 0
    assert cache.insert(RadixKey([1, 2, 4]), T([7, 8, 5])) == 2
    assert cache.match_prefix(RadixKey([1, 2, 3, 4])).device_indices.tolist() == [7, 8, 9]
    assert cache.evict(1).num_tokens_evicted == 1
    alloc.free.assert_called_once()
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=4)
    assert RadixCache(params).page_size == 4
    result = RadixCache(params).insert(InsertParams(key=RadixKey(seq(9))))
    assert isinstance(result, InsertResult) and result.prefix_len == 0
    with pytest.raises(TypeError, match="unexpected keyword argument 'slide'"):
        RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1, slide=2)
    with pytest.raises(TypeError, match="missing argument 'page_size'"):
        RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=None)


def test_empty_keys_match_the_root_and_insert_nothing():
    cache = sim(4)
    assert insert(cache, []) == 0 and insert(cache, [1, 2, 3]) == 0  # shorter than a page
    m = match(cache, [1, 2, 3])
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root_node and cache.total_size() == 0


def test_a_disabled_cache_holds_nothing():
    cache = sim(1, disable=True)
    assert insert(cache, [1, 2, 3], [4, 5, 6]) == 0
    m = match(cache, [1, 2, 3])
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root_node
    assert cache.total_size() == 0 and cache.inc_lock_ref(cache.root_node) == 0


def test_eagle_keys_are_bigrams_of_the_tokens():
    cache = sim(1, is_eagle=True)
    assert insert(cache, [1, 2, 3, 4], [10, 20, 30, 40]) == 0
    assert cache.total_size() == 3  # (1,2), (2,3), (3,4)
    assert match(cache, [1, 2, 3, 4]).device_indices.tolist() == [10, 20, 30]
    assert match(cache, [1, 2]).device_indices.tolist() == [10]
    assert list(cache.root_node.children) == [(1, 2)]
    paged = sim(2, is_eagle=True)
    insert(paged, [1, 2, 3], [10, 20, 30])
    assert paged.total_size() == 2 and len(match(paged, [1, 2]).device_indices) == 0


def test_reset_forgets_every_node():
    cache = sim(1, enable_kv_cache_events=True)
    insert(cache, [1, 2, 3], [4, 5, 6])
    cache.take_events()
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert len(match(cache, [1, 2, 3]).device_indices) == 0
    assert isinstance(cache.take_events()[0], AllBlocksCleared)
    cache.check_integrity()


def test_pretty_print_and_all_values(capsys):
    cache = sim(1)
    insert(cache, [1, 2], [10, 20])
    insert(cache, [3, 4], [30, 40])
    cache.pretty_print()
    out = capsys.readouterr().out
    assert "#tokens: 4" in out and "[1, 2]" in out and "r=0" in out
    assert sorted(cache.all_values_flatten().tolist()) == [10, 20, 30, 40]


# --- locks and eviction -------------------------------------------------------------------------------


def free_recorder():
    freed: list[list[int]] = []
    alloc = unittest.mock.Mock()
    alloc.device = torch.device("cpu")
    alloc.free.side_effect = lambda t: freed.append(t.tolist())
    return alloc, freed


def test_locks_protect_the_node_and_its_ancestors():
    alloc, freed = free_recorder()
    cache = sim(1, mock_allocator=alloc)
    insert(cache, [1, 2, 3, 4], [10, 20, 30, 40])
    insert(cache, [1, 2, 5, 6], [10, 20, 50, 60])
    node = match(cache, [1, 2, 3, 4]).last_device_node
    assert cache.inc_lock_ref(node) == -4  # [1, 2] and [3, 4] became protected
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    assert cache.inc_lock_ref(node) == 0
    result = cache.evict(EvictParams(num_tokens=100))
    assert isinstance(result, EvictResult) and result.num_tokens_evicted == 2
    assert freed == [[50, 60]]
    assert match(cache, [1, 2, 3, 4]).device_indices.tolist() == [10, 20, 30, 40]
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 4
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 4
    assert freed[1] == [30, 40, 10, 20]  # the leaf, then its parent once it became a leaf: one free call
    assert cache.total_size() == 0


@pytest.mark.parametrize(
    "policy, expect",
    [("lru", ["c", "a", "b"]), ("mru", ["b", "a", "c"]), ("fifo", ["a", "b", "c"]), ("filo", ["c", "b", "a"]),
     ("lfu", ["c", "b", "a"]), ("priority", ["b", "c", "a"])],
)  # fmt: skip
def test_eviction_order_follows_the_policy(policy, expect):
    alloc, freed = free_recorder()
    cache = sim(1, mock_allocator=alloc, eviction_policy=policy)
    names = {}
    for name, start, prio in (("a", 100, 5), ("b", 200, 0), ("c", 300, 1)):
        insert(cache, seq(3, start), seq(3, start), priority=prio)
        names[start] = name
    for _ in range(3):
        match(cache, seq(3, 100))  # a: three hits
    match(cache, seq(3, 200))  # b: one hit, the latest
    order = []
    for _ in range(3):
        cache.evict(EvictParams(num_tokens=1))
        order.append(names[freed[-1][0]])
    assert order == expect


def test_a_parent_whose_last_child_goes_is_evicted_at_its_own_priority():
    alloc, freed = free_recorder()
    cache = sim(1, mock_allocator=alloc)
    insert(cache, [1, 2, 3], [1, 2, 3])
    insert(cache, [1, 2, 4], [1, 2, 4])  # [1, 2] is shared: an inner node
    insert(cache, [9, 9], [8, 8])
    match(cache, [1, 2])  # the inner node is the most recent; its leaves are older than [9, 9]
    for _ in range(3):
        cache.evict(EvictParams(num_tokens=1))
    assert freed == [[3], [4], [8, 8]]  # [1, 2] became a leaf after [4], but is newer than [9, 9]


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(["lru", "lfu", "priority", "mru", "fifo", "filo"]),
    ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "lock", "unlock", "evict"]),
                           st.lists(st.integers(1, 3), min_size=1, max_size=6), st.integers(0, 3)), max_size=40),
)  # fmt: skip
def test_each_eviction_takes_an_evictable_leaf_of_least_priority(policy, ops):
    """Against a scan of every leaf: whichever way leaves became evictable (inserted, touched,
    unlocked, uncovered by their last child's eviction), the one evicted has the least priority."""
    alloc, _ = free_recorder()
    cache = sim(1, mock_allocator=alloc, eviction_policy=policy)
    held: list[TreeNode] = []
    rank = cache.eviction_strategy.get_priority
    for op, tokens, prio in ops:
        if op == "insert":
            insert(cache, tokens, list(range(len(tokens))), priority=prio)
        elif op == "match":
            match(cache, tokens)
        elif op == "lock":
            node = match(cache, tokens).last_device_node
            if node is not cache.root_node:
                cache.inc_lock_ref(node)
                held.append(node)
        elif op == "unlock" and held:
            cache.dec_lock_ref(held.pop(prio % len(held)))
        elif op == "evict":
            leaves = [n for n in cache._nodes() if cache._is_evictable(n)]
            if not leaves:
                continue
            least = min(rank(n) for n in leaves)
            cache.evict(EvictParams(num_tokens=1))
            gone = [n for n in leaves if n.value is None]
            assert len(gone) == 1 and rank(gone[0]) == least
        cache.sanity_check()


def test_the_eviction_queue_stays_bounded_under_repeated_hits():
    cache = sim(1)
    for i in range(50):
        insert(cache, [i, i + 1, i + 2])
    for _ in range(40):
        for i in range(50):
            match(cache, [i, i + 1, i + 2])
    assert len(cache._queue) <= 2048  # 2000 pushes, rebuilt at twice the live entries (min 1024)
    cache.sanity_check()


def test_evict_frees_nothing_when_everything_is_locked():
    alloc, freed = free_recorder()
    cache = sim(1, mock_allocator=alloc)
    insert(cache, [1, 2], [1, 2])
    cache.inc_lock_ref(match(cache, [1, 2]).last_device_node)
    assert cache.evict(EvictParams(num_tokens=5)).num_tokens_evicted == 0
    assert freed == [] and cache.total_size() == 2


# --- KV events ----------------------------------------------------------------------------------------


def sglang_hash(tokens, prior=None) -> str:
    """SGLang's page hash: SHA-256 of the previous digest and the tokens as 4-byte little-endian."""
    h = hashlib.sha256()
    if prior:
        h.update(bytes.fromhex(prior))
    for t in tokens:
        h.update(t.to_bytes(4, "little"))
    return h.hexdigest()


def as_int64(digest: str) -> int:
    v = int(digest[:16], 16)
    return v - 2**64 if v >= 2**63 else v


def test_events_carry_sequence_aware_hashes_with_parent_and_tokens_per_page():
    alloc, _ = free_recorder()
    cache = sim(2, mock_allocator=alloc, enable_kv_cache_events=True)
    cache.take_events()
    insert(cache, [1, 2, 1, 2, 3, 4], [10, 11, 12, 13, 14, 15])
    stored = cache.take_events()
    h1 = sglang_hash([1, 2])
    h2 = sglang_hash([1, 2], h1)
    h3 = sglang_hash([3, 4], h2)
    assert [e.block_hashes for e in stored] == [[as_int64(h1)], [as_int64(h2)], [as_int64(h3)]]
    assert [e.parent_block_hash for e in stored] == [None, as_int64(h1), as_int64(h2)]
    assert [e.token_ids for e in stored] == [[1, 2], [1, 2], [3, 4]]
    assert all(isinstance(e, BlockStored) and e.block_size == 2 and e.medium == "GPU" for e in stored)
    # a branch after a split continues the chain from its parent's last page
    insert(cache, [1, 2, 1, 2, 9, 9], [10, 11, 12, 13, 16, 17])
    (branch,) = cache.take_events()
    assert branch.parent_block_hash == as_int64(h2) and branch.block_hashes == [as_int64(sglang_hash([9, 9], h2))]
    cache.evict(EvictParams(num_tokens=6))
    removed = cache.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(as_int64(h) for h in (h1, h2, h3, sglang_hash([9, 9], h2)))


def test_an_extra_key_seeds_the_hash_chain():
    cache = sim(1, enable_kv_cache_events=True)
    cache.take_events()
    insert(cache, [5], extra=None)
    insert(cache, [5], extra="tenant")
    plain, salted = cache.take_events()
    assert plain.block_hashes != salted.block_hashes
    seed = hashlib.sha256(b"extra_key:tenant").hexdigest()
    assert salted.block_hashes == [as_int64(sglang_hash([5], seed))] and salted.parent_block_hash is None


def test_no_events_unless_enabled():
    cache = sim(1)
    insert(cache, [1, 2, 3])
    assert cache.take_events() == [] and cache.root_node.children[1].hash_value is None


# --- requests through the real allocators and request table ---------------------------------------


@dataclass
class SimReq:
    """A request as the cache's request protocol describes it (kvpool.cache.requests)."""

    req_pool_idx: int
    origin_input_ids: list
    extra_key: Any = None
    output_ids: list = field(default_factory=list)
    last_node: Any = None
    cache_protected_len: int = 0
    prefix_indices: Any = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    priority: int = 0

    @property
    def fill_ids(self) -> list:
        return self.origin_input_ids + self.output_ids


class Engine:
    """A scheduler's use of the cache: admit (match, lock, load back from the host tier, allocate,
    evict on shortage), decode one token, chunk (cache_unfinished_req), finish, retract. Records
    each slot's content (the namespace and the token prefix whose KV it holds), so a match can be
    checked slot by slot. With ``host_policy`` the cache is a ``HiRadixCache`` over an FP8 device pool
    and a host pool, every slot's K/V rows hold a pattern of its content, and every loaded slot's
    bytes are checked against it."""

    def __init__(self, kind: str, page: int, pages: int, rows: int = 6, policy: str = "lru",
                 host_policy: Optional[str] = None, layout: str = "layer_first", host_ratio: float = 2.0, **cache_kw):  # fmt: skip
        size = pages * page
        self.pool = None
        if host_policy is not None:
            self.pool = MHATokenToKVPool(size, page, torch.float8_e4m3fn, 3, 8, 2, "cpu", v_head_dim=4)
        if kind == "token":
            self.alloc = TokenToKVPoolAllocator(size, kvcache=self.pool, validate=True)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size, page, kvcache=self.pool, validate=True)
        self.page, self.size = page, size
        self.table = ReqToTokenPool(rows, max_context_len=size + page, device="cpu")
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.alloc, page_size=page,
            eviction_policy=policy, **cache_kw,
        )  # fmt: skip
        if host_policy is None:
            self.cache = RadixCache(params)
        else:
            self.host = MHATokenToKVPoolHost(self.pool, host_ratio, 0, page, layout)
            self.cache = HiRadixCache(params, host_pool=self.host, write_policy=host_policy, load_back_threshold=0)
        self.running: dict[int, SimReq] = {}
        self.content: dict[int, tuple] = {}
        self.ids: dict[tuple, int] = {}
        self.loaded = 0

    def check_slots(self, slots: torch.Tensor, extra: Any, tokens: list) -> None:
        for i, s in enumerate(slots.tolist()):
            assert self.content.get(s) == (extra, tuple(tokens[: i + 1])), f"slot {s} at position {i} holds other KV"

    def pattern(self, contents: list[tuple], layer: int, which: str) -> torch.Tensor:
        """[n, row bytes] uint8: the K or V row bytes of each content (its id's bytes, then a mix)."""
        ids = torch.tensor([self.ids.setdefault(c, len(self.ids)) for c in contents], dtype=torch.int64)
        width = 3 * (8 if which == "k" else 4)
        rows = (ids[:, None] * 131 + torch.arange(width) * 7 + layer * 13 + (which == "v") * 57) % 256
        rows[:, :4] = torch.stack([(ids >> (8 * b)) % 256 for b in range(4)], 1)
        return rows.to(torch.uint8)

    def _rows(self, layer: int, which: str) -> torch.Tensor:
        buf = self.pool.k_buffer[layer] if which == "k" else self.pool.v_buffer[layer]
        return buf.view(torch.uint8).reshape(buf.shape[0], -1)

    def record(self, slots: list[int], contents: list[tuple]) -> None:
        """``slots`` now hold ``contents``' KV (written by the model, here its pattern)."""
        for s, c in zip(slots, contents):
            self.content[s] = c
        if self.pool is not None and slots:
            for layer in range(self.pool.layer_num):
                for which in "kv":
                    self._rows(layer, which)[T(slots)] = self.pattern(contents, layer, which)

    def check_bytes(self, slots: list[int], contents: list[tuple]) -> None:
        for layer in range(self.pool.layer_num):
            for which in "kv":
                got, want = self._rows(layer, which)[T(slots)], self.pattern(contents, layer, which)
                assert torch.equal(got, want), f"loaded {which} rows of layer {layer} differ from the KV backed up"

    def _alloc(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        if isinstance(self.alloc, TokenToKVPoolAllocator):
            return self.alloc.alloc(n)
        one = T([1])
        pre, sq = prefix * one, (prefix + n) * one
        return self.alloc.alloc_extend(pre, pre.clone(), sq, sq.clone(), last * one, n)

    def alloc_or_evict(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        got = self._alloc(n, prefix, last)
        if got is None:
            self.cache.evict(EvictParams(num_tokens=n + self.page))
            got = self._alloc(n, prefix, last)
        return got

    def admit(self, tokens: list, extra: Any = None) -> Optional[SimReq]:
        rows = self.table.alloc(1)
        if rows is None:
            return None
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1], extra)))
        prefix, last = m.device_indices, m.last_device_node
        assert len(prefix) % self.page == 0 and len(prefix) < len(tokens)
        self.check_slots(prefix, extra, tokens)
        self.cache.inc_lock_ref(last)
        if m.host_hit_length:  # as SGLang's PrefillAdder: load back under the device prefix's lock
            new, loaded_node = self.cache.init_load_back(m.last_host_node, m.host_hit_length)
            self.cache.dec_lock_ref(last)
            self.cache.inc_lock_ref(loaded_node)
            last = loaded_node
            if len(new):
                self.cache.ready_to_load_host_cache()
                contents = [(extra, tuple(tokens[: len(prefix) + i + 1])) for i in range(len(new))]
                self.check_bytes(new.tolist(), contents)
                self.record(new.tolist(), contents)
                self.loaded += len(new)
                prefix = torch.cat((prefix, new))
        p = len(prefix)
        new = self.alloc_or_evict(len(tokens) - p, p, int(prefix[-1]) if p else -1)
        if new is None:
            self.cache.dec_lock_ref(last)
            self.table.free(rows[0])
            return None
        row = rows[0]
        self.table.write((row, slice(0, len(tokens))), torch.cat((prefix, new)).to(torch.int32))
        self.record(new.tolist(), [(extra, tuple(tokens[: p + i + 1])) for i in range(len(new))])
        req = SimReq(row, list(tokens), extra, last_node=last, cache_protected_len=p, prefix_indices=prefix,
                     kv_committed_len=len(tokens), kv_allocated_len=len(tokens))  # fmt: skip
        self.running[row] = req
        return req

    def decode(self, req: SimReq, token: int) -> bool:
        n = req.kv_committed_len
        last = int(self.table.req_to_token[req.req_pool_idx, n - 1])
        if isinstance(self.alloc, TokenToKVPoolAllocator):
            got = self.alloc.alloc(1)
        else:
            sq = T([n + 1])
            got = self.alloc.alloc_decode(sq, sq.clone(), T([last]))
        if got is None:
            return False
        req.output_ids.append(token)
        self.table.req_to_token[req.req_pool_idx, n] = int(got[0])
        self.record([int(got[0])], [(req.extra_key, tuple(req.fill_ids))])
        req.kv_committed_len = req.kv_allocated_len = n + 1
        return True

    def chunk(self, req: SimReq) -> None:
        self.cache.cache_unfinished_req(req)
        row = self.table.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)
        assert torch.equal(req.prefix_indices, row)
        self.check_slots(row, req.extra_key, req.fill_ids)

    def finish(self, req: SimReq, insert: bool = True) -> None:
        tokens = req.fill_ids[: req.kv_committed_len]
        self.cache.cache_finished_req(req, is_insert=insert)
        self.table.free(req.req_pool_idx)
        del self.running[req.req_pool_idx]
        if insert:
            aligned = len(tokens) // self.page * self.page
            m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, req.extra_key)))
            assert len(m.device_indices) == aligned
            self.check_slots(m.device_indices, req.extra_key, tokens)

    def drain(self) -> None:
        """Finish everything and evict the whole tree: every slot must be back (host slots too)."""
        for req in list(self.running.values()):
            self.finish(req)
        if isinstance(self.cache, HiRadixCache):
            self.cache.check_hicache_events()
        self.cache.evict(EvictParams(num_tokens=self.size))
        assert self.cache.total_size() == 0
        assert self.alloc.available_size() == self.size // self.page * self.page
        if isinstance(self.cache, HiRadixCache):
            self.cache.evict_host(self.host.size)
            assert self.host.available_size() == self.host.size and len(self.cache.root_node.children) == 0
        self.cache.check_integrity()


@pytest.mark.parametrize("kind, page", [("token", 1), ("paged", 1), ("paged", 16), ("paged", 64)])
def test_requests_share_prefixes_through_the_tree(kind, page):
    eng = Engine(kind, page, pages=12 if page > 1 else 64)
    system = seq(2 * page + 3, 500)
    a = eng.admit(system + [1, 2, 3])
    assert a.cache_protected_len == 0
    for t in range(page + 2):
        assert eng.decode(a, 70 + t)
    eng.cache.check_integrity(eng.running.values())
    eng.finish(a)
    eng.cache.check_integrity(eng.running.values())
    b = eng.admit(system + [9])
    assert b.cache_protected_len == len(system) // page * page  # the system prompt's whole pages
    c = eng.admit(system + [1, 2, 3] + [70 + t for t in range(page + 2)] + [5])
    assert c.cache_protected_len == (len(system) + 3 + page + 2) // page * page
    eng.cache.check_integrity(eng.running.values())
    assert eng.cache.protected_size() == c.cache_protected_len
    eng.chunk(b)
    eng.finish(b, insert=False)  # retracted: its pages go back, the tree keeps what it had
    eng.cache.check_integrity(eng.running.values())
    eng.drain()


@pytest.mark.parametrize("page", [1, 16])
def test_chunked_prefill_continues_on_the_trees_slots(page):
    eng = Engine("paged", page, pages=12)
    shared = seq(3 * page, 100)
    one = eng.admit(shared + [1])
    two = eng.admit(shared + seq(page + 1, 900))  # admitted together: both compute the shared pages
    own = eng.table.req_to_token[two.req_pool_idx, : 3 * page].to(torch.int64).clone()
    eng.finish(one)
    eng.chunk(two)  # its copies of the shared pages go back; it continues on the tree's
    assert two.cache_protected_len == (4 * page + 1) // page * page
    tree = eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(shared))).device_indices
    assert torch.equal(two.prefix_indices[: 3 * page], tree) and not torch.equal(tree, own)
    assert eng.cache.protected_size() == two.cache_protected_len
    eng.cache.check_integrity(eng.running.values())
    eng.drain()


def test_disable_finished_insert_gives_the_pages_back():
    eng = Engine("token", 1, pages=32, disable_finished_insert=True)
    req = eng.admit(seq(10))
    eng.cache.cache_finished_req(req)
    eng.table.free(req.req_pool_idx)
    del eng.running[req.req_pool_idx]
    assert eng.cache.total_size() == 0 and eng.alloc.available_size() == 32
    eng.cache.check_integrity()


def test_the_committed_length_comes_from_the_request():
    """Without kv_committed_len (SGLang's earlier releases) the last generated token has no KV yet."""
    eng = Engine("token", 1, pages=16)
    req = eng.admit(seq(6))
    eng.table.req_to_token[req.req_pool_idx, 6] = int(eng.alloc.alloc(1)[0])  # the first output's KV

    class Earlier:
        pass

    old = Earlier()
    old.__dict__.update({k: v for k, v in vars(req).items() if k not in ("kv_committed_len", "kv_allocated_len")})
    old.output_ids = [1, 2]
    eng.cache.cache_finished_req(old)
    assert eng.cache.total_size() == 7 and eng.alloc.available_size() == 16 - 7


# --- integrity ----------------------------------------------------------------------------------------


def test_check_integrity_finds_leaks_double_owners_and_bad_counts():
    eng = Engine("paged", 4, pages=8)
    req = eng.admit(seq(9))
    eng.finish(req)
    running = eng.admit(seq(8) + [77, 78, 79])
    eng.cache.check_integrity(eng.running.values())
    leaked = eng.alloc.alloc(4)
    with pytest.raises(IntegrityError, match="leaked"):
        eng.cache.check_integrity(eng.running.values())
    eng.alloc.free(leaked)
    tree_slots = eng.cache.all_values_flatten()
    eng.alloc.free(tree_slots[-4:])  # a tree page handed back behind the tree's back
    with pytest.raises(IntegrityError, match="owned but free in the allocator"):
        eng.cache.check_integrity(eng.running.values())
    eng2 = Engine("token", 1, pages=16)
    r = eng2.admit(seq(5))
    eng2.cache.insert(InsertParams(key=RadixKey(seq(5)), value=eng2.table.req_to_token[r.req_pool_idx, :5].to(torch.int64)))
    with pytest.raises(IntegrityError, match="owned twice"):
        eng2.cache.check_integrity(eng2.running.values())
    eng3 = Engine("token", 1, pages=16)
    eng3.admit(seq(5))
    eng3.cache.evictable_size_ += 1
    with pytest.raises(IntegrityError, match="evictable/protected sizes"):
        eng3.cache.check_integrity(eng3.running.values())
    assert running.req_pool_idx in eng.running


def test_check_integrity_finds_a_request_whose_prefix_is_not_its_nodes_path():
    eng = Engine("token", 1, pages=16)
    eng.finish(eng.admit(seq(6)))
    req = eng.admit(seq(6) + [1])
    req.cache_protected_len = 2
    with pytest.raises(IntegrityError, match="cache_protected_len"):
        eng.cache.check_integrity(eng.running.values())


# --- bad input ----------------------------------------------------------------------------------------


def populated(**kwargs) -> RadixCache:
    cache = sim(2, **kwargs)
    insert(cache, [1, 2, 3, 4], [10, 11, 12, 13])
    insert(cache, [1, 2, 5, 6], [10, 11, 14, 15])
    return cache


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (lambda c: c.insert(InsertParams(key=[1, 2])), TypeError, "key must be a RadixKey, got list"),
        (lambda c: c.match_prefix(MatchPrefixParams(key=(1, 2))), TypeError, "key must be a RadixKey, got tuple"),
        (lambda c: c.match_prefix([1, 2]), TypeError, "key must be a RadixKey, got list"),
        (lambda c: c.insert(InsertParams(key=RadixKey([1, 2.5]), value=T([1, 2]))), TypeError,
         r"key.token_ids must hold ints in the int64 range, got 2.5 \(float\) at position 1"),
        (lambda c: c.insert(InsertParams(key=RadixKey("ab"), value=T([1, 2]))), TypeError, "sequence of ints, got str"),
        (lambda c: c.match_prefix(MatchPrefixParams(key=RadixKey([1, 2**64]))), TypeError, "int64 range"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8, 9]), value=T([1, 2]))), ValueError,
         r"value must have one slot per key token \(3\), got 2"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8]), value=torch.tensor([1.0, 2.0]))), ValueError,
         "value must be int32 or int64, got torch.float32"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8]), value=T([[1, 2]]))), ValueError, "value must be 1-D"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8]), value=[1, 2])), TypeError, "value must be a torch.Tensor, got list"),
        (lambda c: c.insert(InsertParams(key=RadixKey([7, 8]), value=T([1, 2]).to("meta"))), ValueError, "value must be on cpu, got meta"),
        (lambda c: c.insert(InsertParams(key=RadixKey([(7, 8)], is_bigram=True), value=T([1]))), ValueError, "is_eagle=False"),
        (lambda c: c.dec_lock_ref(c.root_node.children[(1, 2)]), ValueError, r"not locked \(lock_ref = 0\)"),
        (lambda c: c.dec_lock_ref("node"), TypeError, "node must be a TreeNode, got str"),
        (lambda c: c.inc_lock_ref(populated().root_node.children[(1, 2)]), ValueError, "not attached to it"),
        (lambda c: c.evict(EvictParams(num_tokens=-1)), ValueError, "num_tokens must be a non-negative int, got -1"),
        (lambda c: c.evict(EvictParams(num_tokens=True)), ValueError, "num_tokens must be a non-negative int, got True"),
        (lambda c: c.evict(2.0), ValueError, "num_tokens must be a non-negative int, got 2.0"),
        (lambda c: c.evict(EvictParams(num_tokens=2, swa_num_tokens=2)), ValueError, "swa_num_tokens must be 0"),
        (lambda c: c.evict(EvictParams(num_tokens=2, mamba_num=1)), ValueError, "mamba_num must be 0"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)  # fmt: skip
def test_bad_input_raises_and_leaves_the_tree_as_it_was(call, exc, msg):
    cache = populated(enable_kv_cache_events=True)
    before = tree_state(cache)
    with pytest.raises(exc, match=msg):
        call(cache)
    assert tree_state(cache) == before
    cache.sanity_check()


def test_locking_an_evicted_node_raises():
    alloc, _ = free_recorder()
    cache = sim(1, mock_allocator=alloc)
    insert(cache, [1, 2], [1, 2])
    node = match(cache, [1, 2]).last_device_node
    cache.evict(EvictParams(num_tokens=2))
    with pytest.raises(ValueError, match="evicted"):
        cache.inc_lock_ref(node)


def test_evicting_from_a_disabled_cache_raises():
    cache = sim(1, disable=True)
    with pytest.raises(ValueError, match="disable=True and holds nothing to evict"):
        cache.evict(EvictParams(num_tokens=1))


def test_a_cache_with_an_allocator_needs_the_slots():
    cache = RadixCache(None, TokenToKVPoolAllocator(8), 1)
    with pytest.raises(ValueError, match="value must be the key's device slots"):
        cache.insert(InsertParams(key=RadixKey([1, 2])))
    assert cache.total_size() == 0


def test_validate_checks_that_each_page_is_one_aligned_page():
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    assert alloc.alloc(16).tolist() == list(range(4, 20))
    cache = RadixCache(None, alloc, 4, validate=True)
    with pytest.raises(ValueError, match=r"whole aligned pages of 4 consecutive slots, got \[5, 6, 7, 8\] for page 1"):
        cache.insert(InsertParams(key=RadixKey(seq(8)), value=T([4, 5, 6, 7, 5, 6, 7, 8])))
    assert cache.total_size() == 0
    assert cache.insert(InsertParams(key=RadixKey(seq(9)), value=T([4, 5, 6, 7, 12, 13, 14, 15, 3]))).prefix_len == 0


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(page_size=0), "page_size must be a positive int, got 0"),
        (dict(page_size=1, eviction_policy="lru2"), "eviction_policy must be one of 'lru', 'lfu'"),
        (dict(page_size=4, token_to_kv_pool_allocator=PagedTokenToKVPoolAllocator(64, 16)),
         "page_size must be the allocator's page_size = 16, got 4"),
        (dict(page_size=1, sliding_window_size=128), "sliding_window_size must be None"),
        (dict(page_size=1, cache_ttl_seconds=5.0), "cache_ttl_seconds must be None"),
        (dict(page_size=1, enable_mamba_extra_buffer=True), "enable_mamba_extra_buffer must be False"),
    ],
)  # fmt: skip
def test_bad_construction(kwargs, msg):
    kwargs = {"disable": False, "req_to_token_pool": None, "token_to_kv_pool_allocator": None, **kwargs}
    with pytest.raises(ValueError, match=msg):
        RadixCache(CacheInitParams(**kwargs))


def test_a_request_protecting_more_than_it_committed_is_refused():
    eng = Engine("token", 1, pages=16)
    req = eng.admit(seq(4))
    req.cache_protected_len = 6
    before = (tree_state(eng.cache), eng.alloc.available_size())
    with pytest.raises(ValueError, match=r"req.cache_protected_len must be in 0..4 .*, got 6"):
        eng.cache.cache_finished_req(req)
    assert (tree_state(eng.cache), eng.alloc.available_size()) == before


# --- the state machine --------------------------------------------------------------------------------


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests arrive with shared prefixes, decode, chunk, finish or are retracted; the test also
    evicts and takes extra locks. After every step the tree, the allocator and the request table
    agree (check_integrity: no leak, no slot owned twice), and every match returns slots holding
    exactly the KV of the tokens asked for."""

    @initialize(
        setup=st.sampled_from([("token", 1), ("paged", 1), ("paged", 16), ("paged", 64)]),
        pages=st.integers(4, 12), policy=st.sampled_from(["lru", "lfu", "priority"]), seed=st.integers(0, 3),
    )  # fmt: skip
    def setup(self, setup, pages, policy, seed):
        kind, page = setup
        self.eng = Engine(kind, page, pages, policy=policy)
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 6) for _ in range(2 * page + 2)] for _ in range(2)]
        self.held: list[TreeNode] = []
        self.finished: list[tuple[list, Any]] = []

    def tokens(self, data) -> list:
        page = self.eng.page
        stem = data.draw(st.sampled_from(self.stems))
        cut = data.draw(st.integers(0, len(stem)))
        tail = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=page + 2))
        return stem[:cut] + tail

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def admit(self, data, extra):
        self.eng.admit(self.tokens(data), extra)

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), steps=st.integers(1, 3))
    def decode(self, data, steps):
        req = data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))
        for _ in range(steps):
            if req.kv_committed_len + 1 > self.eng.table.max_context_len or not self.eng.decode(req, data.draw(st.integers(1, 3))):
                break

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def chunk(self, data):
        self.eng.chunk(data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx))))

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish_or_retract(self, data, insert):
        req = data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))
        self.finished.append((req.fill_ids[: req.kv_committed_len] + [1], req.extra_key))
        self.eng.finish(req, insert)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), evict_first=st.booleans())
    def readmit(self, data, evict_first):
        """A request that continues a finished one (the next turn of a chat), maybe after its pages
        were evicted (with a host tier: parked there, loaded back)."""
        tokens, extra = data.draw(st.sampled_from(self.finished))
        if evict_first:
            self.evict(self.eng.size)
        self.eng.admit(tokens, extra)

    @rule(n=st.integers(0, 200))
    def evict_some(self, n):
        self.evict(n)

    def evict(self, n):
        cache = self.eng.cache
        locked = [(node, node.value.tolist()) for node in cache._nodes() if node.lock_ref > 0 and node is not cache.root_node]
        evictable, available = cache.evictable_size(), self.eng.alloc.available_size()
        got = cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted
        assert got >= min(n, evictable) and cache.evictable_size() == evictable - got
        assert self.eng.alloc.available_size() == available + got
        for node, value in locked:
            assert node.value is not None and node.value.tolist() == value, "a locked node was evicted"

    @rule(data=st.data())
    def lock(self, data):
        m = self.eng.cache.match_prefix(MatchPrefixParams(key=RadixKey(self.tokens(data))))
        if m.last_device_node is not self.eng.cache.root_node:
            self.eng.cache.inc_lock_ref(m.last_device_node)
            self.held.append(m.last_device_node)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data):
        node = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.eng.cache.dec_lock_ref(node)

    @rule()
    def unlock_an_unlocked_node(self):
        cache = self.eng.cache
        free = [n for n in cache._nodes() if n.lock_ref == 0 and n.value is not None and n is not cache.root_node]
        if free:
            before = tree_state(cache)
            with pytest.raises(ValueError, match="not locked"):
                cache.dec_lock_ref(free[0])
            assert tree_state(cache) == before

    @invariant()
    def tree_allocator_and_table_agree(self):
        self.eng.cache.check_integrity(self.eng.running.values())

    def teardown(self):
        if hasattr(self, "eng"):
            for node in self.held:
                self.eng.cache.dec_lock_ref(node)
            self.eng.drain()


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(TestPrefixCacheMachine.settings, stateful_step_count=30)


# --- the host tier (HiRadixCache) ---------------------------------------------------------------------

HOST_POLICIES = ["write_through", "write_through_selective", "write_back"]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("host_policy", HOST_POLICIES)
def test_evicted_pages_come_back_from_the_host_byte_for_byte(host_policy, page, layout):
    eng = Engine("paged", page, pages=12 if page > 1 else 96, host_policy=host_policy, layout=layout)
    prompt = seq(3 * page + 2, 300)
    cached = len(prompt) // page * page
    eng.finish(eng.admit(prompt))
    if host_policy == "write_through_selective":  # a second use backs the pages up
        eng.finish(eng.admit(prompt))
    cache = eng.cache
    backed = sum(len(n.host_value) for n in cache._nodes() if n is not cache.root_node and n.host_value is not None)
    assert backed == (0 if host_policy == "write_back" else cached)
    assert cache.evict(EvictParams(num_tokens=eng.size)).num_tokens_evicted == cached
    assert cache.total_size() == 0 and eng.alloc.available_size() == eng.size
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt)))
    assert len(m.device_indices) == 0 and m.host_hit_length == cached and m.last_device_node is cache.root_node
    eng.cache.check_integrity()
    again = eng.admit(prompt)  # loads the pages back (checked against the KV written at first)
    assert eng.loaded == again.cache_protected_len == (len(prompt) - 1) // page * page
    cache.check_hicache_events()
    cache.check_integrity(eng.running.values())
    eng.drain()


def test_selective_write_through_backs_up_only_what_is_used_twice():
    eng = Engine("paged", 4, pages=16, host_policy="write_through_selective")
    eng.finish(eng.admit(seq(9, 100)))
    once = [n for n in eng.cache._nodes() if n is not eng.cache.root_node]
    assert all(n.host_value is None for n in once)
    eng.finish(eng.admit(seq(9, 100)))
    assert all(n.host_value is not None for n in eng.cache._nodes() if n is not eng.cache.root_node)
    eng.cache.evict(EvictParams(num_tokens=64))
    eng.finish(eng.admit(seq(9, 100)))
    assert eng.loaded == 8
    eng.drain()


def test_a_full_host_evicts_host_only_leaves_in_order_then_drops_what_it_cannot_keep():
    eng = Engine("paged", 4, pages=16, host_policy="write_through", host_ratio=0.5)  # 32 host slots
    cache = eng.cache
    prompts = [seq(9, 1000 * (i + 1)) for i in range(5)]  # 8 cached tokens each
    for p in prompts[:4]:
        eng.finish(eng.admit(p))
    assert eng.host.available_size() == 0
    cache.evict(EvictParams(num_tokens=64))  # all four on the host only
    eng.finish(eng.admit(prompts[4]))  # its backup makes room: the oldest host leaf goes
    assert match(cache, prompts[0][:8]).host_hit_length == 0
    assert all(match(cache, p[:8]).host_hit_length == 8 for p in prompts[1:4])
    cache.check_integrity()
    for n in cache._nodes():
        if n is not cache.root_node and n.host_value is not None and n.value is None:
            n.protect_host()  # held (say, by a storage write): the host cannot make room
    eng.finish(eng.admit(seq(9, 9000)))
    fresh = match(cache, seq(8, 9000)).last_device_node
    assert fresh.host_value is None  # no room: it stays on the device only
    cache.evict(EvictParams(num_tokens=64))
    assert len(match(cache, seq(8, 9000)).device_indices) == 0 and match(cache, seq(8, 9000)).host_hit_length == 0
    for n in cache._nodes():
        while n.host_ref_counter:
            n.release_host()
    cache.check_integrity()
    eng.drain()


def test_inserting_host_only_pages_again_takes_the_new_slots():
    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    eng.finish(eng.admit(seq(9, 100)))
    eng.cache.evict(EvictParams(num_tokens=64))
    slots = eng.alloc.alloc(8)
    eng.record(slots.tolist(), [(None, tuple(seq(i + 1, 100))) for i in range(8)])
    assert eng.cache.insert(InsertParams(key=RadixKey(seq(8, 100)), value=slots)).prefix_len == 0
    m = match(eng.cache, seq(8, 100))
    assert m.device_indices.tolist() == slots.tolist() and m.host_hit_length == 0
    assert m.last_device_node.host_value is not None  # the host copy stays
    eng.cache.check_integrity()
    eng.drain()


def test_load_back_below_the_threshold_or_beyond_the_quota_is_declined():
    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    cache = eng.cache
    eng.finish(eng.admit(seq(9, 100)))
    cache.evict(EvictParams(num_tokens=64))
    node = match(cache, seq(8, 100)).last_host_node
    cache.load_back_threshold = 9
    assert (len(cache.init_load_back(node)[0]), cache.init_load_back(node)[1]) == (0, cache.root_node)
    cache.load_back_threshold = 0
    slots, last = cache.init_load_back(node, 8, mem_quota=7)
    assert len(slots) == 0 and last is cache.root_node and eng.alloc.available_size() == 64
    slots, last = cache.init_load_back(node, 8, mem_quota=8)
    assert len(slots) == 8 and last is node and node.lock_ref == 1  # held until the load completes
    assert cache.ready_to_load_host_cache() == 0 and cache.ready_to_load_host_cache() == -1
    cache.check_hicache_events()
    assert node.lock_ref == 0
    cache.check_integrity()


def test_nodes_stay_locked_while_their_backup_or_load_is_in_flight(monkeypatch):
    class Pending:
        done = False

        def query(self):
            return self.done

    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    cache, host = eng.cache, eng.host
    event = Pending()
    backup = host.backup_from_device_all_layer
    monkeypatch.setattr(host, "backup_from_device_all_layer", lambda *a, **k: (backup(*a, **k), event)[1])
    eng.finish(eng.admit(seq(9, 100)))
    node = match(cache, seq(8, 100)).last_device_node
    assert node.lock_ref == 1 and cache.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 0
    cache.check_hicache_events()
    assert node.lock_ref == 1
    event.done = True
    cache.check_hicache_events()
    assert node.lock_ref == 0 and cache.evict(EvictParams(num_tokens=64)).num_tokens_evicted == 8
    cache.check_integrity()


def test_hiradix_takes_sglangs_server_args():
    from types import SimpleNamespace

    pool = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64, 4, kvcache=pool)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)
    args = SimpleNamespace(hicache_ratio=1.5, hicache_size=0, hicache_mem_layout="page_first", hicache_write_policy="write_back",
                           hicache_io_backend="direct", hicache_storage_backend=None)  # fmt: skip
    cache = HiRadixCache(params, args)
    assert (cache.write_policy, cache.io_backend, cache.token_to_kv_pool_host.layout) == ("write_back", "direct", "page_first")
    assert cache.token_to_kv_pool_host.size == 96 and pool.layer_transfer_counter is cache.token_to_kv_pool_host.layer_transfer_counter
    with pytest.raises(ValueError, match="hicache_storage_backend must be None"):
        HiRadixCache(params, SimpleNamespace(**{**vars(args), "hicache_storage_backend": "file"}))


@pytest.mark.parametrize(
    "kwargs, exc, msg",
    [
        (dict(write_policy="write_around"), ValueError, "write_policy must be one of write_through"),
        (dict(io_backend="dma"), ValueError, "io_backend must be one of kernel, direct"),
        (dict(other_pool=True), ValueError, "host_pool must be built over the allocator's device pool"),
        (dict(other_page=True), ValueError, "host_pool's page_size must be the cache's 4, got 8"),
        (dict(no_kvcache=True), ValueError, "allocator built with kvcache="),
        (dict(no_host=True), ValueError, "needs host_pool= or SGLang's server_args"),
    ],
)  # fmt: skip
def test_bad_hiradix_construction(kwargs, exc, msg):
    pool = MHATokenToKVPool(64, 4, torch.bfloat16, 2, 8, 2, "cpu")
    alloc = PagedTokenToKVPoolAllocator(64, 4, kvcache=None if kwargs.pop("no_kvcache", False) else pool)
    host_of = MHATokenToKVPool(64, 8, torch.bfloat16, 2, 8, 2, "cpu") if kwargs.pop("other_pool", False) else pool
    host = MHATokenToKVPoolHost(host_of, 2.0, 0, 8 if kwargs.pop("other_page", False) else 4, "layer_first")
    if kwargs.pop("no_host", False):
        host = None
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=4)
    with pytest.raises(exc, match=msg):
        HiRadixCache(params, host_pool=host, **kwargs)


def test_hiradix_bad_load_back_input():
    eng = Engine("paged", 4, pages=16, host_policy="write_through")
    with pytest.raises(TypeError, match="last_node must be a TreeNode, got str"):
        eng.cache.init_load_back("node")
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int"):
        eng.cache.evict_host(-1)
    other = Engine("paged", 4, pages=16, host_policy="write_through")
    other.finish(other.admit(seq(9)))
    with pytest.raises(ValueError, match="not attached to it"):
        eng.cache.init_load_back(match(other.cache, seq(8)).last_device_node)


class HostTierMachine(PrefixCacheMachine):
    """The same requests over a HiRadixCache: evicted pages park on the host and come back byte for
    byte; the host pool's slots are owned by exactly the nodes holding them."""

    @initialize(
        setup=st.sampled_from([("paged", 1), ("paged", 16), ("token", 1)]), pages=st.integers(4, 10),
        host_policy=st.sampled_from(HOST_POLICIES), ratio=st.sampled_from([0.5, 1.0, 2.0]), seed=st.integers(0, 3),
    )  # fmt: skip
    def setup(self, setup, pages, host_policy, ratio, seed):
        kind, page = setup
        pages = pages if page > 1 else pages * 8
        self.eng = Engine(kind, page, pages, host_policy=host_policy, host_ratio=ratio)
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 6) for _ in range(2 * page + 2)] for _ in range(2)]
        self.held = []
        self.finished = []

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def next_turn_after_eviction(self, data):
        """A chat's turn ends, its pages are evicted to the host, and its next turn comes back."""
        req = data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))
        tokens = req.fill_ids[: req.kv_committed_len] + [1]
        self.eng.finish(req)
        self.evict(self.eng.size)
        self.eng.admit(tokens, req.extra_key)

    @rule(n=st.integers(0, 200))
    def evict_host(self, n):
        before = self.eng.host.available_size()
        freed = self.eng.cache.evict_host(n)
        assert self.eng.host.available_size() == before + freed

    @invariant()
    def transfers_complete(self):
        self.eng.cache.check_hicache_events()


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(TestHostTierMachine.settings, stateful_step_count=30)


@pytest.mark.gpu
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_gpu_load_back_arrives_layer_by_layer_through_the_getters(io_backend):
    dev = "cuda"
    pool = MHATokenToKVPool(1024, 16, torch.float8_e4m3fn, 8, 128, 4, dev)
    alloc = PagedTokenToKVPoolAllocator(1024, 16, device=dev, kvcache=pool)
    host = MHATokenToKVPoolHost(pool, 2.0, 0, 16, "layer_first")
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=16)
    cache = HiRadixCache(params, host_pool=host, io_backend=io_backend, load_back_threshold=0)
    slots = alloc.alloc(256)
    g = torch.Generator(device=dev).manual_seed(0)
    for layer in range(4):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            buf.view(torch.uint8)[slots] = torch.randint(0, 256, (256, 8, 128), dtype=torch.uint8, device=dev, generator=g)
    want = [(pool.get_key_buffer(i)[slots].view(torch.uint8).clone(), pool.get_value_buffer(i)[slots].view(torch.uint8).clone()) for i in range(4)]
    cache.insert(InsertParams(key=RadixKey(seq(256)), value=slots))
    node = match(cache, seq(256)).last_device_node
    assert node.lock_ref == 1  # the backup is in flight
    torch.cuda.synchronize()
    cache.check_hicache_events()
    assert node.lock_ref == 0
    cache.evict(EvictParams(num_tokens=256))
    m = match(cache, seq(256))
    new, last = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert len(new) == 256 and last.lock_ref == 1
    cache.ready_to_load_host_cache()
    for i in range(4):  # the getters make the stream wait for the layer's load
        assert torch.equal(pool.get_key_buffer(i)[new].view(torch.uint8), want[i][0])
        assert torch.equal(pool.get_value_buffer(i)[new].view(torch.uint8), want[i][1])
    torch.cuda.synchronize()
    cache.check_hicache_events()
    assert last.lock_ref == 0
    cache.check_integrity()


# --- hybrid models: state snapshots (MambaRadixCache) ---------------------------------------------

from kvpool import HybridReqToTokenPool, MambaCacheParams, MambaStateShape  # noqa: E402
from kvpool.cache import MambaRadixCache  # noqa: E402

STATE = MambaCacheParams(MambaStateShape(conv=(6, 3), temporal=(2, 3, 4)), layers=(1, 3))


class HybridEngine:
    """A hybrid model's scheduler on a MambaRadixCache: each request has a state slot that holds the
    state after its tokens (here a byte pattern of its content), and with the extra buffer a track
    slot snapshots it at every whole page. Every match is checked: its KV slots hold its tokens'
    KV, and the node it ends on holds the state after exactly those tokens."""

    def __init__(self, page: int, pages: int, states: int, rows: int = 6, extra: bool = False):
        size = pages * page
        self.page, self.size = page, size
        self.table = HybridReqToTokenPool(size=rows, mamba_size=states, max_context_len=size + page, device="cpu",
                                          cache_params=STATE, enable_mamba_extra_buffer=extra)  # fmt: skip
        self.pool = self.table.mamba_pool
        self.alloc = (TokenToKVPoolAllocator(size, validate=True) if page == 1 else PagedTokenToKVPoolAllocator(size, page, validate=True))
        self.cache = MambaRadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.table, token_to_kv_pool_allocator=self.alloc, page_size=page,
            enable_mamba_extra_buffer=extra,
        ), mamba_cache_chunk_size=page)  # fmt: skip
        self.extra = extra
        self.running: dict[int, SimReq] = {}
        self.content: dict[int, tuple] = {}
        self.ids: dict[tuple, int] = {}

    def state_bytes(self, slot: int) -> list[torch.Tensor]:
        return [t[:, slot].reshape(t.shape[0], -1).view(torch.uint8) for t in (*self.pool.conv, self.pool.temporal)]

    def write_state(self, slot: int, content: tuple) -> None:
        cid = self.ids.setdefault(content, len(self.ids))
        for b in self.state_bytes(slot):
            b.copy_((torch.arange(b.numel()).view(b.shape) * 3 + cid * 101) % 256)
            b[:, :4] = torch.tensor([(cid >> (8 * i)) % 256 for i in range(4)], dtype=torch.uint8)

    def check_state(self, slot: int, content: tuple) -> None:
        cid = self.ids.get(content)
        for b in self.state_bytes(slot):
            got = sum(int(x) << (8 * i) for i, x in enumerate(b[0, :4].tolist()))
            assert cid is not None and got == cid, f"state slot {slot} holds another state than after {len(content[1])} tokens"

    def check_match(self, m, extra: Any, tokens: list) -> None:
        n = len(m.device_indices)
        for i, s in enumerate(m.device_indices.tolist()):
            assert self.content.get(s) == (extra, tuple(tokens[: i + 1])), f"slot {s} at position {i} holds other KV"
        if n:
            node = m.last_device_node
            assert node.mamba_value is not None, "KV returned without a state snapshot"
            self.check_state(int(node.mamba_value), (extra, tuple(tokens[:n])))

    def _alloc(self, n: int, prefix: int, last: int) -> Optional[torch.Tensor]:
        if self.page == 1:
            return self.alloc.alloc(n)
        one = T([1])
        pre, sq = prefix * one, (prefix + n) * one
        return self.alloc.alloc_extend(pre, pre.clone(), sq, sq.clone(), last * one, n)

    def compute(self, req: SimReq, start: int) -> None:
        """The model ran tokens start.. of req: its state slot now holds the state after all of them,
        and (extra buffer) its track slots snapshotted it at each whole page passed."""
        tokens = req.fill_ids
        if self.extra:
            for end in range((start // self.page + 1) * self.page, len(tokens) + 1, self.page):
                track = int(req.mamba_ping_pong_track_buffer[req.mamba_next_track_idx])
                self.write_state(track, (req.extra_key, tuple(tokens[:end])))
                req.mamba_last_track_seqlen = end
                req.mamba_next_track_idx = self.table.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)
        self.write_state(int(req.mamba_pool_idx), (req.extra_key, tuple(tokens)))

    def admit(self, tokens: list, extra: Any = None) -> Optional[SimReq]:
        req = SimReq(-1, list(tokens), extra)
        del req.req_pool_idx
        req.mamba_pool_idx = None
        req.mamba_last_track_seqlen = None
        if self.table.alloc([req]) is None:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=2))
            if self.table.alloc([req]) is None:
                return None
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:-1], extra), cow_mamba=True, req=req))
        self.check_match(m, extra, tokens)
        p = len(m.device_indices)
        if p:
            self.check_state(int(req.mamba_pool_idx), (extra, tuple(tokens[:p])))  # forked into its own slot
        self.cache.inc_lock_ref(m.last_device_node)
        new = self._alloc(len(tokens) - p, p, -1)
        if new is None:
            self.cache.evict(EvictParams(num_tokens=len(tokens) - p + self.page))
            new = self._alloc(len(tokens) - p, p, -1)
        if new is None:
            self.cache.dec_lock_ref(m.last_device_node)
            self.table.free_mamba_cache(req)
            self.table.free(req)
            return None
        row = req.req_pool_idx
        self.table.write((row, slice(0, len(tokens))), torch.cat((m.device_indices, new)).to(torch.int32))
        for i, s in enumerate(new.tolist()):
            self.content[s] = (extra, tuple(tokens[: p + i + 1]))
        req.last_node, req.cache_protected_len, req.prefix_indices = m.last_device_node, p, m.device_indices
        req.kv_committed_len = req.kv_allocated_len = len(tokens)
        self.compute(req, p)
        self.running[row] = req
        return req

    def decode(self, req: SimReq, token: int) -> bool:
        n = req.kv_committed_len
        if self.page == 1:
            got = self.alloc.alloc(1)
        else:
            sq = T([n + 1])
            got = self.alloc.alloc_decode(sq, sq.clone(), T([int(self.table.req_to_token[req.req_pool_idx, n - 1])]))
        if got is None:
            return False
        req.output_ids.append(token)
        self.table.req_to_token[req.req_pool_idx, n] = int(got[0])
        self.content[int(got[0])] = (req.extra_key, tuple(req.fill_ids))
        req.kv_committed_len = req.kv_allocated_len = n + 1
        self.compute(req, n)
        return True

    def finish(self, req: SimReq, insert: bool = True) -> None:
        tokens = req.fill_ids[: req.kv_committed_len]
        self.cache.cache_finished_req(req, is_insert=insert)
        self.table.free(req)
        del self.running[[r for r, q in self.running.items() if q is req][0]]
        self.check_match(self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens, req.extra_key))), req.extra_key, tokens)

    def chunk(self, req: SimReq) -> None:
        self.cache.cache_unfinished_req(req)
        row = self.table.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)
        assert torch.equal(req.prefix_indices, row)

    def drain(self) -> None:
        for req in list(self.running.values()):
            self.finish(req)
        self.cache.evict(EvictParams(num_tokens=self.size))
        assert self.cache.total_size() == (0, 0) and self.alloc.available_size() == self.size
        assert self.pool.available_size() == self.pool.size
        self.cache.check_integrity()


def test_a_match_returns_kv_only_up_to_a_state_snapshot():
    cache = MambaRadixCache.create_simulated()
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=T([10, 11, 12, 13]), mamba_value=T([7])))
    cache.insert(InsertParams(key=RadixKey([1, 2, 5]), value=T([10, 11, 15]), mamba_value=T([8])))
    # [1, 2] is now a node without a state: a match ending there returns nothing
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 9])))
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root_node
    assert m.mamba_branching_seqlen is None  # 2 tokens aligned down to the 64-token chunk: 0, no branching point
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 9])))
    assert m.device_indices.tolist() == [10, 11, 12, 13] and int(m.last_device_node.mamba_value) == 7
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3])))  # ends inside [3, 4]: its state is after 4
    assert len(m.device_indices) == 0
    assert cache.total_size() == (5, 2)
    result = cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([10, 11]), mamba_value=T([9])))
    assert (result.prefix_len, result.mamba_exist) == (2, False)  # the state-less node takes it
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 9]))).device_indices.tolist() == [10, 11]
    assert cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([10, 11]), mamba_value=T([6]))).mamba_exist
    cache.sanity_check()


def test_the_branching_point_is_the_match_aligned_to_the_chunk():
    cache = MambaRadixCache.create_simulated(enable_mamba_extra_buffer=True, page_size=2)
    cache.mamba_cache_chunk_size = 4
    cache.insert(InsertParams(key=RadixKey(seq(10)), value=T(seq(10)), mamba_value=T([3])))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(9))))  # 8 tokens deep, no state there
    assert len(m.device_indices) == 0 and m.mamba_branching_seqlen == 8
    assert cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(10)))).mamba_branching_seqlen is None


@pytest.mark.parametrize("page, extra", [(1, False), (1, True), (16, True)])
def test_hybrid_requests_share_prefixes_with_their_states(page, extra):
    eng = HybridEngine(page, pages=12 if page > 1 else 96, states=16, extra=extra)
    system = seq(2 * page + 3, 500)
    a = eng.admit(system + [1, 2])
    for t in range(page + 1):
        assert eng.decode(a, 70 + t)
    eng.cache.check_integrity(eng.running.values())
    eng.finish(a)
    b = eng.admit(system + [1, 2] + [70 + t for t in range(page + 1)] + [9, 9])
    cached = len(system) + 2 + page + 1 if not extra else (len(system) + 2 + page + 1) // page * page
    assert b.cache_protected_len == cached  # up to the finished request's state
    eng.cache.check_integrity(eng.running.values())
    eng.chunk(b)
    eng.cache.check_integrity(eng.running.values())
    eng.finish(b)
    eng.drain()


def test_the_fork_is_copy_on_write():
    eng = HybridEngine(1, pages=64, states=8)
    eng.finish(eng.admit(seq(6)))
    req = eng.admit(seq(6) + [1])
    node = req.last_node
    snapshot = [b.clone() for b in eng.state_bytes(int(node.mamba_value))]
    eng.write_state(int(req.mamba_pool_idx), ("overwritten", ()))  # the request's state moves on
    assert all(torch.equal(a, b) for a, b in zip(snapshot, eng.state_bytes(int(node.mamba_value))))
    assert int(req.mamba_pool_idx) != int(node.mamba_value)
    eng.cache.check_integrity(eng.running.values())


def test_states_are_evicted_apart_from_kv_and_tombstones_go_with_their_last_leaf():
    eng = HybridEngine(1, pages=64, states=12)
    cache = eng.cache
    eng.finish(eng.admit(seq(4)))
    eng.finish(eng.admit(seq(4) + seq(3, 900)))  # [1000..1003] then [900..902]: two snapshots on a path
    assert cache.total_size() == (7, 2)
    inner = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(4)))).last_device_node
    assert inner.mamba_value is not None and inner.children
    # the least recently used state first: the inner one; its node stays as a tombstone
    cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(4) + seq(3, 900))))
    result = cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    assert (result.num_tokens_evicted, result.mamba_num_evicted) == (0, 1)
    assert inner.mamba_value is None and cache.total_size() == (7, 1)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(4) + [5])))
    assert len(m.device_indices) == 0  # the KV is there, its state is not
    cache.check_integrity()
    result = cache.evict(EvictParams(num_tokens=1))
    assert result.num_tokens_evicted == 7 and result.mamba_num_evicted == 1  # the leaf, then the tombstone
    assert cache.total_size() == (0, 0) and eng.pool.available_size() == 12
    cache.check_integrity()


def test_a_locked_snapshot_is_never_evicted():
    eng = HybridEngine(1, pages=64, states=8)
    eng.finish(eng.admit(seq(5)))
    req = eng.admit(seq(5) + [1])  # holds the snapshot after 5 tokens
    assert eng.cache.evict(EvictParams(num_tokens=100, mamba_num=8)).mamba_num_evicted == 0
    assert eng.cache.mamba_protected_size() == 1
    eng.finish(req)
    eng.drain()


def test_bad_hybrid_input():
    cache = MambaRadixCache.create_simulated()
    before = tree_state(cache)
    with pytest.raises(ValueError, match="mamba_value must have 1 entries"):
        cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([1, 2]), mamba_value=T([1, 2])))
    with pytest.raises(TypeError, match="mamba_value must be a torch.Tensor, got NoneType"):
        cache.insert(InsertParams(key=RadixKey([1, 2]), value=T([1, 2])))
    with pytest.raises(TypeError, match="params must be an InsertParams"):
        cache.insert(RadixKey([1, 2]), T([1, 2]))
    with pytest.raises(ValueError, match="mamba_num must be a non-negative int"):
        cache.evict(EvictParams(num_tokens=0, mamba_num=-1))
    with pytest.raises(ValueError, match="swa_num_tokens must be 0"):
        cache.evict(EvictParams(swa_num_tokens=1))
    assert tree_state(cache) == before
    with pytest.raises(ValueError, match="page_size must be 1 without enable_mamba_extra_buffer"):
        MambaRadixCache.create_simulated(page_size=16)


class HybridMachine(RuleBasedStateMachine):
    """Hybrid requests over a MambaRadixCache, KV and states evicted apart: after every step the
    tree, the allocator and the hybrid request table agree (KV slots and state slots), and every
    match returns KV only with the state after exactly that KV's tokens."""

    @initialize(
        setup=st.sampled_from([(1, False), (1, True), (16, True)]), pages=st.integers(4, 8),
        states=st.integers(4, 12), seed=st.integers(0, 3),
    )  # fmt: skip
    def setup(self, setup, pages, states, seed):
        page, extra = setup
        self.eng = HybridEngine(page, pages if page > 1 else pages * 8, states, extra=extra)
        rng = random.Random(seed)
        self.stems = [[rng.randrange(1, 6) for _ in range(2 * page + 2)] for _ in range(2)]

    def pick(self, data) -> SimReq:
        return data.draw(st.sampled_from(sorted(self.eng.running.values(), key=lambda r: r.req_pool_idx)))

    @rule(data=st.data(), extra=st.sampled_from([None, "tenant"]))
    def admit(self, data, extra):
        stem = data.draw(st.sampled_from(self.stems))
        tail = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=self.eng.page + 2))
        self.eng.admit(stem[: data.draw(st.integers(0, len(stem)))] + tail, extra)

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), steps=st.integers(1, 3))
    def decode(self, data, steps):
        req = self.pick(data)
        for _ in range(steps):
            if req.kv_committed_len + 1 > self.eng.table.max_context_len or not self.eng.decode(req, data.draw(st.integers(1, 3))):
                break

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data())
    def chunk(self, data):
        self.eng.chunk(self.pick(data))

    @precondition(lambda self: self.eng.running)
    @rule(data=st.data(), insert=st.booleans())
    def finish_or_retract(self, data, insert):
        self.eng.finish(self.pick(data), insert)

    @rule(n=st.integers(0, 100), states=st.integers(0, 4))
    def evict(self, n, states):
        cache = self.eng.cache
        locked = [(nd, nd.mamba_value) for nd in cache._nodes() if nd.mamba_lock_ref > 0]
        before = (cache.full_evictable_size(), cache.mamba_evictable_size(), self.eng.pool.available_size())
        got = cache.evict(EvictParams(num_tokens=n, mamba_num=states))
        assert got.num_tokens_evicted >= min(n, before[0]) or got.mamba_num_evicted
        assert self.eng.pool.available_size() == before[2] + got.mamba_num_evicted
        for nd, slot in locked:
            assert nd.mamba_value is not None and torch.equal(nd.mamba_value, slot), "a locked state was evicted"

    @invariant()
    def everything_agrees(self):
        self.eng.cache.check_integrity(self.eng.running.values())

    def teardown(self):
        if hasattr(self, "eng"):
            self.eng.drain()


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(TestHybridMachine.settings, stateful_step_count=30)
