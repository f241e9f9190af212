"""Launchers of the allocators' bookkeeping kernels (``kernel.py``): one launch per paged ``alloc``,
``alloc_extend``, ``alloc_decode`` or ``free`` (a token allocator's ``alloc`` launches none: its
slots are recorded held by the next ``give_back``), through the compiled kernel's launcher after the
first launch of a kind (:class:`~kvpool.kernels.launch.DirectLaunches`). The kernels specialise on
no integer value and no address, so a kind is fixed by the dtypes alone and the cache stays small.

Unchecked: the allocator has checked every argument; these only launch. The PyTorch path that
defines the same results is in :mod:`kvpool.pools.allocator` (``ownership.py``, ``paged.py``).
"""

from __future__ import annotations

from typing import Optional

import logging

import torch

from kvpool.kernels.launch import (
    LAUNCH_ERRORS, TRITON_AVAILABLE, DirectLaunches, cdiv, current_cuda_device, current_raw_stream, kernel_params,
    next_pow2, uses_kernel,
)  # fmt: skip

logger = logging.getLogger("kvpool")

kernel = None
if TRITON_AVAILABLE:
    from kvpool.kernels.allocator import kernel

#: Test switch: set to True (under TRITON_INTERPRET=1, e.g. with pytest's monkeypatch.setattr) to
#: run the kernels through Triton's interpreter for CPU allocators; while False, CPU allocators take
#: the PyTorch path. CUDA allocators are not affected. Read at every call.
kernel_on_cpu = False

#: Kinds of ``hand_out``: ``alloc(n)``, ``alloc_extend``, ``alloc_decode``.
PLAIN, EXTEND, DECODE = 0, 1, 2
#: Where ``give_back`` puts released pages: appended to the free ring, or in place (page or -1).
RING, LIST = 0, 1
#: Which counter ``give_back`` adds the released pages to: the ring's end, the release list's count,
#: or none (a free group's pages wait).
TO_TAIL, TO_RELEASE, TO_NONE = 0, 1, -1

#: Outputs per ``hand_out`` program; requests per step of its loop over the lengths (read as vectors),
#: and per step of its comparison of requests with outputs (a matrix of outputs by requests, kept
#: small enough to stay in registers).
HAND_OUT_BLOCK = 128
HAND_OUT_REQ_BLOCK = 128
HAND_OUT_SUB_BLOCK = 16
#: Entries per step of ``give_back``'s single program (at most: a free it sorts itself walks them in
#: steps of its sort's size up to this, ``give_back_shape``), and lent pages per step of its
#: recording them held.
GIVE_BACK_BLOCK = 1024
#: Most entries ``give_back`` sorts itself; a larger free is sorted by ``torch.sort`` first.
GIVE_BACK_SORT_MAX = 4096
HAND_OUT_WARPS = 4
GIVE_BACK_WARPS = 8
#: Low bits of each word ``give_back`` writes to a count mirror that name the launch (its ``seq``):
#: a word is ``count << MIRROR_SEQ_BITS | seq``.
MIRROR_SEQ_BITS = 16

HAND_OUT_PARAMS = (
    "out_ptr", "ring_ptr", "pre_ptr", "seq_ptr", "last_ptr", "owners_ptr", "live_ptr", "page_free_ptr", "ever_ptr",
    "unrecorded_ptr", "head", "cap", "count", "bs", "total", "n_slots", "PAGE", "KIND", "HAS_EVER", "BLOCK",
    "BLOCK_REQ", "BLOCK_SUB",
)  # fmt: skip
GIVE_BACK_PARAMS = (
    "slots_ptr", "owners_ptr", "live_ptr", "page_free_ptr", "dest_ptr", "counters_ptr", "sorted_ptr", "mirror_ptr",
    "map_ptr", "lent_ptr", "mark_ptr", "unrecorded_ptr", "n", "n_slots", "cap", "map_rows", "mark_start",
    "mark_count", "seq", "PAGE", "DEST", "COUNT_AT", "APPEND", "BLOCK", "SORT", "SKIP_PADDING", "MIRROR", "MAPPED",
    "SEQ_BITS", "MARK_BLOCK",
)  # fmt: skip

HAND_OUTS = DirectLaunches("allocator's hand-out", kernel is not None and kernel_params(kernel.hand_out) == HAND_OUT_PARAMS)
GIVE_BACKS = DirectLaunches("allocator's give-back", kernel is not None and kernel_params(kernel.give_back) == GIVE_BACK_PARAMS)


def on_kernels(device: torch.device) -> bool:
    """Whether an allocator on ``device`` keeps its books with these kernels (compiled on CUDA; on
    the CPU only under the interpreter with ``kernel_on_cpu``)."""
    return uses_kernel(device, kernel_on_cpu)


def _wide(ints: tuple[int, ...]) -> object:
    """What the compiled kernel depends on of its integer arguments (all non-negative; it specialises
    on no value): which need 64 bits (Triton types each on its own); False when none does."""
    if max(ints) <= 0x7FFFFFFF:
        return False
    return tuple(v > 0x7FFFFFFF for v in ints)


def hand_out(
    out: torch.Tensor,
    ring: torch.Tensor,
    head: int,
    cap: int,
    count: int,
    lens: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    owners: torch.Tensor,
    live: torch.Tensor,
    page_free: torch.Tensor,
    ever: Optional[torch.Tensor],
    unrecorded: torch.Tensor,
    page_size: int,
    kind: int,
) -> None:
    """Write the ``len(out)`` slots of an allocation into ``out`` and record them held, taking pages
    ``ring[(head + r) % cap]``, ``r < count``. ``lens``: ``(prefix_lens, seq_lens, last_loc)`` for
    ``EXTEND`` (``prefix_lens`` unused for ``DECODE``), None for ``PLAIN``."""
    total = out.shape[0]
    if total == 0 and count == 0:
        return
    # The kernel reads entry j at base + j: a strided view (a column of a table, an expand) is
    # copied first; a contiguous one is passed as it is.
    pre, seq, last = (t.contiguous() for t in lens) if lens is not None else (out, out, out)
    bs = seq.shape[0] if lens is not None else 0
    n_slots = owners.shape[0]
    ever_t = ever if ever is not None else page_free
    tensors = (out, ring, pre, seq, last, owners, live, page_free, ever_t, unrecorded)
    ints = (head, cap, count, bs, total, n_slots)
    consts = (page_size, kind, ever is not None, HAND_OUT_BLOCK, HAND_OUT_REQ_BLOCK, HAND_OUT_SUB_BLOCK)
    grid = (max(cdiv(max(total, count), HAND_OUT_BLOCK), 1), 1, 1)
    key = None
    if HAND_OUTS.enabled:
        key = (out.device.index, consts, pre.dtype, seq.dtype, last.dtype, _wide(ints))
    HAND_OUTS.launch(
        key, grid, tensors + ints + consts,
        lambda: kernel.hand_out[grid[:1]](*tensors, *ints, *consts, num_warps=HAND_OUT_WARPS),  # type: ignore[union-attr]
        out.device,
    )  # fmt: skip


def give_back_shape(sort: int) -> tuple[int, int]:
    """(entries per step, warps) of ``give_back`` for a free it sorts itself into ``sort`` lanes (0:
    sorted already): a small free in one step of its own size on a warp per 128 lanes (a sort of
    few lanes across many warps goes through shared memory at every stage), a large one
    ``GIVE_BACK_BLOCK`` at a time on ``GIVE_BACK_WARPS``."""
    if not sort:
        return GIVE_BACK_BLOCK, GIVE_BACK_WARPS
    block = min(GIVE_BACK_BLOCK, sort)
    return block, max(1, min(GIVE_BACK_WARPS, block // 128))


def give_back_consts(
    page_size: int, dest_kind: int, count_at: int, append: bool, sort: int, skip_padding: bool, mirror: bool, mapped: bool
) -> tuple[tuple, int]:
    """``give_back``'s constexprs in signature order (a compiled kernel's key) and its warps."""
    block, warps = give_back_shape(sort)
    consts = (page_size, dest_kind, count_at, bool(append), block, sort, bool(skip_padding), mirror, mapped,
              MIRROR_SEQ_BITS, GIVE_BACK_BLOCK)  # fmt: skip
    return consts, warps


def give_back(
    entries: torch.Tensor,
    owners: torch.Tensor,
    live: torch.Tensor,
    page_free: torch.Tensor,
    dest: torch.Tensor,
    counters: torch.Tensor,
    cap: int,
    page_size: int,
    dest_kind: int,
    count_at: int,
    append: bool = False,
    scratch: Optional[torch.Tensor] = None,
    skip_padding: bool = False,
    mirror: Optional[tuple[torch.Tensor, int]] = None,
    mapping: Optional[torch.Tensor] = None,
    lent: Optional[torch.Tensor] = None,
    mark: Optional[tuple[torch.Tensor, int, int, torch.Tensor]] = None,
) -> bool:
    """Take back ``entries`` (slots; page ids if ``append``) and put the pages they release in
    ``dest``: appended to the ring of ``cap`` entries whose end is ``counters[0]`` (``RING``), or in
    place, page or -1 (``LIST``, ``dest`` as long as ``entries``). Released pages are added to
    ``counters[count_at]`` (unless ``TO_NONE``), dropped entries to ``counters[2]``.

    Slots must come sorted ascending unless ``scratch`` (int64, ``GIVE_BACK_SORT_MAX`` entries) is
    given and there are at most ``GIVE_BACK_SORT_MAX`` of them: the kernel then sorts them into it.
    ``skip_padding``: entries <= 0 are not counted as dropped. ``mirror``: ``(words, seq)``, int64 words
    (3 entries; pinned host memory for a GPU's counters) the kernel writes ``counters[0:3]`` to when
    it is done, each as ``count << MIRROR_SEQ_BITS | seq`` (``seq`` below ``2**MIRROR_SEQ_BITS``).
    ``mapping`` (a sliding-window allocator's full-to-SWA mapping, int64 ``[rows + 1]``; needs
    ``scratch``): ``entries`` are full slots, taken back as their SWA slots, and their mapping
    entries become 0 (``skip_padding`` should be set: unmapped entries translate to 0 or -1).
    ``lent`` (``RING``): a second copy of the ring the released pages are written to as well.
    ``mark`` (``page_size`` 1): ``(ring, start, count, unrecorded)``, the ``count`` pages lent out
    at ``ring[start..]``, recorded held before anything is taken back (a page outside the slot range
    counted in ``unrecorded``). Returns whether it launched (nothing to take back and nothing lent:
    no launch)."""
    n = entries.shape[0]
    marks = mark[2] if mark is not None else 0
    if n == 0 and marks == 0:
        return False
    if marks and page_size != 1:
        raise ValueError(f"give_back: pages lent out are recorded for page_size 1 only, got page_size {page_size}")
    entries = entries.contiguous()  # read at base + j (a strided view is copied first)
    sort = next_pow2(max(n, 16)) if scratch is not None and not append else 0
    if mapping is not None and not sort:
        raise ValueError("give_back: a mapped free needs the kernel's own sort (scratch, at most GIVE_BACK_SORT_MAX entries)")
    mark_ring, mark_start, _, unrecorded = mark if mark is not None else (entries, 0, 0, counters)
    tensors = (entries, owners, live, page_free, dest, counters, scratch if sort else entries,
               mirror[0] if mirror is not None else counters, mapping if mapping is not None else entries,
               lent if lent is not None else dest, mark_ring, unrecorded)  # fmt: skip
    ints = (n, owners.shape[0], cap, mapping.shape[0] - 1 if mapping is not None else 0, mark_start, marks,
            mirror[1] if mirror is not None else 0)  # fmt: skip
    consts, warps = give_back_consts(page_size, dest_kind, count_at, append, sort, skip_padding, mirror is not None,
                                     mapping is not None)  # fmt: skip
    key = (entries.device.index, consts, _wide(ints)) if GIVE_BACKS.enabled else None
    GIVE_BACKS.launch(
        key, (1, 1, 1), tensors + ints + consts,
        lambda: kernel.give_back[(1,)](*tensors, *ints, *consts, num_warps=warps),  # type: ignore[union-attr]
        entries.device,
    )  # fmt: skip
    return True


class RingFrees:
    """``give_back`` of a token allocator's slots to its free ring, the form every scheduler ``free``
    takes (one slot per page, counted at the ring's end, the kernel's own sort, the counts mirrored),
    launched with the arguments that stay the same from one free to the next kept as they are passed:
    the bookkeeping's addresses, its sizes and the compiled kernels (at most ``GIVE_BACK_SORT_MAX``
    entries: one kernel per sort size, each the one the first ``give_back`` of that size compiled).

    Made for one set of bookkeeping tensors (``holds`` tells whether it is still the allocator's);
    it keeps them alive, so the addresses it passes stay theirs."""

    __slots__ = ("tensors", "_args", "_index", "_bound", "_off")

    def __init__(
        self,
        owners: torch.Tensor,
        live: torch.Tensor,
        page_free: torch.Tensor,
        ring: torch.Tensor,
        counters: torch.Tensor,
        scratch: torch.Tensor,
        mirror: torch.Tensor,
        lent: torch.Tensor,
        unrecorded: torch.Tensor,
        cap: int,
    ) -> None:
        self.tensors = (owners, live, page_free, ring, counters, scratch, mirror, lent, unrecorded)
        o, lv, pf, rg, c, sc, mr, ln, un = (t.data_ptr() for t in self.tensors)
        # give_back's arguments after the entries, as (before n, after n): the entries' mapping stand-in
        # is the entries themselves, the pages lent are read from the ring.
        self._args = ((o, lv, pf, rg, c, sc, mr), (ln, rg, un), (owners.shape[0], cap, 0))
        self._index = owners.device.index
        self._bound: dict[int, tuple[object, tuple]] = {}  # sort size -> (compiled kernel, its constexprs)
        self._off = False  # the launcher refused these arguments once: the general path from then on

    @staticmethod
    def fits(n_slots: int, cap: int) -> bool:
        """Whether an allocator of these sizes can free this way (its integers 32-bit: the kernels kept
        are the ones compiled for those)."""
        return GIVE_BACKS.enabled and max(n_slots, cap + 1) <= 0x7FFFFFFF

    def holds(self, owners: torch.Tensor, live: torch.Tensor, page_free: torch.Tensor, ring: torch.Tensor,
              lent: torch.Tensor, unrecorded: torch.Tensor) -> bool:  # fmt: skip
        """Whether these are still the bookkeeping the launches were made for."""
        t = self.tensors
        return t[0] is owners and t[1] is live and t[2] is page_free and t[3] is ring and t[7] is lent and t[8] is unrecorded

    def launch(self, entries: torch.Tensor, mark_start: int, marks: int, seq: int) -> bool:
        """One ``give_back`` of ``entries`` (int64, contiguous, on the bookkeeping's device, 1 to
        ``GIVE_BACK_SORT_MAX`` of them), recording held first the ``marks`` pages lent at ring
        position ``mark_start``, its counts mirrored under ``seq``. False, with nothing launched,
        where no kept kernel fits (the first free of a size, another current device): ``give_back``
        does it then, and compiles the kernel kept from then on."""
        if self._off or not GIVE_BACKS.enabled:  # direct launches failed once: the general path from then on
            return False
        n = entries.shape[0]
        sort = next_pow2(max(n, 16))
        kept = self._bound.get(sort)
        if kept is None:
            consts = give_back_consts(1, RING, TO_TAIL, False, sort, False, True, False)[0]
            bound = GIVE_BACKS.entries.get((self._index, consts, False))
            if bound is None:
                return False
            kept = self._bound[sort] = (bound, consts)
        bound, consts = kept
        if self._index != current_cuda_device():  # type: ignore[misc]
            return False
        first, middle, sizes = self._args
        at = entries.data_ptr()  # an address, as the others: the caller's device tensor, checked by the allocator
        try:
            bound.run(1, 1, 1, current_raw_stream(self._index), bound.function, bound.metadata, None, None, None,  # type: ignore[attr-defined]
                      at, *first, at, *middle, n, *sizes, mark_start, marks, seq, *consts)  # fmt: skip
        except LAUNCH_ERRORS as exc:  # the launcher refused these arguments before launching: nothing ran
            self._off = True
            logger.warning("kvpool: a token free's kept launch failed (%s); frees take the general launch from now on", exc)
            return False
        return True
