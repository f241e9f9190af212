"""The benchmarks' CPU smoke runs: every script in benchmarks/ runs its ``--cpu-smoke`` mode to the
end and writes its report (JSON, Markdown with the run's environment and command, and the PNG
where matplotlib is installed), and ``benchmarks/report.py`` draws the same Markdown again from the
JSON. The figures of a smoke run measure nothing; these tests check the scripts against the library.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

SMOKES = {  # script: (extra arguments, report name)
    "bench_write.py": (["--sections", "host,write,moves,swa,plans,formats"], "write"),
    "bench_mla.py": ([], "mla"),
    "bench_host_tier.py": ([], "host-tier"),
    "bench_runner.py": (["--model", "llama"], "runner-llama"),
    "bench_runner.py qwen3.5": (["--model", "qwen3.5"], "runner-qwen3.5"),
    "bench_first_call.py": ([], "first-call"),
    "bench_state.py": ([], "state"),
    "bench_prefix_cache.py": ([], "prefix-cache"),
    "bench_allocators.py": ([], "allocators"),
    # The file backend, and the Mooncake backend where Mooncake Store is installed (a skip otherwise).
    "bench_storage.py": ([], "storage"),
    # Time to first token from storage against recomputing, the Llama runner's tiny shape (and Qwen3.5's,
    # a skip saying why while its cache takes no storage tier).
    "bench_storage.py ttft": (["--backends", "none", "--ttft", "llama,qwen3.5"], "storage"),
    # Two ranks over gloo on CPU pools; the staged path alone (the direct path needs CUDA pools).
    "bench_transfer.py": (["--paths", "staged"], "transfer"),
}


def run(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SMOKES))
def test_cpu_smoke_run_writes_its_report(case, tmp_path):
    script = case.split()[0]
    extra, name = SMOKES[case]
    out = run([f"benchmarks/{script}", "--cpu-smoke", "--out", str(tmp_path), *extra])
    assert out.returncode == 0, f"{case} exited {out.returncode}:\n{out.stderr[-4000:]}"
    result = json.loads((tmp_path / f"{name}.json").read_text())
    meta = result["meta"]
    assert meta["smoke"] is True and meta["partial"] is False
    assert meta["command"].startswith(f"python benchmarks/{script} --cpu-smoke")
    assert not result["errors"], result["errors"]
    assert [k for k in ("date", "gpu", "driver", "torch", "triton", "python", "commit") if not meta.get(k)] == []
    md = (tmp_path / f"{name}.md").read_text()
    assert "CPU smoke run" in md and meta["command"] in md and f"torch {meta['torch']}" in md
    assert "|" in md, "a report has at least one table"
    if HAS_MATPLOTLIB:
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    # The same Markdown again from the JSON alone.
    again = tmp_path / "again"
    again.mkdir()
    redraw = run(["benchmarks/report.py", str(tmp_path / f"{name}.json"), "--out", str(again)])
    assert redraw.returncode == 0, redraw.stderr[-4000:]
    assert (again / f"{name}.md").read_text() == md


def test_a_benchmark_without_a_gpu_says_so():
    out = run(["benchmarks/bench_write.py", "--out", "/nonexistent"], timeout=300)
    if "no CUDA device" not in out.stderr:
        pytest.skip("a CUDA device is present")
    assert out.returncode == 2 and "--cpu-smoke" in out.stderr
