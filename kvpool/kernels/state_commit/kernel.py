"""The speculative-state commit as Triton device code only (the launcher is ``launcher.py``).

One launch copies, for every buffer ``b`` of two row tables (a pool's states and its per-draft-step
scratch, the same buffer order) and every request ``i`` of a batch, scratch row ``i * K + steps[i]
- 1`` of source buffer ``b`` into row ``slots[i]`` of destination buffer ``b``, when ``1 <= steps[i]
<= K``. The step count is read on the device, so the host never waits for the verify step. An
optional second set of ``(slots, steps)`` (track slots) rides in the same launch: pair ``p`` of the
grid is request ``p`` of the first set or request ``p - bs`` of the second.

Work is cut as in the row copy's kernel (``copy_rows/kernel.py``): a task is one ``BLOCK_W``-element
column chunk of one buffer's row for one pair; task ``t`` is chunk ``t % chunks`` of buffer
``(t // chunks) % buffers`` for pair ``t // (chunks * buffers)``, and each program loops over tasks
``pid, pid + programs, ...``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Row starts as pointers with the launcher's alignment hint: the row copy's own helper.
from kvpool.kernels.copy_rows.kernel import row_pointers


@triton.jit
def commit_rows(
    dst_table_ptr,  # int64 [3, dst_table_stride]: base address, row stride (bytes), row bytes per buffer
    src_table_ptr,  # int64 [3, src_table_stride]: the same for the scratch buffers (rows: requests x K)
    slots_ptr,  # int32/int64 [bs] (stride slots_stride): destination rows of the first set
    steps_ptr,  # int32/int64 [bs] (stride steps_stride): steps kept per request, 0 = none
    track_slots_ptr,  # int32/int64 [bs]: destination rows of the second set (HAS_TRACK only)
    track_steps_ptr,  # int32/int64 [bs]: steps of the second set (HAS_TRACK only)
    bs,
    num_steps,
    dst_rows,
    src_rows,
    slots_stride,
    steps_stride,
    track_slots_stride,
    track_steps_stride,
    dst_table_stride,
    src_table_stride,
    buffers,
    chunks,
    n_tasks,
    ELEM_BYTES: tl.constexpr,  # 4 (int32) on 4-byte aligned tables, else 2 or 1
    ALIGN: tl.constexpr,  # bytes dividing every base address, row stride and row size (<= 16)
    BLOCK_W: tl.constexpr,
    EVEN: tl.constexpr,  # every buffer's row is a whole number of BLOCK_W chunks: no column mask
    HAS_TRACK: tl.constexpr,
):
    """Copy, per request, the scratch row of its last accepted step into its state row (and its
    track row), every buffer of the tables; a request that kept 0 steps, or whose slot is out of
    range, is skipped."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for task in range(pid, n_tasks, programs):
        chunk = task % chunks
        rest = task // chunks
        b = rest % buffers
        pair = (rest // buffers).to(tl.int64)
        i = pair
        if HAS_TRACK:
            if pair >= bs:
                i = pair - bs
                d = tl.load(track_slots_ptr + i * track_slots_stride).to(tl.int64)
                s = tl.load(track_steps_ptr + i * track_steps_stride).to(tl.int64)
            else:
                d = tl.load(slots_ptr + i * slots_stride).to(tl.int64)
                s = tl.load(steps_ptr + i * steps_stride).to(tl.int64)
        else:
            d = tl.load(slots_ptr + i * slots_stride).to(tl.int64)
            s = tl.load(steps_ptr + i * steps_stride).to(tl.int64)
        src_row = i * num_steps + s - 1
        row_bytes = tl.load(src_table_ptr + 2 * src_table_stride + b)
        row_elems = tl.multiple_of(row_bytes // ELEM_BYTES, ALIGN // ELEM_BYTES)
        col0 = chunk * BLOCK_W
        # Steps outside 1..K and rows outside either table are skipped: never read, never written.
        ok = (s >= 1) & (s <= num_steps) & (d >= 0) & (d < dst_rows) & (src_row < src_rows)
        if ok & (col0 < row_elems):
            d_row = row_pointers(
                tl.load(dst_table_ptr + b), d, tl.load(dst_table_ptr + dst_table_stride + b), ELEM_BYTES, ALIGN
            )
            s_row = row_pointers(
                tl.load(src_table_ptr + b), src_row, tl.load(src_table_ptr + src_table_stride + b), ELEM_BYTES, ALIGN
            )
            cols = col0 + tl.arange(0, BLOCK_W)
            if EVEN:
                tl.store(d_row + cols, tl.load(s_row + cols))
            else:
                mask = cols < row_elems
                tl.store(d_row + cols, tl.load(s_row + cols, mask=mask), mask=mask)
