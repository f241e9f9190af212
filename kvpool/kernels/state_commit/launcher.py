"""Committing speculative state: the plan and launcher of ``kernel.py``, and the call that picks it or
the PyTorch reference (``naive.py``).

After a verify step, request ``i`` of the batch keeps the state it reached after ``steps[i]`` of its
``K`` draft steps: for every buffer of a pool's state table (every layer's convolution window and
recurrent state), row ``slots[i]`` becomes a byte copy of row ``i * K + steps[i] - 1`` of the
matching scratch buffer. ``steps[i] == 0`` keeps the old state; a step count outside ``0..K``, a
negative slot and a slot past the table's rows are skipped (never read, never written). A second
``(slots, steps)`` set, the track slots of a prefix cache, may ride in the same launch.

On CUDA this is one launch over every buffer with no host synchronisation (the steps are read on
the device; CUDA-graph safe). Elsewhere, :func:`commit_rows_reference`, the definition of the result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from kvpool.kernels.launch import (
    PROGRAMS_PER_SM,
    Tile,
    DirectLaunches,
    column_chunks,
    copy_warps,
    kernel_params,
    launch_key,
    row_elements,
    sm_count,
    uses_kernel,
)
from kvpool.kernels.row_table import RowTable
from kvpool.kernels.state_commit.naive import commit_rows_reference

try:
    from kvpool.kernels.state_commit import kernel
except ImportError:  # pragma: no cover - exercised only where triton is absent
    kernel = None

#: The commit's task: a linear layer's recurrent state row is hundreds of kilobytes, so wide column
#: chunks on many warps keep more bytes in flight per program than the row copy's tile.
STATE_COMMIT_TILE = Tile(elems=32768, num_warps=16)

#: Test switch: set to True (under TRITON_INTERPRET=1, e.g. with pytest's monkeypatch.setattr) to
#: run the kernel through Triton's interpreter on CPU tables; while False, CPU tables take the
#: PyTorch reference. CUDA tables are not affected. Read at every call.
kernel_on_cpu = False


@dataclass(frozen=True)
class CommitPlan:
    """Tile and grid of one commit launch (:func:`plan_commit`).

    Attributes
    ----------
    elem_bytes : bytes of the element the kernel loads and stores.
    block_w : elements per column chunk (a power of two).
    chunks : column chunks in the longest row.
    even : every row is a whole number of chunks (no column mask).
    num_warps : warps per program.
    tasks : (pair, buffer, chunk) tasks of the launch.
    programs : the grid, at most the program cap; each program loops over its share of ``tasks``.
    """

    elem_bytes: int
    block_w: int
    chunks: int
    even: bool
    num_warps: int
    tasks: int
    programs: int


@functools.lru_cache(maxsize=256)
def plan_commit(pairs: int, row_bytes: tuple[int, ...], align: int, program_cap: int) -> CommitPlan:
    """Chunk width and grid for ``pairs`` (requests x sets) over buffers of ``row_bytes``: the state
    tile (``STATE_COMMIT_TILE``), one pair per task (state rows are kilobytes to megabytes)."""
    elem, vec, row_elems = row_elements(row_bytes, align)
    block_w, chunks, even = column_chunks(row_elems, STATE_COMMIT_TILE.elems)
    tasks = pairs * len(row_bytes) * chunks
    warps = copy_warps(block_w, vec, STATE_COMMIT_TILE.num_warps)
    return CommitPlan(elem, block_w, chunks, even, warps, tasks, max(1, min(tasks, program_cap)))


#: The kernel's parameters in order (direct launches pass them all positionally).
PARAMS = (
    "dst_table_ptr", "src_table_ptr", "slots_ptr", "steps_ptr", "track_slots_ptr", "track_steps_ptr", "bs",
    "num_steps", "dst_rows", "src_rows", "slots_stride", "steps_stride", "track_slots_stride",
    "track_steps_stride", "dst_table_stride", "src_table_stride", "buffers", "chunks", "n_tasks",
    "ELEM_BYTES", "ALIGN", "BLOCK_W", "EVEN", "HAS_TRACK",
)  # fmt: skip

#: Compiled commit kernels by launch key (CUDA): an eager verify step's commit skips the JIT's
#: per-call binding after the first launch of its kind.
LAUNCHES = DirectLaunches("state commit kernel", kernel is not None and kernel_params(kernel.commit_rows) == PARAMS)


def launch_commit_rows(
    dst: RowTable,
    src: RowTable,
    num_steps: int,
    slots: torch.Tensor,
    steps: torch.Tensor,
    track_slots: Optional[torch.Tensor] = None,
    track_steps: Optional[torch.Tensor] = None,
) -> None:
    """Launch the kernel once on the current stream of the tables' device. Unchecked: the tables must
    hold the same buffers' row sizes in the same order on one device, and the index tensors be 1-D
    int32/int64 of one length on it. After the first launch of a kind (its
    :func:`~kvpool.kernels.launch.launch_key`), later ones go straight to the compiled kernel."""
    bs = slots.shape[0]
    if bs == 0:
        return
    has_track = track_slots is not None
    align = min(dst.align, src.align)
    plan = plan_commit(bs * (2 if has_track else 1), dst.row_bytes, align, sm_count(dst.device) * PROGRAMS_PER_SM)
    ts = track_slots if has_track else slots
    tst = track_steps if has_track else steps
    tensors = (dst.table, src.table, slots, steps, ts, tst)
    ints = (
        bs, num_steps, dst.rows, src.rows, slots.stride(0), steps.stride(0), ts.stride(0), tst.stride(0),
        dst.table.stride(0), src.table.stride(0), len(dst), plan.chunks, plan.tasks,
    )  # fmt: skip
    args = tensors + ints
    constexprs = (plan.elem_bytes, align, plan.block_w, plan.even, has_track)
    key = launch_key(dst.device.index, constexprs, (plan.num_warps,), tensors, ints) if LAUNCHES.enabled else None
    LAUNCHES.launch(key, (plan.programs, 1, 1), args + constexprs, lambda: _jit_launch(plan, constexprs, args), dst.device)


def _jit_launch(plan: CommitPlan, constexprs: tuple, args: tuple):
    """Launch through Triton's JIT (compiling on first use) on the current device and stream; returns
    the compiled kernel (None under the interpreter)."""
    consts = dict(zip(PARAMS[len(args) :], constexprs))
    return kernel.commit_rows[(plan.programs,)](*args, **consts, num_warps=plan.num_warps)  # type: ignore[union-attr]


def commit_rows(
    dst: RowTable,
    src: RowTable,
    num_steps: int,
    slots: torch.Tensor,
    steps: torch.Tensor,
    track_slots: Optional[torch.Tensor] = None,
    track_steps: Optional[torch.Tensor] = None,
) -> None:
    """For every buffer ``b`` and request ``i`` with ``1 <= steps[i] <= num_steps``: row ``slots[i]``
    of ``dst.buffers[b]`` becomes a byte copy of row ``i * num_steps + steps[i] - 1`` of
    ``src.buffers[b]``; likewise for ``(track_slots, track_steps)`` when given. Unchecked (the
    caller checks its arguments); the kernel on CUDA, :func:`commit_rows_reference` elsewhere."""
    if uses_kernel(dst.device, kernel_on_cpu):
        launch_commit_rows(dst, src, num_steps, slots, steps, track_slots, track_steps)
    else:
        commit_rows_reference(dst, src, num_steps, slots, steps, track_slots, track_steps)
