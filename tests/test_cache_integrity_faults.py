"""Every problem the prefix caches' ``check_integrity`` can report, planted one at a time into a
consistent cache (internals are mutated on purpose), and reported exactly: the check lists that one
problem and nothing else. The tree's own checks (``RadixTree.tree_problems``), the host tier's and
the state tier's, the running requests' and the slot ownership's (``kvpool.cache.integrity``)."""

from __future__ import annotations

import re

import pytest
import torch

from kvassert import Engine, HybridEngine, SimReq, device_nodes, seq
from kvpool import IntegrityError
from kvpool.cache import EvictParams, MatchPrefixParams, RadixKey
from kvpool.cache.key import RadixKey as Key
from kvpool.cache.records import HOST, STATE

PREFIX = "RadixCache integrity check failed: "


def problems(cache, running=()) -> list[str]:
    try:
        cache.check_integrity(list(running))
    except IntegrityError as e:
        text = str(e)
        assert text.startswith(PREFIX), text
        return text[len(PREFIX) :].split("; ")
    return []


def assert_reports(cache, running, expected: str) -> None:
    """The check reports exactly one problem, matching ``expected`` (a regex) in full."""
    got = problems(cache, running)
    assert len(got) == 1 and re.fullmatch(expected, got[0]), f"expected exactly [{expected}], got {got}"


def node_of(cache, tokens, extra=None):
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(tokens), extra))).last_device_node


class Tree:
    """A consistent cache of page 4: N1 = [100..103] with children N2 = [104..107] (locked by the
    running request R1, which continues it) and N3 = [500..503] (an unlocked leaf); R2 runs on its
    own slots only."""

    def __init__(self, host_policy=None, page=4):
        self.eng = eng = Engine("paged" if page > 1 else "token", page, pages=64 // page, host_policy=host_policy)
        self.cache, self.alloc, self.table = eng.cache, eng.alloc, eng.table
        eng.finish(eng.admit(seq(2 * page + 1, 100)))
        eng.finish(eng.admit(seq(page, 100) + seq(page + 1, 500)))
        self.r1 = eng.admit(seq(2 * page, 100) + seq(page + 1, 300))
        self.r2 = eng.admit(seq(page + 1, 900))
        self.n1 = node_of(self.cache, seq(page, 100))
        self.n2 = node_of(self.cache, seq(2 * page, 100))
        self.n3 = node_of(self.cache, seq(page, 100) + seq(page, 500))
        self.running = [self.r1, self.r2]
        assert problems(self.cache, self.running) == []
        assert self.n2.lock_ref == 1 and self.n3.lock_ref == 0 and self.r1.last_node is self.n2


@pytest.fixture
def tree():
    return Tree()


# --- the tree ------------------------------------------------------------------------------------


def test_a_root_child_filed_under_another_key(tree):
    root = tree.cache.root_node
    ck = tree.n1.child_key
    root.children[999] = root.children.pop(ck)
    assert_reports(tree.cache, tree.running, rf"node {tree.n1.id} is filed under 999 in the root but records parent/key {re.escape(repr(ck))}")


def test_a_child_filed_under_another_key(tree):
    tree.n1.children[999] = tree.n1.children.pop(tree.n2.child_key)
    assert_reports(tree.cache, tree.running, rf"node {tree.n2.id} is filed under 999 in node {tree.n1.id} but records otherwise")


def test_a_node_filed_under_a_key_that_is_not_its_first_page(tree):
    root = tree.cache.root_node
    root.children[999] = root.children.pop(tree.n1.child_key)
    tree.n1.child_key = 999
    assert_reports(tree.cache, tree.running, rf"node {tree.n1.id} is filed under 999, not its first page's key")


def test_a_node_whose_key_is_not_whole_pages(tree):
    """A key of 6 tokens over the 4 slots of one page (the sizes counting 6): the token count, and
    the value's length for them, are reported."""
    n3 = tree.n3
    n3.key = Key(seq(4, 500) + [600, 601])
    tree.cache.evictable_size_ += 2
    got = problems(tree.cache, tree.running)
    assert got == [
        f"node {n3.id} holds 6 tokens, not a positive multiple of page_size = 4",
        f"node {n3.id} has value of shape (4,) torch.int64 for 6 tokens",
    ]


def test_a_node_of_a_partial_page_with_a_slot_per_token(tree):
    """A key of 6 tokens with 6 slots (2 of a page the allocator handed out): reported, not a crash."""
    n3 = tree.n3
    extra = tree.alloc.alloc(4)
    tree.alloc.free(extra[2:])
    n3.key = Key(seq(4, 500) + [600, 601])
    n3.value = torch.cat((n3.value, extra[:2]))
    tree.cache.evictable_size_ += 2
    got = problems(tree.cache, tree.running)
    assert got[:1] == [f"node {n3.id} holds 6 tokens, not a positive multiple of page_size = 4"], got


def test_a_node_in_another_namespace_than_its_parent(tree):
    n2, n1 = tree.n2, tree.n1
    n1.children.pop(n2.child_key)
    n2.key = Key(seq(4, 104), "other")
    n2.child_key = ("other", tuple(seq(4, 104)))
    n1.children[n2.child_key] = n2
    assert_reports(tree.cache, tree.running, rf"node {n2.id} has extra_key 'other' below a node of extra_key None")


def test_an_evicted_node_left_in_the_tree(tree):
    slots = tree.n3.value
    tree.n3.value = None
    tree.cache.evictable_size_ -= 4
    tree.alloc.free(slots)
    assert_reports(tree.cache, tree.running, rf"node {tree.n3.id} is evicted but still in the tree")


def test_a_value_of_the_wrong_dtype(tree):
    tree.n3.value = tree.n3.value.to(torch.int32)
    assert_reports(tree.cache, tree.running, rf"node {tree.n3.id} has value of shape \(4,\) torch.int32 for 4 tokens")


def test_a_negative_lock_ref(tree):
    """Reported as negative and, being below its children's total of 0, as that too."""
    tree.n3.device.lock_ref = -1
    tree.cache.evictable_size_ -= 4
    tree.cache.protected_size_ += 4
    got = problems(tree.cache, tree.running)
    assert got == [f"node {tree.n3.id} has lock_ref -1 < 0", f"node {tree.n3.id} has lock_ref -1, below its children's total 0"], got


def test_a_lock_ref_below_its_childrens_total(tree):
    tree.n1.device.lock_ref = 0
    tree.cache.evictable_size_ += 4
    tree.cache.protected_size_ -= 4
    assert_reports(tree.cache, tree.running, rf"node {tree.n1.id} has lock_ref 0, below its children's total 1")


def test_an_evictable_leaf_missing_from_the_eviction_queue(tree):
    tree.n3.device.queue_entry = None
    assert_reports(tree.cache, tree.running, rf"node {tree.n3.id} is an evictable leaf missing from the eviction queue")


def test_recorded_sizes_that_are_not_the_nodes(tree):
    tree.cache.evictable_size_ += 1
    assert_reports(tree.cache, tree.running, r"evictable/protected sizes are recorded as 5/8 but the nodes hold 4/8")


# --- running requests ----------------------------------------------------------------------------


def twin(req: SimReq, **changes) -> SimReq:
    other = SimReq(req.req_pool_idx, list(req.origin_input_ids), req.extra_key, list(req.output_ids), req.last_node,
                   req.cache_protected_len, req.prefix_indices, req.kv_committed_len, req.kv_allocated_len)  # fmt: skip
    for k, v in changes.items():
        setattr(other, k, v)
    return other


def test_two_running_requests_in_one_row(tree):
    copy = twin(tree.r1, kv_allocated_len=tree.r1.cache_protected_len)  # owns no slot of its own
    assert_reports(tree.cache, [*tree.running, copy], rf"request in row {tree.r1.req_pool_idx}: two running requests hold the row")


def test_a_running_request_whose_row_is_free(tree):
    tree.table.free(tree.r2.req_pool_idx)
    assert_reports(tree.cache, tree.running, rf"request in row {tree.r2.req_pool_idx}: the row is free in the request table")


def test_a_running_request_whose_last_node_is_not_locked(tree):
    tree.cache.dec_lock_ref(tree.n2)
    assert_reports(tree.cache, tree.running, rf"request in row {tree.r1.req_pool_idx}: its last_node {tree.n2.id} is not locked")


def test_a_running_request_whose_last_node_was_evicted(tree):
    cache = tree.cache
    cache.dec_lock_ref(tree.n2)  # its lock dropped behind its back
    cache.evict(EvictParams(num_tokens=100))
    assert tree.n2.value is None
    assert_reports(cache, tree.running, rf"request in row {tree.r1.req_pool_idx}: its last_node {tree.n2.id} is evicted")


def test_a_running_request_whose_last_node_is_not_a_node(tree):
    tree.r1.last_node = "node"
    assert_reports(tree.cache, tree.running, rf"request in row {tree.r1.req_pool_idx}: its last_node is a str, not a TreeNode")


def test_a_running_request_whose_last_node_is_of_another_tree(tree):
    other = Tree()
    other.cache.inc_lock_ref(other.n3)  # locked and on the device there: only its tree is wrong
    tree.r1.last_node = other.n3
    assert_reports(tree.cache, tree.running,
                   rf"request in row {tree.r1.req_pool_idx}: its last_node {other.n3.id}'s path to the root is not on the device \(evicted or detached\)")  # fmt: skip


def test_a_running_request_whose_protected_slots_are_not_its_nodes(tree):
    row = tree.r1.req_pool_idx
    tree.table.req_to_token[row, 0] = tree.table.req_to_token[row, 8]  # one of its own slots instead of the tree's
    assert_reports(tree.cache, tree.running,
                   rf"request in row {row}: its first 8 slots \(cache_protected_len\) are not the 8 slots of its last_node's path")  # fmt: skip


# --- slot ownership ------------------------------------------------------------------------------


@pytest.fixture
def flat():
    """Page 1 (no page checks): slots out of range show up on their own."""
    return Tree(page=1)


def test_the_tree_holding_slots_outside_the_pool(flat):
    value = flat.n3.value.clone()
    flat.alloc.free(value[:1])
    value[0] = 10**6
    flat.n3.value = value
    assert_reports(flat.cache, flat.running, r"the tree holds slots outside 0\.\.64: 1000000")


def test_a_running_request_holding_slots_outside_the_pool(flat):
    row = flat.r2.req_pool_idx
    flat.alloc.free(flat.table.req_to_token[row, :1].to(torch.int64))
    flat.table.req_to_token[row, 0] = 10**6
    assert_reports(flat.cache, flat.running, r"running requests hold slots outside 0\.\.64: 1000000")


def test_a_tree_page_that_is_not_consecutive_slots(tree):
    v = tree.n3.value.clone()
    tree.n3.value = v[[1, 0, 2, 3]]
    assert_reports(tree.cache, tree.running, r"1 of the tree's pages are not 4 consecutive slots from a page start")


def test_a_slot_owned_by_the_tree_and_a_request(tree):
    row = tree.r2.req_pool_idx
    own = int(tree.table.req_to_token[row, 4])
    tree.alloc.free(torch.tensor([own]))
    shared = int(tree.n3.value[0])
    tree.table.req_to_token[row, 4] = shared
    assert_reports(tree.cache, tree.running, rf"1 slots owned twice \(tree and/or requests\): {shared}")


def test_tree_slots_free_in_the_allocator(tree):
    tree.alloc.free(tree.n3.value)
    slots = ", ".join(map(str, tree.n3.value.tolist()))
    assert_reports(tree.cache, tree.running, rf"4 slots owned but free in the allocator: {slots}")


def test_leaked_slots(tree):
    leaked = tree.alloc.alloc(4)
    slots = ", ".join(map(str, leaked.tolist()))
    assert_reports(tree.cache, tree.running, rf"4 slots handed out but owned by neither the tree nor a request \(leaked\): {slots}")


def test_a_slot_the_allocator_handed_out_twice(tree):
    """Planted in the allocator's holder counts (its page's count agrees): the ownership check and
    the allocator's own check both report it."""
    s = int(tree.n3.value[0])
    tree.alloc._owners[s] += 1
    tree.alloc._live[s // 4] += 1
    got = problems(tree.cache, tree.running)
    assert got == [
        f"1 slots handed out more than once by the allocator: {s}",
        f"PagedTokenToKVPoolAllocator integrity check failed: 1 slots owned more than once, handed out again while held (first: slot {s}, 2 owners)",
    ], got


# --- the host tier -------------------------------------------------------------------------------


@pytest.fixture
def host():
    """A HiRadixCache (write-through): N1 with children N2 and N3, all backed up, nothing locked."""
    t = Tree(host_policy="write_through")
    for req in list(t.running):
        t.eng.finish(req)
    t.running = []
    assert problems(t.cache) == [] and all(n.host_value is not None for n in device_nodes(t.cache))
    return t


def test_an_evicted_node_without_a_host_copy(host):
    slots = host.n3.value
    host.n3.value = None
    host.n3.host_value = None  # its host slots stay allocated: the host count reports them too
    host.cache.evictable_size_ -= 4
    host.alloc.free(slots)
    got = problems(host.cache)
    assert got[0] == f"node {host.n3.id} is evicted with no host copy but still in the tree", got
    assert got[1:] == [f"the host pool has {host.eng.host.size - host.eng.host.available_size()} slots allocated but the nodes hold {host.eng.host.size - host.eng.host.available_size() - 4}"]


def test_a_host_only_node_with_children_on_the_device(host):
    n1 = host.n1
    slots = n1.value
    n1.value = None
    host.cache.evictable_size_ -= 4
    host.alloc.free(slots)
    assert_reports(host.cache, (), rf"node {n1.id} is on the host only but has 2 children on the device")


def test_host_slots_held_by_two_nodes(host):
    host.n3.host_value = host.n2.host_value.clone()  # N3's own host slots stay allocated, unowned
    got = problems(host.cache)
    assert got == ["4 host slots held by two nodes"], got


def test_host_slots_allocated_that_no_node_holds(host):
    held = host.eng.host.size - host.eng.host.available_size()
    host.eng.host.alloc(4)
    assert_reports(host.cache, (), rf"the host pool has {held + 4} slots allocated but the nodes hold {held}")


def test_a_host_only_leaf_missing_from_the_host_queue(host):
    host.cache.evict(EvictParams(num_tokens=1))
    parked = [n for n in device_nodes(host.cache) if n.value is None and not n.children]
    assert len(parked) == 1
    parked[0].records[HOST].queue_entry = None
    assert_reports(host.cache, (), rf"node {parked[0].id} is a host-only leaf missing from the host eviction queue")


# --- the state tier ------------------------------------------------------------------------------


@pytest.fixture
def hybrid():
    """A MambaRadixCache: [1000..1003] with a snapshot and below it [900..902] with its own."""
    eng = HybridEngine(1, pages=64, states=12)
    eng.finish(eng.admit(seq(4)))
    eng.finish(eng.admit(seq(4) + seq(3, 900)))
    inner = node_of(eng.cache, seq(4))
    leaf = node_of(eng.cache, seq(4) + seq(3, 900))
    assert inner.mamba_value is not None and leaf.mamba_value is not None and leaf.parent is inner
    assert problems(eng.cache) == []
    return eng, inner, leaf


def test_a_leaf_without_a_snapshot(hybrid):
    eng, _, leaf = hybrid
    snapshot = leaf.records.pop(STATE)
    eng.cache.mamba_evictable_size_ -= 1
    eng.pool.free(snapshot.slot)
    assert_reports(eng.cache, (), rf"node {leaf.id} is a leaf without a state snapshot \(a tombstone leaf\)")


def test_a_snapshot_locked_more_than_its_node(hybrid):
    eng, _, leaf = hybrid
    leaf.records[STATE].lock_ref = 1
    eng.cache.mamba_evictable_size_ -= 1
    eng.cache.mamba_protected_size_ += 1
    assert_reports(eng.cache, (), rf"node {leaf.id} has mamba_lock_ref 1 above lock_ref 0")


def test_an_evictable_snapshot_missing_from_the_state_queue(hybrid):
    eng, inner, _ = hybrid
    inner.records[STATE].queue_entry = None
    assert_reports(eng.cache, (), rf"node {inner.id}'s snapshot is evictable but missing from the state queue")


def test_state_slots_held_by_two_nodes(hybrid):
    eng, inner, leaf = hybrid
    eng.pool.free(leaf.records[STATE].slot)
    leaf.records[STATE].slot = inner.records[STATE].slot.clone()
    got = problems(eng.cache)  # the request table, told the tree's state slots, sees it too
    assert got == ["1 state slots held by two nodes", "HybridReqToTokenPool integrity check failed: 1 external slots listed twice"], got


def test_recorded_state_counts_that_are_not_the_nodes(hybrid):
    eng, _, _ = hybrid
    eng.cache.mamba_evictable_size_ += 1
    assert_reports(eng.cache, (), r"state evictable/protected counts are recorded as 3/0 but the nodes hold 2/0")
