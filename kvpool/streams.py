"""Stream switching and ordering for the paths that queue work on their own CUDA streams (the host
tier's transfer streams, the rank-to-rank transfer's side stream).

These run on the host path of every transfer call, before its work reaches the GPU, and a small
transfer's latency is made of that host path. They do what ``torch.cuda.device`` nested with
``torch.cuda.stream``, and ``Stream.wait_stream``, do, in fewer calls into torch;
``wait_stream`` would also create a new event on every call. ``HostIntUploads`` brings a pool's
host ints (the state slots and rows a request table hands out) to its device the same way: behind
the stream's work, at the cost of the copy alone.
"""

from __future__ import annotations

from typing import Optional

import torch


class OnStream:
    """Context manager: ``stream`` is the current stream, and its device the current device, until
    exit, which restores both (as ``with torch.cuda.device(d), torch.cuda.stream(stream)``). The
    device switch is ``torch.cuda.device``'s own, which leaves a device that had no CUDA context
    without one on the way back; the stream switch skips ``torch.cuda.stream``'s lookups.

    >>> with OnStream(side):            # doctest: +SKIP
    ...     launch_kernels()            # queued on `side`
    """

    __slots__ = ("stream", "device", "prev_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self.device = torch.cuda.device(stream.device_index)

    def __enter__(self) -> "OnStream":
        self.device.__enter__()
        self.prev_stream = torch.cuda.current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.prev_stream)
        self.device.__exit__(None, None, None)


class StreamMark:
    """One event, kept and recorded again for each use, that orders one stream after another's work
    so far: ``mark.order(waiter, after)`` is ``waiter.wait_stream(after)`` without a new event per
    call. A wait applies to the record just before it, so a later record does not disturb an
    earlier wait."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = torch.cuda.Event()

    def order(self, waiter: torch.cuda.Stream, after: torch.cuda.Stream) -> None:
        """Work queued on ``waiter`` from now on starts after the work queued on ``after`` so far."""
        self._event.record(after)
        waiter.wait_event(self._event)


class HostIntUploads:
    """Short lists of host ints as new int64 tensors on a CUDA device, copied behind the current
    stream's work without synchronising (what ``torch.tensor(values).pin_memory().to(device,
    non_blocking=True)`` does, at the cost of the copy alone).

    The values are written into one half of a pinned staging buffer, one list after the next, and
    copied from there on one stream. When the half is full, or the current stream is another, the
    other half is taken once the copies that read it have run (an event recorded on their stream
    when it was left); until then, and for a list longer than a half, a list goes through pinned
    memory of its own, as above.

    Parameters
    ----------
    device : the CUDA device the tensors are made on.
    half : ints per half of the staging buffer.
    """

    def __init__(self, device: torch.device, half: int = 4096) -> None:
        self.device = device
        self._half = half
        self._host = torch.empty(2 * half, dtype=torch.int64, pin_memory=True)
        self._ints = self._host.numpy()  # written without a torch call
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._which, self._at = 0, 0  # the half in use, and its next free position
        self._stream: Optional[int] = None  # raw handle of the stream its copies were queued on
        self._left: list[Optional[torch.cuda.Event]] = [None, None]  # per half: recorded when it was left

    def __call__(self, values: list[int]) -> torch.Tensor:
        n = len(values)
        raw = _current_raw_stream(self._index)
        end = (self._which + 1) * self._half
        if n > self._half or ((self._at + n > end or self._stream not in (None, raw)) and not self._switch()):
            return torch.tensor(values, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
        at = self._at
        self._ints[at : at + n] = values
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        out.copy_(self._host[at : at + n], non_blocking=True)
        self._at, self._stream = at + n, raw
        return out

    def _switch(self) -> bool:
        """Leave the half in use for the other if the copies that read that one have run (False,
        nothing changed, otherwise); the half left gets an event behind its own copies."""
        other = 1 - self._which
        done = self._left[other]
        if done is not None and not done.query():
            return False
        left = None
        if self._stream is not None:
            left = torch.cuda.Event()
            left.record(torch.cuda.ExternalStream(self._stream, device=self.device))
        self._left[self._which] = left
        self._which, self._at, self._stream = other, other * self._half, None
        return True


#: The raw handle of a CUDA device's current stream (a C function: no Python frame on a hot path).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", (0).__mul__)
