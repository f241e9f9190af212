"""Row copies over tables of buffers, as Triton device code only (the launcher is ``launcher.py``).

One launch copies, for every buffer ``b`` of a table and every pair ``i``, row ``dst_index[i]`` of
destination buffer ``b`` from row ``src_index[i]`` of source buffer ``b``. Buffers are named by their
base address in an int64 table (``tl.load(...).to(pointer)``), so a table may mix device buffers and
pinned host buffers (reached through unified addressing), and the buffers of a model's layers need
no common tensor.

Work is cut into tasks: a task is one block of ``BLOCK_P`` pairs x one block of ``BLOCK_W`` elements
(a column chunk) of one buffer's rows. Task ``t`` is chunk ``t % chunks`` of buffer
``(t // chunks) % buffers`` for pair block ``t // (chunks * buffers)``, so programs that run at the
same time work on neighbouring bytes. Each program loops over tasks ``pid, pid + programs, ...``: the
grid is capped independently of the pair count (a host-tier copy runs on a few SMs).

``ONE_PASS``: every pair is in the single pair block, so each (buffer, column chunk) belongs to
exactly one program, which loads the source bytes of all pairs, waits at a barrier until every
thread of the program has its values, and only then stores. Programs own disjoint byte columns, so
a destination row that is also a source row (a move inside one pool) is read before it is written,
whichever pairs chain or cycle through it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_pointers(base, index, stride, ELEM_BYTES: tl.constexpr, ALIGN: tl.constexpr):
    """Row starts ``base + index * stride`` (bytes) as pointers to the element moved. The compiler
    cannot know the alignment of an address read from memory; the launcher guarantees ALIGN divides
    every base, stride and row size, and the hint lets it issue ALIGN-byte vector accesses."""
    addr = base + index * stride
    if ELEM_BYTES == 4:
        ptr = addr.to(tl.pointer_type(tl.int32))
    elif ELEM_BYTES == 2:
        ptr = addr.to(tl.pointer_type(tl.int16))
    else:
        ptr = addr.to(tl.pointer_type(tl.uint8))
    return tl.multiple_of(ptr, [ALIGN])


@triton.jit
def copy_rows(
    dst_table_ptr,  # int64 [3, dst_table_stride]: row 0 base address, row 1 row stride (bytes), row 2 row bytes
    src_table_ptr,  # int64 [3, src_table_stride]: same, for the source buffers
    dst_index_ptr,  # int32/int64 [n_pairs] (stride dst_index_stride): destination rows
    src_index_ptr,  # int32/int64 [n_pairs] (stride src_index_stride): source rows
    n_pairs,
    dst_rows,
    src_rows,
    dst_index_stride,
    src_index_stride,
    dst_table_stride,
    src_table_stride,
    buffers,
    chunks,
    n_tasks,
    ELEM_BYTES: tl.constexpr,  # size of the element moved: 4 (int32) on 4-byte aligned tables, else 2 or 1
    ALIGN: tl.constexpr,  # bytes dividing every base address, row stride and row size (<= 16)
    BLOCK_P: tl.constexpr,
    BLOCK_W: tl.constexpr,
    EVEN: tl.constexpr,  # every buffer's row is a whole number of BLOCK_W chunks: no column mask
    ONE_PASS: tl.constexpr,
):
    """Copy rows between buffers named by address tables: program p copies its share of the (dst, src)
    row pairs, every buffer of the tables, skipping entries outside each buffer's rows."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    VEC: tl.constexpr = ALIGN // ELEM_BYTES
    for task in range(pid, n_tasks, programs):
        chunk = task % chunks
        rest = task // chunks
        b = rest % buffers
        pair_block = rest // buffers
        row_bytes = tl.load(src_table_ptr + 2 * src_table_stride + b)
        row_elems = tl.multiple_of(row_bytes // ELEM_BYTES, VEC)
        col0 = chunk * BLOCK_W
        # Buffers with shorter rows than the longest have empty trailing chunks.
        if col0 < row_elems:
            pairs = pair_block * BLOCK_P + tl.arange(0, BLOCK_P)
            in_range = pairs < n_pairs
            p64 = pairs.to(tl.int64)
            di = tl.load(dst_index_ptr + p64 * dst_index_stride, mask=in_range, other=-1).to(tl.int64)
            si = tl.load(src_index_ptr + p64 * src_index_stride, mask=in_range, other=-1).to(tl.int64)
            # Negative and out-of-range rows, on either side, are skipped: never read, never written.
            ok = (di >= 0) & (di < dst_rows) & (si >= 0) & (si < src_rows)

            d_base = tl.load(dst_table_ptr + b)
            d_stride = tl.load(dst_table_ptr + dst_table_stride + b)
            s_base = tl.load(src_table_ptr + b)
            s_stride = tl.load(src_table_ptr + src_table_stride + b)
            d_row = row_pointers(d_base, di, d_stride, ELEM_BYTES, ALIGN)  # [BLOCK_P]
            s_row = row_pointers(s_base, si, s_stride, ELEM_BYTES, ALIGN)

            cols = col0 + tl.arange(0, BLOCK_W)
            mask = ok[:, None]
            if not EVEN:
                mask = mask & (cols < row_elems)[None, :]
            x = tl.load(s_row[:, None] + cols[None, :], mask=mask)
            if ONE_PASS:
                # Every thread of the program holds its sources before any thread stores.
                tl.debug_barrier()
            tl.store(d_row[:, None] + cols[None, :], x, mask=mask)
