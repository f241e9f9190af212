"""``TokenToKVPoolAllocator`` by deliberate examples: slots handed out from 1 in order (never slot 0), a
failed alloc changing nothing, FIFO reuse, ``need_sort``, free groups, backup and restore, clear,
validate and the bad frees it refuses, constructor errors, SGLang's keywords and getters, a kvcache
the allocator does not fit, and ``check_integrity`` reporting corruption with counts.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import allocator_snapshot, held_slots
from kvpool.errors import IntegrityError
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.allocator import AllocatorState, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

T = torch.tensor


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
    before = allocator_snapshot(a)
    assert a.alloc(4) is None  # 2 free + 1 released = 3 < 4
    assert allocator_snapshot(a) == before
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
    before = allocator_snapshot(a)
    first = a.alloc(3)
    a.free(T([1]))
    a.restore_state(state)
    assert allocator_snapshot(a) == before
    assert a.alloc(3).tolist() == first.tolist()
    a.restore_state(state)  # a state can be restored again
    assert allocator_snapshot(a) == before
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
    before = allocator_snapshot(a)
    a.free(s[4:8])  # page 2 pending too
    a.alloc(4)
    a.restore_state(state)  # still inside the group: page 1 pending again, page 2 held again
    assert allocator_snapshot(a) == before
    a.free_group_end()
    assert a.available_size() == 8 and sorted(a.free_pages.tolist()) == [1, 4]
    a.check_integrity()


def test_restore_outside_a_group_makes_the_snapshots_pending_pages_available():
    """A allocator_snapshot taken inside a group and restored after free_group_end() must not strand the pages
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
    before = allocator_snapshot(a)
    with pytest.raises(ValueError, match=message):
        a.free(T(indices))
    assert allocator_snapshot(a) == before


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
