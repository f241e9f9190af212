"""The benchmarks' shared report: the run's environment, progress on stderr, a time budget, and the
JSON + Markdown + PNG written under ``--out`` after every finished case (a run cut short still
leaves a report).

Every benchmark script builds one :class:`Report` from its parsed arguments and hands it a
``markdown(result) -> str`` body and a ``plot(result, fig)`` drawer, both reading only the result
dictionary, so a saved run can be drawn again:

    python benchmarks/report.py RUN/write.json [--out DIR]     (rewrites RUN/write.md and .png)

Each report names the GPU, its driver, torch (with its CUDA), Triton, Python, the commit, the date
and the command. The PNG needs matplotlib (``pip install kvpool[bench]``); without it the JSON and
Markdown are written and the plot is skipped with a note on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SMOKE_FLAGS = ("--cpu-smoke", "--dry-run")


def interpret_if_smoke(argv: Optional[list[str]] = None) -> bool:
    """A smoke run executes the Triton kernels through the interpreter, which must be switched on
    before any ``@triton.jit`` function is defined: call this before importing kvpool or peers."""
    smoke = any(flag in (sys.argv[1:] if argv is None else argv) for flag in SMOKE_FLAGS)
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return smoke


def add_common_arguments(parser: argparse.ArgumentParser, name: str, budget_s: Optional[float] = None) -> None:
    """``--out``, ``--name``, ``--budget-s`` and ``--cpu-smoke`` (alias ``--dry-run``), the same in every benchmark."""
    parser.add_argument("--out", default="bench_out", help="directory for NAME.json, NAME.md and NAME.png")
    parser.add_argument("--name", default=name, help=f"file name of the report (default: {name})")
    parser.add_argument("--budget-s", type=float, default=budget_s,
                        help="skip the cases left after this many seconds (reported as skipped)"
                        + (f"; default {budget_s:g}" if budget_s else ""))  # fmt: skip
    parser.add_argument(*SMOKE_FLAGS, dest="cpu_smoke", action="store_true",
                        help="run every code path on the CPU at toy sizes: checks the script, measures nothing")  # fmt: skip


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    sha = _run(["git", "rev-parse", "--short", "HEAD"])
    if not sha:
        return "unknown (no git repository here)"
    return sha + (" (with uncommitted changes)" if _run(["git", "status", "--porcelain", "--untracked-files=no"]) else "")


def source_digest() -> str:
    """sha256 (12 hex digits) of kvpool/ and benchmarks/ ``*.py``: names the code measured even where
    the run's copy of the tree has no .git."""
    h = hashlib.sha256()
    for top in ("kvpool", "benchmarks"):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(ROOT, top))):
            dirnames.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    h.update(os.path.relpath(path, ROOT).encode())
                    with open(path, "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()[:12]


def environment(smoke: bool) -> dict:
    """The GPU, driver, torch (and its CUDA), Triton, Python, commit and date of this run."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    gpu = driver = "none"
    if not smoke and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()[:1]
        driver = driver[0] if driver else "unknown"
    elif smoke:
        gpu = f"none (CPU smoke run on {platform.processor() or platform.machine()})"
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu,
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": git_commit(),
        "source_sha256": source_digest(),
        "smoke": smoke,
    }


def header(meta: dict, title: str) -> list[str]:
    """The lines every report opens with."""
    out = [f"# {title}", ""]
    if meta.get("smoke") or meta.get("dry_run"):
        out += ["**CPU smoke run: every figure below is a host time of toy sizes on the CPU, not a measurement.**", ""]
    if meta.get("partial"):
        out += ["**Partial: the run did not finish (this is its last checkpoint).**", ""]
    gpu = meta.get("gpu") or meta.get("device_name") or meta.get("device") or "unknown"
    machine = f"CPU: {meta['cpu']}" if meta.get("cpu") else f"GPU: {gpu}, driver {meta.get('driver', 'unknown')}"
    out += [
        f"{machine}; torch {meta.get('torch')} (CUDA {meta.get('cuda', 'unknown')}), "
        f"Triton {meta.get('triton', 'unknown')}, Python {meta.get('python', 'unknown')}  ",
        f"Date: {meta.get('date')}; commit {meta.get('commit', 'unknown')}"
        + (f" (source sha256 {meta['source_sha256']})" if meta.get("source_sha256") else "") + "  ",
        f"Command: `{meta.get('command', '')}`",
        "",
    ]
    return out


class Report:
    """One run's result dictionary and its files ``OUT/NAME.{json,md,png}``.

    ``result["meta"]`` holds the environment, the command and the benchmark's name; the rest is the
    benchmark's own. ``log`` prints progress to stderr; ``over_budget(what)`` is True (and lists
    ``what`` as skipped) once ``--budget-s`` seconds have passed; ``save()`` writes the JSON and the
    Markdown (call it after each case), ``save(final=True)`` also the PNG.
    """

    def __init__(self, args: argparse.Namespace, benchmark: str, title: str,
                 markdown: Callable[[dict], str], plot: Optional[Callable[[dict, Any], None]] = None) -> None:  # fmt: skip
        self.out, self.name, self.title = args.out, args.name, title
        self.budget_s = args.budget_s
        self.markdown_body, self.plot_body = markdown, plot
        self.start = time.perf_counter()
        meta = environment(args.cpu_smoke)
        meta.update(benchmark=benchmark, title=title, command=command_line(benchmark, sys.argv[1:]))
        self.result: dict = {"meta": meta, "skipped": [], "errors": {}}
        os.makedirs(self.out, exist_ok=True)
        self.log(f"{meta['gpu']}, driver {meta['driver']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}")

    @property
    def meta(self) -> dict:
        return self.result["meta"]

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, msg: str) -> None:
        print(f"[{self.name}] {msg}", file=sys.stderr, flush=True)

    def over_budget(self, what: str) -> bool:
        if self.budget_s is None or self.elapsed() <= self.budget_s:
            return False
        self.result["skipped"].append(f"{what}: time budget of {self.budget_s:g} s spent")
        self.log(f"skipped {what}: time budget spent")
        return True

    def error(self, what: str, exc: BaseException) -> None:
        """A failed case: reported in the result and on stderr; the run goes on."""
        self.result["errors"][what] = short_error(exc)
        self.log(f"{what} failed: {short_error(exc)}")

    def path(self, ext: str) -> str:
        return os.path.join(self.out, f"{self.name}.{ext}")

    def save(self, final: bool = False) -> None:
        self.meta["partial"] = not final
        self.meta["elapsed_s"] = round(self.elapsed(), 1)
        with open(self.path("json"), "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        with open(self.path("md"), "w") as f:
            f.write(render_markdown(self.result, self.markdown_body))
        if final:
            if self.plot_body is not None:
                draw(self.result, self.plot_body, self.path("png"), self.log)
            self.log(f"done in {self.elapsed():.0f} s: {self.path('json')}, {self.path('md')}")


def command_line(benchmark: str, argv: list[str]) -> str:
    """The command that ran, with the output directory spelled DIR (where the files went is not part
    of what was measured)."""
    args, out = list(argv), []
    while args:
        a = args.pop(0)
        if a == "--out" and args:
            args.pop(0)
            a = "--out DIR"
        elif a.startswith("--out="):
            a = "--out DIR"
        out.append(a)
    return " ".join(["python", f"benchmarks/{benchmark}.py", *out])


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def render_markdown(result: dict, body: Callable[[dict], str]) -> str:
    meta = result.get("meta", {})
    lines = header(meta, meta.get("title", meta.get("benchmark", "benchmark")))
    text = "\n".join(lines) + "\n" + body(result).rstrip() + "\n"
    problems = [f"- {k}: {v}" for k, v in result.get("errors", {}).items()] + [f"- skipped {s}" for s in result.get("skipped", [])]
    if problems:
        text += "\n## Errors and skips\n\n" + "\n".join(problems) + "\n"
    return text


def draw(result: dict, body: Callable[[dict, Any], None], path: str, log: Callable[[str], None] = print) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed (pip install kvpool[bench]): no plot")
        return
    fig = plt.figure(figsize=(11, 4.8))
    try:
        body(result, fig)
        meta = result.get("meta", {})
        gpu = f"CPU: {meta['cpu']}" if meta.get("cpu") else meta.get("gpu") or meta.get("device_name") or meta.get("device")
        fig.text(0.99, 0.005, f"{gpu}, torch {meta.get('torch')}, Triton {meta.get('triton')}, {meta.get('date')}",
                 ha="right", va="bottom", fontsize=7, color="0.4")  # fmt: skip
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(path, dpi=100)
    except Exception as exc:  # a plot must never lose the report
        log(f"plot failed: {short_error(exc)}")
    finally:
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="a report's JSON, written by one of the benchmarks")
    parser.add_argument("--out", help="directory for the Markdown and the PNG (default: the JSON's)")
    args = parser.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    benchmark = result.get("meta", {}).get("benchmark")
    if not benchmark:
        parser.error(f"{args.json} names no benchmark (meta.benchmark)")
    sys.path.insert(0, HERE)
    module = importlib.import_module(benchmark)
    stem = os.path.splitext(os.path.basename(args.json))[0]
    out = args.out or os.path.dirname(os.path.abspath(args.json))
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(render_markdown(result, module.markdown))
    if getattr(module, "plot", None) is not None:
        draw(result, module.plot, os.path.join(out, f"{stem}.png"))
    print(f"{out}/{stem}.md" + (" and .png" if getattr(module, "plot", None) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
