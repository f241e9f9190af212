"""Row copies between tables of buffers: the engine under KV moves, the host tier and rank transfers.

A :class:`RowTable` names a list of buffers (one per layer and per K/V, say) by their addresses, once;
:func:`copy_rows` then copies, for every buffer of the table, the rows named by a pair of index
tensors, in one Triton launch on CUDA (``copy_rows_kernel.py``) or with plain PyTorch elsewhere
(:func:`copy_rows_reference`, the definition of the result).

Semantics (both paths):

* For every buffer ``b`` and pair ``i``: row ``dst_index[i]`` of ``dst.buffers[b]`` becomes a byte copy
  of row ``src_index[i]`` of ``src.buffers[b]``. Rows not named are untouched.
* A pair with a negative index on either side is padding: skipped. A pair with an index past its
  table's rows is skipped too (never read, never written); ``validate=True`` raises ``IndexError``
  for it instead (one synchronisation).
* If a destination buffer is also the source buffer (a move inside one pool), the result is as if
  every source row were read before any destination row is written: chains (``dst[i] == src[i+1]``),
  cycles and ``dst == src`` are all defined. A destination named twice gets one of its sources
  (which one is unspecified). Up to ``ONE_PASS_MAX_PAIRS`` pairs this takes one launch in which each
  program holds all its pairs' source bytes before it stores; above that the rows go through a
  device staging buffer (two launches per group of buffers, the one case that allocates).
* No host-device synchronisation (except ``validate``), CUDA-graph safe, and, for tables that do not
  share memory, no device allocation.

Tables may live on different devices when one side is pinned host memory: the kernel reads and
writes it directly through unified addressing. Index tensors and address tables then live on the GPU.
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvpool.checks import positive_int
from kvpool.streams import OnStream

try:
    from kvpool.kernels import copy_rows_kernel as _k

    TRITON_AVAILABLE = True
    INTERPRETER = type(_k._copy_rows_kernel).__name__ == "InterpretedFunction"
except ImportError:  # pragma: no cover - exercised only where triton is absent
    _k = None
    TRITON_AVAILABLE = False
    INTERPRETER = False

#: Most pairs a copy between aliasing tables does in one launch: the program of a column chunk holds
#: all pairs' bytes of that chunk, at least one 16-byte vector each, within a 4096-element tile.
ONE_PASS_MAX_PAIRS = 1024
#: Device memory a staged copy (aliasing tables, more pairs than one pass takes) uses per launch pair.
STAGING_BYTES = 256 * 2**20
#: The widest vector the kernel issues (16 bytes: ld.global.v4.b32).
MAX_ALIGN = 16

_INDEX_DTYPES = (torch.int32, torch.int64)

# Tests set this (under TRITON_INTERPRET=1) to run the kernel through Triton's interpreter on CPU
# tables; otherwise CPU tables take the reference path.
_kernel_on_cpu = False


# --- tables -----------------------------------------------------------------------------------------


def _row_is_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _pow2_dividing(values: Sequence[int], cap: int = MAX_ALIGN) -> int:
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
        self.align = _pow2_dividing(addrs + row_bytes + (strides if rows > 1 else ()))
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


# --- checks -----------------------------------------------------------------------------------------


def _compute_device(dst: RowTable, src: RowTable) -> torch.device:
    """Where a copy between these tables runs: the CUDA device if either side is on CUDA (the other
    then on the same device or pinned host memory), else the CPU."""
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, RowTable):
            raise TypeError(f"{name} must be a RowTable, got {type(t).__name__}")
    if len(dst) != len(src):
        raise ValueError(f"src must have as many buffers as dst ({len(dst)}), got {len(src)}")
    if dst.row_bytes != src.row_bytes:
        b = next(i for i, (a, c) in enumerate(zip(dst.row_bytes, src.row_bytes)) if a != c)
        raise ValueError(
            f"src buffer {b} must have rows of {dst.row_bytes[b]} bytes like dst buffer {b}, got {src.row_bytes[b]}"
        )
    if dst.device.type != "cuda" and src.device.type != "cuda":
        return torch.device("cpu")
    cuda = dst.device if dst.device.type == "cuda" else src.device
    for name, t in (("dst", dst), ("src", src)):
        if t.device.type == "cuda" and t.device != cuda:
            raise ValueError(f"{name} buffers must be on {cuda} like the other table's, got {t.device}")
        if t.device.type == "cpu" and not t.pinned:
            raise ValueError(f"{name} buffers are pageable host memory, which {cuda} cannot reach: pin them")
        if t.table_device != cuda:
            raise ValueError(f"{name}'s address table must be on {cuda}, got {t.table_device}")
    return cuda


def _check_index(index: object, name: str, device: torch.device) -> torch.Tensor:
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(index).__name__}")
    if index.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {index.dtype}")
    if index.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(index.shape)}")
    if index.device != device:
        raise ValueError(f"{name} must be on {device}, got {index.device}")
    return index


def check_pairs(
    dst_index: object, src_index: object, device: torch.device, names: tuple[str, str] = ("dst_index", "src_index")
) -> int:
    """Both index tensors int32/int64, 1-D, on ``device``, of one length; returns the length."""
    di = _check_index(dst_index, names[0], device)
    si = _check_index(src_index, names[1], device)
    if di.shape[0] != si.shape[0]:
        raise ValueError(f"{names[1]} must have as many entries as {names[0]} ({di.shape[0]}), got {si.shape[0]}")
    return di.shape[0]


def check_in_range(indices: Sequence[tuple[torch.Tensor, int, str]]) -> None:
    """Raise IndexError naming the first entry >= rows of each (index, rows, name), negative entries
    being padding. One synchronisation for all of them."""
    live = [(t, rows, name) for t, rows, name in indices if t.numel()]
    if not live:
        return
    flags = torch.stack([(t >= rows).any() for t, rows, _ in live]).tolist()
    for (t, rows, name), bad in zip(live, flags):
        if bad:
            pos = int(torch.argmax((t >= rows).to(torch.uint8)))
            raise IndexError(
                f"{name}[{pos}] = {int(t[pos])} is out of range: rows are 0..{rows - 1} (negative entries are skipped)"
            )


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


# --- launch plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyTile:
    """Work per task: about ``elems`` elements (4 bytes each when aligned) with ``num_warps`` warps."""

    elems: int
    num_warps: int
    #: Register cap per thread (ptxas ``.maxnreg``), or None for the compiler's choice.
    maxnreg: Optional[int] = None

    def __post_init__(self) -> None:
        if self.elems < 1 or self.elems & (self.elems - 1):
            raise ValueError(f"elems must be a positive power of two, got {self.elems}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two from 1 to 32, got {self.num_warps}")


#: Tiles by grid kind. Not yet swept on hardware (benchmarks/bench_host_tier.py --sweep reports the
#: alternatives): 16 KiB per task over 4 warps keeps 8 vector loads per thread in flight on an
#: SM-wide grid; a grid of a few programs (the host tier's) needs more bytes in flight per SM to
#: cover PCIe latency, so it takes 64 KiB tasks over 16 warps.
SM_TILE = CopyTile(elems=4096, num_warps=4)
FEW_PROGRAMS_TILE = CopyTile(elems=16384, num_warps=16)
#: A grid of at most this many programs uses FEW_PROGRAMS_TILE.
FEW_PROGRAMS = 32
#: Programs per SM of an uncapped grid (each loops over its share of the tasks).
PROGRAMS_PER_SM = 8
#: Register budget of a one-pass program (it holds all pairs of its column chunk).
ONE_PASS_TILE = CopyTile(elems=4096, num_warps=4)


@dataclass(frozen=True)
class CopyPlan:
    elem_bytes: int
    align: int
    block_p: int
    block_w: int
    chunks: int
    even: bool
    one_pass: bool
    num_warps: int
    tasks: int
    programs: int


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def plan_copy(
    n_pairs: int,
    buffers: int,
    row_bytes: tuple[int, ...],
    align: int,
    one_pass: bool,
    program_cap: int,
    tile: CopyTile,
) -> CopyPlan:
    """Block shapes and grid for a copy. ``row_bytes``: the distinct row sizes of the buffers."""
    elem = min(align, 4)
    vec = align // elem
    row_elems = [rb // elem for rb in row_bytes]
    longest = _pow2(max(row_elems))
    if one_pass:
        if n_pairs > ONE_PASS_MAX_PAIRS:
            raise ValueError(f"a one-pass plan takes at most {ONE_PASS_MAX_PAIRS} pairs, got {n_pairs}")
        block_p = _pow2(n_pairs)
        block_w = min(longest, max(vec, ONE_PASS_TILE.elems // block_p))
        warps_cap = ONE_PASS_TILE.num_warps
    else:
        block_w = min(longest, tile.elems)
        block_p = max(1, min(tile.elems // block_w, _pow2(n_pairs)))
        warps_cap = tile.num_warps
    chunks = -(-max(row_elems) // block_w)
    even = all(e % block_w == 0 for e in row_elems)
    tasks = buffers * chunks * -(-n_pairs // block_p)
    # About two vectors per thread at least: a 1-pair, 256-element task runs on one warp.
    warps = max(1, min(warps_cap, (block_p * block_w) // (64 * vec)))
    warps = 1 << (warps.bit_length() - 1)
    return CopyPlan(elem, align, block_p, block_w, chunks, even, one_pass, warps, tasks, min(tasks, program_cap))


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_key(device_index: int, plan: CopyPlan, maxnreg: Optional[int], tensors: tuple, ints: tuple) -> tuple:
    """Everything the compiled kernel for a launch depends on: the device, the plan's constexprs and
    warps, the register cap, and what Triton specialises each argument on: a tensor's dtype and
    whether 16 divides its address; an int's type (i32 up to 2**31 - 1, i64, u64 from 2**63),
    whether it is 1 and whether 16 divides it. Two launches with equal keys run the same compiled
    kernel; the key is a superset of Triton's own, so a kernel is never reused for arguments it was
    not compiled for. (The grid is not part of it: pair counts with the same blocks share a kernel.)"""
    return (
        device_index, plan.elem_bytes, plan.align, plan.block_p, plan.block_w, plan.even, plan.one_pass,
        plan.num_warps, maxnreg, *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors],
        *[(v == 1) | (v % 16 == 0) << 1 | (v > 0x7FFFFFFF) << 2 | (v >= 1 << 63) << 3 | (v < -0x80000000) << 4 for v in ints],
    )  # fmt: skip


#: The kernel's parameters, in order: what a launch passes the compiled kernel's launcher
#: positionally, constexprs included. That launcher does not check how many it gets (Triton 3.6-3.7),
#: so the cached launches are only used when the kernel's signature is exactly this.
PARAMS = (
    "dst_table_ptr", "src_table_ptr", "dst_index_ptr", "src_index_ptr", "n_pairs", "dst_rows", "src_rows",
    "dst_index_stride", "src_index_stride", "dst_table_stride", "src_table_stride", "buffers", "chunks",
    "n_tasks", "ELEM_BYTES", "ALIGN", "BLOCK_P", "BLOCK_W", "EVEN", "ONE_PASS",
)  # fmt: skip


def kernel_params() -> tuple:
    """The row-copy kernel's parameter names, from its Python signature (JIT or interpreter)."""
    fn = _k._copy_rows_kernel
    return tuple(inspect.signature(getattr(fn, "fn", fn)).parameters)


#: Compiled kernels by :func:`launch_key` (CUDA). A launch through the JIT binds and specialises
#: every argument and looks up its cache: 22 us of host time per launch on an H200's host against 8 us
#: for the compiled kernel's own launcher (``benchmarks/probe_host_calls.py``); a transfer of 32
#: layers one by one launches 32 times before the model's work can be queued. As many entries as
#: the JIT's own cache has kernels.
_COMPILED: dict[tuple, object] = {}
#: Cleared for good if this Triton's kernel has another signature, or its launcher refuses the
#: arguments as the JIT passes them; launches then all go through the JIT.
_FAST_LAUNCH = TRITON_AVAILABLE and not INTERPRETER and kernel_params() == PARAMS


def launch_copy_rows(
    dst: RowTable,
    dst_index: torch.Tensor,
    src: RowTable,
    src_index: torch.Tensor,
    *,
    max_programs: Optional[int] = None,
    tile: Optional[CopyTile] = None,
    one_pass: bool = False,
    stream: Optional[torch.cuda.Stream] = None,
) -> None:
    """Launch the kernel once. Unchecked: the arguments must have passed :func:`copy_rows`'s checks,
    ``one_pass`` must be set when the tables alias (and then ``len(dst_index) <= ONE_PASS_MAX_PAIRS``).
    ``tile`` overrides the tile table (benchmarks). ``stream``: the CUDA stream to launch on (default:
    the current one), without making it current.

    After the first launch of a kind (:func:`launch_key`), later ones go straight to the compiled
    kernel's launcher, skipping the JIT's per-call argument binding."""
    global _FAST_LAUNCH
    n = dst_index.shape[0]
    if n == 0:
        return
    device = dst.table_device
    if tile is None:
        tile = FEW_PROGRAMS_TILE if max_programs is not None and max_programs <= FEW_PROGRAMS else SM_TILE
    cap = max_programs if max_programs is not None else _sm_count(device) * PROGRAMS_PER_SM
    plan = plan_copy(n, len(dst), dst.distinct_row_bytes, min(dst.align, src.align), one_pass, cap, tile)
    tensors = (dst.table, src.table, dst_index, src_index)
    ints = (
        n, dst.rows, src.rows, dst_index.stride(0), src_index.stride(0), dst.table.stride(0), src.table.stride(0),
        len(dst), plan.chunks, plan.tasks,
    )  # fmt: skip
    args = tensors + ints
    if device.type != "cuda" or INTERPRETER:
        _jit_launch(plan, tile, args)
        return
    current = device.index == torch.cuda.current_device()
    key = launch_key(device.index, plan, tile.maxnreg, tensors, ints) if _FAST_LAUNCH and current else None
    compiled = _COMPILED.get(key) if key is not None else None
    if compiled is not None:
        constexprs = (plan.elem_bytes, plan.align, plan.block_p, plan.block_w, plan.even, plan.one_pass)
        try:
            compiled[(plan.programs, 1, 1)](*args, *constexprs, stream=None if stream is None else stream.cuda_stream)
            return
        except TypeError:  # a launcher that parses its arguments refused these before launching
            _FAST_LAUNCH = False
            _COMPILED.clear()
    if stream is not None or not current:
        with OnStream(stream if stream is not None else torch.cuda.current_stream(device)):
            compiled = _jit_launch(plan, tile, args)
    else:
        compiled = _jit_launch(plan, tile, args)
    if key is not None and _FAST_LAUNCH and compiled is not None:
        _COMPILED[key] = compiled


def _jit_launch(plan: CopyPlan, tile: CopyTile, args: tuple):
    """Launch through Triton's JIT (compiling on first use) on the current device and stream; returns
    the compiled kernel (None under the interpreter)."""
    consts = dict(
        ELEM_BYTES=plan.elem_bytes, ALIGN=plan.align,
        BLOCK_P=plan.block_p, BLOCK_W=plan.block_w, EVEN=plan.even, ONE_PASS=plan.one_pass,
        num_warps=plan.num_warps,
    )  # fmt: skip
    if tile.maxnreg is not None:
        consts["maxnreg"] = tile.maxnreg
    return _k._copy_rows_kernel[(plan.programs,)](*args, **consts)


def _staging_table(staging: torch.Tensor, n: int, src: RowTable) -> RowTable:
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


def _staged_copy(
    dst: RowTable, dst_index: torch.Tensor, src: RowTable, src_index: torch.Tensor, max_programs: Optional[int]
) -> None:
    """Aliasing tables with more pairs than one pass takes: per group of buffers, gather every source
    row into a staging buffer, then scatter from it (pairs whose source is skipped stay skipped)."""
    n = dst_index.shape[0]
    device = dst.table_device
    arange = torch.arange(n, device=device, dtype=torch.int64)
    src_ok = (src_index >= 0) & (src_index < src.rows)
    back = torch.where(src_ok, arange, -1)
    start = 0
    while start < len(src):
        stop, total = start + 1, src.row_bytes[start]
        while stop < len(src) and (total + src.row_bytes[stop]) * n <= STAGING_BYTES:
            total += src.row_bytes[stop]
            stop += 1
        s_sub, d_sub = src.select(start, stop), dst.select(start, stop)
        staging = torch.empty(n * total, dtype=torch.uint8, device=device)
        st = _staging_table(staging, n, s_sub)
        launch_copy_rows(st, arange, s_sub, src_index, max_programs=max_programs)
        launch_copy_rows(d_sub, dst_index, st, back, max_programs=max_programs)
        start = stop


# --- reference path ---------------------------------------------------------------------------------


def byte_rows(buf: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``buf`` ([rows, ...], contiguous rows) as a uint8 [rows, row_bytes] view of the same memory."""
    esz = buf.element_size()
    out = torch.empty(0, dtype=torch.uint8, device=buf.device)
    out.set_(buf.untyped_storage(), buf.storage_offset() * esz, (buf.shape[0], row_bytes), (buf.stride(0) * esz, 1))
    return out


def copy_rows_reference(dst: RowTable, dst_index: torch.Tensor, src: RowTable, src_index: torch.Tensor) -> None:
    """The copy in plain PyTorch (``index_select`` then ``index_put_`` on byte views), the definition of
    :func:`copy_rows`'s result. Unchecked. No synchronisation when both tables and the indices share a
    device; with pinned host and CUDA tables it moves the indices across (which synchronises)."""
    n = dst_index.shape[0]
    if n == 0 or dst.rows == 0 or src.rows == 0:
        return
    di = dst_index.to(torch.int64)
    si = src_index.to(torch.int64)
    valid = (di >= 0) & (di < dst.rows) & (si >= 0) & (si < src.rows)
    src_safe = torch.where(valid, si, 0).to(src.device)
    # Pairs to skip are redirected, on the device, to repeat the first valid pair's write (same row,
    # same bytes); with no valid pair, every pair rewrites destination row 0 with its own contents.
    any_valid = valid.any()
    first = torch.argmax(valid.to(torch.uint8)).view(1)
    target = torch.where(valid, di, torch.where(any_valid, di.index_select(0, first), 0)).to(dst.device)
    valid_d, any_valid_d, first_d = valid.to(dst.device), any_valid.to(dst.device), first.to(dst.device)
    # index_put_ with a row named twice may interleave the duplicates' bytes (CPU threads split the
    # work by element): every pair writing a row writes the bytes of the last pair naming it.
    winner = _last_pair_per_target(target)
    for b, rb in enumerate(dst.row_bytes):
        s_bytes = byte_rows(src.buffers[b], rb)
        d_bytes = byte_rows(dst.buffers[b], rb)
        rows = s_bytes.index_select(0, src_safe).to(dst.device)  # every source read before any write
        fallback = torch.where(any_valid_d, rows.index_select(0, first_d), d_bytes[:1])
        d_bytes.index_put_((target,), torch.where(valid_d[:, None], rows, fallback).index_select(0, winner))


def _last_pair_per_target(target: torch.Tensor) -> torch.Tensor:
    """[n] int64 -> [n]: for each pair, the position of the last pair with the same target (device
    operations of fixed size: no synchronisation)."""
    order = torch.sort(target, stable=True).indices
    ordered = target.index_select(0, order)
    last = order.index_select(0, torch.searchsorted(ordered, ordered, right=True) - 1)
    return torch.empty_like(order).scatter_(0, order, last)


# --- the public function ----------------------------------------------------------------------------


def _use_kernel(device: torch.device) -> bool:
    if not TRITON_AVAILABLE:
        return False
    if device.type == "cuda":
        return not INTERPRETER
    return INTERPRETER and _kernel_on_cpu


def copy_rows(
    dst: RowTable,
    dst_index: torch.Tensor,
    src: RowTable,
    src_index: torch.Tensor,
    *,
    max_programs: int | None = None,
    validate: bool = False,
) -> None:
    """For every buffer b and every i: row ``dst_index[i]`` of ``dst.buffers[b]`` becomes a byte copy of
    row ``src_index[i]`` of ``src.buffers[b]``.

    Parameters
    ----------
    dst, src : RowTable with the same number of buffers and equal ``row_bytes`` per buffer.
    dst_index, src_index : Tensor [n], int32 or int64, on the device the copy runs on (the CUDA
        device when either table is on CUDA, else the CPU). Negative entries are padding (the pair is
        skipped); entries >= the table's rows are never read or written.
    max_programs : cap on the kernel's grid (the host tier copies on a few SMs). None: 8 per SM.
    validate : raise IndexError for an entry >= rows instead of skipping it (one synchronisation).

    A destination buffer may be its own source buffer: the copy is then as if all sources were read
    before any destination is written. On CUDA: one Triton launch for all buffers (two per group of
    buffers through a staging buffer when tables alias and n > ``ONE_PASS_MAX_PAIRS``). Elsewhere:
    :func:`copy_rows_reference`. No host-device synchronisation unless ``validate``; CUDA-graph safe.

    Raises
    ------
    TypeError, ValueError
        Mismatched tables, bad index tensors, tables sharing memory other than buffer-to-itself.
    IndexError
        With ``validate``, naming the index, the value and its position.

    Examples
    --------
    >>> pool = RowTable.of([k_cache, v_cache])                  # [slots, H, D] each
    >>> copy_rows(pool, torch.tensor([7, 8]), pool, torch.tensor([3, 4]))   # rows 3, 4 -> 7, 8
    """
    checked_copy(dst, dst_index, src, src_index, max_programs, validate, ("dst_index", "src_index"))


def checked_copy(
    dst: RowTable,
    dst_index: torch.Tensor,
    src: RowTable,
    src_index: torch.Tensor,
    max_programs: Optional[int],
    validate: bool,
    names: tuple[str, str],
) -> None:
    """:func:`copy_rows` with the callers' own names for the index arguments in its errors (a pool's
    ``tgt_loc``/``src_loc``, a host pool's ``host_indices``/``device_indices``)."""
    device = _compute_device(dst, src)
    n = check_pairs(dst_index, src_index, device, names)
    if max_programs is not None:
        positive_int(max_programs, "max_programs")
    same = aliases(dst, src)
    if validate:
        check_in_range([(dst_index, dst.rows, names[0]), (src_index, src.rows, names[1])])
    if n == 0:
        return
    if not _use_kernel(device):
        copy_rows_reference(dst, dst_index, src, src_index)
    elif same and n > ONE_PASS_MAX_PAIRS:
        _staged_copy(dst, dst_index, src, src_index, max_programs)
    else:
        launch_copy_rows(dst, dst_index, src, src_index, max_programs=max_programs, one_pass=same)
