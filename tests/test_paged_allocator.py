"""``PagedTokenToKVPoolAllocator`` by deliberate examples: whole pages skipping page 0,
``alloc_extend`` and ``alloc_decode`` continuing partial pages or taking fresh ones (and
``alloc_extend_naive`` giving the same slots), ``None`` when pages run out with nothing changed, a
page returning only when all its handed-out slots are freed, validate on frees and ``last_loc``,
empty batches, ``need_sort`` and free groups.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import allocator_snapshot, dec, ext
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator, alloc_extend_naive

T = torch.tensor


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
    before = allocator_snapshot(a)
    assert ext(a, [0, 0], [1, 1], [-1, -1]) is None  # two fresh pages wanted, one free
    assert allocator_snapshot(a) == before
    assert ext(a, [5], [9], [8]).tolist() == [9, 10, 11, 12]  # 3 on page 2, then page 3
    assert dec(a, [10], [12]).tolist() == [13]
    before = allocator_snapshot(a)
    assert dec(a, [11, 1], [13, -1]) is None  # the second request needs a page; none is free
    assert allocator_snapshot(a) == before


def test_paged_decode_none_changes_nothing():
    a = PagedTokenToKVPoolAllocator(8, 4)  # 2 pages
    ext(a, [0, 0], [4, 4], [-1, -1])  # both pages full
    before = allocator_snapshot(a)
    assert dec(a, [5], [7]) is None
    assert allocator_snapshot(a) == before


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
    before = allocator_snapshot(a)
    with pytest.raises(ValueError, match=message):
        ext(a, prefix, seq, last_loc)
    assert allocator_snapshot(a) == before


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
