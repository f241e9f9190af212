"""``AllocatorState``: a snapshot of a slot allocator's bookkeeping, and what is wrong with one.

``backup_state()`` returns one and ``restore_state()`` puts it back; ``integrity_problems`` checks a
snapshot against itself, which is what every allocator's ``check_integrity()`` reports
(docs/contract.md, "Allocators and the request table").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot taken by ``backup_state()``; ``restore_state()`` puts it back (any number of times).

    Taking one reads nothing from the device: the lists are kept as the device holds them, with counts
    on the device. ``free_pages``, ``release_pages`` and ``free_group`` read those counts (a
    synchronisation on a GPU) to give the lists themselves.
    """

    page_size: int
    num_pages: int
    free_ring: torch.Tensor  # [C] int64: the free list from its front; its first free_count entries
    free_count: torch.Tensor  # [] int64 on the device
    free_known: int  # how many of them the host knew of (a lower bound)
    release_raw: torch.Tensor  # [R] int64 page ids freed under need_sort, -1 for no page
    release_count: torch.Tensor  # [] int64 on the device: pages in release_raw
    release_known: int  # how many of them the host knew of (a lower bound)
    group_raw: tuple[torch.Tensor, ...]  # int64 page ids freed inside an open free group, -1 for no page
    owners: torch.Tensor  # [(num_pages + 1) * page_size] int32 holders per slot
    live: torch.Tensor  # [num_pages + 1] int32 holders per page
    page_free: torch.Tensor  # [num_pages + 1] bool
    unrecorded: torch.Tensor  # [] int64 slots handed out outside the range (see check_integrity)

    @property
    def free_pages(self) -> torch.Tensor:
        """Tensor [F] int64: the free list, oldest free first (reads its count)."""
        return self.free_ring[: int(self.free_count)]

    @property
    def release_pages(self) -> torch.Tensor:
        """Tensor [R] int64: the pages freed under ``need_sort``, in free order."""
        return self.release_raw[self.release_raw >= 0]

    @property
    def free_group(self) -> tuple[torch.Tensor, ...]:
        """The pages freed inside the open free group, one tensor per ``free`` that released some."""
        pages = (t[t >= 0] for t in self.group_raw)
        return tuple(t for t in pages if t.numel())


def integrity_problems(state: AllocatorState) -> list[str]:
    """Every inconsistency of a snapshot with itself, with counts (reads it to the host)."""
    p, n = state.page_size, state.num_pages
    free = state.free_pages.cpu()
    release = state.release_pages.cpu()
    pending = torch.cat([t.cpu() for t in state.free_group]) if state.free_group else free[:0]
    owners = state.owners.cpu()
    live = state.live.cpu()
    page_free = state.page_free.cpu()
    listed = torch.cat((free, release, pending))
    problems: list[str] = []

    out_of_range = listed[(listed < 1) | (listed > n)]
    if out_of_range.numel():
        problems.append(f"{out_of_range.numel()} listed free pages outside 1..{n} (first: {int(out_of_range[0])})")
    uniq, counts = torch.unique(listed, return_counts=True)
    dups = uniq[counts > 1]
    if dups.numel():
        problems.append(f"{dups.numel()} pages listed free more than once (first: {int(dups[0])})")
    in_lists = torch.zeros(n + 1, dtype=torch.bool)
    in_lists[listed.clamp(0, n)] = True
    mismatch = (in_lists != page_free).nonzero().flatten()
    if mismatch.numel():
        problems.append(
            f"{mismatch.numel()} pages whose free flag disagrees with the free lists (first: {int(mismatch[0])})"
        )
    negative = (owners < 0).nonzero().flatten()
    if negative.numel():
        problems.append(f"{negative.numel()} slots with a negative owner count (first: slot {int(negative[0])})")
    shared = (owners > 1).nonzero().flatten()
    if shared.numel():
        s = int(shared[0])
        problems.append(
            f"{shared.numel()} slots owned more than once, handed out again while held "
            f"(first: slot {s}, {int(owners[s])} owners)"
        )
    owned_per_page = owners.view(n + 1, p).sum(dim=1, dtype=torch.int32)
    bad_live = (owned_per_page != live).nonzero().flatten()
    if bad_live.numel():
        i = int(bad_live[0])
        problems.append(
            f"{bad_live.numel()} pages whose live count disagrees with their owned slots "
            f"(first: page {i}, live {int(live[i])}, owned {int(owned_per_page[i])})"
        )
    if live[0] != 0 or bool(page_free[0]) or bool(owners[:p].any()):
        problems.append("reserved page 0 is handed out or listed free")
    holding = live[1:] > 0
    held = int(holding.sum())
    both = int((holding & in_lists[1:]).sum())
    if both:
        problems.append(f"{both} pages are both listed free and hold owned slots")
    neither = int((~holding & ~in_lists[1:]).sum())
    if neither:
        problems.append(f"{neither} pages are neither free nor holding an owned slot (leaked)")
    total = free.numel() + release.numel() + pending.numel() + held
    if total != n:
        problems.append(
            f"{free.numel()} free + {release.numel()} released + {pending.numel()} pending "
            f"+ {held} held pages = {total}, expected num_pages = {n}"
        )
    unrecorded = int(state.unrecorded)
    if unrecorded:
        problems.append(
            f"{unrecorded} slots were handed out outside the range {p}..{(n + 1) * p - 1} and could not be "
            f"recorded (a last_loc outside it, unchecked without validate)"
        )
    return problems


@dataclass(frozen=True)
class AllocatorErrors:
    """What ``errors()`` reports: bad calls the allocator survived without ``validate``.

    rejected_frees : entries ``free`` dropped since construction (double frees, slot 0, slots never
        handed out, out of range, listed twice); never added to a free list.
    unrecorded : slots handed out outside the handed-out range (from an unchecked ``last_loc``), not
        recorded as held.
    """

    rejected_frees: int
    unrecorded: int
