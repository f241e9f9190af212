"""A write to a slot outside the cache touches no byte outside it, on every path.

Nothing but the write's own range check stands between a slot of -1 (or ``rows``) and the memory
just before the cache's first row (or after its last): a pool's layer buffers are separate
allocations with no guard rows around them. Here the caches are views into larger buffers whose
first and last rows are guard rows, so a write that lands one row off changes a guard row (which
the test sees) instead of memory it does not own (which would only show up as a crash).
"""

from __future__ import annotations

import pytest
import torch

from kvassert import CACHE_DTYPES, DEVICE, bits, fused_runs, id_of, poison_
from kvpool import fused_fp8_set_kv_buffer, reference_set_kv_buffer

ROWS, HEADS, DIM = 6, 1, 16
#: Just outside the cache on both sides, then the cache's own first and last rows.
SLOTS = [-1, ROWS, -2, ROWS + 1, 0, ROWS - 1]
WRITES = [fused_fp8_set_kv_buffer, reference_set_kv_buffer]


def _guarded(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer of ROWS + 4 poisoned rows, the cache: its rows 2 .. ROWS + 1)."""
    buffer = poison_(torch.empty(ROWS + 4, HEADS, DIM, dtype=dtype, device=DEVICE))
    return buffer, buffer[2 : ROWS + 2]


@fused_runs
@pytest.mark.parametrize("write", WRITES, ids=id_of)
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=id_of)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=id_of)
def test_slots_outside_the_cache_leave_the_rows_around_it_unchanged(cache_dtype, loc_dtype, write):
    k_buffer, k_cache = _guarded(cache_dtype)
    v_buffer, v_cache = _guarded(cache_dtype)
    before_k, before_v = bits(k_buffer).clone(), bits(v_buffer).clone()
    x = torch.linspace(-3.0, 3.0, len(SLOTS) * HEADS * DIM, device=DEVICE).reshape(len(SLOTS), HEADS, DIM)
    loc = torch.tensor(SLOTS, dtype=loc_dtype, device=DEVICE)
    write(x, x, k_cache, v_cache, loc, 0.5, 0.5)
    written = {2, ROWS + 1}  # buffer rows of the cache's rows 0 and ROWS - 1
    for name, buffer, before in (("K", k_buffer, before_k), ("V", v_buffer, before_v)):
        after = bits(buffer)
        for row in range(ROWS + 4):
            changed = not torch.equal(after[row], before[row])
            if row in written:
                assert changed, f"{name}: cache row {row - 2} (slot {row - 2}) was not written"
            else:
                assert not changed, f"{name}: buffer row {row} (cache row {row - 2}) changed"
