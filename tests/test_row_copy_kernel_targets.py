"""The row-copy kernel compiled for real GPU targets on a machine without one: it compiles for every
target, and its builds keep the vector widths, barriers and wide tasks its speed depends on.
"""

from __future__ import annotations

import pytest

from kvassert import cross_compile


# --- the row-copy kernel compiled for real GPU targets --------------------------------------------
# Its Hopper build moves rows in 16-byte vectors (8-byte ones when that is all the tables' alignment
# allows), with the one-pass plans' barrier between loads and stores.


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return cross_compile("--copy-rows")


def _one(compiled, **match):
    [v] = [v for v in compiled if all(v[k] == x for k, x in match.items())]
    return v


def test_the_row_copy_kernel_compiles_for_every_target(compiled):
    assert {v["target"] for v in compiled} == {"sm90", "sm100", "sm80", "gfx942"}
    assert len(compiled) == 10


def test_aligned_rows_move_in_16_byte_vectors_only(compiled):
    for v in compiled:
        if v["target"] in ("sm90", "sm100", "sm80") and v["align"] == 16:
            # Every data access is a v4: per thread, as many vector loads as stores, and the only
            # scalar loads are the indices and the table entries.
            assert v["ld_v4"] > 0 and v["ld_v4"] == v["st_v4"] == v["st"], v
            assert v["ld_v2"] == v["st_v2"] == 0, v


def test_eight_byte_alignment_gives_8_byte_vectors(compiled):
    v = _one(compiled, target="sm90", align=8)
    assert v["ld_v2"] > 0 and v["ld_v2"] == v["st_v2"] == v["st"] and v["ld_v4"] == 0


def test_one_pass_plans_have_a_barrier_and_streaming_plans_none(compiled):
    for v in compiled:
        if "bar_sync" not in v:
            continue  # AMD: no PTX to inspect
        if v["one_pass"]:
            assert v["bar_sync"] >= 1, v
        else:
            assert v["bar_sync"] == 0, v


def test_host_tier_plan_uses_wide_tasks(compiled):
    v = _one(compiled, target="sm90", few_programs=True)
    assert v["num_warps"] == 16 and v["block_p"] * v["block_w"] == 16384
