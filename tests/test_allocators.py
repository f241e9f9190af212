"""Slot allocators: deliberate examples, then hypothesis state machines against a plain-Python
model (no slot handed out twice, slot 0 never handed out, counts agree, a failed alloc changes nothing,
backup/restore round-trips, free groups, check_integrity passes)."""

from __future__ import annotations

import doctest
from typing import Optional

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvpool.pools.allocator.base as token_allocator_module
import kvpool.pools.allocator.paged as paged_allocator_module
from kvpool.errors import IntegrityError
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.allocator import (
    AllocatorState,
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    alloc_extend_naive,
)

T = torch.tensor


def snapshot(a) -> tuple:
    """Everything an allocator knows, as plain Python values (to prove that a call changed nothing)."""
    s = a.backup_state()
    return (
        s.free_pages.tolist(), s.release_pages.tolist(), [p for t in s.free_group for p in t.tolist()],
        s.owners.tolist(), s.live.tolist(), s.page_free.tolist(), int(s.unrecorded), a.is_not_in_free_group,
    )  # fmt: skip


def held_slots(a) -> set[int]:
    return set(a.backup_state().owners.nonzero().flatten().tolist())


def ext(a, prefix, seq, last_loc):
    """alloc_extend with the CPU copies and the token count derived from the lists."""
    pre, sq = T(prefix, dtype=torch.int64), T(seq, dtype=torch.int64)
    return a.alloc_extend(pre, pre.clone(), sq, sq.clone(), T(last_loc, dtype=torch.int64), int((sq - pre).sum()))


def dec(a, seq, last_loc):
    sq = T(seq, dtype=torch.int64)
    return a.alloc_decode(sq, sq.clone(), T(last_loc, dtype=torch.int64))


def test_docstring_examples_run():
    for module in (token_allocator_module, paged_allocator_module):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


# --- TokenToKVPoolAllocator ------------------------------------------------------------------------


def test_token_alloc_hands_out_one_to_size_in_order_and_never_slot_0():
    a = TokenToKVPoolAllocator(6)
    got = a.alloc(4)
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    assert got.tolist() == [1, 2, 3, 4]
    assert a.alloc(2).tolist() == [5, 6]
    assert a.available_size() == 0
    assert a.alloc(1) is None
    assert a.alloc(0).tolist() == []
    a.check_integrity()


def test_token_alloc_failure_changes_nothing():
    a = TokenToKVPoolAllocator(5, need_sort=True)
    a.alloc(3)
    a.free(T([2]))
    before = snapshot(a)
    assert a.alloc(4) is None  # 2 free + 1 released = 3 < 4
    assert snapshot(a) == before
    assert a.alloc(3).tolist() == [2, 4, 5]  # merged and sorted once it fits


@pytest.mark.parametrize("bad", [-1, 1.0, True, "2", None])
def test_token_alloc_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="need_size must be a non-negative int, got"):
        TokenToKVPoolAllocator(4).alloc(bad)


def test_token_free_and_reuse_fifo():
    a = TokenToKVPoolAllocator(4)
    a.alloc(4)
    a.free(T([3, 1]))
    assert a.available_size() == 2
    assert sorted(a.alloc(2).tolist()) == [1, 3]
    a.free([2])  # a list works too
    assert a.alloc(1).tolist() == [2]
    a.check_integrity()


def test_token_returned_tensor_does_not_alias_the_free_list():
    a = TokenToKVPoolAllocator(4)
    got = a.alloc(2)
    got += 100
    assert a.alloc(2).tolist() == [3, 4]
    a.check_integrity()


def test_token_need_sort_keeps_frees_aside_until_needed():
    a = TokenToKVPoolAllocator(4, need_sort=True)
    a.alloc(3)
    a.free(T([3, 1]))
    assert a.available_size() == 3
    assert a.alloc(1).tolist() == [4]  # the free list still has 4; released 1 and 3 wait
    assert a.alloc(2).tolist() == [1, 3]  # merged, sorted
    a.check_integrity()


def test_token_free_group_applies_at_end():
    a = TokenToKVPoolAllocator(4)
    a.alloc(4)
    a.free_group_begin()
    a.free(T([1]))
    a.free(T([4, 2]))
    assert a.available_size() == 0
    a.check_integrity()  # pending frees are accounted for
    a.free_group_end()
    assert a.available_size() == 3
    assert sorted(a.alloc(3).tolist()) == [1, 2, 4]
    a.check_integrity()


def test_token_free_group_begin_twice_keeps_pending_frees():
    a = TokenToKVPoolAllocator(4)
    a.alloc(4)
    a.free_group_begin()
    a.free(T([1]))
    a.free_group_begin()
    a.free(T([2]))
    a.free_group_end()
    assert a.available_size() == 2
    a.free_group_end()  # outside a group: nothing to do
    a.check_integrity()


def test_token_double_free_inside_a_group_is_caught():
    a = TokenToKVPoolAllocator(4, validate=True)
    a.alloc(2)
    a.free_group_begin()
    a.free(T([1]))
    with pytest.raises(ValueError, match="slot 1 at position 0, which was already freed"):
        a.free(T([1]))
    a.free_group_end()
    assert a.available_size() == 3


def test_token_backup_restore_round_trip_and_twice():
    a = TokenToKVPoolAllocator(6)
    a.alloc(2)
    state = a.backup_state()
    assert isinstance(state, AllocatorState)
    before = snapshot(a)
    first = a.alloc(3)
    a.free(T([1]))
    a.restore_state(state)
    assert snapshot(a) == before
    assert a.alloc(3).tolist() == first.tolist()
    a.restore_state(state)  # a state can be restored again
    assert snapshot(a) == before
    a.check_integrity()


def test_restore_refuses_a_state_of_another_allocator():
    a = TokenToKVPoolAllocator(6)
    with pytest.raises(ValueError, match="state must come from an allocator with page_size=1, num_pages=6"):
        a.restore_state(TokenToKVPoolAllocator(7).backup_state())
    with pytest.raises(ValueError, match="state must be an AllocatorState"):
        a.restore_state((a.free_pages, a.release_pages))


def test_backup_inside_a_group_and_restore_inside_it_keeps_the_pending_frees():
    a = PagedTokenToKVPoolAllocator(16, 4)
    s = a.alloc(12)
    a.free_group_begin()
    a.free(s[:4])  # page 1 pending
    state = a.backup_state()
    assert [t.tolist() for t in state.free_group] == [[1]]
    before = snapshot(a)
    a.free(s[4:8])  # page 2 pending too
    a.alloc(4)
    a.restore_state(state)  # still inside the group: page 1 pending again, page 2 held again
    assert snapshot(a) == before
    a.free_group_end()
    assert a.available_size() == 8 and sorted(a.free_pages.tolist()) == [1, 4]
    a.check_integrity()


def test_restore_outside_a_group_makes_the_snapshots_pending_pages_available():
    """A snapshot taken inside a group and restored after free_group_end() must not strand the pages
    the group freed: they become available at once."""
    a = PagedTokenToKVPoolAllocator(16, 4)
    s = a.alloc(8)
    a.free_group_begin()
    a.free(s[:4])
    state = a.backup_state()
    a.free_group_end()
    a.alloc(4)  # takes page 3 (1 was appended after it)
    a.restore_state(state)
    assert a.is_not_in_free_group and a.free_group == []
    assert a.available_size() == 12
    a.check_integrity()


def test_restore_undoes_frees_made_inside_a_group_since_the_backup():
    a = TokenToKVPoolAllocator(4)
    a.alloc(2)
    state = a.backup_state()
    a.free_group_begin()
    a.free(T([1]))
    a.restore_state(state)  # slot 1 held again; the group stays open, with nothing pending
    assert not a.is_not_in_free_group and a.free_group == []
    a.free_group_end()
    assert a.available_size() == 2 and held_slots(a) == {1, 2}
    a.check_integrity()


def test_token_clear_resets_everything():
    a = TokenToKVPoolAllocator(5)
    a.alloc(3)
    a.free_group_begin()
    a.free(T([1]))
    a.clear()
    assert a.available_size() == 5 and a.is_not_in_free_group and a.free_group == []
    assert a.alloc(5).tolist() == [1, 2, 3, 4, 5]
    a.check_integrity()


@pytest.mark.parametrize(
    "indices, message",
    [
        ([0], "slot 0 at position 0, which is the padding slot 0"),
        ([2, 7], "slot 7 at position 1, which is outside the handed-out range 1..6"),
        ([-3], "slot -3 at position 0, which is outside"),
        ([5], "slot 5 at position 0, which was never allocated"),
        ([1], "slot 1 at position 0, which was already freed"),
        ([2, 3, 2], "slot 2 more than once"),
    ],
    ids=["slot0", "out-of-range", "negative", "never-allocated", "double-free", "twice-in-one-call"],
)
def test_token_validate_raises_on_bad_free_and_changes_nothing(indices, message):
    a = TokenToKVPoolAllocator(6, validate=True)
    a.alloc(4)
    a.free(T([1]))
    before = snapshot(a)
    with pytest.raises(ValueError, match=message):
        a.free(T(indices))
    assert snapshot(a) == before


def test_validate_from_environment(monkeypatch):
    monkeypatch.setenv("KVPOOL_VALIDATE", "1")
    a = TokenToKVPoolAllocator(4)
    assert a.validate
    with pytest.raises(ValueError, match="padding slot"):
        a.free(T([0]))


def test_token_without_validate_bad_frees_are_dropped_never_duplicated(caplog):
    a = TokenToKVPoolAllocator(4)
    a.alloc(3)
    a.free(T([1]))
    a.free(T([0, 1, 2, 2, 9, -1, 4]))  # only 2 is valid: 0 padding, 1 already free, 9/-1 range, 4 never
    assert a.rejected_frees == 6
    assert "dropped 6 entries" in caplog.text
    assert a.available_size() == 3
    got = a.alloc(3).tolist()
    assert sorted(got) == [1, 2, 4]
    a.check_integrity()


@pytest.mark.parametrize(
    "indices, message",
    [
        (T([1.0]), "free_index must be an integer tensor, got torch.float32"),
        (T([[1]]), r"free_index must be 1-D, got shape \(1, 1\)"),
        (3, "free_index must be a tensor or a sequence of ints, got int"),
        ([1, 2.0], "free_index must hold ints"),
    ],
)
def test_free_rejects_malformed_input(indices, message):
    with pytest.raises(ValueError, match=message):
        TokenToKVPoolAllocator(4).free(indices)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"size": 0}, "size must be a positive int, got 0"),
        ({"size": 4, "dtype": "fp8"}, "dtype must be a torch.dtype or None, got 'fp8'"),
    ],
)
def test_token_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TokenToKVPoolAllocator(**kwargs)


def test_sglang_keywords_and_getters():
    pool = object()
    a = TokenToKVPoolAllocator(8, dtype=torch.float8_e4m3fn, device="cpu", kvcache=pool, need_sort=True)
    assert a.get_kvcache() is pool and a.size_full == 8 and a.page_size == 1 and a.dtype == torch.float8_e4m3fn
    with pytest.raises(NotImplementedError):
        a.alloc_extend()
    with pytest.raises(NotImplementedError):
        a.alloc_decode()


@pytest.mark.parametrize(
    "pool_page_size, make_allocator, message",
    [
        (1, lambda pool: TokenToKVPoolAllocator(pool.size + 1, kvcache=pool),
         r"size must be at most the kvcache's size = 16 \(the slots its buffers hold\), got 17"),
        (4, lambda pool: PagedTokenToKVPoolAllocator(pool.size + 4, 4, kvcache=pool), "size must be at most the kvcache's size = 16"),
        (4, lambda pool: PagedTokenToKVPoolAllocator(pool.size, 2, kvcache=pool), "page_size must equal the kvcache's page_size = 4, got 2"),
        (4, lambda pool: TokenToKVPoolAllocator(pool.size, kvcache=pool),
         "page_size must equal the kvcache's page_size = 4, got 1 .*use PagedTokenToKVPoolAllocator"),
    ],
    ids=["token-larger", "paged-larger", "paged-page-size", "token-on-paged-pool"],
)
def test_an_allocator_that_does_not_fit_its_kvcache_is_refused(pool_page_size, make_allocator, message):
    """Slots past the pool would be handed out and their writes skipped; slots of another page size
    would straddle the pool's pages (a token allocator on a paged pool hands out page 0's slots)."""
    pool = MHATokenToKVPool(16, pool_page_size, torch.bfloat16, 1, 8, 1, "cpu", warmup=False)
    with pytest.raises(ValueError, match=message):
        make_allocator(pool)
    if pool_page_size == 1:
        assert TokenToKVPoolAllocator(16, kvcache=pool).alloc(16).max() < pool.rows
    else:
        assert PagedTokenToKVPoolAllocator(16, 4, kvcache=pool).alloc(16).max() < pool.rows
        assert PagedTokenToKVPoolAllocator(12, 4, kvcache=pool).alloc(12).max() < pool.rows  # a smaller one fits


def test_check_integrity_reports_corruption_with_counts():
    a = TokenToKVPoolAllocator(8)
    a.alloc(3)
    a.free_pages = torch.cat((a.free_pages, T([4, 2])))  # 4 is already listed; 2 is handed out
    with pytest.raises(IntegrityError) as info:
        a.check_integrity()
    text = str(info.value)
    assert "1 pages listed free more than once (first: 4)" in text
    assert "1 pages are both listed free and hold owned slots" in text
    assert "expected num_pages = 8" in text


# --- PagedTokenToKVPoolAllocator ------------------------------------------------------------------


def test_paged_alloc_whole_pages_skipping_page_0():
    a = PagedTokenToKVPoolAllocator(18, page_size=4)  # 4 pages; 2 slots left over are never used
    assert a.num_pages == 4 and a.available_size() == 16
    assert a.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert a.alloc(12) is None
    assert a.alloc(8).tolist() == list(range(12, 20))
    a.check_integrity()


def test_paged_alloc_size_must_be_whole_pages():
    with pytest.raises(ValueError, match="need_size must be a multiple of page_size = 4, got 6"):
        PagedTokenToKVPoolAllocator(16, 4).alloc(6)


@pytest.mark.parametrize(
    "args, message",
    [
        ((16, 0), "page_size must be a positive int, got 0"),
        ((3, 4), "size must be at least page_size = 4 \\(one page\\), got 3"),
    ],
)
def test_paged_constructor_errors(args, message):
    with pytest.raises(ValueError, match=message):
        PagedTokenToKVPoolAllocator(*args)


def test_paged_alloc_extend_fills_partial_page_then_full_pages_then_a_partial_one():
    a = PagedTokenToKVPoolAllocator(64, 4, validate=True)
    assert ext(a, [0], [3], [-1]).tolist() == [4, 5, 6]  # page 1
    # request 0: positions 3..12 = 1 slot on page 1, pages 2 and 3 full, 1 slot on page 4
    # request 1 (new): 4 tokens = exactly page 5; request 2: nothing new
    out = ext(a, [3, 0, 0], [13, 4, 0], [6, -1, -1])
    assert out.tolist() == [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22, 23]
    assert a.available_size() == (16 - 5) * 4  # pages 6..16 free
    a.check_integrity()


def test_paged_alloc_extend_with_aligned_prefix_takes_a_fresh_page():
    a = PagedTokenToKVPoolAllocator(32, 4)
    ext(a, [0], [4], [-1])  # page 1 full
    assert ext(a, [4], [6], [7]).tolist() == [8, 9]


def naive(prefix, seq, last_loc, free_pages, page_size=4):
    """alloc_extend_naive on lists: the slots it writes into a fresh out_indices."""
    pre, sq = T(prefix, dtype=torch.int64), T(seq, dtype=torch.int64)
    out = torch.full((int((sq - pre).sum()),), -7, dtype=torch.int64)
    assert alloc_extend_naive(pre, sq, T(last_loc, dtype=torch.int64), T(free_pages, dtype=torch.int64), out,
                              page_size, "cpu") is None  # fmt: skip
    return out.tolist()


def test_alloc_extend_naive_continues_the_partial_page_then_takes_free_pages_in_request_order():
    # request 0 (position 5 in slot 9, on page 2): slots 10, 11, then page 7 whole, then 3 slots of page 3
    # request 1 (new, 3 tokens): the next free page, 5; request 2: nothing new
    assert naive([6, 0, 4], [15, 3, 4], [9, -1, 19], [7, 3, 5, 8]) == [10, 11, 28, 29, 30, 31, 12, 13, 14, 20, 21, 22]
    assert naive([3], [4], [14], []) == [15]  # fills its page: no fresh page needed
    assert naive([8], [8], [35], []) == []
    assert naive([], [], [], [2]) == []


def test_alloc_extend_naive_gives_the_slots_alloc_extend_hands_out():
    a = PagedTokenToKVPoolAllocator(64, 4, validate=True)
    ext(a, [0, 0], [3, 6], [-1, -1])  # request 0 on page 1 (4..6), request 1 on pages 2, 3 (8..13)
    cases = ([3, 6, 0], [13, 7, 5], [6, 13, -1])
    free = a.free_pages.clone()
    assert naive(*cases, free.tolist()) == ext(a, *cases).tolist()
    assert a.free_pages.tolist() == free[5:].tolist()  # the allocator took the pages naive used


def test_alloc_extend_naive_writes_int32_out_indices_and_leaves_its_inputs_alone():
    pre, sq, last, free = T([2]), T([9]), T([5]), T([4, 6])
    before = [t.clone() for t in (pre, sq, last, free)]
    out = torch.zeros(7, dtype=torch.int32)
    alloc_extend_naive(pre.int(), sq.int(), last.int(), free.int(), out, 4, torch.device("cpu"))
    assert out.tolist() == [6, 7, 16, 17, 18, 19, 24]
    assert all(torch.equal(x, y) for x, y in zip(before, (pre, sq, last, free)))


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(out=torch.zeros(4, dtype=torch.int64)), "out_indices must have sum\\(seq_lens - prefix_lens\\) = 3 entries, got 4"),
        (dict(free=torch.tensor([], dtype=torch.int64)), "free_pages must hold the 1 pages this extension takes, got 0"),
        (dict(pre=T([5]), out=torch.zeros(0, dtype=torch.int64)), "prefix_lens\\[0\\] must be in 0..seq_lens\\[0\\] = 3, got 5"),
        (dict(seq=T([3, 3])), "seq_lens must have 1 entries"),
        (dict(last=T([1.0])), "last_loc must be a 1-D integer tensor"),
        (dict(free=T([[2]])), "free_pages must be a 1-D integer tensor"),
        (dict(out=[0, 0, 0]), "out_indices must be a tensor"),
        (dict(out=torch.zeros(3, dtype=torch.int64, device="meta")), "out_indices must be on .*cpu, got meta"),
        (dict(page_size=0), "page_size must be a positive int, got 0"),
    ],
)
def test_alloc_extend_naive_refuses_bad_arguments_before_writing(args, match):
    a = dict(pre=T([0]), seq=T([3]), last=T([-1]), free=T([2]), out=torch.full((3,), -7), page_size=4)
    a.update(args)
    with pytest.raises(ValueError, match=match):
        alloc_extend_naive(a["pre"], a["seq"], a["last"], a["free"], a["out"], a["page_size"], "cpu")
    if "out" not in args:
        assert a["out"].tolist() == [-7, -7, -7]  # nothing written


def test_paged_alloc_decode_continues_or_starts_pages():
    a = PagedTokenToKVPoolAllocator(32, 4, validate=True)
    ext(a, [0, 0], [3, 4], [-1, -1])  # request 0 on page 1 (4,5,6), request 1 fills page 2
    assert dec(a, [4, 5], [6, 11]).tolist() == [7, 12]  # request 1 starts page 3
    assert dec(a, [5, 6], [7, 12]).tolist() == [16, 13]  # request 0 starts page 4
    a.check_integrity()


def test_paged_extend_and_decode_return_none_when_pages_run_out():
    a = PagedTokenToKVPoolAllocator(12, 4)  # 3 pages
    ext(a, [0], [5], [-1])  # pages 1 and 2 (slots 4..8)
    before = snapshot(a)
    assert ext(a, [0, 0], [1, 1], [-1, -1]) is None  # two fresh pages wanted, one free
    assert snapshot(a) == before
    assert ext(a, [5], [9], [8]).tolist() == [9, 10, 11, 12]  # 3 on page 2, then page 3
    assert dec(a, [10], [12]).tolist() == [13]
    before = snapshot(a)
    assert dec(a, [11, 1], [13, -1]) is None  # the second request needs a page; none is free
    assert snapshot(a) == before


def test_paged_decode_none_changes_nothing():
    a = PagedTokenToKVPoolAllocator(8, 4)  # 2 pages
    ext(a, [0, 0], [4, 4], [-1, -1])  # both pages full
    before = snapshot(a)
    assert dec(a, [5], [7]) is None
    assert snapshot(a) == before


def test_paged_page_returns_only_when_all_handed_out_slots_are_freed():
    """SGLang releases a page when any of its slots is freed; that hands a live slot to another
    request. Here the page comes back only with its last slot."""
    a = PagedTokenToKVPoolAllocator(8, 4)  # 2 pages
    slots = ext(a, [0], [3], [-1])  # slots 4, 5, 6 of page 1
    a.free(slots[2:])  # roll back the last token
    assert a.available_size() == 4  # page 1 still held
    assert a.alloc(8) is None
    other = a.alloc(4)
    assert other.tolist() == [8, 9, 10, 11]
    assert dec(a, [3], [5]).tolist() == [6]  # the request re-takes its own slot
    a.free(slots[:2])
    assert a.available_size() == 0
    a.free(T([6]))
    assert a.available_size() == 4
    a.check_integrity()


def test_paged_bad_free_without_validate_never_releases_a_live_page():
    a = PagedTokenToKVPoolAllocator(8, 4)
    s = ext(a, [0], [2], [-1])  # slots 4, 5
    a.free(T([4, 4, 4]))  # a double free counted once; slot 5 is still live
    assert a.rejected_frees == 2 and a.available_size() == 4
    a.free(T([6, 1]))  # 6 was never handed out (reserved for the request's page), 1 is on page 0
    assert a.available_size() == 4
    a.free(s[1:])
    assert a.available_size() == 8
    a.check_integrity()


@pytest.mark.parametrize(
    "indices, message",
    [
        ([2], "slot 2 at position 0, which is on the reserved page 0 \\(slots 0..3\\)"),
        ([6], "slot 6 at position 0, which was never allocated"),
        ([12], "slot 12 at position 0, which is outside the handed-out range 4..11"),
    ],
)
def test_paged_validate_bad_frees(indices, message):
    a = PagedTokenToKVPoolAllocator(8, 4, validate=True)
    ext(a, [0], [2], [-1])
    with pytest.raises(ValueError, match=message):
        a.free(T(indices))


@pytest.mark.parametrize(
    "prefix, seq, last_loc, message",
    [
        ([2], [3], [4], "last_loc\\[0\\] must be a slot at offset 1 of its page .*got 4"),
        ([2], [3], [9], "last_loc\\[0\\] must be on a page this allocator has handed out, got slot 9"),
        ([1], [3], [4], "would continue on slot 5, which is already handed out"),
    ],
)
def test_paged_validate_checks_last_loc(prefix, seq, last_loc, message):
    a = PagedTokenToKVPoolAllocator(16, 4, validate=True)
    ext(a, [0], [2], [-1])  # slots 4, 5
    before = snapshot(a)
    with pytest.raises(ValueError, match=message):
        ext(a, prefix, seq, last_loc)
    assert snapshot(a) == before


def test_paged_alloc_extend_argument_errors():
    a = PagedTokenToKVPoolAllocator(16, 4)
    one = T([1])
    with pytest.raises(ValueError, match="extend_num_tokens must be sum\\(seq_lens - prefix_lens\\) = 2, got 3"):
        a.alloc_extend(one, one, 3 * one, 3 * one, -one, 3)
    with pytest.raises(ValueError, match="seq_lens_cpu must be >= prefix_lens_cpu, got 1 < 3 for request 0"):
        a.alloc_extend(3 * one, 3 * one, one, one, -one, -2)
    with pytest.raises(ValueError, match="seq_lens_cpu must have 1 entries"):
        a.alloc_extend(one, one, T([2, 2]), T([2, 2]), -one, 2)
    with pytest.raises(ValueError, match="last_loc must be a 1-D integer tensor"):
        a.alloc_extend(one, one, one, one, T([1.0]), 0)
    with pytest.raises(ValueError, match="seq_lens_cpu must be >= 1"):
        a.alloc_decode(0 * one, 0 * one, one)
    with pytest.raises(ValueError, match="prefix_lens_cpu must be a tensor, got list"):
        a.alloc_extend(one, [1], one, one, one, 0)


def test_paged_validate_compares_device_and_cpu_lengths():
    a = PagedTokenToKVPoolAllocator(16, 4, validate=True)
    with pytest.raises(ValueError, match="seq_lens must equal seq_lens_cpu"):
        a.alloc_decode(T([2]), T([1]), T([3]))


def test_paged_empty_batches():
    a = PagedTokenToKVPoolAllocator(16, 4)
    empty = T([], dtype=torch.int64)
    assert ext(a, [], [], []).tolist() == []
    assert a.alloc_decode(empty, empty, empty).tolist() == []
    assert a.available_size() == 16


def test_paged_need_sort_and_group():
    a = PagedTokenToKVPoolAllocator(16, 4, need_sort=True)
    s = a.alloc(16)
    a.free_group_begin()
    a.free(s[12:])  # page 4
    a.free(s[:4])  # page 1
    assert a.available_size() == 0
    a.free_group_end()
    assert a.available_size() == 8
    assert a.alloc(8).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]  # sorted on merge
    a.check_integrity()


# --- errors change nothing, batches are checked as a whole, double ownership shows ----------------


def test_validate_rejects_two_requests_continuing_onto_one_slot():
    a = PagedTokenToKVPoolAllocator(64, 4, validate=True)
    assert ext(a, [0], [3], [-1]).tolist() == [4, 5, 6]
    before = snapshot(a)
    with pytest.raises(ValueError, match="requests 0 and 1 would both continue on slot 7"):
        dec(a, [4, 4], [6, 6])
    assert snapshot(a) == before
    a.check_integrity()


def test_validate_rejects_two_requests_extending_onto_one_page():
    a = PagedTokenToKVPoolAllocator(64, 4, validate=True)
    ext(a, [0], [2], [-1])  # slots 4, 5
    before = snapshot(a)
    with pytest.raises(ValueError, match="requests 0 and 1 would both continue on slot 6"):
        ext(a, [2, 2], [3, 4], [5, 5])
    assert snapshot(a) == before


def test_validate_rejects_a_last_loc_that_is_not_held_on_a_held_page():
    a = PagedTokenToKVPoolAllocator(64, 4, validate=True)
    ext(a, [0], [2], [-1])  # slots 4, 5 on page 1; 6, 7 not handed out
    with pytest.raises(ValueError, match="last_loc\\[0\\] must be the request's last slot, .* slot 6, which is not"):
        dec(a, [4], [6])


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("op", ["extend", "decode"])
def test_device_and_cpu_lengths_disagreeing_raise_and_change_nothing(validate, op):
    """Without validate this took a page, then failed in repeat_interleave: the page leaked."""
    a = PagedTokenToKVPoolAllocator(64, 4, validate=validate)
    ext(a, [0], [3], [-1])
    before = snapshot(a)
    with pytest.raises(ValueError, match="seq_lens must equal seq_lens_cpu, got seq_lens\\[0\\] = 9 and .* = 5"):
        if op == "extend":
            a.alloc_extend(T([3]), T([3]), T([9]), T([5]), T([6]), 2)
        else:
            a.alloc_decode(T([9]), T([5]), T([6]))
    assert snapshot(a) == before
    a.check_integrity()


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda a: dec(a, [4], [10**6]), IndexError, "alloc_decode: last_loc\\[0\\] must be a slot in 4..67.*1000000"),
        (lambda a: dec(a, [4, 2], [6, -1]), IndexError, "last_loc\\[1\\] must be a slot in 4..67"),
        (lambda a: ext(a, [3], [5], [2]), IndexError, "alloc_extend: last_loc\\[0\\] must be a slot in 4..67"),
        (lambda a: ext(a, [3], [5], [5]), ValueError, "last_loc\\[0\\] must be a slot at offset 2 of its page"),
        (lambda a: a.alloc_extend(T([3]), T([2]), T([5]), T([5]), T([6]), 3), ValueError, "prefix_lens must equal"),
        (lambda a: a.free(torch.zeros(2, dtype=torch.int64, device="meta")), ValueError, "free_index must be on the"),
    ],
    ids=["decode-far", "decode-negative", "extend-page-0", "extend-offset", "prefix-lens", "free-meta"],
)
def test_bad_arguments_are_named_and_change_nothing(validate, call, error, message):
    """A last_loc outside the slots, and a tensor on another device given to free, raise an error
    that names the argument, and nothing changes."""
    a = PagedTokenToKVPoolAllocator(64, 4, validate=validate)  # 16 pages, slots 4..67
    ext(a, [0], [3], [-1])
    before = snapshot(a)
    with pytest.raises(error, match=message):
        call(a)
    assert snapshot(a) == before
    a.check_integrity()


def test_check_integrity_catches_a_slot_owned_twice_after_the_page_is_reallocated():
    """A wrong last_loc without validate continues onto free page 3; once alloc hands that page out
    again, slot 15 has two holders, and check_integrity says so."""
    a = PagedTokenToKVPoolAllocator(16, 4)  # pages 1..4
    ext(a, [0], [3], [-1])  # slots 4, 5, 6
    assert dec(a, [4], [14]).tolist() == [15]  # wrong: page 3 is free
    with pytest.raises(IntegrityError, match="1 pages are both listed free and hold owned slots"):
        a.check_integrity()
    assert 15 in a.alloc(12).tolist()  # pages 2, 3, 4
    with pytest.raises(IntegrityError, match="1 slots owned more than once.*first: slot 15, 2 owners"):
        a.check_integrity()
    a.free(T([15]))  # one holder gives it back; the other still holds it, and so its page
    assert 15 in held_slots(a) and a.available_size() == 0
    a.check_integrity()


def test_without_host_checks_a_far_last_loc_is_not_recorded_but_reported(monkeypatch):
    """What a GPU allocator does without validate (it cannot read last_loc without a sync): the slot
    is returned, never used as an index into the bookkeeping, and check_integrity reports it."""
    a = PagedTokenToKVPoolAllocator(64, 4)
    monkeypatch.setattr(a, "_cheap_device_checks", False)
    ext(a, [0], [3], [-1])
    state = a.backup_state()
    assert dec(a, [4, 2], [10**6, 5]).tolist() == [10**6 + 1, 6]
    assert held_slots(a) == {4, 5, 6}
    with pytest.raises(IntegrityError, match="1 slots were handed out outside the range 4..67"):
        a.check_integrity()
    a.restore_state(state)
    a.check_integrity()


def test_without_host_checks_disagreeing_lengths_never_raise_from_the_device_ops(monkeypatch):
    a = PagedTokenToKVPoolAllocator(64, 4)
    monkeypatch.setattr(a, "_cheap_device_checks", False)
    ext(a, [0], [3], [-1])
    out = a.alloc_extend(T([3, 0]), T([3, 0]), T([2, 40]), T([9, 1]), T([6, -1]), 7)
    assert out.numel() == 7  # wrong slots, as the lengths are wrong, but no error and no stray index
    with pytest.raises(IntegrityError, match="1 pages are neither free nor holding an owned slot"):
        a.check_integrity()  # the CPU lengths asked for 2 pages; the device ones used 1
    assert a.alloc_decode(T([0, 0]), T([1, 1]), T([-1, -1])).tolist() == [0, 0]
    with pytest.raises(IntegrityError, match="2 slots were handed out outside the range"):
        a.check_integrity()


# --- the base class, SGLang's attribute names, CPU copies ------------------------------------------


def test_base_class_is_exported_and_both_allocators_derive_from_it():
    import kvpool
    import kvpool.pools

    assert kvpool.BaseTokenToKVPoolAllocator is kvpool.pools.BaseTokenToKVPoolAllocator is BaseTokenToKVPoolAllocator
    assert issubclass(TokenToKVPoolAllocator, BaseTokenToKVPoolAllocator)
    assert issubclass(PagedTokenToKVPoolAllocator, BaseTokenToKVPoolAllocator)


def test_a_subclass_that_overrides_clear_constructs_as_in_sglang():
    """SGLang's subclasses call super().__init__(size, page_size, dtype, device, kvcache, need_sort),
    set their own fields, then call their clear(); the base must not call it before those exist."""

    class Tracked(BaseTokenToKVPoolAllocator):
        def __init__(self, size: int) -> None:
            super().__init__(size, 1, torch.bfloat16, "cpu", None, False)
            self.handed_out: list[int] = []
            self.clear()

        def clear(self) -> None:
            super().clear()
            self.handed_out.clear()

        def alloc(self, need_size: int):
            out = super().alloc(need_size)
            if out is not None:
                self.handed_out += out.tolist()
            return out

    a = Tracked(4)
    assert a.alloc(2).tolist() == [1, 2] and a.handed_out == [1, 2]
    a.clear()
    assert a.handed_out == [] and a.available_size() == 4
    a.check_integrity()


def test_base_class_methods_left_to_subclasses_raise_not_implemented():
    a = BaseTokenToKVPoolAllocator(8, 2)
    calls = (a.alloc_extend, a.alloc_decode, a.get_cpu_copy, a.load_cpu_copy,  # SGLang's base takes any arguments
             lambda: a.get_cpu_copy(T([2])), lambda: a.load_cpu_copy(None, T([2]), mamba_indices=None))
    for call in calls:
        with pytest.raises(NotImplementedError):
            call()
    assert a.alloc(4).tolist() == [2, 3, 4, 5]
    line = a.debug_print()
    assert isinstance(line, str) and "4 slots available" in line and "2 pages held" in line


def test_sglang_attribute_names_keep_sglangs_meaning():
    a = PagedTokenToKVPoolAllocator(16, 4, need_sort=True)
    assert a.free_pages.tolist() == [1, 2, 3, 4] and a.release_pages.tolist() == []  # page ids
    assert a.is_not_in_free_group and a.free_group == []
    s = a.alloc(12)
    a.free(s[4:8])
    assert a.free_pages.tolist() == [4] and a.release_pages.tolist() == [2]  # need_sort: set aside
    a.free_group_begin()
    assert not a.is_not_in_free_group
    a.free(s[:4])
    assert [t.tolist() for t in a.free_group] == [[1]] and a.available_size() == 8
    a.free_group_end()
    assert a.release_pages.tolist() == [2, 1]
    a.merge_and_sort_free()
    assert a.free_pages.tolist() == [1, 2, 4] and a.release_pages.tolist() == []
    t = TokenToKVPoolAllocator(3)
    t.alloc(1)
    assert t.free_pages.tolist() == [2, 3]  # page size 1: page ids are slot ids


class FakeKVCache:
    def __init__(self):
        self.calls = []

    def get_cpu_copy(self, indices):
        self.calls.append(("get", indices.tolist()))
        return [f"rows {indices.tolist()}"]

    def load_cpu_copy(self, kv_cache_cpu, indices):
        self.calls.append(("load", kv_cache_cpu, indices.tolist()))


@pytest.mark.parametrize(
    "make",
    [lambda kv: TokenToKVPoolAllocator(8, kvcache=kv), lambda kv: PagedTokenToKVPoolAllocator(8, 2, kvcache=kv)],
    ids=["token", "paged"],
)
def test_cpu_copies_delegate_to_the_kvcache(make):
    kv = FakeKVCache()
    a = make(kv)
    idx = a.alloc(2)
    copy = a.get_cpu_copy(idx)
    assert copy == [f"rows {idx.tolist()}"]
    assert a.load_cpu_copy(copy, idx, mamba_indices=None) is None
    assert kv.calls == [("get", idx.tolist()), ("load", copy, idx.tolist())]
    with pytest.raises(ValueError, match="mamba_indices must be None"):
        a.get_cpu_copy(idx, mamba_indices=T([0]))
    no_pool = make(None)
    with pytest.raises(ValueError, match="get_cpu_copy copies rows of the pool .* with kvcache=.*got kvcache=None"):
        no_pool.get_cpu_copy(idx)
    with pytest.raises(ValueError, match="load_cpu_copy"):
        make(object()).load_cpu_copy(copy, idx)


# --- state machines --------------------------------------------------------------------------------


class TokenAllocatorMachine(RuleBasedStateMachine):
    """TokenToKVPoolAllocator against a model: the set of free slots and the groups handed out."""

    @initialize(
        size=st.integers(1, 24), need_sort=st.booleans(), validate=st.booleans()
    )
    def setup(self, size, need_sort, validate):
        self.a = TokenToKVPoolAllocator(size, need_sort=need_sort, validate=validate)
        self.size = size
        self.free = set(range(1, size + 1))  # available now
        self.owned: set[int] = set()
        self.pending: set[int] = set()  # freed inside the open group
        self.in_group = False
        self.saved: list[tuple[AllocatorState, tuple]] = []

    def model(self) -> tuple:
        return (frozenset(self.free), frozenset(self.owned), frozenset(self.pending))

    @rule(n=st.integers(0, 26))
    def alloc(self, n):
        before = snapshot(self.a)
        got = self.a.alloc(n)
        if n > len(self.free):
            assert got is None
            assert snapshot(self.a) == before
            return
        slots = got.tolist()
        assert len(slots) == n and len(set(slots)) == n
        assert set(slots) <= self.free, f"handed out {set(slots) - self.free}, which are not free"
        assert 0 not in slots
        self.free -= set(slots)
        self.owned |= set(slots)

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), as_list=st.booleans())
    def free_some(self, data, as_list):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.owned)), min_size=1, max_size=6, unique=True))
        self.a.free(chosen if as_list else T(chosen))
        self.owned -= set(chosen)
        (self.pending if self.in_group else self.free).update(chosen)

    @rule(data=st.data())
    def bad_free(self, data):
        not_owned = sorted(set(range(-2, self.size + 3)) - self.owned)
        bad = data.draw(st.sampled_from(not_owned))
        batch = [bad] + (sorted(self.owned)[:1] if self.owned else [])
        before = snapshot(self.a)
        if self.a.validate:
            with pytest.raises(ValueError, match=f"got slot {bad} at position 0"):
                self.a.free(T(batch))
            assert snapshot(self.a) == before
        else:
            self.a.free(T(batch))  # the bad entry is dropped, the good one freed
            for s in batch[1:]:
                self.owned.discard(s)
                (self.pending if self.in_group else self.free).add(s)

    @precondition(lambda self: not self.in_group)
    @rule()
    def group_begin(self):
        self.a.free_group_begin()
        self.in_group = True

    @precondition(lambda self: self.in_group)
    @rule()
    def group_end(self):
        self.a.free_group_end()
        self.in_group = False
        self.free |= self.pending
        self.pending = set()

    @rule()
    def backup(self):
        self.saved.append((self.a.backup_state(), self.model()))

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def restore(self, data):
        """Inside or outside a group, either way round: the snapshot's pending frees stay pending only
        if a group is open now."""
        state, model = data.draw(st.sampled_from(self.saved))
        self.a.restore_state(state)
        free, owned, pending = model
        self.free, self.owned = set(free), set(owned)
        if self.in_group:
            self.pending = set(pending)
        else:
            self.free |= pending
            self.pending = set()

    @rule()
    def clear(self):
        self.a.clear()
        self.free, self.owned, self.pending, self.in_group = set(range(1, self.size + 1)), set(), set(), False

    @invariant()
    def counts_agree_and_integrity_holds(self):
        assert self.a.available_size() == len(self.free)
        assert held_slots(self.a) == self.owned
        self.a.check_integrity()


class PagedAllocatorMachine(RuleBasedStateMachine):
    """PagedTokenToKVPoolAllocator against a model of requests (slot lists in token order), loose
    owned slots, and free pages; alloc_extend/alloc_decode outputs are checked position by position."""

    @initialize(
        page_size=st.sampled_from([1, 2, 4]), pages=st.integers(1, 8), spare=st.integers(0, 3),
        need_sort=st.booleans(), validate=st.booleans(), host_checks=st.booleans(),
    )  # fmt: skip
    def setup(self, page_size, pages, spare, need_sort, validate, host_checks):
        spare = spare % page_size
        self.p = page_size
        self.n = pages
        size = pages * page_size + spare
        self.a = PagedTokenToKVPoolAllocator(size, page_size, need_sort=need_sort, validate=validate)
        # host_checks=False runs the allocator as on a GPU, where device arguments are not read
        # without validate, so that the masking of stray slots is exercised here too.
        self.a._cheap_device_checks = host_checks
        self.arg_checks = validate or host_checks
        self.requests: dict[int, list[int]] = {}
        self.loose: set[int] = set()  # owned slots no request continues from
        self.pending: set[int] = set()  # pages released inside the open group
        self.in_group = False
        self.next_rid = 0
        self.saved: list[tuple[AllocatorState, tuple]] = []

    # model helpers
    def owned(self) -> set[int]:
        out = set(self.loose)
        for slots in self.requests.values():
            out.update(slots)
        return out

    def free_pages(self) -> set[int]:
        held = {s // self.p for s in self.owned()}
        return set(range(1, self.n + 1)) - held - self.pending

    def after_free(self, held_before: set[int]) -> None:
        released = held_before - {s // self.p for s in self.owned()}
        if self.in_group:
            self.pending |= released

    def check_new_slots(self, out: list[int], requests: list[tuple[int, int, int, int]]) -> None:
        """requests: (prefix_len, seq_len, last_loc, first output index) per request."""
        free_before = self.free_pages()
        owned = self.owned()
        assert len(set(out)) == len(out), "a slot handed out twice in one call"
        fresh_pages_by_request = []
        for pre, seq, last, start in requests:
            fresh: set[int] = set()
            held_end = -(-pre // self.p) * self.p
            for k, pos in enumerate(range(pre, seq)):
                s = out[start + k]
                assert s not in owned and s >= self.p, f"slot {s} is owned or on page 0"
                assert s % self.p == pos % self.p, f"position {pos} landed at page offset {s % self.p}"
                if pos < held_end:
                    assert s == last + 1 + k
                else:
                    assert s // self.p in free_before, f"page {s // self.p} was not free"
                    fresh.add(s // self.p)
                    if pos % self.p:
                        assert s == out[start + k - 1] + 1, "a page's slots must be consecutive"
            assert len(fresh) == -(-seq // self.p) - -(-pre // self.p)
            fresh_pages_by_request.append(fresh)
        all_fresh = [pg for f in fresh_pages_by_request for pg in f]
        assert len(all_fresh) == len(set(all_fresh)), "two requests got the same fresh page"

    def state(self) -> tuple:
        return ({r: list(s) for r, s in self.requests.items()}, set(self.loose), set(self.pending))

    # rules
    @rule(data=st.data(), width=st.integers(0, 3))
    def extend(self, data, width):
        rids = []
        if self.requests:
            rids = data.draw(st.lists(st.sampled_from(sorted(self.requests)), unique=True, max_size=width))
        batch = [(r, len(self.requests[r])) for r in rids]
        batch += [(None, 0)] * data.draw(st.integers(0, 2))
        grows = [data.draw(st.integers(0, 2 * self.p + 1)) for _ in batch]
        prefix = [pre for _, pre in batch]
        seq = [pre + g for (_, pre), g in zip(batch, grows)]
        last = [self.requests[r][-1] if r is not None and self.requests[r] else -1 for r, _ in batch]
        need = sum(-(-s // self.p) - -(-q // self.p) for q, s in zip(prefix, seq))
        before = snapshot(self.a)
        got = ext(self.a, prefix, seq, last)
        if need > len(self.free_pages()):
            assert got is None
            assert snapshot(self.a) == before
            return
        out = got.tolist()
        assert len(out) == sum(grows)
        starts = [sum(grows[:i]) for i in range(len(batch))]
        self.check_new_slots(out, [(q, s, l, st_) for q, s, l, st_ in zip(prefix, seq, last, starts)])
        for (r, _), g, start in zip(batch, grows, starts):
            if r is None:
                r = self.next_rid
                self.next_rid += 1
                self.requests[r] = []
            self.requests[r] += out[start : start + g]

    @precondition(lambda self: any(self.requests.values()))
    @rule(data=st.data())
    def decode(self, data):
        live = sorted(r for r, s in self.requests.items() if s)
        rids = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=4))
        seq = [len(self.requests[r]) + 1 for r in rids]
        last = [self.requests[r][-1] for r in rids]
        need = sum(1 for s in seq if (s - 1) % self.p == 0)
        before = snapshot(self.a)
        got = dec(self.a, seq, last)
        if need > len(self.free_pages()):
            assert got is None
            assert snapshot(self.a) == before
            return
        out = got.tolist()
        self.check_new_slots(out, [(s - 1, s, l, i) for i, (s, l) in enumerate(zip(seq, last))])
        for r, s in zip(rids, out):
            self.requests[r].append(s)

    @rule(k=st.integers(0, 3))
    def alloc_pages(self, k):
        free = self.free_pages()
        before = snapshot(self.a)
        got = self.a.alloc(k * self.p)
        if k > len(free):
            assert got is None
            assert snapshot(self.a) == before
            return
        slots = got.tolist()
        assert {s // self.p for s in slots} <= free and len(set(slots)) == len(slots) == k * self.p
        self.loose |= set(slots)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), how=st.sampled_from(["whole", "suffix", "scattered"]))
    def free_request(self, data, how):
        r = data.draw(st.sampled_from(sorted(self.requests)))
        slots = self.requests[r]
        held_before = {s // self.p for s in self.owned()}
        if how == "whole" or not slots:
            chosen = list(slots)
            del self.requests[r]
        elif how == "suffix":
            k = data.draw(st.integers(1, len(slots)))
            chosen = slots[-k:]
            self.requests[r] = slots[:-k]
        else:
            chosen = data.draw(st.lists(st.sampled_from(slots), unique=True, min_size=1))
            self.loose |= set(slots) - set(chosen)
            del self.requests[r]
        self.a.free(T(chosen, dtype=torch.int64))
        self.after_free(held_before)

    @precondition(lambda self: self.loose)
    @rule(data=st.data())
    def free_loose(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.loose)), unique=True, min_size=1))
        held_before = {s // self.p for s in self.owned()}
        self.a.free(chosen)
        self.loose -= set(chosen)
        self.after_free(held_before)

    @rule(data=st.data())
    def bad_free(self, data):
        owned = self.owned()
        bad = data.draw(st.sampled_from(sorted(set(range(-1, (self.n + 2) * self.p)) - owned)))
        before = snapshot(self.a)
        if self.a.validate:
            with pytest.raises(ValueError, match=f"got slot {bad} at position 0"):
                self.a.free(T([bad]))
        else:
            self.a.free(T([bad, bad]))
        assert snapshot(self.a) == before

    @precondition(lambda self: not self.in_group)
    @rule()
    def group_begin(self):
        self.a.free_group_begin()
        self.in_group = True

    @precondition(lambda self: self.in_group)
    @rule()
    def group_end(self):
        self.a.free_group_end()
        self.in_group = False
        self.pending = set()

    @rule()
    def backup(self):
        self.saved.append((self.a.backup_state(), self.state()))

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def restore(self, data):
        state, (requests, loose, pending) = data.draw(st.sampled_from(self.saved))
        self.a.restore_state(state)
        self.requests = {r: list(s) for r, s in requests.items()}
        self.loose = set(loose)
        self.pending = set(pending) if self.in_group else set()

    # misuse: each call is undone with restore_state, after checking what it did

    def continuing(self, data, rem: Optional[int] = None, besides: Optional[int] = None) -> Optional[int]:
        """A request (not ``besides``) whose last page is partial (``rem`` tokens on it, if given);
        one is started if there is none and a page is free."""
        partial = sorted(
            r for r, s in self.requests.items() if len(s) % self.p and r != besides and rem in (None, len(s) % self.p)
        )
        if partial:
            return data.draw(st.sampled_from(partial))
        if self.p == 1 or not self.free_pages():
            return None
        n = rem if rem is not None else data.draw(st.integers(1, self.p - 1))
        out = ext(self.a, [0], [n], [-1]).tolist()
        self.check_new_slots(out, [(0, n, -1, 0)])
        self.requests[self.next_rid] = out
        self.next_rid += 1
        return self.next_rid - 1

    def damaged(self, new_slots: list[int]) -> bool:
        """Whether check_integrity must fail once ``new_slots`` gained a holder: one is outside the
        recorded range, already held (or listed twice), or on a page that is not held."""
        owned, n_slots = self.owned(), (self.n + 1) * self.p
        held_pages = {s // self.p for s in owned}
        return len(set(new_slots)) < len(new_slots) or any(
            not self.p <= s < n_slots or s in owned or s // self.p not in held_pages for s in new_slots
        )

    def undo(self, state: AllocatorState, before: tuple, new_slots: list[int]) -> None:
        if self.damaged(new_slots):
            with pytest.raises(IntegrityError):
                self.a.check_integrity()
        else:
            self.a.check_integrity()
        self.a.restore_state(state)
        assert snapshot(self.a) == before

    @rule(data=st.data(), kind=st.sampled_from(["other-request", "other-page", "misaligned", "outside"]))
    def wrong_last_loc(self, data, kind):
        """alloc_decode with a last_loc that is not the request's last slot. Another request's last
        slot passes even validate (the allocator does not know which request holds a page); the two
        collide when that request continues."""
        p, n_slots = self.p, (self.n + 1) * self.p
        r = self.continuing(data)
        if r is None:
            return
        slots = self.requests[r]
        rem, own = len(slots) % p, slots[-1]
        if kind == "other-request":
            other = self.continuing(data, rem=rem, besides=r)
            if other is None:
                return
            wrong = self.requests[other][-1]
        elif kind == "other-page":
            wrong = data.draw(st.integers(1, self.n)) * p + rem - 1
        elif kind == "misaligned":
            wrong = data.draw(st.integers(p, n_slots - 1).filter(lambda s: (s + 1) % p != rem))
        else:
            wrong = data.draw(st.sampled_from([-1, 0, p - 1, n_slots, n_slots + rem, 10**6]))
        owned = self.owned()
        if kind == "other-page" and wrong == own:
            return  # that is the right last_loc
        state, before = self.a.backup_state(), snapshot(self.a)
        error = None
        if self.arg_checks and kind in ("misaligned", "outside"):
            error = IndexError if kind == "outside" else ValueError
        elif self.a.validate and (wrong not in owned or wrong + 1 in owned):
            error = ValueError  # not the holder's last slot (or its page is not held), or runs onto a held slot
        if error is not None:
            with pytest.raises(error, match="last_loc\\[0\\]|request 0"):
                dec(self.a, [len(slots) + 1], [wrong])
            assert snapshot(self.a) == before
            return
        assert dec(self.a, [len(slots) + 1], [wrong]).tolist() == [wrong + 1]
        self.undo(state, before, [wrong + 1])

    @rule(data=st.data(), op=st.sampled_from(["decode", "extend"]))
    def batch_sharing_a_page(self, data, op):
        """One request listed twice in a batch: both entries continue onto the same slots."""
        r = self.continuing(data)
        if r is None:
            return
        slots = self.requests[r]
        n, own = len(slots), slots[-1]
        grows = [1, 1] if op == "decode" else [data.draw(st.integers(1, 2 * self.p)) for _ in range(2)]
        state, before = self.a.backup_state(), snapshot(self.a)
        if self.a.validate:
            with pytest.raises(ValueError, match="requests 0 and 1 would both continue on slot"):
                ext(self.a, [n, n], [n + g for g in grows], [own, own])
            assert snapshot(self.a) == before
            return
        need = sum(-(-(n + g) // self.p) - -(-n // self.p) for g in grows)
        got = ext(self.a, [n, n], [n + g for g in grows], [own, own])
        if need > len(self.free_pages()):
            assert got is None
            assert snapshot(self.a) == before
            return
        assert got.tolist()[0] == got.tolist()[grows[0]] == own + 1
        self.undo(state, before, got.tolist())

    @rule()
    def clear(self):
        self.a.clear()
        self.requests, self.loose, self.pending, self.in_group = {}, set(), set(), False

    @invariant()
    def counts_agree_and_integrity_holds(self):
        assert self.a.available_size() == len(self.free_pages()) * self.p
        assert held_slots(self.a) == self.owned()
        self.a.check_integrity()


TestTokenAllocatorMachine = TokenAllocatorMachine.TestCase
TestPagedAllocatorMachine = PagedAllocatorMachine.TestCase
TestPagedAllocatorMachine.settings = settings(TestPagedAllocatorMachine.settings, stateful_step_count=40)
