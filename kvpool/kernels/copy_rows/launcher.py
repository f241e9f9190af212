"""Row copies between tables of buffers: the engine under KV moves, the host tier and rank transfers.

:func:`copy_rows` copies, for every buffer of a :class:`~kvpool.kernels.row_table.RowTable`, the rows
named by a pair of index tensors: one Triton launch on CUDA (``kernel.py``; the launch plan
and launcher are here), plain PyTorch elsewhere (``naive.py``, the definition of the result).
Padding, range and aliasing rules: docs/contract.md ("Moves and CPU copies").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kvpool.checks import check_in_range, check_index, check_same_length, positive_int
from kvpool.kernels.copy_rows.naive import byte_rows, copy_rows_reference
from kvpool.kernels.launch import (
    INTERPRETER,
    PROGRAMS_PER_SM,
    TRITON_AVAILABLE,
    DirectLaunches,
    Tile,
    cdiv,
    column_chunks,
    copy_warps,
    kernel_params,
    launch_key,
    next_pow2,
    row_elements,
    sm_count,
    uses_kernel,
)
from kvpool.kernels.row_table import RowTable, aliases, staging_table

#: An SM-wide grid's task: enough vector loads per thread in flight without spilling registers.
SM_TILE = Tile(elems=4096, num_warps=4)
#: A grid of a few programs (the host tier's) needs more bytes in flight per SM to cover PCIe latency.
FEW_PROGRAMS_TILE = Tile(elems=16384, num_warps=16)
#: A grid of at most this many programs uses FEW_PROGRAMS_TILE.
FEW_PROGRAMS = 32
#: Register budget of a one-pass program (aliasing tables: it holds all pairs of its column chunk).
ONE_PASS_TILE = Tile(elems=4096, num_warps=4)
#: Most pairs a copy between aliasing tables does in one launch (each pair at least one 16-byte
#: vector per program within ONE_PASS_TILE); more go through a staging buffer.
ONE_PASS_MAX_PAIRS = 1024
#: Device memory a staged copy allocates per gather/scatter pair of launches: larger groups of
#: buffers per launch pair against a larger allocation.
STAGING_BYTES = 256 * 2**20

kernel = None
if TRITON_AVAILABLE:
    from kvpool.kernels.copy_rows import kernel

__all__ = [
    "FEW_PROGRAMS", "FEW_PROGRAMS_TILE", "INTERPRETER", "ONE_PASS_MAX_PAIRS", "ONE_PASS_TILE", "PROGRAMS_PER_SM",
    "RowTable", "SM_TILE", "STAGING_BYTES", "Tile", "aliases", "byte_rows", "check_pairs",
    "checked_copy", "copy_rows", "copy_rows_reference", "kernel_on_cpu", "launch_copy_rows", "plan_copy",
]  # fmt: skip

#: Test switch: set to True (under TRITON_INTERPRET=1, e.g. with pytest's monkeypatch.setattr) to
#: run the kernel through Triton's interpreter on CPU tables; while False, CPU tables take the
#: PyTorch reference. CUDA tables are not affected. Read at every call.
kernel_on_cpu = False


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


def check_pairs(
    dst_index: object, src_index: object, device: torch.device, names: tuple[str, str] = ("dst_index", "src_index")
) -> int:
    """Both index tensors int32/int64, 1-D, on ``device``, of one length; returns the length."""
    di = check_index(dst_index, names[0], device=device)
    si = check_index(src_index, names[1], device=device)
    return check_same_length(di, names[0], si, names[1])


# --- launch plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopyPlan:
    """Tile and grid of one row-copy launch (:func:`plan_copy`).

    Attributes
    ----------
    elem_bytes : bytes of the element the kernel loads and stores.
    align : bytes that divide every row's address, stride and size (the kernel's alignment hint).
    block_p : pairs per task.
    block_w : elements per column chunk (a power of two).
    chunks : column chunks in the longest row.
    even : every row is a whole number of chunks (no column mask).
    one_pass : every pair in one pair block, all sources read before any store (tables that alias).
    num_warps : warps per program.
    tasks : (pair block, buffer, chunk) tasks of the launch.
    programs : the grid, at most the program cap; each program loops over its share of ``tasks``.
    """

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

    @property
    def constexprs(self) -> tuple:
        """The kernel's compile-time constants for this plan, in signature order."""
        return (self.elem_bytes, self.align, self.block_p, self.block_w, self.even, self.one_pass)


@functools.lru_cache(maxsize=4096)
def plan_copy(
    n_pairs: int,
    buffers: int,
    row_bytes: tuple[int, ...],
    align: int,
    one_pass: bool,
    program_cap: int,
    tile: Tile,
) -> CopyPlan:
    """Block shapes and grid for a copy. ``row_bytes``: the distinct row sizes of the buffers."""
    elem, vec, row_elems = row_elements(row_bytes, align)
    if one_pass:
        if n_pairs > ONE_PASS_MAX_PAIRS:
            raise ValueError(f"a one-pass plan takes at most {ONE_PASS_MAX_PAIRS} pairs, got {n_pairs}")
        block_p = next_pow2(n_pairs)
        block_w, chunks, even = column_chunks(row_elems, max(vec, ONE_PASS_TILE.elems // block_p))
        warps_cap = ONE_PASS_TILE.num_warps
    else:
        block_w, chunks, even = column_chunks(row_elems, tile.elems)
        block_p = max(1, min(tile.elems // block_w, next_pow2(n_pairs)))
        warps_cap = tile.num_warps
    tasks = buffers * chunks * cdiv(n_pairs, block_p)
    warps = copy_warps(block_p * block_w, vec, warps_cap)
    return CopyPlan(elem, align, block_p, block_w, chunks, even, one_pass, warps, tasks, min(tasks, program_cap))


#: The kernel's parameters, in order: what a launch passes the compiled kernel's launcher
#: positionally, constexprs included. That launcher does not check how many it gets (Triton 3.6-3.7),
#: so the cached launches are only used when the kernel's signature is exactly this.
PARAMS = (
    "dst_table_ptr", "src_table_ptr", "dst_index_ptr", "src_index_ptr", "n_pairs", "dst_rows", "src_rows",
    "dst_index_stride", "src_index_stride", "dst_table_stride", "src_table_stride", "buffers", "chunks",
    "n_tasks", "ELEM_BYTES", "ALIGN", "BLOCK_P", "BLOCK_W", "EVEN", "ONE_PASS",
)  # fmt: skip


#: Compiled kernels by launch key (CUDA): a transfer of 32 layers one by one launches 32 times
#: before the model's work can be queued, so each launch after the first of its kind skips the JIT's
#: per-call binding.
LAUNCHES = DirectLaunches("row copy", kernel is not None and kernel_params(kernel.copy_rows) == PARAMS)


def launch_copy_rows(
    dst: RowTable,
    dst_index: torch.Tensor,
    src: RowTable,
    src_index: torch.Tensor,
    *,
    max_programs: Optional[int] = None,
    tile: Optional[Tile] = None,
    one_pass: bool = False,
    stream: Optional[torch.cuda.Stream] = None,
) -> None:
    """Launch the kernel once. Unchecked: the arguments must have passed :func:`copy_rows`'s checks,
    ``one_pass`` must be set when the tables alias (and then ``len(dst_index) <= ONE_PASS_MAX_PAIRS``).
    ``tile`` overrides the tile table (benchmarks). ``stream``: the CUDA stream to launch on (default:
    the current one), without making it current.

    After the first launch of a kind (:func:`~kvpool.kernels.launch.launch_key`), later ones go
    straight to the compiled kernel's launcher, skipping the JIT's per-call argument binding."""
    n = dst_index.shape[0]
    if n == 0:
        return
    device = dst.table_device
    if tile is None:
        tile = FEW_PROGRAMS_TILE if max_programs is not None and max_programs <= FEW_PROGRAMS else SM_TILE
    cap = max_programs if max_programs is not None else sm_count(device) * PROGRAMS_PER_SM
    plan = plan_copy(n, len(dst), dst.distinct_row_bytes, min(dst.align, src.align), one_pass, cap, tile)
    tensors = (dst.table, src.table, dst_index, src_index)
    ints = (
        n, dst.rows, src.rows, dst_index.stride(0), src_index.stride(0), dst.table.stride(0), src.table.stride(0),
        len(dst), plan.chunks, plan.tasks,
    )  # fmt: skip
    args = tensors + ints
    constexprs = plan.constexprs
    key = launch_key(device.index, constexprs, (plan.num_warps, tile.maxnreg), tensors, ints) if LAUNCHES.enabled else None
    LAUNCHES.launch(key, (plan.programs, 1, 1), args + constexprs, lambda: _jit_launch(plan, tile, args), device, stream)


def _jit_launch(plan: CopyPlan, tile: Tile, args: tuple):
    """Launch through Triton's JIT (compiling on first use) on the current device and stream; returns
    the compiled kernel (None under the interpreter)."""
    consts = dict(
        ELEM_BYTES=plan.elem_bytes, ALIGN=plan.align,
        BLOCK_P=plan.block_p, BLOCK_W=plan.block_w, EVEN=plan.even, ONE_PASS=plan.one_pass,
        num_warps=plan.num_warps,
    )  # fmt: skip
    if tile.maxnreg is not None:
        consts["maxnreg"] = tile.maxnreg
    return kernel.copy_rows[(plan.programs,)](*args, **consts)


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
        st = staging_table(staging, n, s_sub)
        launch_copy_rows(st, arange, s_sub, src_index, max_programs=max_programs)
        launch_copy_rows(d_sub, dst_index, st, back, max_programs=max_programs)
        start = stop


# --- the public function ----------------------------------------------------------------------------


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
    if not uses_kernel(device, kernel_on_cpu):
        copy_rows_reference(dst, dst_index, src, src_index)
    elif same and n > ONE_PASS_MAX_PAIRS:
        _staged_copy(dst, dst_index, src, src_index, max_programs)
    else:
        launch_copy_rows(dst, dst_index, src, src_index, max_programs=max_programs, one_pass=same)
