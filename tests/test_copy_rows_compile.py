"""The row-copy kernel compiles for real GPU targets on this CPU-only machine, and its Hopper build
moves rows in 16-byte vectors (8-byte ones when that is all the tables' alignment allows), with the
one-pass plans' barrier between loads and stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cross_compile.py"), "--copy-rows"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _one(compiled, **match):
    [v] = [v for v in compiled if all(v[k] == x for k, x in match.items())]
    return v


def test_every_target_compiles(compiled):
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
