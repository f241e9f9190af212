"""The disaggregation example (``examples/disagg_sim.py``) on the CPU: it checks every byte it moves,
hybrid states included.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --- the example ---------------------------------------------------------------------------------------------


def _disagg_sim(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "disagg_sim.py"), "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_disagg_sim_example_checks_every_byte():
    run = _disagg_sim("--requests", "10")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS" in run.stdout and "GB/s" in run.stdout, run.stdout
    bad = _disagg_sim("--requests", "3", "--corrupt")
    assert bad.returncode == 1 and "FAILED: 1 tokens differ on arrival" in bad.stdout, bad.stdout + bad.stderr


def test_disagg_sim_example_moves_hybrid_states_and_checks_them():
    run = _disagg_sim("--model", "qwen3.5", "--requests", "6", "--decode-page-size", "4")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS" in run.stdout and "6 states x 6 linear layers byte-equal on arrival" in run.stdout, run.stdout
    bad = _disagg_sim("--model", "qwen3.5", "--requests", "2", "--corrupt")
    assert bad.returncode == 1 and "0 tokens differ on arrival" in bad.stdout, bad.stdout + bad.stderr
    assert "1 states differ on arrival" in bad.stdout and "linear layer" in bad.stdout, bad.stdout
