"""The SWA host pool's book (``SWAKVPoolHost``, docs/contract.md, "Host tier for sliding-window
models"): which page of the sliding-window part holds each host full page's SWA rows, and which host
full slots hold one, on the host and on the device.

On a GPU a backup does not wait to learn from the mapping which of its slots have an SWA part: it
takes an SWA page for every page it parks, writes the device's answer into the device record (what
loads read) and sends a copy to the host. A later call applies that copy once it has arrived
(:meth:`SWAPages.learn`), giving back the SWA pages of the pages that needed none; each page's backup
number drops a copy that arrives after a newer backup or a free of its page. Host bookkeeping in
NumPy, plus one bool tensor on the device.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch


class _Unknown(NamedTuple):
    """A backup whose SWA answer is on its way to the host: its pages, their slots and backup
    numbers then, and which entries have an SWA part (landed once ``event`` has; None on a CPU)."""

    pages: np.ndarray
    slots: np.ndarray
    seqs: np.ndarray
    flags: torch.Tensor
    event: Optional[torch.cuda.Event]


def page_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """The slots of ``pages``, page after page."""
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, without waiting for the device (through pinned memory on CUDA)."""
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class SWAPages:
    """The book of an SWA host pool of ``page_num`` full pages of ``page_size`` slots, over the SWA
    part's host pool ``swa_host`` (whose pages it takes and gives back), for a device pool on
    ``device``.

    Attributes
    ----------
    swa_page : int64 [page_num] NumPy, the SWA page holding each full page's SWA rows (-1: none).
    has_dev : bool [page_num * page_size] on ``device``: which host full slots hold SWA rows.
    generation : changes whenever ``swa_page`` or ``has_dev`` does (it keys a load's cached host side).
    """

    def __init__(self, page_num: int, page_size: int, swa_host, device: torch.device) -> None:
        self.page_num, self.page_size, self.swa_host, self.device = page_num, page_size, swa_host, device
        self.clear()

    def clear(self) -> None:
        """No page holds SWA rows (the SWA part's pages are the caller's to clear)."""
        self.swa_page = np.full(self.page_num, -1, dtype=np.int64)
        self._has = np.zeros(self.page_num * self.page_size, dtype=bool)  # the host's copy, once known
        self.has_dev = torch.zeros(self.page_num * self.page_size, dtype=torch.bool, device=self.device)
        self._seq = np.zeros(self.page_num, dtype=np.int64)
        self._unknown: list[_Unknown] = []
        self.generation = 0

    # --- what the host knows ------------------------------------------------------------------------

    def has_swa(self, slots: np.ndarray) -> np.ndarray:
        """Which of host full ``slots`` hold SWA rows, after every answer has arrived (waits for them)."""
        self.learn(wait=True)
        return self._has[slots]

    def learn(self, wait: bool) -> None:
        """Apply the answers of earlier backups that have reached the host (``wait``: all of them,
        waiting for each): which slots hold SWA rows, and the SWA pages of pages that needed none
        back to the SWA part. An answer for a page backed up again or freed since is dropped."""
        left: list[_Unknown] = []
        for u in self._unknown:
            if u.event is not None and not u.event.query():
                if not wait:
                    left.append(u)
                    continue
                u.event.synchronize()
            current = self._seq[u.pages] == u.seqs
            has = u.flags.numpy()
            entries = np.repeat(current, self.page_size)
            self._has[u.slots[entries]] = has[entries]
            self.release(u.pages[current & ~has.reshape(-1, self.page_size).any(axis=1)])
        self._unknown = left

    # --- pages --------------------------------------------------------------------------------------

    def missing(self, pages: np.ndarray) -> int:
        """How many of ``pages`` hold no SWA page."""
        return int((self.swa_page[pages] < 0).sum())

    def release(self, pages: np.ndarray) -> None:
        """Give the SWA pages of ``pages`` (those holding one) back to the SWA part."""
        held = self.swa_page[pages]
        held = held[held >= 0]
        if held.shape[0]:
            self.swa_host.free(torch.from_numpy(page_slots(held, self.page_size)))
            self.generation += 1
        self.swa_page[pages] = -1

    def freed(self, slots: np.ndarray) -> None:
        """Host full ``slots`` (whole pages) were freed: their SWA pages go back, their answers in flight
        are dropped."""
        pages = slots[:: self.page_size] // self.page_size
        self.release(pages)
        self._seq[pages] += 1
        self._has[slots] = False
        self.learn(wait=False)

    def _take(self, pages: np.ndarray) -> None:
        if pages.shape[0]:
            got = self.swa_host.alloc(pages.shape[0] * self.page_size)
            self.swa_page[pages] = got.numpy()[:: self.page_size] // self.page_size  # type: ignore[union-attr]

    def _record(self, pages: np.ndarray, slots: np.ndarray, has: torch.Tensor) -> None:
        self._seq[pages] += 1
        self.generation += 1
        self.has_dev[to_device(torch.from_numpy(slots), self.device)] = has

    # --- backups ------------------------------------------------------------------------------------

    def park_known(self, pages: np.ndarray, slots: np.ndarray, has: np.ndarray) -> np.ndarray:
        """A backup of full ``pages`` (``slots``) whose SWA part is known (``has`` per slot): an SWA
        page for each page with SWA rows, given back by pages that need none now. Returns the
        positions in ``slots`` of the pages that hold SWA rows (their SWA slots are
        ``page_slots(swa_page[...])``).

        Raises
        ------
        ValueError
            The SWA part has too few free pages; nothing changes.
        """
        ps = self.page_size
        needs = has.reshape(-1, ps).any(axis=1)
        held = self.swa_page[pages]
        new, gone = needs & (held < 0), ~needs & (held >= 0)
        free_pages = self.swa_host.available_size() // ps + int(gone.sum())
        if int(new.sum()) > free_pages:
            raise ValueError(
                f"the host pool's sliding-window part has {free_pages} free pages, this backup needs "
                f"{int(new.sum())} more (swa_available_size() is {self.swa_host.available_size()} slots): "
                f"free host pages first; nothing copied"
            )
        self.release(pages[gone])
        self._take(pages[new])
        self._has[slots] = has
        self._record(pages, slots, torch.from_numpy(has).to(self.device))
        return np.flatnonzero(needs)

    def park_unknown(self, pages: np.ndarray, slots: np.ndarray, has: torch.Tensor) -> None:
        """A backup of full ``pages`` (``slots``) whose SWA part only the device knows (``has``, bool
        on the device): an SWA page for every page (the caller checked :meth:`missing` fits), the
        device record written, and a copy of ``has`` on its way to the host."""
        self._take(pages[self.swa_page[pages] < 0])
        self._has[slots] = False  # until the answer arrives
        self._record(pages, slots, has)
        if has.device.type == "cpu":
            flags, event = has.clone(), None
        else:
            flags = torch.empty(has.shape, dtype=torch.bool, pin_memory=True)
            flags.copy_(has, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(has.device))  # the stream the copy is queued on
        self._unknown.append(_Unknown(pages.copy(), slots.copy(), self._seq[pages].copy(), flags, event))
