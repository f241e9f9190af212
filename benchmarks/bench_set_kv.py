"""The K/V write on a GPU: kvpool against the alternatives and the ceiling, in one process, in one command.

Sections (each written to bench.json and bench.md as soon as it is done, so a run cut short still
leaves a report):

1. Copy ceiling: a 2 GiB device-to-device ``copy_`` (start and end of the run).
2. ``host``: host time of one eager write, T=1, H=1, D=128: ``set_kv_buffer``, the pool's writer
   (``KVWriter.write``) called directly, Triton's JIT launch and a hand launch of the compiled kernel
   the writer launches (with the arguments it passes, recorded from its direct launch), and a
   one-kernel torch op as a control; tensor and float scales; calls interleaved, median of runs of
   thousands of calls each. ``set_kv_buffer minus hand launch`` is the write's own host time.
3. ``write``, per model shape and token count: kvpool's fused ``set_kv_buffer``, the same kernel with
   ``div.rn``, kvpool's reference path, SGLang's eager fallback, ``torch.compile`` of an FP8
   ``index_copy_`` write, the textbook design ported to Triton (a program per token and head), and the
   one-program-per-token Triton kernel; plus a copy kernel moving the same bytes and the cast-only
   scatter of the same bytes to the same slots (the ceiling a write can reach), timed the same way.
   Each method's first call is checked against kvpool's bytes and never timed. Also the calibration
   cost (``observe_amax(True)``) and the speculative-decoding verify write
   (``set_kv_buffer_prefix_valid`` against a plain write of all bs x width tokens and a masked one).
4. ``moves``: ``move_kv_cache`` of 1, 16, 256 slots across 32 layers against a per-layer index copy.
5. ``plans`` (not run by default): the plan sweep. For every shape (the main table's, H=8 D=96 and
   DeepSeek-V3's MLA row) and token count, every launch-plan candidate of ``plan_write`` (layouts x
   tiles), the one-program-per-token kernel and the cast-only scatter ceiling; GB/s and % of the
   ceiling for large writes, microseconds per write in a graph at decode sizes. What it reports
   is what the policy in ``kvpool/kernels/store_kv_plan.py`` is chosen from.

How it times (benchmarks/timing.py): device time is the median of CUDA-graph replays, so host launch
cost never enters it; "cold" means a 96 MB L2 flush before every call, its own time subtracted
(how a layer's write meets the cache in a forward pass). Decode sizes and the small sections also
report the time per call in a graph of 64 calls cycling over the layers without a flush, and the
wall time per call of eager calls back to back (host-bound). GB/s counts the bytes docs/contract.md
("How performance is measured") defines.
Inputs are random (never zeros), slots random and distinct. A method that fails is reported and the
run goes on. The targets are evaluated from the figures in ``bench_report.py``.

Usage (on a GPU):  python benchmarks/bench_set_kv.py --out DIR [--quick] [--sections host,write,moves,plans]
       (anywhere): python benchmarks/bench_set_kv.py --out DIR --dry-run [--sections ...]
The dry run executes every section on the CPU with tiny sizes (Triton kernels in the interpreter) and
reports figures that measure nothing; it checks the script, not the kernels' speed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

# A dry run executes the Triton kernels through the interpreter, which must be switched on before any
# @triton.jit function is defined (in peers.py and in kvpool), hence before those imports.
if "--dry-run" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_report  # noqa: E402
import peers  # noqa: E402
from timing import DryClock, GpuClock  # noqa: E402

from kvpool import MHATokenToKVPool, reference_set_kv_buffer  # noqa: E402
from kvpool.config import KernelOptions  # noqa: E402
from kvpool.kernels import store_kv, store_kv_kernel  # noqa: E402
from kvpool.kernels.store_kv import FIXED, PER_CALL, KVWriter  # noqa: E402
from kvpool.kernels.store_kv_checks import FUNCTION_NAMES, POOL_NAMES, Geometry  # noqa: E402
from kvpool.kernels.store_kv_plan import CHUNK, JOINED, PER_HEAD, ROW, ROW_JOINED  # noqa: E402
from kvpool.kernels.tuning import Tile  # noqa: E402

FP8 = torch.float8_e4m3fn
MODELS = bench_report.MODELS
M = bench_report.Method
SCALE = 0.37


@dataclass(frozen=True)
class Plan:
    """What one run measures and how many calls each measurement takes."""

    name: str
    device: str
    tokens: tuple[int, ...]  # token counts of the main table
    large_min: int  # the large-write targets apply from this token count
    decode_max: int  # token counts up to this are decode sizes (graph-of-64 and eager wall times too)
    calib_tokens: tuple[int, ...]
    prefix_models: tuple[str, ...]
    prefix_bs: tuple[int, ...]
    prefix_width: int
    move_slots: tuple[int, ...]
    plan_tokens: tuple[int, ...]  # token counts of the plan sweep (--sections plans)
    slots: int  # per layer, main table and prefix-valid pools
    layers: int  # layers written in turn (graph replays cycle over them, as a model's step does)
    move_layers: int
    move_pool_slots: int
    cold_calls: int  # calls per graph when L2 is flushed before each
    graph_calls: int  # calls per graph without flushes
    wall_calls: int
    wall_runs: int
    host_calls: int
    host_runs: int
    budget_s: float  # past this, remaining measurements are skipped (and reported as skipped)


FULL = Plan(
    "full", "cuda", tokens=(1, 32, 128, 256, 4096, 8192, 16384, 32768), large_min=8192, decode_max=256,
    calib_tokens=(1, 256, 16384), prefix_models=tuple(list(MODELS)[:2]), prefix_bs=(1, 2, 4, 8, 16, 32, 64),
    prefix_width=16, move_slots=(1, 16, 256), plan_tokens=(1, 32, 256, 4096, 16384, 32768), slots=1 << 20, layers=8,
    move_layers=32, move_pool_slots=1 << 17, cold_calls=10, graph_calls=64, wall_calls=400, wall_runs=5, host_calls=3000,
    host_runs=7, budget_s=330,
)  # fmt: skip
QUICK = Plan(
    "quick", "cuda", tokens=(1, 256, 8192, 16384), large_min=8192, decode_max=256,
    calib_tokens=(1, 16384), prefix_models=tuple(list(MODELS)[:1]), prefix_bs=(1, 64),
    prefix_width=16, move_slots=(1, 256), plan_tokens=(1, 256, 16384), slots=1 << 20, layers=8, move_layers=32,
    move_pool_slots=1 << 17, cold_calls=10, graph_calls=64, wall_calls=200, wall_runs=3, host_calls=2000, host_runs=5,
    budget_s=110,
)  # fmt: skip
DRY = Plan(
    "dry-run", "cpu", tokens=(1, 5, 24), large_min=24, decode_max=5,
    calib_tokens=(1, 24), prefix_models=tuple(list(MODELS)[:1]), prefix_bs=(1, 3),
    prefix_width=4, move_slots=(1, 3), plan_tokens=(5,), slots=1 << 10, layers=2, move_layers=32, move_pool_slots=64,
    cold_calls=10, graph_calls=64, wall_calls=400, wall_runs=5, host_calls=5, host_runs=2, budget_s=1e9,
)  # fmt: skip


def log(msg: str) -> None:
    print(msg, flush=True)


def bytes_moved(t: int, h: int, d: int, in_size: int = 2, pool_size: int = 1, loc_size: int = 8) -> int:
    """Bytes a write moves (docs/contract.md, "How performance is measured"): T x (H x D + Hv x Dv) x
    (input + pool element size) + T x loc element size."""
    return t * (h * d + h * d) * (in_size + pool_size) + t * loc_size


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


class Run:
    """State of one run: plan, clock, results, the time budget, and checkpoints to disk."""

    def __init__(self, plan: Plan, clock, out: str, meta: dict) -> None:
        self.plan = plan
        self.clock = clock
        self.out = out
        self.start = time.perf_counter()
        self.result: dict = {
            "meta": meta, "plan": asdict(plan), "records": [], "host": {}, "prefix": [], "moves": {},
            "sections_s": {}, "skipped": [], "partial": True,
        }  # fmt: skip
        self.dev = torch.device(plan.device)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self, what: str) -> bool:
        if self.elapsed() <= self.plan.budget_s:
            return False
        self.result["skipped"].append(f"{what}: time budget of {self.plan.budget_s:.0f} s spent")
        return True

    def section(self, name: str, fn) -> None:
        """Run one section; a failure is reported, never fatal; results are written either way."""
        t0 = time.perf_counter()
        log(f"[bench] {name} (at {self.elapsed():.0f} s)")
        try:
            fn()
        except Exception as exc:  # a broken section must not lose the others
            self.result.setdefault("section_errors", {})[name] = short_error(exc)
            log(f"[bench] {name} failed: {short_error(exc)}")
        self.result["sections_s"][name] = round(time.perf_counter() - t0, 1)
        self.checkpoint()

    def checkpoint(self, final: bool = False) -> None:
        self.result["partial"] = not final
        self.result["meta"]["elapsed_s"] = round(self.elapsed(), 1)
        self.result["targets"] = bench_report.targets(self.result)
        with open(os.path.join(self.out, "bench.json"), "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        with open(os.path.join(self.out, "bench.md"), "w") as f:
            f.write(bench_report.markdown(self.result))

    def randn(self, *shape: int, scale: float = 60.0, gen=None) -> torch.Tensor:
        return (torch.randn(*shape, device=self.dev, generator=gen) * scale).to(torch.bfloat16)

    def slots(self, n: int, rows: int, gen) -> torch.Tensor:
        """n distinct random slots in 1..rows-1 (slot 0 is the padding slot)."""
        return torch.randperm(rows - 1, device=self.dev, generator=gen)[:n] + 1


def kvpool_pool(slots: int, h: int, d: int, layers: int, dev: torch.device) -> MHATokenToKVPool:
    """A pool whose writes must take the fused kernel (``fused="always"`` raises rather than time the
    reference path by mistake; on the CPU it runs the kernel in the interpreter). No warmup: every
    variant a measurement uses is compiled by its untimed first call."""
    return MHATokenToKVPool(slots, 1, FP8, h, d, layers, dev, fused="always", warmup=False)


# --- 1. copy ceiling ---------------------------------------------------------------------------------


def copy_ceiling(run: Run, key: str) -> None:
    gbps = run.clock.copy_ceiling_gbps()
    run.result["meta"][key] = gbps
    log(f"  copy ceiling {gbps:.0f} GB/s")


def same_bytes_copy_gbps(run: Run, nbytes: int) -> float:
    """A copy kernel moving the same bytes as a write (nbytes/2 read, nbytes/2 written), timed like
    the writes (graph replay, L2 flushed): what any kernel of that size can reach."""
    n = max(1, nbytes // 8)
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=run.dev)
    dst = torch.empty_like(src)
    us = run.clock.device_us(lambda i: torch.bitwise_not(src, out=dst), run.plan.cold_calls, cold=True)
    return 8 * n / (us * 1e-6) / 1e9


# --- 2. host time of one eager write -----------------------------------------------------------------


class _Recorder:
    """Stands in for a compiled kernel for one launch: records the grid and the arguments it gets."""

    def __init__(self, real) -> None:
        self.real, self.launches = real, []

    def __getitem__(self, grid):
        def launch(*args):
            self.launches.append((grid, args))
            return self.real[grid](*args)

        return launch


def captured_launch(writer: KVWriter, call) -> tuple:
    """Make ``call`` (one write through ``writer``) until it launches directly, and return what the
    writer launched: (compiled kernel, grid, arguments, its entry). Raises when the writer does not
    launch compiled kernels directly (interpreter, KVPOOL_DIRECT_LAUNCH=0, a failed direct launch)."""
    call()
    call()  # the first goes through Triton's JIT and keeps the compiled kernel; the second launches it
    launches = writer.launches
    if not launches.enabled or not launches.entries:
        raise RuntimeError(f"the writer launches through Triton's JIT (direct launches {'on' if launches.enabled else 'off'})")
    recorders = {entry: _Recorder(compiled) for entry, compiled in launches.entries.items()}
    launches.entries.update(recorders)
    try:
        call()
    finally:
        launches.entries.update({entry: r.real for entry, r in recorders.items()})
    [(entry, rec)] = [(e, r) for e, r in recorders.items() if r.launches]
    grid, args = rec.launches[0]
    return rec.real, grid, args, entry


def host_overhead(run: Run) -> None:
    """Host microseconds of one eager call, T=1, H=1, D=128: set_kv_buffer, the pool's writer called
    directly, Triton's JIT launch and a hand launch of the compiled kernel the writer launches (with
    the arguments it passes), and, as a control, a one-kernel torch op; interleaved, in one run."""
    plan, dev = run.plan, run.dev
    h, d = 1, 128
    pool = kvpool_pool(4096, h, d, 1, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = run.randn(1, h, d, gen=gen)
    loc = torch.tensor([5], device=dev)
    kb, vb = pool.k_buffer[0], pool.v_buffer[0]
    writer = pool._writer
    kernel = store_kv_kernel._store_kv_kernel
    calls: dict = {}
    notes: list = []
    for label, scale in (("tensor scales", torch.tensor([SCALE], device=dev)), ("float scales", SCALE)):

        def pool_call(scale=scale):
            pool.set_kv_buffer(None, loc, x, x, scale, scale, layer_id_override=0)

        calls[f"set_kv_buffer ({label})"] = pool_call
        calls[f"KVWriter.write ({label})"] = lambda s=scale: writer.write(kb, vb, loc, x, x, s, s, POOL_NAMES)
        try:
            compiled, grid, args, entry = captured_launch(writer, pool_call)
            jit_args = args[: len(PER_CALL) + len(FIXED)]
            calls[f"hand launch ({label})"] = lambda c=compiled, g=grid, a=args: c[g](*a)
            calls[f"Triton JIT launch ({label})"] = lambda g=grid, a=jit_args, kw=entry.constexprs: kernel[g](*a, **kw)
        except Exception as exc:
            notes.append(f"hand launch ({label}) unavailable: {short_error(exc)}")
    tiny, out = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    calls["control: torch.add on one element"] = lambda: torch.add(tiny, 1.0, out=out)
    jit_before = writer.jit_launches
    times = interleaved_host_us(run, calls)
    host = {"calls": plan.host_calls, "runs": plan.host_runs, "us": {}, "runs_us": times, "notes": notes}
    for name, runs in times.items():
        host["us"][name] = statistics.median(runs) if runs else None
    for label in ("tensor scales", "float scales"):
        s, hand = host["us"].get(f"set_kv_buffer ({label})"), host["us"].get(f"hand launch ({label})")
        if s is not None and hand is not None:
            host["us"][f"set_kv_buffer minus hand launch ({label})"] = s - hand
    host["jit_launches_while_timed"] = writer.jit_launches - jit_before
    run.result["host"] = host
    log("  host us/call: " + ", ".join(f"{k}={v:.2f}" for k, v in host["us"].items() if v is not None))
    for n in notes:
        log(f"  note: {n}")


def interleaved_host_us(run: Run, calls: dict) -> dict:
    """Host microseconds per call: ``host_runs`` rounds, each timing ``host_calls`` back-to-back calls
    of every function in turn (interleaving spreads host noise over all of them alike). A function
    that raises is dropped and reported."""
    plan, clock = run.plan, run.clock
    alive = {}
    for name, fn in calls.items():
        try:
            for _ in range(50 if not clock.dry else 1):
                fn()
            alive[name] = fn
        except Exception as exc:
            run.result.setdefault("errors", []).append(f"host: {name}: {short_error(exc)}")
    clock.sync()
    times: dict = {name: [] for name in alive}
    for _ in range(plan.host_runs):
        for name, fn in alive.items():
            clock.sync()
            t0 = time.perf_counter()
            for _ in range(plan.host_calls):
                fn()
            times[name].append((time.perf_counter() - t0) / plan.host_calls * 1e6)
    clock.sync()
    return times


# --- 3/4/5. the write --------------------------------------------------------------------------------


def measure(run: Run, rec: dict, fn, t: int, nbytes: int | None, decode: bool) -> None:
    """Cold device time (and GB/s), and for decode sizes the graph-of-N and eager wall times, into rec;
    a failure goes into rec["error"]."""
    plan, clock = run.plan, run.clock
    layers = plan.layers
    try:
        us = clock.device_us(lambda i: fn(i % layers), plan.cold_calls, cold=True)
        rec["device_us"] = us
        if nbytes is not None:
            rec["gbps"] = nbytes / (us * 1e-6) / 1e9
        if decode:
            rec["graph_us"] = clock.device_us(lambda i: fn(i % layers), plan.graph_calls, cold=False)
            rec["wall_us"] = clock.wall_us(lambda i: fn(i % layers), plan.wall_calls, plan.wall_runs)
    except Exception as exc:  # a failing peer is reported, never fatal
        rec["error"] = short_error(exc)


def cast_scatter_ceiling(run: Run, k, v, caches: list, loc, nbytes: int, decode: bool, timer=None) -> dict:
    """The ceiling of a write of ``k``, ``v`` to ``loc``: the cast-only scatter of the same bytes to
    the same slots, best of its tiles, timed by ``timer`` (default ``measure``: cold device time and
    GB/s, and at decode sizes per call in a graph and eager wall time)."""
    timer = timer or (lambda rec, fn: measure(run, rec, fn, k.shape[0], nbytes, decode))
    best: dict = {}
    errors = []
    for block, warps in peers.CAST_SCATTER_TILES:
        rec: dict = {}
        fn = lambda i, b=block, w=warps: peers.cast_scatter(k, v, caches[i][0], caches[i][1], loc, b, w)  # noqa: E731
        if first_call(run, rec, fn):
            timer(rec, fn)
        field = "device_us" if "device_us" in rec else "graph_us"
        if "error" in rec:
            errors.append(rec["error"])
        elif field in rec and rec[field] < best.get(field, float("inf")):
            best = {**rec, "tile": f"{block}/{warps}"}
    return best or {"error": "; ".join(errors) or "not measured"}


def first_call(run: Run, rec: dict, fn, check=None) -> bool:
    """The untimed first call (compilation, lazy allocation) and the agreement check."""
    try:
        fn(0)
        run.clock.sync()
        if check is not None:
            rec["mismatch_frac"] = check()
        return True
    except Exception as exc:
        rec["error"] = short_error(exc)
        return False


def bench_shape(run: Run, name: str, h: int, d: int) -> None:
    plan, dev = run.plan, run.dev
    pool = kvpool_pool(plan.slots, h, d, plan.layers, dev)
    rows = pool.rows
    kb, vb = pool.k_buffer, pool.v_buffer
    kv = [pool.get_kv_buffer(i) for i in range(plan.layers)]
    divrn = KVWriter(
        Geometry(FP8, h, d, h, d, dev), kb[0].stride(), vb[0].stride(), rows, "always",
        options=KernelOptions(fast_div=False), caches_aligned=True,
    )  # fmt: skip
    gen = torch.Generator(device=dev).manual_seed(0)
    scale = torch.tensor([SCALE], device=dev)
    one = torch.tensor([1.0], device=dev)  # SGLang divides its inputs in place: 1.0 keeps them unchanged
    records = run.result["records"]
    for t in plan.tokens:
        if run.over_budget(f"{name} T={t}"):
            continue
        xk, xv = run.randn(t, h, d, gen=gen), run.randn(t, h, d, gen=gen)
        xk_s, xv_s = xk.clone(), xv.clone()
        loc = run.slots(t, rows, gen)
        fns = {
            M.KVPOOL: lambda i: pool.set_kv_buffer(None, loc, xk, xv, scale, scale, layer_id_override=i),
            M.DIVRN: lambda i: divrn.write(kb[i], vb[i], loc, xk, xv, scale, scale, POOL_NAMES),
            M.REFERENCE: lambda i: reference_set_kv_buffer(xk, xv, kv[i][0], kv[i][1], loc, scale, scale),
            M.SGLANG: lambda i: peers.sglang_fallback(xk_s, xv_s, kb[i], vb[i], loc, one, one, FP8),
            M.COMPILE: lambda i: peers.compiled_index_copy(xk, xv, kv[i][0], kv[i][1], loc, scale, scale),
            M.PER_HEAD: lambda i: peers.straightforward_triton(xk, xv, kb[i], vb[i], loc, scale, scale, FP8),
            M.PER_TOKEN: lambda i: peers.per_token_triton(xk, xv, kv[i][0], kv[i][1], loc, scale, scale),
        }
        nbytes = bytes_moved(t, h, d)
        decode = t <= plan.decode_max
        base = {"model": name, "H": h, "D": d, "T": t, "bytes": nbytes}
        try:
            records.append({**base, "method": M.COPY, "gbps": same_bytes_copy_gbps(run, nbytes)})
        except Exception as exc:
            records.append({**base, "method": M.COPY, "error": short_error(exc)})
        records.append({**base, "method": M.CEILING, **cast_scatter_ceiling(run, xk, xv, kv, loc, nbytes, decode)})
        expected: list = []  # kvpool's bytes at loc in layer 0, after its first call

        def mismatch() -> float:
            got = torch.cat([kb[0][loc].reshape(-1), vb[0][loc].reshape(-1)])
            return (got != expected[0]).float().mean().item()

        row = []
        for method, fn in fns.items():
            rec = {**base, "method": method}
            check = mismatch if expected and method not in (M.KVPOOL, M.SGLANG) else None
            if first_call(run, rec, fn, check):
                if method == M.KVPOOL:
                    expected.append(torch.cat([kb[0][loc].reshape(-1), vb[0][loc].reshape(-1)]))
                measure(run, rec, fn, t, nbytes, decode)
            records.append(rec)
            row.append(f"{method}=" + (f"{rec['gbps']:.0f}" if "gbps" in rec else "error"))
        if t in plan.calib_tokens:
            records.append(calibration(run, pool, fns[M.KVPOOL], base, t, nbytes, decode))
            row.append(f"{M.OBSERVE}=" + (f"{records[-1]['gbps']:.0f}" if "gbps" in records[-1] else "error"))
        log(f"  {name} T={t} (GB/s, {run.elapsed():.0f} s): " + ", ".join(row))
        del xk, xv, xk_s, xv_s, loc, fns
    if name in plan.prefix_models:
        prefix_valid(run, pool, name, h, d, gen, scale)
    del pool, kb, vb, kv
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def calibration(run: Run, pool: MHATokenToKVPool, write, base: dict, t: int, nbytes: int, decode: bool) -> dict:
    """Issue 15: the same write while the pool observes per-head maxima (same pool, inputs and slots)."""
    rec = {**base, "method": M.OBSERVE}
    try:
        pool.observe_amax(True)  # the first time, this compiles the observing variants
        if first_call(run, rec, write):
            measure(run, rec, write, t, nbytes, decode)
            if pool.kv_amax is None or not bool(pool.kv_amax.amax() > 0):
                rec["error"] = "observe_amax(True) but no maximum was observed"
    except Exception as exc:
        rec["error"] = short_error(exc)
    finally:
        pool.observe_amax(False)
    return rec


def prefix_valid(run: Run, pool: MHATokenToKVPool, name: str, h: int, d: int, gen, scale) -> None:
    """Issue 11: the verify write at bs x width, against a plain write of the same tokens and against
    masking loc first. Graph device times (cold, and per call in a graph of 64), eager wall times."""
    plan, dev = run.plan, run.dev
    width = plan.prefix_width
    for bs in plan.prefix_bs:
        if run.over_budget(f"prefix-valid {name} bs={bs}"):
            continue
        t = bs * width
        xk, xv = run.randn(t, h, d, gen=gen), run.randn(t, h, d, gen=gen)
        loc_2d = run.slots(t, pool.rows, gen).view(bs, width)
        commit = torch.randint(0, width + 1, (bs,), device=dev, generator=gen)
        committed = int(commit.sum().item())
        fns = {
            M.PREFIX: lambda i: pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, xk, xv, scale, scale, layer_id_override=i),
            M.PREFIX_PLAIN: lambda i: pool.set_kv_buffer(None, loc_2d.view(-1), xk, xv, scale, scale, layer_id_override=i),
            M.PREFIX_MASKED: lambda i: peers.masked_loc_write(pool, i, loc_2d, commit, xk, xv, scale, scale),
        }
        line = []
        for method, fn in fns.items():
            rec = {"model": name, "H": h, "D": d, "bs": bs, "width": width, "committed": committed, "method": method}
            if first_call(run, rec, fn):
                measure(run, rec, fn, t, None, decode=True)
            run.result["prefix"].append(rec)
            line.append(f"{method}=" + (f"{rec['graph_us']:.2f}" if "graph_us" in rec else "error"))
        log(f"  prefix-valid {name} bs={bs} width={width} (us per call in a graph): " + ", ".join(line))


def bench_write(run: Run) -> None:
    for i, (name, (h, d)) in enumerate(MODELS.items()):
        log(f"[bench] shape {i + 1}/{len(MODELS)}: {name}")
        try:
            bench_shape(run, name, h, d)
        except Exception as exc:  # e.g. the pool does not fit: the other shapes still run
            run.result.setdefault("errors", []).append(f"{name}: {short_error(exc)}")
            log(f"  {name} failed: {short_error(exc)}")
        run.checkpoint()


# --- plans ---------------------------------------------------------------------------------------

#: The shapes of the plan sweep: the main table's, the shape named where the policy trailed the
#: one-program-per-token kernel, and DeepSeek-V3's MLA row (K = the 512 latent values, V = the 64 rotary ones).
PLAN_SHAPES = {**MODELS, "H=8, D=96": (8, 96), "DeepSeek-V3 MLA row (512 + 64)": (1, 512, 1, 64)}
#: The candidates: (layout, tile); tile None means the policy's tiles by token count.
PLAN_CANDIDATES = [
    ("auto", None),
    *((PER_HEAD, Tile(e, w)) for e, w in ((512, 4), (1024, 4), (2048, 4), (4096, 4), (4096, 8))),
    *((JOINED, Tile(e, w)) for e, w in ((1024, 4), (2048, 4), (4096, 8))),
    *((ROW, Tile(e, w)) for e, w in ((1024, 4), (2048, 4), (4096, 4), (4096, 8))),
    *((ROW_JOINED, Tile(e, w)) for e, w in ((512, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8))),
    *((CHUNK, Tile(e, w)) for e, w in ((2048, 4), (4096, 4))),
]
PLAN_CHUNKS = (32, 64)


def plan_measure(run: Run, rec: dict, fn, nbytes: int, decode: bool) -> None:
    """The plan sweep's one figure per call: per write in a graph of graph_calls writes at decode
    sizes, else cold device time and GB/s; a failure goes into rec["error"]."""
    plan, clock = run.plan, run.clock
    try:
        if decode:
            rec["graph_us"] = clock.device_us(lambda i: fn(i % plan.layers), plan.graph_calls, cold=False)
        else:
            us = rec["device_us"] = clock.device_us(lambda i: fn(i % plan.layers), plan.cold_calls, cold=True)
            rec["gbps"] = nbytes / (us * 1e-6) / 1e9
    except Exception as exc:
        rec["error"] = short_error(exc)


def _plan_label(layout: str, tile, chunk: int) -> str:
    size = "policy tiles" if tile is None else f"{tile.elems}/{tile.num_warps}"
    return f"{layout} {size}" + (f" chunk {chunk}" if layout == CHUNK else "")


def plan_sweep(run: Run) -> None:
    """The write's plan candidates against the one-program-per-token port and the cast-only scatter
    ceiling, every shape and token count in one run: large writes cold (GB/s and % of the ceiling),
    decode sizes per write in a graph of graph_calls writes. Each candidate's bytes are checked
    against the policy's first."""
    plan, dev = run.plan, run.dev
    sweep = run.result.setdefault("plans", [])
    shapes = PLAN_SHAPES
    if run.clock.dry:  # every candidate, on two shapes: the interpreter takes seconds per launch
        shapes = {name: shape for name, shape in PLAN_SHAPES.items() if name in ("odd (H=3, D=96)", "DeepSeek-V3 MLA row (512 + 64)")}
    for name, shape in shapes.items():
        mla = len(shape) == 4
        h, d, hv, dv = shape if mla else (*shape, *shape)
        slots = plan.slots
        if mla:  # the two parts of one row buffer, as an MLA pool holds them
            rows = [torch.zeros(slots, 1, d + dv, dtype=torch.uint8, device=dev) for _ in range(plan.layers)]
            stores = [(r[:, :, :d], r[:, :, d:]) for r in rows]
        else:
            stores = [(torch.zeros(slots, h, d, dtype=torch.uint8, device=dev),
                       torch.zeros(slots, hv, dv, dtype=torch.uint8, device=dev)) for _ in range(plan.layers)]  # fmt: skip
        caches = [(a.view(FP8), b.view(FP8)) for a, b in stores]
        gen = torch.Generator(device=dev).manual_seed(3)
        scale = torch.tensor([SCALE], device=dev)
        for t in plan.plan_tokens:
            if run.over_budget(f"plans {name} T={t}"):
                continue
            if mla:
                row = run.randn(t, 1, d + dv, gen=gen)
                k, v = row[:, :, :d], row[:, :, d:]
            else:
                k, v = run.randn(t, h, d, gen=gen), run.randn(t, hv, dv, gen=gen)
            loc = run.slots(t, slots, gen)
            nbytes = t * (h * d + hv * dv) * 3 + t * 8
            decode = t <= plan.decode_max
            base = {"model": name, "T": t, "bytes": nbytes}
            timer = lambda rec, fn: plan_measure(run, rec, fn, nbytes, decode)  # noqa: E731
            line = [cast_scatter_ceiling(run, k.contiguous(), v.contiguous(), caches, loc, nbytes, decode, timer)]
            line[0].update(base, method=M.CEILING)
            expected: list = []

            def exact() -> bool:
                got = torch.cat([stores[0][0][loc].reshape(-1), stores[0][1][loc].reshape(-1)])
                return bool(torch.equal(got, expected[0]))

            seen: dict = {}
            for layout, tile in PLAN_CANDIDATES:
                for chunk in PLAN_CHUNKS if layout == CHUNK else (32,):
                    label = _plan_label(layout, tile, chunk)
                    writers = [store_kv.writer_for(kc, vc, "always", tile=tile, layout=layout, chunk=chunk) for kc, vc in caches[:1]]
                    chosen = writers[0].plan(k.stride(), v.stride(), (2, 2), False, t)
                    rec = {**base, "method": label, "plan": chosen.__dict__}
                    if chosen in seen:  # a candidate this call cannot take falls back to another plan
                        rec["same_plan_as"] = seen[chosen]
                        line.append(rec)
                        continue
                    seen[chosen] = label
                    w = writers[0]
                    fn = lambda i, w=w: w.write(stores[i][0], stores[i][1], loc, k, v, scale, scale, FUNCTION_NAMES)  # noqa: E731
                    if first_call(run, rec, fn):
                        if not expected:
                            expected.append(torch.cat([stores[0][0][loc].reshape(-1), stores[0][1][loc].reshape(-1)]))
                        rec["exact"] = exact()
                        plan_measure(run, rec, fn, nbytes, decode)
                    line.append(rec)
            port = {**base, "method": M.PER_TOKEN}
            fn = lambda i: peers.per_token_triton(k, v, caches[i][0], caches[i][1], loc, scale, scale)  # noqa: E731
            if first_call(run, port, fn):
                plan_measure(run, port, fn, nbytes, decode)
            line.append(port)
            sweep.extend(line)
            log("  plans " + bench_report.plan_line(line, decode))
        del stores, caches
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        run.checkpoint()


# --- 6. moves ----------------------------------------------------------------------------------------


def bench_moves(run: Run) -> None:
    """Issue 11: move_kv_cache across all layers of a 32-layer pool (Llama-3-8B geometry)."""
    plan, dev = run.plan, run.dev
    h, d = MODELS[bench_report.MOVE_MODEL]
    pool = kvpool_pool(plan.move_pool_slots, h, d, plan.move_layers, dev)
    gen = torch.Generator(device=dev).manual_seed(2)
    for buf in (*pool.k_buffer, *pool.v_buffer):  # never move zeros
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device=dev, generator=gen))
    has_move = callable(getattr(pool, "move_kv_cache", None))
    moves: dict = {"model": bench_report.MOVE_MODEL, "layers": plan.move_layers, "records": []}
    if not has_move:
        moves["kvpool_skipped"] = (
            "MHATokenToKVPool has no move_kv_cache in this checkout (it is being written on branch "
            "copyrows); only the per-layer loop was timed"
        )
        log(f"  {moves['kvpool_skipped']}")
    run.result["moves"] = moves
    kb, vb = pool.k_buffer, pool.v_buffer
    row_bytes = h * d * kb[0].element_size()
    for n in plan.move_slots:
        if run.over_budget(f"moves n={n}"):
            continue
        picked = run.slots(2 * n, pool.rows, gen)
        src, tgt = picked[:n], picked[n:]
        fns = {M.MOVE_LOOP: lambda i: peers.per_layer_move(kb, vb, tgt, src)}
        if has_move:
            fns = {M.MOVE: lambda i: pool.move_kv_cache(tgt, src), **fns}
        nbytes = 2 * n * plan.move_layers * 2 * row_bytes  # K and V rows of every layer, read + written
        line = []
        for method, fn in fns.items():
            rec = {"slots": n, "bytes": nbytes, "method": method}
            for buf in (kb[0], vb[-1]):  # fresh targets, so the check sees this method's copy
                buf[tgt] = torch.randint(0, 256, buf[tgt].shape, dtype=torch.uint8, device=dev, generator=gen)

            def check() -> float:
                return max((kb[0][tgt] != kb[0][src]).float().mean().item(), (vb[-1][tgt] != vb[-1][src]).float().mean().item())

            if first_call(run, rec, fn, check):
                # Moves happen once per step, so the cold time is the one that counts; graph and wall too.
                measure(run, rec, fn, n, nbytes, decode=True)
            moves["records"].append(rec)
            line.append(f"{method}=" + (f"{rec['device_us']:.1f} us" if "device_us" in rec else "error"))
        log(f"  move {n} slots x {plan.move_layers} layers (cold device time): " + ", ".join(line))
    del pool, kb, vb
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the write section's pools need the room


# --- run ---------------------------------------------------------------------------------------------


def source_digest() -> str:
    """sha256 (first 12 hex digits) of every kvpool/*.py and benchmarks/*.py file: identifies the code
    measured even where the run's copy of the tree has no .git."""
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


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown (no git repository here)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out", help="directory for bench.json, bench.md, bench.png")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer sizes and calls (under 2 minutes on an H200)")
    mode.add_argument("--dry-run", action="store_true", help="every section on the CPU, tiny sizes, no real timing")
    parser.add_argument("--commit", help="the commit measured, where the tree has no .git (default: git rev-parse)")
    parser.add_argument("--budget-s", type=float, help="skip what remains after this many seconds (default: the plan's)")
    parser.add_argument(
        "--sections", default="host,write,moves",
        help="comma-separated subset of host,write,moves,plans (default: host,write,moves; plans: the plan sweep)",
    )
    args = parser.parse_args()
    plan = DRY if args.dry_run else QUICK if args.quick else FULL
    if args.budget_s is not None:
        plan = Plan(**{**asdict(plan), "budget_s": args.budget_s})
    sections = set(args.sections.split(","))
    if not sections <= {"host", "write", "moves", "plans"}:
        parser.error(f"--sections takes host, write, moves, plans; got {args.sections}")
    if plan.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: this benchmark runs on a GPU (use --dry-run to check the script on the CPU)")
        return 2
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/bench_set_kv.py --out DIR" + " --quick" * args.quick + " --dry-run" * args.dry_run
    command += "".join(f" --{k.replace('_', '-')} {v}" for k, v in (("commit", args.commit), ("budget_s", args.budget_s)) if v)
    command += f" --sections {args.sections}" if args.sections != "host,write,moves" else ""
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if plan.device == "cuda" else f"none (dry run on {platform.processor() or 'CPU'})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": args.commit or git_commit(),
        "source_sha256": source_digest(),
        "command": command,
        "plan": plan.name,
        "dry_run": plan.name == "dry-run",
    }
    log(f"[bench] {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, plan {plan.name}")
    clock = DryClock() if args.dry_run else GpuClock()
    run = Run(plan, clock, args.out, meta)
    run.section("copy ceiling", lambda: copy_ceiling(run, "ceiling_gbps"))
    if "host" in sections:
        run.section("host time", lambda: host_overhead(run))
    # Moves before the long write section: should the time budget run out, issue 11 is still measured.
    if "moves" in sections:
        run.section("moves", lambda: bench_moves(run))
    if "write" in sections:
        run.section("write", lambda: bench_write(run))
    if "plans" in sections:
        run.section("plans", lambda: plan_sweep(run))
    run.section("copy ceiling (end)", lambda: copy_ceiling(run, "ceiling_gbps_end"))
    run.checkpoint(final=True)
    try:
        import matplotlib  # noqa: F401

        bench_report.plot(run.result, os.path.join(args.out, "bench.png"))
    except ImportError:
        log("[bench] matplotlib not installed: no plot")
    except Exception as exc:
        log(f"[bench] plot failed: {short_error(exc)}")
    with open(os.path.join(args.out, "bench.md")) as f:
        print(f.read())
    log(f"[bench] done in {run.elapsed():.0f} s: {args.out}/bench.json, {args.out}/bench.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
