"""``add_holders`` and ``drop_holders``: what an allocation and a ``free`` do to the per-slot
bookkeeping, on the device, with no read back.

How the bookkeeping works is in :mod:`kvpool.pools.allocator`.
"""

from __future__ import annotations

from typing import Optional

import torch


def add_holders(
    books: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ever: Optional[torch.Tensor],
    taken: Optional[torch.Tensor],
    slots: torch.Tensor,
    page_size: int,
    inside_range: bool,
) -> None:
    """Record ``slots`` held (one more holder each) and the pages ``taken`` no longer listed free.

    Slots not known to be ``inside_range`` (cut from free pages) are masked: one outside the
    handed-out range (from an unchecked ``last_loc``, or a free list assigned from outside) is
    counted in ``unrecorded`` instead, so that no index leaves the bookkeeping tensors; ``taken``
    None means the pages of the slots recorded (one slot per page).

    Parameters
    ----------
    books : ``(owners, live, page_free, unrecorded)``, the allocator's bookkeeping (updated in place).
    ever : bool per slot, set for the slots recorded (validate's record of slots ever handed out), or None.
    taken : Tensor [P] int64 page ids, or None.
    slots : Tensor [N] int64 on the bookkeeping's device.
    page_size : slots per page.
    inside_range : every slot is in ``page_size..owners.numel()-1``.
    """
    owners, live, page_free, unrecorded = books
    if inside_range:
        at, add = slots, torch.ones_like(slots, dtype=torch.int32)
    else:
        inside = (slots >= page_size) & (slots < owners.numel())
        at, add = torch.where(inside, slots, 0), inside.to(torch.int32)
    page_free.index_fill_(0, at // page_size if taken is None else taken, False)  # a scalar fill: no copy to the device
    owners.index_add_(0, at, add)
    live.index_add_(0, at // page_size, add)
    if not inside_range:
        unrecorded += add.numel() - add.sum()
    if ever is not None:
        ever[at] = True


def drop_holders(
    owners: torch.Tensor, live: torch.Tensor, page_free: torch.Tensor, slots: torch.Tensor, page_size: int,
    skip_padding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop one holder of each held slot in ``slots`` and mark free the pages left without holders.

    An entry counts only if it is a slot in the handed-out range (``page_size..owners.numel()-1``),
    held (owner count above 0), and its first occurrence in ``slots``; the others change nothing, so
    a double free, a foreign slot or a slot listed twice never releases a page. A page is released
    when its holder count reaches 0 and it is not already listed free; it is released once, however
    many of its slots ``slots`` lists.

    Every tensor stays on the device and has a length the host knows: O(len(slots)) work whatever the
    pool's size, and nothing read back (no synchronisation).

    Parameters
    ----------
    owners, live, page_free : the allocator's bookkeeping (updated in place).
    slots : Tensor [N] int64 on the bookkeeping's device, N >= 1.
    page_size : slots per page.
    skip_padding : entries <= 0 (padding) change nothing and are not counted as dropped.

    Returns
    -------
    pages : Tensor [N] int64, ascending where ``released``: the released pages.
    released : Tensor [N] bool, one true entry per released page.
    dropped : Tensor [] int64, the entries that did not count (padding aside with ``skip_padding``).
    """
    p = page_size
    n_slots = owners.numel()
    s = torch.sort(slots).values
    at = torch.where((s >= p) & (s < n_slots), s, 0)  # entries outside the range count at slot 0
    first = torch.ones_like(s, dtype=torch.bool)
    first[1:] = s[1:] != s[:-1]
    ok = first & (at > 0) & (owners[at] > 0)
    minus = -ok.to(torch.int32)
    owners.index_add_(0, at, minus)
    if p == 1:  # a page is a slot: the entry that counts is the page's only one
        live.index_add_(0, at, minus)
        released = ok & (owners[at] == 0) & ~page_free[at]
        page_free[torch.where(released, at, 0)] = released  # page 0 only ever gets False
        return at, released, _dropped(s, ok, skip_padding)
    page = at // p  # non-decreasing, except for entries at slot 0, whose page 0 is never released
    live.index_add_(0, page, minus)
    # One entry per run of a page (its first), and only for a run that freed something.
    start = torch.ones_like(first)
    start[1:] = page[1:] != page[:-1]
    run = torch.cumsum(start, 0) - 1
    freed = torch.zeros_like(minus).index_add_(0, run, ok.to(torch.int32))
    released = start & (freed[run] > 0) & (live[page] == 0) & ~page_free[page]
    page_free[torch.where(released, page, 0)] = released  # page 0 only ever gets False
    return page, released, _dropped(s, ok, skip_padding)


def _dropped(s: torch.Tensor, ok: torch.Tensor, skip_padding: bool) -> torch.Tensor:
    """Entries of ``s`` that did not count, padding (entries <= 0) aside if ``skip_padding``."""
    if skip_padding:
        return (~ok & (s > 0)).sum()
    return s.numel() - ok.sum()
