"""``RowTable``: a list of buffers named by their addresses, as one row-copy launch addresses them.

Every path that copies rows (moves inside a pool, CPU copies, the host tier, transfers between
ranks, state pools) describes its buffers once as a table of base addresses, row strides and row
sizes on the device; :func:`kvpool.kernels.copy_rows.copy_rows` then copies rows between two tables
in one launch. A device pool's table is ``pool.row_table`` (docs/contract.md, "Moves and CPU copies").
"""

from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence

import torch

#: The widest vector the row-copy kernel issues (16 bytes: ld.global.v4.b32).
MAX_ALIGN = 16


def _row_is_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _alignment(values: Sequence[int], cap: int = MAX_ALIGN) -> int:
    """The largest power of two <= cap that divides every value."""
    g = 0
    for v in values:
        g = math.gcd(g, v)
    if g == 0:
        return cap
    return min(cap, g & -g)


class RowTable:
    """A list of buffers that one launch addresses: buffer b is ``rows x row_bytes[b]`` bytes, row r at
    ``base[b] + r * row_stride[b]`` (bytes). All buffers of a table share ``rows`` and ``device``.

    Build tables off the hot path, and not while a CUDA graph is being captured: ``RowTable.of``
    copies the address table to the device (one synchronisation, or none with ``non_blocking``). A
    table keeps its buffers alive; it is valid as long as they are not resized or re-pointed.

    Attributes
    ----------
    buffers : tuple of Tensor, the buffers (any dtype; bytes are copied).
    rows : int, rows of every buffer.
    row_bytes : tuple of int, bytes of one row of each buffer.
    device : torch.device, where the buffers live.
    table : Tensor [3, >= len(buffers)] int64 on ``table_device``: base addresses, row strides and row
        bytes (columns may be a slice of a larger table, see :meth:`select`).
    table_device : torch.device, where the kernel runs for this table (a CUDA device for pinned host
        buffers when CUDA is available).
    align : int, the largest power of two <= 16 dividing every address, row stride and row size.
    pinned : bool, whether CPU buffers are in pinned (page-locked) memory.

    Examples
    --------
    >>> k = [torch.zeros(64, 8, 128, dtype=torch.uint8) for _ in range(2)]
    >>> table = RowTable.of(k)
    >>> table.rows, table.row_bytes
    (64, (1024, 1024))
    """

    __slots__ = (
        "buffers", "rows", "row_bytes", "device", "table", "table_device", "align", "pinned",
        "distinct_row_bytes", "_addrs", "_strides", "_alias", "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        buffers: tuple[torch.Tensor, ...],
        rows: int,
        row_bytes: tuple[int, ...],
        device: torch.device,
        table: torch.Tensor,
        addrs: tuple[int, ...],
        strides: tuple[int, ...],
        pinned: bool,
    ) -> None:
        # Private: use RowTable.of. Everything here is already checked.
        self.buffers = buffers
        self.rows = rows
        self.row_bytes = row_bytes
        self.distinct_row_bytes = tuple(sorted(set(row_bytes)))  # what a launch plan depends on
        self.device = device
        self.table = table
        self.table_device = table.device
        self._addrs = addrs
        self._strides = strides
        self.pinned = pinned
        self.align = _alignment(addrs + row_bytes + (strides if rows > 1 else ()))
        self._alias: dict[int, tuple[weakref.ref, bool]] = {}

    @classmethod
    def of(
        cls,
        buffers: Sequence[torch.Tensor],
        *,
        table_device: Optional[str | torch.device] = None,
        non_blocking: bool = False,
        pinned: Optional[bool] = None,
    ) -> "RowTable":
        """A table of ``buffers``: each ``[rows, ...]`` with its row (dims 1..) contiguous, any dtype.

        Parameters
        ----------
        buffers : non-empty sequence of Tensor, same ``rows`` (dim 0) and device.
        table_device : where the address table (and the kernel) lives. Default: the buffers' device;
            for pinned host buffers, the current CUDA device when CUDA is available.
        non_blocking : copy the address table to a CUDA device through pinned memory on the current
            stream, without synchronising; the table is then ready for work on that stream (or on
            streams that wait for it). Default: a plain copy, which synchronises once (tables built
            at construction and used on several streams).
        pinned : whether host buffers are page-locked. None asks torch (``is_pinned``); True vouches
            for memory page-locked outside torch's allocator (``cudaHostRegister``).

        Raises
        ------
        TypeError, ValueError
            On an empty list, non-tensors, differing rows or devices, rows that are not contiguous,
            empty rows, or host buffers that a CUDA table cannot reach (not pinned).
        """
        if isinstance(buffers, torch.Tensor) or not isinstance(buffers, Sequence):
            raise TypeError(f"buffers must be a sequence of tensors, got {type(buffers).__name__}")
        if len(buffers) == 0:
            raise ValueError("buffers must hold at least one tensor, got an empty sequence")
        for b, t in enumerate(buffers):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"buffers[{b}] must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() < 1:
                raise ValueError(f"buffers[{b}] must have a row dimension (dim >= 1), got a 0-d tensor")
        first = buffers[0]
        rows, device = first.shape[0], first.device
        row_bytes, addrs, strides = [], [], []
        for b, t in enumerate(buffers):
            if t.shape[0] != rows:
                raise ValueError(f"buffers[{b}] must have {rows} rows like buffers[0], got {t.shape[0]}")
            if t.device != device:
                raise ValueError(f"buffers[{b}] must be on {device} like buffers[0], got {t.device}")
            if not _row_is_contiguous(t):
                raise ValueError(
                    f"buffers[{b}] must have contiguous rows (dims 1..), got shape {tuple(t.shape)} "
                    f"strides {t.stride()}"
                )
            nbytes = t[0].numel() * t.element_size() if rows else math.prod(t.shape[1:]) * t.element_size()
            if nbytes == 0:
                raise ValueError(f"buffers[{b}] must have rows of at least one byte, got shape {tuple(t.shape)}")
            row_bytes.append(nbytes)
            addrs.append(t.data_ptr())
            strides.append(t.stride(0) * t.element_size())
        if device.type != "cpu" or not torch.cuda.is_available():
            pinned = False
        elif pinned is None:
            pinned = all(t.is_pinned() for t in buffers)
        tdev = _table_device(device, pinned, table_device)
        host = torch.tensor([addrs, strides, row_bytes], dtype=torch.int64)
        if tdev.type == "cpu":
            table = host
        elif non_blocking:
            table = host.pin_memory().to(tdev, non_blocking=True)
        else:
            table = host.to(tdev)
        return cls(tuple(buffers), rows, tuple(row_bytes), device, table, tuple(addrs), tuple(strides), pinned)

    def __len__(self) -> int:
        return len(self.row_bytes)

    def select(self, start: int, stop: int) -> "RowTable":
        """Buffers ``start..stop-1`` as a table whose address table is a view of this one's (no copy,
        no synchronisation): a layer's K and V out of a pool's table, say."""
        if not 0 <= start < stop <= len(self.buffers):
            raise IndexError(f"select({start}, {stop}) is outside the table's buffers 0..{len(self.buffers) - 1}")
        return RowTable(
            self.buffers[start:stop], self.rows, self.row_bytes[start:stop], self.device,
            self.table[:, start:stop], self._addrs[start:stop], self._strides[start:stop], self.pinned,
        )  # fmt: skip

    def spans(self) -> list[tuple[int, int]]:
        """[first byte, last byte + 1) of each buffer's rows."""
        if self.rows == 0:
            return [(a, a) for a in self._addrs]
        return [(a, a + (self.rows - 1) * s + n) for a, s, n in zip(self._addrs, self._strides, self.row_bytes)]

    def __repr__(self) -> str:
        return (
            f"RowTable({len(self.buffers)} buffers x {self.rows} rows, row_bytes={self.row_bytes[:4]}"
            f"{'...' if len(self.row_bytes) > 4 else ''}, device={self.device}, align={self.align})"
        )


def _table_device(device: torch.device, pinned: bool, requested: Optional[str | torch.device]) -> torch.device:
    if requested is None:
        if device.type == "cpu" and pinned:
            return torch.device("cuda", torch.cuda.current_device())
        return device
    tdev = torch.device(requested)
    if tdev.type == "cuda" and tdev.index is None:
        tdev = torch.device("cuda", torch.cuda.current_device())
    if tdev == device:
        return tdev
    if device.type == "cpu" and tdev.type == "cuda":
        if not pinned:
            raise ValueError(
                f"buffers must be in pinned host memory to be addressed from {tdev}, got pageable CPU tensors"
            )
        return tdev
    raise ValueError(f"table_device must be the buffers' device {device} (or CUDA for pinned buffers), got {tdev}")


def aliases(dst: RowTable, src: RowTable) -> bool:
    """Whether some destination buffer is its own source buffer (same memory, same row stride), as in
    a move within one pool. Any other sharing of memory between the tables is refused, since no
    launch order could make it well defined. Memoised per pair of tables."""
    memo = dst._alias.get(id(src))
    if memo is not None and memo[0]() is src:
        return memo[1]
    same = False
    tagged = sorted([(lo, hi, 0, b) for b, (lo, hi) in enumerate(dst.spans())] +
                    [(lo, hi, 1, b) for b, (lo, hi) in enumerate(src.spans())])  # fmt: skip
    open_: list[tuple[int, int, int, int]] = []
    for cur in tagged:
        lo = cur[0]
        open_ = [o for o in open_ if o[1] > lo]
        for o in open_:
            if o[2] == cur[2] or cur[0] == cur[1]:
                continue  # two buffers of one table, or an empty span
            d, s = (o, cur) if o[2] == 0 else (cur, o)
            b, c = d[3], s[3]
            if b == c and dst._addrs[b] == src._addrs[c] and (dst._strides[b] == src._strides[c] or dst.rows <= 1):
                same = True
            else:
                raise ValueError(
                    f"dst buffer {b} shares memory with src buffer {c}: only a buffer and its own source "
                    f"(same position, address and row stride) may overlap"
                )
        if cur[0] != cur[1]:
            open_.append(cur)
    dst._alias[id(src)] = (weakref.ref(src), same)
    return same


def staging_table(staging: torch.Tensor, n: int, src: RowTable) -> RowTable:
    """A table over ``staging`` (uint8, n x sum(row_bytes)) holding buffer b's n rows contiguously,
    built with device operations only (no host-to-device copy: graph-safe, no synchronisation)."""
    rb_dev = src.table[2]
    offsets = torch.cumsum(rb_dev, 0) - rb_dev
    table = torch.stack((offsets * n + staging.data_ptr(), rb_dev, rb_dev))
    views, addrs, off = [], [], 0
    for rb in src.row_bytes:
        views.append(staging[off * n : (off + rb) * n].view(n, rb))
        addrs.append(staging.data_ptr() + off * n)
        off += rb
    return RowTable(tuple(views), n, src.row_bytes, staging.device, table, tuple(addrs), src.row_bytes, False)
