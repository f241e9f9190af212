"""Bad input to the prefix caches, as a table: every call of ``kvassert.cache_bad_calls`` (wrong types,
bools as ints, floats, negative and out-of-range slots, slot 0, free slots, slots already in the
tree, repeated slots, evicted, unlocked and foreign nodes, meta tensors, unhashable namespaces, bad
priorities, bad requests) on each cache kind, populated with cached prefixes, running requests and a
node that left the tree. Each raises a clear error naming the argument and changes nothing: tree,
sizes, allocator, request table, KV, state and host pools (``kvassert.cache_snapshot``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvassert import Engine, HybridEngine, SWAEngine, assert_unchanged, cache_bad_calls, cache_snapshot, device_nodes, known_bad, seq
from kvpool.cache import EvictParams, InsertParams, MatchPrefixParams, RadixCache, RadixKey

KINDS = ["radix-page-1", "radix-page-4", "hiradix-page-4", "mamba-page-1", "mamba-page-4", "swa-page-1", "swa-page-4"]


def populated(kind: str) -> SimpleNamespace:
    """A cache of ``kind`` holding two cached prefixes (one evicted, its node kept as ``gone``) and
    two running requests (one continuing a cached prefix)."""
    if kind == "mamba-page-1":
        eng = HybridEngine(1, pages=64, states=12)
    elif kind == "mamba-page-4":
        eng = HybridEngine(4, pages=16, states=16, extra=True)
    elif kind.startswith("swa"):
        page = int(kind.rsplit("-", 1)[1])
        eng = SWAEngine(page, pages=64 // page * 2 if page > 1 else 64, swa_pages=24 // page * 2 if page > 1 else 40, window=page)
    elif kind.startswith("hiradix"):
        eng = Engine("paged", 4, pages=16, host_policy="write_through")
    else:
        page = int(kind.rsplit("-", 1)[1])
        eng = Engine("paged", page, pages=64 // page * 2 if page > 1 else 64)
    p = eng.page
    eng.finish(eng.admit(seq(2 * p + 1, 500)))
    eng.finish(eng.admit(seq(2 * p + 1, 700)))
    cache = eng.cache
    first = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(2 * p + 1, 500)))).last_device_node
    cache.match_prefix(MatchPrefixParams(key=RadixKey(seq(2 * p + 1, 700))))
    cache.evict(EvictParams(num_tokens=1))  # the least recently used leaf: the prefix from 500
    left = [first] if first.value is None else []
    eng.admit(seq(2 * p, 700) + seq(p + 1, 900))
    eng.admit(seq(3 * p + 1, 1500))
    if kind == "mamba-page-4":
        eng.admit(seq(p - 1, 2500))  # shorter than a page: no state known yet
    if kind.startswith("swa"):
        slid = eng.admit(seq(p + 1, 3500))
        for t in range(3 * p):  # its first tokens leave the window: their SWA KV goes back
            eng.decode(slid, t)
    foreign = RadixCache.create_simulated(page_size=p)
    foreign.insert(InsertParams(key=RadixKey(list(range(p)))))
    node = foreign.match_prefix(MatchPrefixParams(key=RadixKey(list(range(p))))).last_device_node
    assert left and len(eng.running) >= 2 and device_nodes(cache)
    return SimpleNamespace(cache=cache, alloc=eng.alloc, page=p, size=eng.size, running=eng.running, gone=left,
                           foreign=node, eng=eng)  # fmt: skip


CASES = [(kind, name) for kind in KINDS for name in sorted(cache_bad_calls(populated(kind)))]


def _case(kind: str, name: str):
    reason = known_bad(kind, name)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(kind, name, marks=marks, id=f"{kind}: {name}")


@pytest.mark.parametrize("kind, name", [_case(k, n) for k, n in CASES])
def test_a_bad_call_raises_naming_the_argument_and_changes_nothing(kind, name):
    ctx = populated(kind)
    call, exc, msg = cache_bad_calls(ctx)[name]
    before = cache_snapshot(ctx.cache)
    with pytest.raises(exc, match=msg):
        call()
    assert_unchanged(before, cache_snapshot(ctx.cache), name)
    ctx.cache.check_integrity(ctx.running.values())


def test_the_table_holds_at_least_200_bad_calls():
    assert len(CASES) >= 200
