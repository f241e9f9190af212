"""``SWATokenToKVPoolAllocator``: every call hands out or gives back slots in both parts and keeps
the full-to-SWA mapping (page sizes 1 and 4), ``free_swa`` gives back only the SWA part, backup and
restore cover both parts and the mapping, refused calls change nothing in either part, and
``check_integrity`` reports faults planted in the mapping. The expectations come from the contract
(which slots, which mapping), never from the allocator's own answers.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import DEVICE, Layer, dec, ext, held_slots, make_swa_pool, swa_allocator_snapshot, swa_as_on_gpu
from kvpool import IntegrityError, SWAKVPool, SWATokenToKVPoolAllocator
from kvpool.pools.allocator.state import AllocatorErrors

T = torch.tensor


def mapping_of(a) -> dict[int, int]:
    """Full slot -> SWA slot for every mapped full slot."""
    m = a.full_to_swa_index_mapping.tolist()
    assert m[-1] == -1
    return {f: s for f, s in enumerate(m[:-1]) if s}


# --- alloc ---------------------------------------------------------------------------------------------


def test_alloc_takes_slots_in_both_parts_and_maps_them_in_order():
    a = SWATokenToKVPoolAllocator(10, 6, 1)
    assert (a.size, a.size_full, a.size_swa, a.available_size()) == (6, 10, 6, 6)
    full = a.alloc(4)
    assert full.dtype == torch.int64 and full.tolist() == [1, 2, 3, 4]
    assert mapping_of(a) == {1: 1, 2: 2, 3: 3, 4: 4}
    assert a.translate_loc_from_full_to_swa(T([4, 1, -1, 0, 99])).tolist() == [4, 1, -1, 0, -1]
    assert (a.full_available_size(), a.swa_available_size(), a.available_size()) == (6, 2, 2)
    assert a.alloc(0).tolist() == []
    a.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_is_refused_whole_when_either_part_is_short(page_size):
    p = page_size
    a = SWATokenToKVPoolAllocator(8 * p, 2 * p, p)
    a.alloc(2 * p)  # the SWA part is full now, the full part is not
    before = swa_allocator_snapshot(a)
    assert a.alloc(p) is None
    assert swa_allocator_snapshot(a) == before
    b = SWATokenToKVPoolAllocator(2 * p, 8 * p, p)
    b.alloc(2 * p)  # now the full part is full
    before = swa_allocator_snapshot(b)
    assert b.alloc(p) is None and swa_allocator_snapshot(b) == before


def test_alloc_extend_and_decode_continue_each_part_on_its_own_pages():
    a = SWATokenToKVPoolAllocator(64, 20, 4)
    a.alloc(8)  # pages 1, 2 of both parts, held by another request
    a.free_swa(T([4, 5, 6, 7]))  # ... whose first page left the window: SWA page 1 is free, last in line
    a.alloc(4)  # page 3 of both parts; the SWA part's free pages are now 4, 5, 1
    full = ext(a, [0, 0], [6, 3], [-1, -1])  # two prompts: 6 tokens (two pages), 3 tokens
    assert full.tolist() == [16, 17, 18, 19, 20, 21, 24, 25, 26]  # full pages 4, 5 and 6
    assert a.translate_loc_from_full_to_swa(full).tolist() == [16, 17, 18, 19, 20, 21, 4, 5, 6]  # SWA 4, 5, 1
    more = ext(a, [6, 3], [7, 4], [21, 26])  # both continue their partial pages
    assert more.tolist() == [22, 27]
    assert a.translate_loc_from_full_to_swa(more).tolist() == [22, 7]
    a.free_swa(T([8, 9, 10, 11]))  # the other request's second page leaves the window: SWA page 2
    step = dec(a, [8, 5], [22, 27])  # the second request starts a page: full page 7, SWA page 2
    assert step.tolist() == [23, 28]
    assert a.translate_loc_from_full_to_swa(step).tolist() == [23, 8]
    for f, s in mapping_of(a).items():
        assert f % 4 == s % 4  # a slot and its SWA slot sit at the same page offset
    a.check_integrity()


def test_alloc_extend_is_refused_whole_when_the_swa_part_is_short():
    a = SWATokenToKVPoolAllocator(64, 8, 4)
    ext(a, [0], [5], [-1])  # SWA: both pages taken
    before = swa_allocator_snapshot(a)
    assert ext(a, [0], [1], [-1]) is None
    assert ext(a, [5], [9], [8]) is None  # continues page 2 (3 slots), then needs a fresh page
    assert dec(a, [9], [8]) is None
    assert swa_allocator_snapshot(a) == before
    assert ext(a, [5], [8], [8]).tolist() == [9, 10, 11]  # within its pages: no fresh page needed
    a.check_integrity()


def test_a_continuation_whose_swa_part_left_the_window_is_refused_in_both_parts():
    a = SWATokenToKVPoolAllocator(64, 32, 4)
    full = ext(a, [0], [6], [-1])
    a.free_swa(full)  # the whole request left the window (a caller error: its last token too)
    before = swa_allocator_snapshot(a)
    with pytest.raises(IndexError, match="SWA part refused last_loc translated through the full-to-SWA mapping"):
        ext(a, [6], [7], [int(full[-1])])
    with pytest.raises(IndexError, match="SWA part refused"):
        dec(a, [7], [int(full[-1])])
    assert swa_allocator_snapshot(a) == before
    a.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_size_one_hands_out_with_alloc_only(page_size):
    a = SWATokenToKVPoolAllocator(16, 8, page_size)
    if page_size == 1:
        with pytest.raises(NotImplementedError, match="alloc_extend is for PagedTokenToKVPoolAllocator"):
            ext(a, [0], [2], [-1])
        with pytest.raises(NotImplementedError, match="alloc_decode is for PagedTokenToKVPoolAllocator"):
            dec(a, [1], [-1])
    else:
        assert a.alloc(4).tolist() == [4, 5, 6, 7]
        with pytest.raises(ValueError, match="need_size must be a multiple of page_size = 4, got 2"):
            a.alloc(2)


# --- free and free_swa -------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_gives_back_both_parts_and_free_swa_only_the_window(page_size):
    p = page_size
    a = SWATokenToKVPoolAllocator(16 * p, 4 * p, p)
    full = a.alloc(4 * p)
    swa = a.translate_loc_from_full_to_swa(full).tolist()
    a.free_swa(full[: 2 * p])  # the oldest tokens left the window
    assert set(mapping_of(a)) == set(full[2 * p :].tolist())
    assert held_slots(a.swa_attn_allocator) == set(swa[2 * p :])
    assert held_slots(a.full_attn_allocator) == set(full.tolist())
    assert (a.full_available_size(), a.swa_available_size()) == (12 * p, 2 * p)
    a.free_swa(full[: 2 * p])  # again: those slots have no SWA part any more, nothing happens
    assert a.swa_available_size() == 2 * p
    a.free(full)  # the request ends: its full slots, and the SWA slots still mapped
    assert (a.full_available_size(), a.swa_available_size()) == (16 * p, 4 * p)
    assert mapping_of(a) == {} and a.errors() == AllocatorErrors(rejected_frees=0, unrecorded=0)
    a.check_integrity()


def test_free_takes_a_cpu_tensor_or_a_list_and_nothing_for_nothing():
    a = SWATokenToKVPoolAllocator(8, 8, 1)
    a.alloc(5)
    a.free([1, 2])
    a.free(T([3], dtype=torch.int32))
    a.free(T([], dtype=torch.int64))
    a.free_swa([])
    assert mapping_of(a) == {4: 4, 5: 5} and a.available_size() == 6
    a.check_integrity()


def test_free_groups_hold_both_parts_pages_until_the_end():
    a = SWATokenToKVPoolAllocator(16, 8, 4)
    full = a.alloc(8)
    a.free_group_begin()
    assert not a.is_not_in_free_group
    a.free(full[:4])
    assert (a.full_available_size(), a.swa_available_size()) == (8, 0) and 4 not in mapping_of(a)
    a.free_group_end()
    assert (a.full_available_size(), a.swa_available_size()) == (12, 4) and a.is_not_in_free_group
    a.check_integrity()


def test_need_sort_hands_out_low_pages_first_in_both_parts():
    a = SWATokenToKVPoolAllocator(16, 12, 4, need_sort=True)
    full = a.alloc(12)
    a.free(full[8:])
    a.free(full[:4])
    assert a.alloc(8).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert a.translate_loc_from_full_to_swa(T([4, 12])).tolist() == [4, 12]
    a.check_integrity()


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.int32])
def test_a_last_loc_of_any_integer_dtype_continues_both_parts(dtype):
    """The parts take ``last_loc`` of any integer dtype; its translation for the SWA part does too."""
    a = SWATokenToKVPoolAllocator(64, 20, 4)
    first = ext(a, [0], [3], [-1])  # slots 4, 5, 6 in both parts
    pre, seq = torch.tensor([3]), torch.tensor([5])
    more = a.alloc_extend(pre, pre, seq, seq, torch.tensor([6], dtype=dtype), 2)
    assert more.tolist() == [7, 8] and a.translate_loc_from_full_to_swa(more).tolist() == [7, 8]
    step = a.alloc_decode(torch.tensor([6]), torch.tensor([6]), torch.tensor([8], dtype=dtype))
    assert step.tolist() == [9] and first.tolist() == [4, 5, 6]
    a.check_integrity()


def test_on_a_gpu_unmapped_entries_of_a_free_are_dropped_by_the_swa_part_and_not_reported():
    a = swa_as_on_gpu(SWATokenToKVPoolAllocator(16, 8, 4))
    full = a.alloc(8)
    a.free_swa(full[:4])
    a.free(full)  # its first page has no SWA part: those 4 entries reach the SWA part as slot 0
    assert a.errors() == AllocatorErrors(rejected_frees=0, unrecorded=0)
    assert (a.full_available_size(), a.swa_available_size()) == (16, 8)
    a.free(T([4]))  # a real double free is still reported (by the full part: slot 4 has no SWA part now)
    assert a.errors().rejected_frees == 1
    a.check_integrity()


def test_on_a_gpu_an_allocation_beyond_the_host_counts_reads_them_first():
    a = swa_as_on_gpu(SWATokenToKVPoolAllocator(8, 4, 1), lands=False)
    full = a.alloc(4)
    a.free(full[:2])  # the counts stay on the "device"
    assert a.swa_available_size() == 0
    assert a.alloc(2) is not None and a.alloc(1) is None
    a.check_integrity()


def test_on_a_gpu_slots_from_an_unchecked_last_loc_never_leave_the_mapping():
    a = swa_as_on_gpu(SWATokenToKVPoolAllocator(16, 8, 4))
    bad = ext(a, [2], [4], [18])  # last_loc 18 is past the full pool (rows 0..19): slots 19, 20
    assert bad.tolist() == [19, 20]
    m = a.full_to_swa_index_mapping.tolist()
    assert m[-1] == -1 and m[19] == 0 and len(m) == 21  # 20 is outside: not recorded
    with pytest.raises(IntegrityError, match="handed out"):
        a.check_integrity()


# --- snapshots, clear, kvcache ------------------------------------------------------------------------


def test_restore_state_undoes_both_parts_and_the_mapping_in_place():
    a = SWATokenToKVPoolAllocator(32, 16, 4)
    first = ext(a, [0], [5], [-1])
    state = a.backup_state()
    before = swa_allocator_snapshot(a)
    mapping = a.full_to_swa_index_mapping
    ext(a, [5], [9], [int(first[-1])])
    a.free_swa(first[:4])
    a.free(first[4:])
    a.restore_state(state)
    assert swa_allocator_snapshot(a) == before and a.full_to_swa_index_mapping is mapping
    a.restore_state(state)  # any number of times
    assert swa_allocator_snapshot(a) == before
    a.check_integrity()


def test_clear_frees_everything_and_keeps_the_last_entry():
    a = SWATokenToKVPoolAllocator(16, 8, 1)
    a.alloc(6)
    a.clear()
    assert mapping_of(a) == {} and a.available_size() == 8 and a.full_available_size() == 16
    a.check_integrity()


def test_with_a_pool_the_mapping_is_registered_and_writes_follow_it():
    pool = make_swa_pool(torch.float32, size=24, size_swa=12)
    a = SWATokenToKVPoolAllocator(24, 12, 1, None, DEVICE, pool)
    assert pool.full_to_swa_index_mapping is a.full_to_swa_index_mapping and a.get_kvcache() is pool
    a.alloc(3)
    full = a.alloc(2)  # full slots 4, 5 -> SWA slots 4, 5
    a.free_swa(T([4]))
    x = torch.arange(2 * 48, dtype=torch.float32, device=DEVICE).view(2, 3, 16)
    pool.set_kv_buffer(Layer(0), full, x, x[:, :, :8])
    k = pool.get_key_buffer(0)
    assert torch.equal(k[0], x[0]) and torch.equal(k[5], x[1])  # slot 4 has no SWA part: padding row 0
    copy = a.get_cpu_copy(full)
    assert torch.equal(copy["swa"].k[0, 1].view(torch.float32), x[1].cpu())


@pytest.mark.parametrize("kwargs, message", [
    (dict(kvcache=object()), "kvcache must be an SWAKVPool or None, got object"),
    (dict(size=32), "size must be at most the kvcache's size = 24"),
    (dict(size_swa=16), "size must be at most the kvcache's size = 12"),
    (dict(page_size=2), "page_size must equal the kvcache's page_size = 1"),
    (dict(page_size=0), "page_size must be a positive int"),
])  # fmt: skip
def test_bad_construction_raises(kwargs, message):
    pool = make_swa_pool(torch.bfloat16, size=24, size_swa=12)
    args = dict(size=24, size_swa=12, page_size=1, dtype=None, device=DEVICE, kvcache=pool)
    with pytest.raises(ValueError, match=message):
        SWATokenToKVPoolAllocator(**{**args, **kwargs})
    assert pool.full_to_swa_index_mapping is None


# --- bad input -----------------------------------------------------------------------------------------


def test_bad_calls_raise_naming_the_argument_and_change_nothing():
    a = SWATokenToKVPoolAllocator(32, 16, 4)
    ext(a, [0], [5], [-1])
    other = SWATokenToKVPoolAllocator(64, 16, 4).backup_state()
    one = T([1])
    calls = [
        (lambda: a.alloc(-4), "need_size must be a non-negative int"),
        (lambda: a.alloc(6), "need_size must be a multiple of page_size = 4, got 6"),
        (lambda: a.alloc_extend(one, one, 2 * one, 2 * one, one, 3), "extend_num_tokens must be sum"),
        (lambda: a.alloc_extend(one, one.float(), 2 * one, 2 * one, one, 1), "prefix_lens_cpu must be"),
        (lambda: a.alloc_decode(one, one, T([1, 2])), "last_loc must have 1 entries"),
        (lambda: ext(a, [5], [6], [9]), "last_loc.0. must be a slot at offset 0"),
        (lambda: a.free(T([1.0])), "free_index must be"),
        (lambda: a.free(3.5), "free_index must be a tensor or a sequence of ints"),
        (lambda: a.free_swa([1.5]), "free_index must hold ints"),
        (lambda: a.restore_state(other), "state.full must be a snapshot of this allocator's full part"),
        (lambda: a.restore_state(other.full), "state must be an SWAAllocatorState"),
        (lambda: a.translate_loc_from_full_to_swa(T([1.0])), "kv_indices must be an int32 or int64 tensor"),
        (lambda: a.get_cpu_copy(one), "construct SWATokenToKVPoolAllocator with kvcache"),
    ]  # fmt: skip
    before = swa_allocator_snapshot(a)
    for call, message in calls:
        with pytest.raises(ValueError, match=message):
            call()
        assert swa_allocator_snapshot(a) == before, message


def test_under_validate_a_bad_free_raises_and_frees_nothing_in_either_part():
    a = SWATokenToKVPoolAllocator(16, 8, 1, validate=True)
    full = a.alloc(4)
    a.free(full[:1])
    before = swa_allocator_snapshot(a)
    for bad, why in (([2, 1], "already freed"), ([0], "padding slot 0"), ([3, 3], "more than once"), ([9], "never allocated")):
        with pytest.raises(ValueError, match=why):
            a.free(T(bad))
        assert swa_allocator_snapshot(a) == before, why
    a.free_swa(full[1:2])
    a.free(full[1:])  # slot 2 has no SWA part: only its full part is freed, no error
    assert a.available_size() == 8 and a.full_available_size() == 16
    a.check_integrity()


def test_under_validate_a_corrupt_mapping_makes_free_raise_in_the_swa_part_and_undo_the_full_part():
    a = SWATokenToKVPoolAllocator(16, 8, 1, validate=True)
    a.alloc(2)
    a.full_to_swa_index_mapping[2] = 1  # both full slots map to SWA slot 1
    before = swa_allocator_snapshot(a)
    with pytest.raises(ValueError, match="more than once"):
        a.free(T([1, 2]))
    assert swa_allocator_snapshot(a) == before


# --- check_integrity -----------------------------------------------------------------------------------


FAULTS = [
    ("unheld full slot mapped", lambda a: a.full_to_swa_index_mapping.__setitem__(12, 5),
     "mapped full slots not held by the full part"),
    ("a SWA slot mapped twice", lambda a: a.full_to_swa_index_mapping.__setitem__(5, 4),
     "SWA slots mapped from more than one full slot"),
    ("held SWA slot unmapped", lambda a: a.full_to_swa_index_mapping.__setitem__(4, 0),
     "SWA slots held but mapped from no full slot"),
    ("SWA slot not held", lambda a: a.swa_attn_allocator.free(torch.tensor([6])),
     "whose SWA slot the SWA part does not hold"),
    ("another page offset", lambda a: a.full_to_swa_index_mapping.__setitem__(5, 7),
     "at another page offset than their SWA slot"),
    ("page 0 mapped", lambda a: a.full_to_swa_index_mapping.__setitem__(1, 4), "slots of page 0 mapped"),
    ("last entry", lambda a: a.full_to_swa_index_mapping.__setitem__(-1, 0), "last entry must be -1, got 0"),
    ("outside the SWA part", lambda a: a.full_to_swa_index_mapping.__setitem__(6, 99), "mapping entries outside"),
    ("a part's own books", lambda a: setattr(a.full_attn_allocator, "free_pages", torch.tensor([3, 3])),
     "full part: PagedTokenToKVPoolAllocator integrity check failed"),
]  # fmt: skip


@pytest.mark.parametrize("name, plant, report", FAULTS, ids=[f[0] for f in FAULTS])
def test_check_integrity_reports_a_planted_fault(name, plant, report):
    a = SWATokenToKVPoolAllocator(32, 16, 4)
    a.alloc(8)  # full 4..11 -> SWA 4..11
    a.check_integrity()
    plant(a)
    with pytest.raises(IntegrityError, match=report):
        a.check_integrity()


# --- on a GPU: no call waits ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_no_call_waits_for_the_gpu():
    from kvassert import no_sync

    a = SWATokenToKVPoolAllocator(4096, 1024, 16, device="cuda")
    cuda = dict(device="cuda", dtype=torch.int64)
    first = a.alloc(64)
    a.free(a.alloc(32))  # its count comes back behind the queued work
    pre, seq = torch.tensor([0, 64], **cuda), torch.tensor([20, 70], **cuda)
    pre_cpu, seq_cpu, next_cpu = pre.cpu(), seq.cpu(), (seq + 1).cpu()
    minus_one = torch.tensor([-1], **cuda)
    torch.cuda.synchronize()
    with no_sync():
        state = a.backup_state()
        last = torch.cat((minus_one, first[-1:]))
        got = a.alloc_extend(pre, pre_cpu, seq, seq_cpu, last, 26)
        step = a.alloc_decode(seq + 1, next_cpu, torch.cat((got[19:20], got[25:26])))
        a.translate_loc_from_full_to_swa(step)
        a.free_swa(first[:16])
        a.free(torch.cat((first, got, step)))
        a.available_size(), a.swa_available_size(), a.full_available_size()
        a.restore_state(state)
    torch.cuda.synchronize()
    a.check_integrity()
    assert a.errors().rejected_frees == 0
