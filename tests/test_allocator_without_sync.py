"""The allocators without waiting for the device: on a GPU (and here on the CPU with the counts
copied back instead of read, as on a GPU) ``free`` leaves the count of the pages that came back on
the device. ``available_size()`` never counts more than is free, an allocation beyond the host's
count reads the counts and gets exactly what a waiting allocator would, bad frees are dropped and
counted by ``errors()`` (test_allocator_state_machines.py runs the state machines so too). On CUDA
no call waits for a queued kernel (sync debug mode).
"""

from __future__ import annotations

import pytest
import torch

from kvassert import counts_copied_back, held_slots
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from kvpool.pools.allocator.state import AllocatorErrors

T = torch.tensor


def test_available_size_never_counts_a_page_whose_free_is_not_counted_yet():
    a = counts_copied_back(TokenToKVPoolAllocator(8), lands=False)
    s = a.alloc(8)
    a.free(s[:3])
    assert a.available_size() == 0  # the device has the count; the host has not read it
    assert a.alloc(2).tolist() == [1, 2]  # beyond the host's count: reads it, then takes from it
    assert a.available_size() == 1
    a.check_integrity()


def test_counts_copied_back_are_folded_in_without_a_read(monkeypatch):
    a = counts_copied_back(PagedTokenToKVPoolAllocator(64, 4))
    s = a.alloc(32)
    reads = []
    original = type(a._lists).read
    monkeypatch.setattr(type(a._lists), "read", lambda lists: (reads.append(1), original(lists)))
    a.free(s[:10])  # pages 1 and 2 come back; page 3 keeps two slots
    assert a.available_size() == 40 and a.alloc(40) is not None
    assert a.alloc(4) is None  # the copy was of the latest counts: they are exact, None needs no read
    assert reads == []


def test_bad_frees_are_dropped_and_counted_when_the_counts_are_read(caplog):
    a = counts_copied_back(TokenToKVPoolAllocator(4), lands=False)
    a.alloc(3)
    a.free(T([1]))
    a.free(T([0, 1, 2, 2, 9, -1, 4]))  # only 2 is valid: 0 padding, 1 already free, 9/-1 range, 4 never
    assert a.rejected_frees == 0 and "dropped" not in caplog.text  # not read yet
    assert a.errors() == AllocatorErrors(rejected_frees=6, unrecorded=0)
    assert "dropped 6 entries" in caplog.text and a.rejected_frees == 6
    assert a.available_size() == 3 and sorted(a.alloc(3).tolist()) == [1, 2, 4]
    a.check_integrity()


def test_a_page_freed_twice_in_a_group_is_listed_once():
    a = counts_copied_back(PagedTokenToKVPoolAllocator(16, 4, need_sort=True), lands=False)
    s = a.alloc(16)
    a.free_group_begin()
    a.free(s[:4])
    a.free(s[:4])  # a double free of page 1
    a.free(s[8:12])
    a.free_group_end()
    assert a.errors().rejected_frees == 4
    assert a.release_pages.tolist() == [1, 3]
    assert a.alloc(8).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    a.check_integrity()


def test_backup_and_restore_keep_counts_not_read_yet():
    a = counts_copied_back(TokenToKVPoolAllocator(6), lands=False)
    s = a.alloc(6)
    a.free(s[:2])
    state = a.backup_state()
    a.free(s[2:4])
    a.restore_state(state)
    assert a.available_size() == 0  # the snapshot's free is still not counted on the host
    assert sorted(a.alloc(2).tolist()) == [1, 2] and a.alloc(1) is None
    assert held_slots(a) == {1, 2, 3, 4, 5, 6}
    a.check_integrity()


# --- CUDA: no call waits for a queued kernel ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("need_sort", [False, True])
def test_no_allocator_call_waits_for_the_gpu_without_validate(need_sort):
    dev = torch.device("cuda")
    token = TokenToKVPoolAllocator(1 << 16, device=dev, need_sort=need_sort)
    paged = PagedTokenToKVPoolAllocator(1 << 16, 64, device=dev, need_sort=need_sort)
    lens = {k: T(v) for k, v in dict(pre=[0, 0, 0], seq=[300, 64, 1], dseq=[301, 65, 2]).items()}
    on_dev = {k: v.to(dev) for k, v in lens.items()}
    no_loc = torch.full((3,), -1, dtype=torch.int64, device=dev)
    busy = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            busy = busy @ busy  # the device is busy: a call that waited would wait for these
        state = token.backup_state()
        got = token.alloc(64)
        token.free(got)
        token.free(got)  # a double free, dropped on the device
        token.free_group_begin()
        token.free(token.alloc(64))
        token.free_group_end()
        token.available_size()
        token.restore_state(state)
        slots = paged.alloc_extend(on_dev["pre"], lens["pre"], on_dev["seq"], lens["seq"], no_loc, 365)
        ends = torch.stack((slots[299], slots[363], slots[364]))
        step = paged.alloc_decode(on_dev["dseq"], lens["dseq"], ends)
        paged.backup_state()
        paged.free(torch.cat((slots, step)))
        paged.alloc(128)
        paged.available_size()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert token.errors() == AllocatorErrors(rejected_frees=64, unrecorded=0)
    assert token.available_size() == 1 << 16
    assert paged.errors().rejected_frees == 0 and paged.available_size() == (1 << 16) - 128
    token.check_integrity()
    paged.check_integrity()


@pytest.mark.gpu
def test_on_a_second_gpu_the_counts_copied_back_are_waited_for_on_its_stream():
    """An allocator on a device that is not the current one: the copy of a free's counts runs on
    that device's stream, so its landing is judged there; a copy still queued behind that device's
    work is not taken for the counts (which would count pages still held as free)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    torch.cuda.set_device(0)
    a = PagedTokenToKVPoolAllocator(4096, 4, device="cuda:1")
    held = a.alloc(4096)
    state = a.backup_state()
    a.free(held)
    torch.cuda.synchronize(1)
    assert a.available_size() == 4096
    with torch.cuda.device(1):
        torch.cuda._sleep(2_000_000_000)  # the next copy waits behind this on cuda:1
    a.restore_state(state)  # every slot held again
    assert a.available_size() == 0 and a.alloc(16) is None
    torch.cuda.synchronize(1)
    a.check_integrity()


def test_counts_written_back_by_a_kernel_are_taken_only_once_every_word_names_its_launch():
    """A free's kernel writes each count with the launch's sequence number in its low bits: words
    still from an earlier launch (a copy half landed, in any order) are not taken for the counts."""
    from kvpool.kernels.allocator.launcher import MIRROR_SEQ_BITS
    from kvpool.pools.allocator.count_mirror import CountMirror

    m = CountMirror(3, torch.device("cpu"))
    first = m.next_seq()
    m.tagged.copy_(T([5, 6, 7]) << MIRROR_SEQ_BITS | first)
    m.landed_behind("first")
    second = m.next_seq()
    m.landed_behind("second")  # replaces the first: only the latest launch's counts are taken
    assert m.poll() is None
    m.tagged[0] = 8 << MIRROR_SEQ_BITS | second
    m.tagged[2] = 9 << MIRROR_SEQ_BITS | second
    assert m.poll() is None  # the middle word is still the first launch's
    m.tagged[1] = 0 << MIRROR_SEQ_BITS | second
    assert m.poll() == ([8, 0, 9], "second")
    assert m.poll() is None  # taken once


def test_the_launch_numbers_go_round_without_naming_the_words_before_any_launch():
    from kvpool.kernels.allocator.launcher import MIRROR_SEQ_BITS
    from kvpool.pools.allocator.count_mirror import CountMirror

    m = CountMirror(1, torch.device("cpu"))
    seqs = [m.next_seq() for _ in range(2 << MIRROR_SEQ_BITS)]
    assert 0 not in seqs and set(seqs) == set(range(1, 1 << MIRROR_SEQ_BITS))
    assert seqs[(1 << MIRROR_SEQ_BITS) - 1] == 1  # round again after the last
