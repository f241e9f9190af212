"""Host slots in whole pages: the host pool's page allocator and the checks every host index passes.

Host slots are ``0..size-1``, cut into pages of ``page_size`` consecutive slots; ``alloc`` hands out
whole pages and every transfer names whole pages (docs/contract.md, "Host tier", "Allocation").
Pure NumPy bookkeeping on the host, no device work.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvpool.checks import check_in_range, check_index, non_negative_int

_CPU = torch.device("cpu")


class HostPages:
    """The allocator of ``page_num`` pages of ``page_size`` host slots each.

    Parameters
    ----------
    page_num : pages (>= 1).
    page_size : slots per page (>= 1).

    Examples
    --------
    >>> pages = HostPages(4, 2)
    >>> pages.alloc(4).tolist()
    [0, 1, 2, 3]
    >>> pages.available_size()
    4
    """

    def __init__(self, page_num: int, page_size: int) -> None:
        self.page_num, self.page_size = page_num, page_size
        self.size = page_num * page_size
        # Scratch for the each-page-once check: position of a page in the list being checked.
        self._seen_at = np.zeros(page_num, dtype=np.int64)
        self.clear()

    # --- allocation -----------------------------------------------------------------------------

    def clear(self) -> None:
        """Every page free again."""
        self._free_pages = np.arange(self.page_num, dtype=np.int64)
        self._allocated = np.zeros(self.page_num, dtype=bool)

    def available_size(self) -> int:
        """Free slots (a multiple of ``page_size``)."""
        return int(self._free_pages.shape[0]) * self.page_size

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` slots in whole pages (each page's slots consecutive): an int64 CPU tensor
        ``[need_size]``, or None (nothing changes) when fewer are free.

        Raises
        ------
        ValueError
            ``need_size`` not a non-negative multiple of ``page_size``.
        """
        non_negative_int(need_size, "need_size")
        if need_size % self.page_size:
            raise ValueError(f"need_size must be a multiple of page_size {self.page_size}, got {need_size}")
        pages = need_size // self.page_size
        if pages > self._free_pages.shape[0]:
            return None
        taken, self._free_pages = self._free_pages[:pages], self._free_pages[pages:]
        self._allocated[taken] = True
        slots = taken[:, None] * self.page_size + np.arange(self.page_size, dtype=np.int64)
        return torch.from_numpy(slots.reshape(-1))

    def free(self, indices: torch.Tensor) -> int:
        """Give back whole allocated pages (any order of pages); returns the number of slots.

        Raises
        ------
        ValueError, IndexError
            Anything but whole allocated pages, each once (as :meth:`slots`, and a page listed twice
            or not allocated), before anything changes.
        """
        slots = self.slots(indices, "indices")
        pages = self.pages_of(slots)
        self.check_once(pages, "indices")
        free = self.first_free(pages)
        if free is not None:
            raise ValueError(
                f"indices must be allocated host slots: page {free} (slots {free * self.page_size}..) is not "
                f"allocated (double free?)"
            )
        self._allocated[pages] = False
        self._free_pages = np.concatenate((self._free_pages, pages))
        return int(slots.shape[0])

    # --- checks ---------------------------------------------------------------------------------

    def page_index(self, index: object) -> int:
        """``index`` (an int, or a one-element integer tensor) if it is the first slot of a page.
        Raises ``TypeError`` or ``IndexError`` naming ``index``."""
        if isinstance(index, torch.Tensor) and index.numel() == 1 and not index.dtype.is_floating_point:
            index = int(index)
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"index must be an int (the page's first host slot), got {type(index).__name__}")
        index = int(index)
        if not 0 <= index < self.size or index % self.page_size:
            raise IndexError(
                f"index must be the first slot of a page (a multiple of {self.page_size} in 0..{self.size - 1}), "
                f"got {index}"
            )
        return index

    def slots(self, indices: object, name: str) -> np.ndarray:
        """``indices`` (a 1-D int32/int64 CPU tensor of whole aligned pages in range) as int64 NumPy.

        Raises
        ------
        TypeError, ValueError
            Not such a tensor, or not whole aligned pages.
        IndexError
            A slot outside ``0..size-1``.
        """
        check_index(indices, name, device=_CPU, where="cpu (host slots)")
        slots = indices.numpy().astype(np.int64, copy=True)  # type: ignore[union-attr]
        n, ps = slots.shape[0], self.page_size
        if n % ps:
            raise ValueError(f"{name} must hold whole pages of {ps} slots, got {n} entries")
        if n and not self.whole_pages(slots):  # find and report the first problem
            check_in_range([(indices, self.size, name)], what="host slots", negative_ok=False)  # type: ignore
            pages = slots.reshape(-1, ps)
            misaligned = (pages[:, 0] % ps != 0) | np.any(pages != pages[:, :1] + np.arange(ps), axis=1)
            p = int(np.flatnonzero(misaligned)[0])
            raise ValueError(
                f"{name} must be whole pages ({ps} consecutive slots from a multiple of {ps}): "
                f"entries {p * ps}..{p * ps + ps - 1} are {pages[p].tolist()[:8]}"
            )
        return slots

    def whole_pages(self, slots: np.ndarray) -> bool:
        """Whether ``slots`` (non-empty, a multiple of ``page_size`` long) are whole pages in range,
        in a few passes over the page starts (a transfer's checks are part of its host time): each
        page is ``page_size`` consecutive slots from a multiple of it below ``size``."""
        ps = self.page_size
        starts = slots[::ps]
        if starts.min() < 0 or starts.max() >= self.size or (ps > 1 and (starts % ps).any()):
            return False
        return ps == 1 or np.array_equal(slots.reshape(-1, ps), starts[:, None] + np.arange(ps))

    def pages_of(self, slots: np.ndarray) -> np.ndarray:
        """The page of each page-aligned run of ``slots`` (checked by :meth:`slots`)."""
        return slots[:: self.page_size] // self.page_size

    def check_once(self, pages: np.ndarray, name: str) -> None:
        """Raise ``ValueError`` naming the first page ``pages`` lists twice."""
        n = pages.shape[0]
        if n < 2 or (np.diff(pages) > 0).all():  # ascending: as a fresh pool's alloc hands them out
            return
        at = np.arange(n, dtype=np.int64)
        self._seen_at[pages] = at  # a page listed twice keeps its last position
        twice = np.flatnonzero(self._seen_at[pages] != at)
        if twice.shape[0]:
            p = int(pages[twice[0]])
            raise ValueError(f"{name} must name each page once, got page {p} (slots {p * self.page_size}..) twice")

    def transfer_pages(self, slots: np.ndarray, backup: bool, validate: bool) -> np.ndarray:
        """The pages of a transfer's checked ``host_indices`` (:meth:`slots`), after the checks that
        read the bookkeeping: a backup names each page once (a host row written twice would end up
        with either source), and with ``validate`` every page is allocated. Raises ``ValueError``."""
        pages = self.pages_of(slots)
        if backup:
            self.check_once(pages, "host_indices")
        if validate and pages.shape[0]:
            free = self.first_free(pages)
            if free is not None:
                what = "slot" if self.page_size == 1 else "page"
                raise ValueError(f"host_indices must be allocated host slots: {what} {free} is free")
        return pages

    def first_free(self, pages: np.ndarray) -> Optional[int]:
        """The first of ``pages`` that is not allocated, or None."""
        free = pages[~self._allocated[pages]]
        return int(free[0]) if free.shape[0] else None
