"""``CountMirror``: device counters copied to pinned host memory behind the work queued so far, and
told, without waiting, once the copy has landed; the allocator's free lists fold it into their host
counts then (:mod:`kvpool.pools.allocator.freelist`).
"""

from __future__ import annotations

from typing import Optional

import torch

from kvpool.kernels.allocator.launcher import MIRROR_SEQ_BITS
from kvpool.kernels.launch import current_raw_stream

_SEQ_MASK = (1 << MIRROR_SEQ_BITS) - 1


class CountMirror:
    """A pinned host copy of a few device counters, queued behind the device's work; ``poll`` returns
    it, without waiting, once it has landed (on a CPU device the copy is immediate).

    The copy is either launched here (``queue``: a copy and a CUDA event), or written by a kernel that
    changed the counters (``tagged``: ``next_seq()`` names the launch, ``landed_behind`` then marks
    it), one launch and the event fewer per call: the kernel writes each counter as ``value <<
    MIRROR_SEQ_BITS | seq``, so the copy has landed once every word carries the launch's ``seq``,
    whatever order the words arrive in. Counts stay far below ``2**(63 - MIRROR_SEQ_BITS)``.

    Parameters
    ----------
    n : counters copied.
    device : the counters' device.
    """

    def __init__(self, n: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._device = device
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
        self.tagged = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
        self._words = self.tagged.numpy()  # read without a torch call: the host's view of the kernel's writes
        self._seq = 0  # of the latest launch named (0 names none: the words start as 0)
        self._event = torch.cuda.Event() if cuda else None
        self._stream: Optional[tuple[int, torch.cuda.Stream]] = None  # (raw handle, stream object)
        self._tag: Optional[object] = None
        self._expect: Optional[int] = None  # the seq the pending copy's words carry, None: the event's copy

    def queue(self, counters: torch.Tensor, tag: object) -> None:
        """Copy ``counters`` (1-D int64 on the device) once the work queued so far has run; ``tag`` comes
        back with them. A copy not yet polled is replaced."""
        self.host.copy_(counters, non_blocking=self._event is not None)
        if self._event is not None:
            # The copy runs on the counters' device's stream, which need not be the current device's.
            self._event.record(self._current_stream())
        self._tag, self._expect = tag, None

    def next_seq(self) -> int:
        """The ``seq`` of the next kernel that writes ``tagged`` (1 up to ``2**MIRROR_SEQ_BITS - 1``,
        then round again)."""
        self._seq = self._seq % _SEQ_MASK + 1
        return self._seq

    def landed_behind(self, tag: object) -> None:
        """The last work queued writes the counters to ``tagged`` under the latest ``next_seq()``:
        ``poll`` returns them, with ``tag``, once it has run. A copy not yet polled is replaced."""
        self._tag, self._expect = tag, self._seq

    def _current_stream(self) -> torch.cuda.Stream:
        """The counters' device's current stream, its object kept while the raw handle is the same
        (``torch.cuda.current_stream`` builds a new one each time)."""
        raw = current_raw_stream(self._device.index if self._device.index is not None else torch.cuda.current_device())
        if self._stream is None or self._stream[0] != raw:
            self._stream = (raw, torch.cuda.current_stream(self._device))
        return self._stream[1]

    def poll(self) -> Optional[tuple[list[int], object]]:
        """The latest copy and its tag if it has landed (once), else None; never waits."""
        if self._tag is None:
            return None
        if self._expect is None:
            if self._event is not None and not self._event.query():
                return None
            counts = self.host.tolist()
        else:
            words = self._words.tolist()
            if any(w & _SEQ_MASK != self._expect for w in words):
                return None  # not every word of that launch has arrived
            counts = [w >> MIRROR_SEQ_BITS for w in words]
        tag, self._tag = self._tag, None
        return counts, tag

    def drop(self) -> None:
        """Forget the copy in flight (the counts it holds no longer apply)."""
        self._tag = None
