"""The allocators' bookkeeping as Triton device code (the launchers are ``launcher.py``): one launch
hands slots out, one takes them back, so a scheduler's allocator call costs one kernel launch rather
than a chain of small PyTorch operations, and never waits for the device.

The bookkeeping (:mod:`kvpool.pools.allocator`): ``owners`` [slots] int32 holders per slot, ``live``
[pages + 1] int32 holders per page, ``page_free`` [pages + 1] bool, and the free list, a buffer
of page ids whose front the host keeps and whose end (``counters[0]``) the device keeps (positions
are taken modulo its capacity, a guard only: the host moves the list to a fresh buffer before the
end could reach it).

``hand_out`` writes the slots of an allocation and records them as held. The pages it takes are
``ring[(head + r) % cap]`` for ``r < count``, chosen by the host from counts it knows. Three kinds:
``PLAIN`` (``alloc(n)``: whole pages, slot ``t`` is offset ``t % PAGE`` of page ``t // PAGE``),
``EXTEND`` (``alloc_extend``: request ``i``'s tokens ``prefix_lens[i]..seq_lens[i]-1`` first continue
its last partial page from ``last_loc[i] + 1``, then fill fresh pages taken in request order) and
``DECODE`` (one token per request, ``prefix_lens = seq_lens - 1``). The request of output ``t`` is
found by counting the requests whose extensions end at or before ``t``, and the fresh pages before
it likewise, so each program needs only the lengths, never a scan of another program: vector
operations over chunks of requests, and a small outputs-by-requests comparison only for the chunks
with a request ending among the program's outputs (a decode needs none: output ``t`` is request
``t``'s). The kernels stay in registers on Hopper (``scripts/cross_compile.py`` reports the
registers and spills; a test holds them there). Every index is
clamped into its tensor and every slot outside ``PAGE..slots-1`` is counted in ``unrecorded``
instead of recorded: device lengths that disagree with the host's give wrong slots, never an access
out of bounds.

``give_back`` is a ``free``: over slots sorted ascending (sorted by the program itself when there
are at most ``SORT`` of them), one program walks blocks of entries in order. An entry counts if it
is the first of its value, inside the handed-out range and held; it drops one holder of its slot
and of its page. The entry whose atomic decrement takes a page's holder count to zero releases
the page (unless the page is already listed free; with one slot per page, the entry that takes its
slot's one holder): exactly one entry per page, and since a page's entries are adjacent, released
pages come out in ascending order, the order of the PyTorch path. ``RING`` appends them at the free
list's end (position ``counters[0]``), ``LIST`` writes each entry's page or -1 in place (the
release list and free groups). ``APPEND`` takes page ids instead of slots, no bookkeeping: entries
>= 0 are appended to the ring.

A token allocator's ``alloc`` launches nothing: it lends a view of the free list's front and leaves
its pages unrecorded. Every ``give_back`` launch (and for one slot per page only) first records the
pages lent since the last one as held, from the allocator's own copy of the list, then takes its
entries back: a slot freed right after it was lent is held when its free is checked.
"""

from __future__ import annotations

import triton
import triton.language as tl

PLAIN: tl.constexpr = tl.constexpr(0)
EXTEND: tl.constexpr = tl.constexpr(1)
DECODE: tl.constexpr = tl.constexpr(2)


@triton.jit
def _extension(pre_ptr, seq_ptr, j, bs, total, PAGE: tl.constexpr):
    """Requests ``j``'s extensions, clamped to ``0..total`` (0 past ``bs``), and the fresh pages each
    takes (at least 0)."""
    jm = j < bs
    seq_j = tl.load(seq_ptr + j, mask=jm, other=0).to(tl.int64)
    pre_j = tl.load(pre_ptr + j, mask=jm, other=0).to(tl.int64)
    ext_j = tl.where(jm, tl.minimum(tl.maximum(seq_j - pre_j, 0), total), 0)
    fresh_j = tl.where(jm, tl.maximum(tl.cdiv(seq_j, PAGE) - tl.cdiv(pre_j, PAGE), 0), 0)
    return ext_j, fresh_j


@triton.jit(
    do_not_specialize=["head", "cap", "count", "bs", "total", "n_slots"],
    do_not_specialize_on_alignment=list(range(10)),
)
def hand_out(
    out_ptr, ring_ptr, pre_ptr, seq_ptr, last_ptr, owners_ptr, live_ptr, page_free_ptr, ever_ptr, unrecorded_ptr,
    head, cap, count, bs, total, n_slots,
    PAGE: tl.constexpr, KIND: tl.constexpr, HAS_EVER: tl.constexpr, BLOCK: tl.constexpr, BLOCK_REQ: tl.constexpr,
    BLOCK_SUB: tl.constexpr,
):  # fmt: skip
    """Write ``out[0:total]``, the slots of one allocation, and record each held (``owners``,
    ``live``, ``ever`` if ``HAS_EVER``); the ``count`` pages taken from ``ring`` stop being listed free.
    Program ``pid`` makes outputs ``pid * BLOCK ..`` and takes the pages of the same ranks."""
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = t < total
    last_rank = tl.maximum(count - 1, 0)
    if KIND == PLAIN:
        rank = tl.minimum(t // PAGE, last_rank)
        page = tl.load(ring_ptr + (head + rank) % cap, mask=valid & (count > 0), other=0)
        slot = page * PAGE + t % PAGE
    else:
        if KIND == DECODE:
            # Output t is request t's one token. The fresh pages before it: the requests before t whose
            # token starts a page, those before this program's outputs counted first, a chunk at a time.
            t0 = pid.to(tl.int64) * BLOCK
            prior = tl.zeros([BLOCK_REQ], dtype=tl.int64)
            before_outputs = tl.minimum(t0, bs)
            for j0 in range(0, before_outputs, BLOCK_REQ):
                j = j0 + tl.arange(0, BLOCK_REQ)
                seq_j = tl.load(seq_ptr + j, mask=j < before_outputs, other=0).to(tl.int64)
                prior += ((seq_j >= 1) & ((seq_j - 1) % PAGE == 0)).to(tl.int64)
            req = tl.minimum(t, bs - 1)
            seq_t = tl.load(seq_ptr + req, mask=valid, other=0).to(tl.int64)
            starts = (valid & (seq_t >= 1) & ((seq_t - 1) % PAGE == 0)).to(tl.int64)
            fresh_before = tl.sum(prior, 0) + tl.cumsum(starts, 0) - starts
            before = t
        else:
            # Per output t: its request (the requests whose extension ends at or before t), the tokens and
            # the fresh pages of the requests before it, from the lengths alone. Extensions are clamped to
            # 0..total, so the ends only grow and the requests done for t are the first ones: their count,
            # and the largest of their running sums. A chunk of BLOCK_REQ requests is read as vectors; the
            # requests ending before this program's first output count for all of its outputs. Only where
            # some end among its outputs are the chunk's requests compared with each output, BLOCK_SUB at
            # a time (read again, from cache): a request ends among a program's outputs at most once.
            t0 = pid.to(tl.int64) * BLOCK
            t_end = t0 + BLOCK
            req = tl.zeros([BLOCK], dtype=tl.int64)
            before = tl.zeros([BLOCK], dtype=tl.int64)
            fresh_before = tl.zeros([BLOCK], dtype=tl.int64)
            ends_carry = tl.zeros([1], dtype=tl.int64)
            fresh_carry = tl.zeros([1], dtype=tl.int64)
            for j0 in range(0, bs, BLOCK_REQ):
                j = j0 + tl.arange(0, BLOCK_REQ)
                ext_j, fresh_j = _extension(pre_ptr, seq_ptr, j, bs, total, PAGE)
                ends_j = tl.cumsum(ext_j, 0) + ends_carry
                fresh_ends_j = tl.cumsum(fresh_j, 0) + fresh_carry
                done_all = (j < bs) & (ends_j <= t0)
                req += tl.sum(done_all.to(tl.int64), 0)
                before = tl.maximum(before, tl.max(tl.where(done_all, ends_j, 0), 0))
                fresh_before = tl.maximum(fresh_before, tl.max(tl.where(done_all, fresh_ends_j, 0), 0))
                ending = (j < bs) & (ends_j > t0) & (ends_j < t_end)
                if tl.sum(ending.to(tl.int32), 0) > 0:
                    sub_ends = ends_carry
                    sub_fresh = fresh_carry
                    chunk_end = tl.minimum(j0 + BLOCK_REQ, bs)
                    for s0 in range(j0, chunk_end, BLOCK_SUB):
                        js = s0 + tl.arange(0, BLOCK_SUB)
                        ext_s, fresh_s = _extension(pre_ptr, seq_ptr, js, chunk_end, total, PAGE)
                        ends_s = tl.cumsum(ext_s, 0) + sub_ends
                        fresh_ends_s = tl.cumsum(fresh_s, 0) + sub_fresh
                        sub_ends += tl.sum(ext_s, 0)
                        sub_fresh += tl.sum(fresh_s, 0)
                        ending_s = (js < chunk_end) & (ends_s > t0) & (ends_s < t_end)
                        if tl.sum(ending_s.to(tl.int32), 0) > 0:
                            done = ending_s[None, :] & (ends_s[None, :] <= t[:, None])
                            req += tl.sum(done.to(tl.int64), 1)
                            before = tl.maximum(before, tl.max(tl.where(done, ends_s[None, :], 0), 1))
                            fresh_before = tl.maximum(fresh_before, tl.max(tl.where(done, fresh_ends_s[None, :], 0), 1))
                ends_carry += tl.sum(ext_j, 0)
                fresh_carry += tl.sum(fresh_j, 0)
        req = tl.minimum(req, bs - 1)
        seq_r = tl.load(seq_ptr + req, mask=valid, other=0).to(tl.int64)
        if KIND == DECODE:
            pre_r = seq_r - 1
        else:
            pre_r = tl.load(pre_ptr + req, mask=valid, other=0).to(tl.int64)
        last_r = tl.load(last_ptr + req, mask=valid, other=0).to(tl.int64)
        k = t - before
        pos = pre_r + k
        held = tl.cdiv(pre_r, PAGE)
        rank = tl.minimum(tl.maximum(fresh_before + pos // PAGE - held, 0), last_rank)
        page = tl.load(ring_ptr + (head + rank) % cap, mask=valid & (count > 0), other=0)
        continues = (pos < held * PAGE) | (count == 0)
        slot = tl.where(continues, last_r + 1 + k, page * PAGE + pos % PAGE)
    tl.store(out_ptr + t, slot, mask=valid)
    inside = valid & (slot >= PAGE) & (slot < n_slots)
    at = tl.where(inside, slot, 0)
    tl.atomic_add(owners_ptr + at, 1, mask=inside, sem="relaxed")
    tl.atomic_add(live_ptr + at // PAGE, 1, mask=inside, sem="relaxed")
    if HAS_EVER:
        tl.store(ever_ptr + at, 1, mask=inside)
    outside = tl.sum((valid & ~inside).to(tl.int64), 0)
    if outside > 0:
        tl.atomic_add(unrecorded_ptr, outside, sem="relaxed")
    # The pages taken leave the free list: no longer listed free.
    r = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    taken = r < count
    taken_page = tl.load(ring_ptr + (head + r) % cap, mask=taken, other=0)
    taken &= (taken_page >= 0) & (taken_page < n_slots // PAGE)
    tl.store(page_free_ptr + taken_page, 0, mask=taken)


RING: tl.constexpr = tl.constexpr(0)
LIST: tl.constexpr = tl.constexpr(1)


@triton.jit(
    do_not_specialize=["n", "n_slots", "cap", "map_rows", "mark_start", "mark_count", "seq"],
    do_not_specialize_on_alignment=list(range(12)),
)
def give_back(
    slots_ptr, owners_ptr, live_ptr, page_free_ptr, dest_ptr, counters_ptr, sorted_ptr, mirror_ptr, map_ptr,
    lent_ptr, mark_ptr, unrecorded_ptr,
    n, n_slots, cap, map_rows, mark_start, mark_count, seq,
    PAGE: tl.constexpr, DEST: tl.constexpr, COUNT_AT: tl.constexpr, APPEND: tl.constexpr, BLOCK: tl.constexpr,
    SORT: tl.constexpr, SKIP_PADDING: tl.constexpr, MIRROR: tl.constexpr, MAPPED: tl.constexpr,
    SEQ_BITS: tl.constexpr, MARK_BLOCK: tl.constexpr,
):  # fmt: skip
    """Take back the ``n`` entries at ``slots_ptr`` in one program (grid of 1): drop their holders and
    put the pages they release in ``dest`` (``DEST``), adding them to ``counters[COUNT_AT]`` and the
    entries that did not count to ``counters[2]`` (entries <= 0 aside if ``SKIP_PADDING``).
    ``MIRROR``: then write ``counters[0:3]`` to ``mirror_ptr`` (pinned host memory on a GPU) as
    ``value << SEQ_BITS | seq``, each word naming the launch it comes from, so that the host can tell
    a copy that has landed without an event, and no copy needs launching after it. ``MAPPED`` (with
    ``SORT``): the entries are full slots of a sliding-window allocator, taken back as their SWA slots ``map[entry]`` (-1 outside
    ``0..map_rows-1``), whose mapping entries are then set to 0, every translation read first.
    ``RING`` also writes each released page to ``lent`` (the copy of the free list that ``alloc``
    lends views of) at the same position.

    First (``PAGE`` 1), the ``mark_count`` pages at ``mark[mark_start..]``, lent by ``alloc`` since
    the last launch (``MARK_BLOCK`` at a time; the entries go ``BLOCK`` at a time), are recorded
    held (a page outside ``1..n_slots-1`` is counted in ``unrecorded`` instead), so that a free of one of them frees a held slot, and a second free of
    it is caught."""
    # The counters are read once, at the start (nothing else in the launch writes them): their new
    # values are stored, and mirrored, from registers at the end.
    c = tl.arange(0, 4)
    counts = tl.load(counters_ptr + c, mask=c < 3, other=0)
    if PAGE == 1:
        outside = tl.zeros([1], dtype=tl.int64)
        for r0 in range(0, mark_count, MARK_BLOCK):
            r = r0 + tl.arange(0, MARK_BLOCK)
            lent = r < mark_count
            page = tl.load(mark_ptr + mark_start + r, mask=lent, other=0)
            inside = lent & (page >= 1) & (page < n_slots)
            at = tl.where(inside, page, 0)
            tl.atomic_add(owners_ptr + at, 1, mask=inside, sem="relaxed")
            tl.atomic_add(live_ptr + at, 1, mask=inside, sem="relaxed")
            tl.store(page_free_ptr + at, 0, mask=inside)
            outside += tl.sum((lent & ~inside).to(tl.int64), 0)
        at_unrecorded = unrecorded_ptr + tl.arange(0, 1)
        tl.store(at_unrecorded, tl.load(at_unrecorded, mask=outside > 0, other=0) + outside, mask=outside > 0)
        tl.debug_barrier()  # every hold recorded before a free reads one
    tail = tl.sum(tl.where(c == 0, counts, 0), 0)
    if SORT > 0:
        # Entries not sorted yet (at most SORT of them): sort them here, into sorted_ptr, and walk that.
        j = tl.arange(0, SORT)
        raw = tl.load(slots_ptr + j, mask=j < n, other=0x3FFFFFFFFFFFFFFF)
        if MAPPED:
            mapped = (j < n) & (raw >= 0) & (raw < map_rows)
            swa = tl.load(map_ptr + tl.where(mapped, raw, 0), mask=mapped, other=-1)
            tl.debug_barrier()  # every entry translated before any is cleared (an entry may repeat)
            tl.store(map_ptr + raw, tl.zeros_like(swa), mask=mapped)
            raw = tl.where(j < n, swa, 0x3FFFFFFFFFFFFFFF)
        tl.store(sorted_ptr + j, tl.sort(raw, 0), mask=j < n)
        tl.debug_barrier()  # every thread's stores visible before any reads a neighbour's
        slots_ptr = sorted_ptr
    lane = tl.arange(0, BLOCK)
    placed = tl.zeros([1], dtype=tl.int64)
    dropped = tl.zeros([1], dtype=tl.int64)
    for i0 in range(0, n, BLOCK):
        i = i0 + lane
        valid = i < n
        s = tl.load(slots_ptr + i, mask=valid, other=0)
        if APPEND:
            page = s
            released = valid & (s >= 0)
        else:
            prev = tl.load(slots_ptr + i - 1, mask=valid & (i > 0), other=-1)
            first = (i == 0) | (s != prev)
            inside = (s >= PAGE) & (s < n_slots)
            at = tl.where(inside, s, 0)
            page = at // PAGE
            holders = tl.load(owners_ptr + at, mask=valid & inside, other=0)
            listed = tl.load(page_free_ptr + page, mask=valid & inside, other=1) != 0
            ok = valid & first & inside & (holders > 0)
            tl.store(owners_ptr + at, holders - 1, mask=ok)
            if PAGE == 1:  # the page is the slot: released when its one holder goes (no count to wait for)
                tl.atomic_add(live_ptr + page, -1, mask=ok, sem="relaxed")
                released = ok & (holders == 1) & ~listed
            else:
                was = tl.atomic_add(live_ptr + page, -1, mask=ok, sem="relaxed")
                released = ok & (was == 1) & ~listed
            tl.store(page_free_ptr + page, 1, mask=released)
            if SKIP_PADDING:
                dropped += tl.sum((valid & ~ok & (s > 0)).to(tl.int64), 0)
            else:
                dropped += tl.sum((valid & ~ok).to(tl.int64), 0)
        if DEST == RING:
            rank = tl.cumsum(released.to(tl.int64), 0) - 1
            pos = (tail + placed + rank) % cap
            tl.store(dest_ptr + pos, page, mask=released)
            tl.store(lent_ptr + pos, page, mask=released)
        else:
            tl.store(dest_ptr + i, tl.where(released, page, -1), mask=valid)
        placed += tl.sum(released.to(tl.int64), 0)
    added = tl.where(c == COUNT_AT, tl.sum(placed, 0), 0)
    if not APPEND:
        added += tl.where(c == 2, tl.sum(dropped, 0), 0)
    counts += added
    tl.store(counters_ptr + c, counts, mask=c < 3)
    if MIRROR:
        tl.store(mirror_ptr + c, (counts << SEQ_BITS) | seq, mask=c < 3)
