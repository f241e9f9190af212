"""Both allocators on bad calls: errors change nothing, batches are checked as a whole (two requests
continuing onto one slot or page, a ``last_loc`` not held), device and CPU lengths that disagree,
arguments named in the error, a slot owned twice caught by ``check_integrity``, and what the device
ops do without host checks.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import allocator_snapshot, dec, ext, held_slots
from kvpool.errors import IntegrityError
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator, checks

T = torch.tensor


# --- errors change nothing, batches are checked as a whole, double ownership shows ----------------


def test_validate_rejects_two_requests_continuing_onto_one_slot():
    a = PagedTokenToKVPoolAllocator(64, 4, validate=True)
    assert ext(a, [0], [3], [-1]).tolist() == [4, 5, 6]
    before = allocator_snapshot(a)
    with pytest.raises(ValueError, match="requests 0 and 1 would both continue on slot 7"):
        dec(a, [4, 4], [6, 6])
    assert allocator_snapshot(a) == before
    a.check_integrity()


def test_validate_rejects_two_requests_extending_onto_one_page():
    a = PagedTokenToKVPoolAllocator(64, 4, validate=True)
    ext(a, [0], [2], [-1])  # slots 4, 5
    before = allocator_snapshot(a)
    with pytest.raises(ValueError, match="requests 0 and 1 would both continue on slot 6"):
        ext(a, [2, 2], [3, 4], [5, 5])
    assert allocator_snapshot(a) == before


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
    before = allocator_snapshot(a)
    with pytest.raises(ValueError, match="seq_lens must equal seq_lens_cpu, got seq_lens\\[0\\] = 9 and .* = 5"):
        if op == "extend":
            a.alloc_extend(T([3]), T([3]), T([9]), T([5]), T([6]), 2)
        else:
            a.alloc_decode(T([9]), T([5]), T([6]))
    assert allocator_snapshot(a) == before
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
    before = allocator_snapshot(a)
    with pytest.raises(error, match=message):
        call(a)
    assert allocator_snapshot(a) == before
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


@pytest.mark.parametrize("validate", [False, True])
def test_padding_entries_are_skipped_uncounted_with_skip_padding(validate):
    """``free(..., skip_padding=True)``: entries <= 0 change nothing, raise nothing and are not
    counted; every other bad entry is still refused (validate) or dropped and counted."""
    a = PagedTokenToKVPoolAllocator(64, 4, validate=validate)
    held = a.alloc(8)
    before = allocator_snapshot(a)
    a.free(torch.tensor([0, -1, 0]), skip_padding=True)
    assert allocator_snapshot(a) == before and a.errors().rejected_frees == 0
    a.free(torch.cat((torch.tensor([0, -1]), held)), skip_padding=True)
    assert a.available_size() == 64 and a.errors().rejected_frees == 0
    if validate:
        with pytest.raises(ValueError, match="free_index"):
            a.free(torch.tensor([0, 40]), skip_padding=True)
    else:
        a.free(torch.tensor([0, 40]), skip_padding=True)
        assert a.errors().rejected_frees == 1


@pytest.mark.parametrize("bs", [2, checks.SMALL_BATCH + 1])  # the lengths are summed in Python up to SMALL_BATCH requests, by numpy above
def test_lengths_past_the_bound_are_refused_and_change_nothing(bs):
    """CPU lengths whose sums would overflow int64 on the tensor path: refused naming
    ``seq_lens_cpu``, on both paths, before anything changes."""
    big = 2**63 - 1
    pre, seq = torch.full((bs,), big - 3), torch.full((bs,), big)
    a = PagedTokenToKVPoolAllocator(64, 4)
    before = allocator_snapshot(a)
    with pytest.raises(ValueError, match="seq_lens_cpu must be below"):
        a.alloc_extend(pre, pre, seq, seq, torch.full((bs,), -1), 3 * bs)
    assert allocator_snapshot(a) == before and a.available_size() == 64


@pytest.mark.parametrize("bs", [1, checks.SMALL_BATCH, checks.SMALL_BATCH + 1, 300])
def test_the_cpu_lengths_are_summed_alike_in_python_and_by_numpy(bs):
    """Tokens and fresh pages of an extension, and page-starting decode tokens, as a loop over the
    lengths computes them, for batches either side of where the sums move to numpy; a bad batch is
    refused with the same message on both sides."""
    rng = torch.Generator().manual_seed(bs)
    for page in (1, 4, 64):
        pre = torch.randint(0, 300, (bs,), generator=rng)
        seq = pre + torch.randint(0, 300, (bs,), generator=rng)
        want_fresh = sum(-(-s // page) - -(-q // page) for q, s in zip(pre.tolist(), seq.tolist()))
        total = int((seq - pre).sum())
        assert checks.extend_lengths(pre, seq, total, page) == (total, want_fresh)
        assert checks.decode_lengths(seq + 1, page) == sum(s % page == 0 for s in seq.tolist())
        bad = seq.clone()
        bad[-1] = pre[-1] - 1
        with pytest.raises(ValueError, match=f"seq_lens_cpu must be >= prefix_lens_cpu, got {int(bad[-1])} < {int(pre[-1])} for request {bs - 1}"):
            checks.extend_lengths(pre, bad, total, page)
