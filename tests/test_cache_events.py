"""KV events of the prefix cache: SGLang's sequence-aware page hashes, namespaces, and no events
unless enabled."""

from __future__ import annotations

import hashlib

from kvassert import free_recorder, insert, sim
from kvpool.cache import BlockRemoved, BlockStored, EvictParams


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
