"""Requests entering and leaving ``RadixCache`` through the real allocators and request table, and
``check_integrity`` finding what is wrong with them."""

from __future__ import annotations

import pytest
import torch

from kvassert import Engine, seq
from kvpool import IntegrityError
from kvpool.cache import InsertParams, MatchPrefixParams, RadixKey


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
