"""Slot allocators a scheduler uses to hand out rows of an ``MHATokenToKVPool`` (SPEC 5).

``TokenToKVPoolAllocator`` hands out single slots ``1..size``; ``PagedTokenToKVPoolAllocator`` hands
out whole pages of ``page_size`` slots and continues each request's last partial page. Both keep
their bookkeeping as tensors on ``device`` (as SGLang does) and share one implementation: the token
allocator is the paged one with pages of one slot.

Bookkeeping, per allocator:

- ``free`` / ``release``: page ids ready to be handed out (``release`` holds frees made with
  ``need_sort`` until an allocation needs them; they are then merged and sorted).
- ``owned[slot]``: the slot was handed out and has not been freed.
- ``live[page]``: how many slots of the page are owned. A page goes back to the free list only when
  this reaches 0, so freeing part of a page never hands a still-owned slot to another request.
- ``page_free[page]``: the page is in ``free``, ``release`` or waiting in a free group. A page is
  appended to a free list only when this flag goes from False to True, so the free list can never
  hold a page twice, whatever the caller frees.

``free`` synchronises once with the device (how many pages come back is data dependent; SGLang's
paged ``free`` synchronises in ``torch.unique`` too). Under ``validate`` (or ``KVPOOL_VALIDATE=1``)
a bad free raises ``ValueError``; without it the bad entries are dropped and counted in
``rejected_frees``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from kvpool.args import non_negative_int, positive_int, resolve_device
from kvpool.config import validate_enabled

logger = logging.getLogger("kvpool")

Indices = Union[torch.Tensor, Sequence[int]]

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


class IntegrityError(RuntimeError):
    """An allocator's or request table's bookkeeping is inconsistent (raised by ``check_integrity``)."""


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot taken by ``backup_state()``; ``restore_state()`` puts it back (any number of times).

    The free lists are shared with the allocator (it never modifies them in place); the masks are
    copies.
    """

    page_size: int
    num_pages: int
    free_pages: torch.Tensor  # [F] int64 page ids
    release_pages: torch.Tensor  # [R] int64 page ids
    owned: torch.Tensor  # [(num_pages + 1) * page_size] bool
    live: torch.Tensor  # [num_pages + 1] int32
    page_free: torch.Tensor  # [num_pages + 1] bool


def _ceil_div(x: torch.Tensor, d: int) -> torch.Tensor:
    return (x + d - 1) // d


class _PageAllocator:
    """Pages ``1..num_pages`` of ``page_size`` slots; page 0 (slots ``0..page_size-1``) is reserved."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: Optional[torch.dtype],
        device: str | torch.device,
        kvcache: Any,
        need_sort: bool,
        validate: bool,
    ) -> None:
        self.size = positive_int(size, "size")
        self.page_size = positive_int(page_size, "page_size")
        if size < page_size:
            raise ValueError(f"size must be at least page_size = {page_size} (one page), got {size}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.device = resolve_device(device)
        self._kvcache = kvcache
        self.need_sort = bool(need_sort)
        self.validate = validate_enabled(validate)
        self.num_pages = size // page_size
        #: Entries dropped by ``free`` without ``validate`` (double frees, slot 0, never allocated).
        self.rejected_frees = 0
        self._slots_per_page = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.clear()

    # --- SGLang surface --------------------------------------------------------------------------

    @property
    def size_full(self) -> int:
        return self.size

    def get_kvcache(self) -> Any:
        return self._kvcache

    def available_size(self) -> int:
        """Slots that ``alloc`` can hand out now (frees still pending in a free group excluded)."""
        return (self._free.numel() + self._release.numel()) * self.page_size

    def clear(self) -> None:
        """Every page free, nothing owned, no free group open."""
        dev = self.device
        n_slots = (self.num_pages + 1) * self.page_size
        self._free = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=dev)
        self._release = torch.empty(0, dtype=torch.int64, device=dev)
        self._owned = torch.zeros(n_slots, dtype=torch.bool, device=dev)
        self._live = torch.zeros(self.num_pages + 1, dtype=torch.int32, device=dev)
        self._page_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=dev)
        self._page_free[0] = False  # page 0 is never free: it is never handed out
        # Slots ever handed out, kept only to tell "double free" from "never allocated" in errors.
        self._ever = torch.zeros(n_slots, dtype=torch.bool, device=dev) if self.validate else None
        self._in_group = False
        self._pending: list[torch.Tensor] = []

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Hand out ``need_size`` slots (whole pages), or return None and change nothing.

        Returns
        -------
        Tensor [need_size] int64 on ``device`` (a new tensor), or None when fewer are free.
        """
        n = non_negative_int(need_size, "need_size")
        p = self.page_size
        if n % p:
            raise ValueError(f"need_size must be a multiple of page_size = {p}, got {n}")
        pages = self._take_pages(n // p)
        if pages is None:
            return None
        slots = (pages[:, None] * p + self._slots_per_page).reshape(-1)
        self._mark_owned(slots)
        self._live[pages] = p
        return slots

    def free(self, free_index: Indices) -> None:
        """Give slots back. A page returns to the free list once all its handed-out slots are freed.

        Inside a free group the slots stop being owned at once, but their pages become available only
        at ``free_group_end()``.

        Raises
        ------
        ValueError
            Under ``validate``: a slot that is not currently handed out (double free, never
            allocated, slot 0, reserved page, out of range), or one listed twice. Nothing is freed.
            Without ``validate`` such entries are dropped and counted in ``rejected_frees``.
        """
        slots = self._as_slots(free_index)
        if slots.numel() == 0:
            return
        slots = self._accept(slots)
        if slots.numel() == 0:
            return
        p = self.page_size
        self._owned[slots] = False
        if p == 1:
            touched = slots
            self._live[slots] = 0
        else:
            pages = slots // p  # sorted, since _accept returns sorted slots
            self._live.index_add_(0, pages, torch.full_like(pages, -1, dtype=torch.int32))
            touched = torch.unique_consecutive(pages)
        emptied = touched[(self._live[touched] == 0) & ~self._page_free[touched]]
        if emptied.numel() == 0:
            return
        self._page_free[emptied] = True
        if self._in_group:
            self._pending.append(emptied)
        else:
            self._give_back(emptied)

    def free_group_begin(self) -> None:
        """Start batching frees: pages freed from now on become available at ``free_group_end()``.
        Calling it again inside a group keeps the group (and its pending frees) open."""
        self._in_group = True

    def free_group_end(self) -> None:
        """Make the pages freed since ``free_group_begin()`` available, in one concatenation."""
        self._in_group = False
        pending, self._pending = self._pending, []
        if pending:
            self._give_back(torch.cat(pending))

    def backup_state(self) -> AllocatorState:
        """Snapshot of the free lists and ownership, for ``restore_state`` (speculative allocation)."""
        self._not_in_group("backup_state")
        return AllocatorState(
            self.page_size, self.num_pages, self._free, self._release,
            self._owned.clone(), self._live.clone(), self._page_free.clone(),
        )  # fmt: skip

    def restore_state(self, state: AllocatorState) -> None:
        """Return to a snapshot from ``backup_state()`` of this allocator."""
        self._not_in_group("restore_state")
        if not isinstance(state, AllocatorState):
            raise ValueError(f"state must be an AllocatorState from backup_state(), got {type(state).__name__}")
        if (state.page_size, state.num_pages) != (self.page_size, self.num_pages):
            raise ValueError(
                f"state must come from an allocator with page_size={self.page_size}, num_pages={self.num_pages}, "
                f"got page_size={state.page_size}, num_pages={state.num_pages}"
            )
        self._free = state.free_pages
        self._release = state.release_pages
        self._owned = state.owned.clone()
        self._live = state.live.clone()
        self._page_free = state.page_free.clone()

    def merge_and_sort_free(self) -> None:
        """Move the pages freed under ``need_sort`` into the free list, sorted (low pages first)."""
        if self._release.numel():
            self._free = torch.sort(torch.cat((self._free, self._release))).values
            self._release = self._release[:0]

    def check_integrity(self) -> None:
        """Check the bookkeeping against itself (reads it to the host; for tests and debugging).

        Raises
        ------
        IntegrityError
            Listing every inconsistency found, with counts.
        """
        p, n = self.page_size, self.num_pages
        free = self._free.cpu()
        release = self._release.cpu()
        pending = torch.cat(self._pending).cpu() if self._pending else free[:0]
        owned = self._owned.cpu()
        live = self._live.cpu()
        page_free = self._page_free.cpu()
        listed = torch.cat((free, release, pending))
        problems: list[str] = []

        out_of_range = listed[(listed < 1) | (listed > n)]
        if out_of_range.numel():
            problems.append(
                f"{out_of_range.numel()} listed free pages outside 1..{n} (first: {int(out_of_range[0])})"
            )
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
        owned_per_page = owned.view(n + 1, p).sum(dim=1, dtype=torch.int32)
        bad_live = (owned_per_page != live).nonzero().flatten()
        if bad_live.numel():
            i = int(bad_live[0])
            problems.append(
                f"{bad_live.numel()} pages whose live count disagrees with their owned slots "
                f"(first: page {i}, live {int(live[i])}, owned {int(owned_per_page[i])})"
            )
        if live[0] != 0 or bool(page_free[0]):
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
        if problems:
            raise IntegrityError(f"{type(self).__name__} integrity check failed: " + "; ".join(problems))

    # --- internals -------------------------------------------------------------------------------

    def _not_in_group(self, what: str) -> None:
        if self._in_group:
            raise RuntimeError(
                f"{what} inside a free group would lose the group's pending frees; call free_group_end() first"
            )

    def _take_pages(self, count: int) -> Optional[torch.Tensor]:
        """The first ``count`` free pages, removed from the free list; None (nothing changed) if short."""
        if count > self._free.numel():
            if count > self._free.numel() + self._release.numel():
                return None
            self.merge_and_sort_free()
        pages = self._free[:count]
        self._free = self._free[count:]
        self._page_free[pages] = False
        return pages

    def _give_back(self, pages: torch.Tensor) -> None:
        if self.need_sort:
            self._release = torch.cat((self._release, pages))
        else:
            self._free = torch.cat((self._free, pages))

    def _mark_owned(self, slots: torch.Tensor) -> None:
        self._owned[slots] = True
        if self._ever is not None:
            self._ever[slots] = True

    def _as_slots(self, free_index: Indices) -> torch.Tensor:
        if isinstance(free_index, torch.Tensor):
            if free_index.dtype not in _INT_DTYPES:
                raise ValueError(f"free_index must be an integer tensor, got {free_index.dtype}")
            if free_index.dim() > 1:
                raise ValueError(f"free_index must be 1-D, got shape {tuple(free_index.shape)}")
            return free_index.reshape(-1).to(device=self.device, dtype=torch.int64)
        if isinstance(free_index, (int, bool)) or not isinstance(free_index, Sequence):
            raise ValueError(f"free_index must be a tensor or a sequence of ints, got {type(free_index).__name__}")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in free_index):
            raise ValueError(f"free_index must hold ints, got {list(free_index)!r}")
        return torch.tensor(list(free_index), dtype=torch.int64, device=self.device)

    def _accept(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots that may be freed, sorted and unique; raises (validate) or drops the rest."""
        p = self.page_size
        n_slots = self._owned.numel()
        ok = (slots >= p) & (slots < n_slots) & self._owned[slots.clamp(0, n_slots - 1)]
        if self.validate:
            if not bool(ok.all()):
                self._raise_bad_free(slots, int((~ok).nonzero()[0]))
            uniq = torch.unique(slots)
            if uniq.numel() != slots.numel():
                ordered = torch.sort(slots).values
                dup = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
                raise ValueError(
                    f"free_index must list each slot once, got slot {dup} more than once (a double free)"
                )
            return uniq
        accepted = torch.unique(slots[ok])
        dropped = slots.numel() - accepted.numel()
        if dropped:
            if self.rejected_frees == 0:
                logger.warning(
                    "kvpool: %s.free dropped %d entries that were not handed-out slots (double free, "
                    "slot 0 or never allocated); construct with validate=True to raise instead",
                    type(self).__name__, dropped,
                )  # fmt: skip
            self.rejected_frees += dropped
        return accepted

    def _raise_bad_free(self, slots: torch.Tensor, position: int) -> None:
        p = self.page_size
        s = int(slots[position])
        n_slots = self._owned.numel()
        where = f"got slot {s} at position {position}"
        if s == 0:
            why = "which is the padding slot 0, never handed out"
        elif 0 < s < p:
            why = f"which is on the reserved page 0 (slots 0..{p - 1}), never handed out"
        elif s < 0 or s >= n_slots:
            why = f"which is outside the handed-out range {p}..{n_slots - 1}"
        elif self._ever is not None and bool(self._ever[s]):
            why = "which was already freed (a double free)"
        else:
            why = "which was never allocated"
        raise ValueError(f"free_index must hold slots that are handed out and not yet freed, {where}, {why}")


class TokenToKVPoolAllocator(_PageAllocator):
    """Hands out single KV-cache slots ``1..size`` of a pool; slot 0 is the padding slot.

    Parameters
    ----------
    size : number of slots to manage (the pool's ``size``).
    dtype : the pool's element type; kept for SGLang compatibility, not used.
    device : where the free list and index tensors live (the pool's device, usually).
    kvcache : the pool these slots index (``get_kvcache()`` returns it).
    need_sort : keep freed slots aside and merge them, sorted, only when an allocation needs them
        (hands out low slots first, for locality).
    validate : raise ``ValueError`` on a bad free (double free, slot 0, never allocated) instead of
        dropping it; ``KVPOOL_VALIDATE=1`` turns it on too.

    Examples
    --------
    >>> a = TokenToKVPoolAllocator(8)
    >>> a.alloc(3)
    tensor([1, 2, 3])
    >>> a.free(torch.tensor([2]))
    >>> a.available_size()
    6
    """

    def __init__(
        self,
        size: int,
        dtype: Optional[torch.dtype] = None,
        device: str | torch.device = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
        *,
        validate: bool = False,
    ) -> None:
        super().__init__(size, 1, dtype, device, kvcache, need_sort, validate)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Hand out ``need_size`` slots, or return None (changing nothing) when fewer are free.

        Returns
        -------
        Tensor [need_size] int64 on ``device``, or None.
        """
        n = non_negative_int(need_size, "need_size")
        slots = self._take_pages(n)
        if slots is None:
            return None
        slots = slots.clone()  # callers may modify it; the free list must not follow
        self._mark_owned(slots)
        self._live[slots] = 1
        return slots

    def alloc_extend(self, *args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        raise NotImplementedError("alloc_extend is for PagedTokenToKVPoolAllocator; use alloc(n) with page_size 1")

    def alloc_decode(self, *args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
        raise NotImplementedError("alloc_decode is for PagedTokenToKVPoolAllocator; use alloc(n) with page_size 1")


class PagedTokenToKVPoolAllocator(_PageAllocator):
    """Hands out KV-cache slots a page at a time: pages ``1..size // page_size`` of ``page_size``
    slots; page 0 (slots ``0..page_size-1``, the padding slot among them) is never handed out.

    A request's slots fill its pages in order, so ``alloc_extend``/``alloc_decode`` continue its last
    partial page before taking a fresh one. A page returns to the free list only once every slot
    handed out from it has been freed.

    Parameters
    ----------
    size : slots to manage (the pool's ``size``); ``size // page_size`` pages are handed out.
    page_size : slots per page (the pool's ``page_size``).
    dtype, device, kvcache, need_sort, validate : as for ``TokenToKVPoolAllocator``. Under
        ``validate``, ``alloc_extend``/``alloc_decode`` also check ``last_loc`` against the pages the
        allocator handed out (one synchronisation).

    Examples
    --------
    >>> a = PagedTokenToKVPoolAllocator(64, page_size=4)
    >>> one = torch.tensor([1])
    >>> a.alloc_extend(0 * one, 0 * one, 3 * one, 3 * one, -one, 3)  # a 3-token prompt, on page 1
    tensor([4, 5, 6])
    >>> # that request grows from 3 to 5 tokens (its last slot is 6); a new one brings 2 tokens
    >>> a.alloc_extend(torch.tensor([3, 0]), torch.tensor([3, 0]), torch.tensor([5, 2]),
    ...                torch.tensor([5, 2]), torch.tensor([6, -1]), 4)
    tensor([ 7,  8, 12, 13])
    >>> a.alloc_decode(torch.tensor([6, 3]), torch.tensor([6, 3]), torch.tensor([8, 13]))
    tensor([ 9, 14])
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: Optional[torch.dtype] = None,
        device: str | torch.device = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
        *,
        validate: bool = False,
    ) -> None:
        super().__init__(size, page_size, dtype, device, kvcache, need_sort, validate)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Slots for extending each request from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

        Request i's new tokens first fill its last partial page (slots ``last_loc[i] + 1``, ...),
        then whole fresh pages, then the first slots of one more fresh page. Fresh pages are taken
        from the free list in request order.

        Parameters
        ----------
        prefix_lens, seq_lens : Tensor [B], int, on ``device``: tokens already held / held after.
        prefix_lens_cpu, seq_lens_cpu : the same values on the CPU (they size the allocation
            without a device synchronisation).
        last_loc : Tensor [B], int, on ``device``: slot of each request's last held token (any value,
            conventionally -1, when ``prefix_lens[i]`` is a multiple of ``page_size``).
        extend_num_tokens : ``sum(seq_lens - prefix_lens)``.

        Returns
        -------
        Tensor [extend_num_tokens] int64 on ``device``, request after request; or None, changing
        nothing, when too few pages are free.

        Raises
        ------
        ValueError
            On inconsistent lengths; under ``validate`` also when ``last_loc`` does not point into a
            page this allocator handed out, at the position ``prefix_lens`` implies.
        """
        p = self.page_size
        bs = _check_lens_vector(prefix_lens_cpu, "prefix_lens_cpu", None)
        _check_lens_vector(seq_lens_cpu, "seq_lens_cpu", bs)
        for t, name in ((prefix_lens, "prefix_lens"), (seq_lens, "seq_lens"), (last_loc, "last_loc")):
            _check_device_vector(t, name, bs, self.device)
        pre_c = prefix_lens_cpu.to(torch.int64)
        seq_c = seq_lens_cpu.to(torch.int64)
        if bs and bool((pre_c < 0).any()):
            raise ValueError(f"prefix_lens_cpu must be >= 0, got {pre_c.tolist()}")
        if bs and bool((seq_c < pre_c).any()):
            i = int((seq_c < pre_c).nonzero()[0])
            raise ValueError(
                f"seq_lens_cpu must be >= prefix_lens_cpu, got {int(seq_c[i])} < {int(pre_c[i])} for request {i}"
            )
        total_tokens = int((seq_c - pre_c).sum())
        if isinstance(extend_num_tokens, bool) or not isinstance(extend_num_tokens, int):
            raise ValueError(f"extend_num_tokens must be an int, got {extend_num_tokens!r}")
        if extend_num_tokens != total_tokens:
            raise ValueError(
                f"extend_num_tokens must be sum(seq_lens - prefix_lens) = {total_tokens}, got {extend_num_tokens}"
            )
        pre = prefix_lens.to(torch.int64)
        seq = seq_lens.to(torch.int64)
        last = last_loc.to(torch.int64)
        if self.validate:
            _check_same(pre, pre_c, "prefix_lens")
            _check_same(seq, seq_c, "seq_lens")
            self._check_continuation(last, pre, seq, "alloc_extend")

        new_pages_cpu = _ceil_div(seq_c, p) - _ceil_div(pre_c, p)
        pages = self._take_pages(int(new_pages_cpu.sum()))
        if pages is None:
            return None
        if total_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)

        ext = seq - pre
        held = _ceil_div(pre, p)  # pages each request holds already (the last one maybe partial)
        new_pages = _ceil_div(seq, p) - held
        first_page = torch.cumsum(new_pages, 0) - new_pages  # index into `pages` per request
        first_token = torch.cumsum(ext, 0) - ext  # index into the output per request
        req = torch.repeat_interleave(torch.arange(bs, device=self.device), ext, output_size=total_tokens)
        k = torch.arange(total_tokens, device=self.device) - first_token[req]  # offset in the extension
        pos = pre[req] + k  # token position in its sequence
        on_held_page = pos < held[req] * p
        if pages.numel():
            page_rank = (first_page[req] + pos // p - held[req]).clamp(0, pages.numel() - 1)
            fresh = pages[page_rank] * p + pos % p
            out = torch.where(on_held_page, last[req] + 1 + k, fresh)
        else:
            out = last[req] + 1 + k
        self._mark_owned(out)
        self._live.index_add_(0, out // p, torch.ones_like(out, dtype=torch.int32))
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """One slot per request for its next token: ``last_loc[i] + 1`` when that is on the same page,
        else the first slot of a fresh page (fresh pages are taken in request order).

        Parameters
        ----------
        seq_lens : Tensor [B], int, on ``device``: tokens each request holds after this step
            (so the new token is at position ``seq_lens[i] - 1``).
        seq_lens_cpu : the same values on the CPU.
        last_loc : Tensor [B], int, on ``device``: slot of each request's last held token.

        Returns
        -------
        Tensor [B] int64 on ``device``, or None, changing nothing, when too few pages are free.
        """
        p = self.page_size
        bs = _check_lens_vector(seq_lens_cpu, "seq_lens_cpu", None)
        _check_device_vector(seq_lens, "seq_lens", bs, self.device)
        _check_device_vector(last_loc, "last_loc", bs, self.device)
        seq_c = seq_lens_cpu.to(torch.int64)
        if bs and bool((seq_c < 1).any()):
            raise ValueError(f"seq_lens_cpu must be >= 1 (they count the new token), got {seq_c.tolist()}")
        seq = seq_lens.to(torch.int64)
        last = last_loc.to(torch.int64)
        if self.validate:
            _check_same(seq, seq_c, "seq_lens")
            self._check_continuation(last, seq - 1, seq, "alloc_decode")

        pages = self._take_pages(int(((seq_c - 1) % p == 0).sum()))
        if pages is None:
            return None
        if bs == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        starts_page = (seq - 1) % p == 0
        if pages.numel():
            rank = (torch.cumsum(starts_page, 0) - 1).clamp(0, pages.numel() - 1)
            out = torch.where(starts_page, pages[rank] * p, last + 1)
        else:
            out = last + 1
        self._mark_owned(out)
        self._live.index_add_(0, out // p, torch.ones_like(out, dtype=torch.int32))
        return out

    def _check_continuation(self, last: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor, what: str) -> None:
        """Validate mode: the slots continuing each partial page are on a page this allocator handed
        out (and still holds) and are not owned already."""
        p = self.page_size
        rem = pre % p
        continues = (rem != 0) & (seq > pre)
        if not bool(continues.any()):
            return
        for i in continues.nonzero().flatten().tolist():
            s = int(last[i])
            if (s + 1) % p != int(rem[i]):
                raise ValueError(
                    f"{what}: last_loc[{i}] must be a slot at offset {int(rem[i]) - 1} of its page "
                    f"(prefix length {int(pre[i])}, page_size {p}), got {s}"
                )
            page = s // p
            if not 1 <= page <= self.num_pages or int(self._live[page]) == 0:
                raise ValueError(
                    f"{what}: last_loc[{i}] must be on a page this allocator has handed out, got slot {s} "
                    f"(page {page}, which is not held)"
                )
            n_cont = min(int(seq[i]), int(_ceil_div(pre[i], p)) * p) - int(pre[i])
            cont = torch.arange(s + 1, s + 1 + n_cont, device=self.device)
            if bool(self._owned[cont].any()):
                taken = int(cont[self._owned[cont]][0])
                raise ValueError(
                    f"{what}: request {i} would continue on slot {taken}, which is already handed out; "
                    f"last_loc[{i}] must be the request's last slot, got {s}"
                )


def _check_lens_vector(t: object, name: str, bs: Optional[int]) -> int:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(t.shape)} {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if bs is not None and t.shape[0] != bs:
        raise ValueError(f"{name} must have {bs} entries (one per request), got {t.shape[0]}")
    return t.shape[0]


def _check_device_vector(t: object, name: str, bs: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(t.shape)} {t.dtype}")
    if t.shape[0] != bs:
        raise ValueError(f"{name} must have {bs} entries (one per request), got {t.shape[0]}")
    if t.device != device:
        raise ValueError(f"{name} must be on the allocator's device {device}, got {t.device}")


def _check_same(device_t: torch.Tensor, cpu_t: torch.Tensor, name: str) -> None:
    if not torch.equal(device_t.cpu(), cpu_t):
        raise ValueError(f"{name} must equal {name}_cpu, got {device_t.tolist()} vs {cpu_t.tolist()}")
