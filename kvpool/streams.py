"""Stream switching and ordering for the paths that queue work on their own CUDA streams (the host
tier's transfer streams, the rank-to-rank transfer's side stream).

These run on the host path of every transfer call, before its work reaches the GPU, and a small
transfer's latency is made of that host path. They do what ``torch.cuda.device`` nested with
``torch.cuda.stream``, and ``Stream.wait_stream``, do, in fewer calls into torch;
``wait_stream`` would also create a new event on every call.
"""

from __future__ import annotations

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
