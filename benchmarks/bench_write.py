"""The K/V write on a GPU: kvpool against the alternatives and the ceiling, in one process.

Sections (``--sections``, comma-separated; default ``host,write,moves``):

* ``host``: host time of one eager write (T=1, H=1, D=128): ``set_kv_buffer``, the pool's writer
  (``KVWriter.write``) called directly, a hand launch of the compiled kernel the writer launched
  (``CompiledKernel[grid](...)`` with the arguments it passed), the launcher's entry alone (what
  the writer itself calls), the same launch through Triton's JIT (what a caller without a launch
  cache pays), and a one-kernel torch op as a control; tensor and float scales; calls
  interleaved, median of runs of thousands of calls each.
* ``write``, per model shape and token count: kvpool's ``set_kv_buffer``, the same kernel with
  ``div.rn``, kvpool's reference path, SGLang's eager fallback, ``torch.compile`` of an FP8
  ``index_copy_`` write, the textbook design ported to Triton (a program per token and head) and
  the one-program-per-token Triton kernel; beside them a copy kernel moving the same bytes and the
  cast-only scatter of the same bytes to the same slots (the ceiling a write can reach). Each
  method's first call is compared with kvpool's bytes and never timed. Also the write while the
  pool observes maxima for calibration, and the speculative-decoding verify write
  (``set_kv_buffer_prefix_valid`` against a plain write of all bs x width tokens and a masked one).
* ``moves``: ``move_kv_cache`` of 1, 16, 256 slots across 32 layers against a per-layer index copy.
* ``swa``: the write of a sliding-window layer of an ``SWAKVPool`` (gpt-oss's geometry, H=8 D=64,
  full-to-SWA mapping from an ``SWATokenToKVPoolAllocator``): ``set_kv_buffer`` at full slots
  (translation and the SWA part's write), the SWA part's own write at the translated slots, and the
  cast-only scatter of the same bytes to the translated slots (the ceiling).
* ``plans``: every launch-plan candidate of the write (layouts x tiles) for each shape (the
  ``write`` section's, H=8 D=96, DeepSeek-V3's MLA row) against the one-program-per-token kernel and
  the cast-only scatter ceiling: GB/s and % of the ceiling for large writes, microseconds per write
  in a CUDA graph at decode sizes. What ``kvpool/kernels/store_kv/plan.py``'s policy is chosen from.
* ``formats`` (``write_formats``): the writes that store scales with their rows, for the ``write``
  section's shapes and DeepSeek-V3's MLA row: ``MHATokenToKVPoolFP4`` (exponent scales and NVFP4),
  ``MHATokenToKVPoolFP8PerTokenHead`` and ``MLATokenToKVPoolFP4``, each against the cast-only scatter
  of the same code and scale bytes to the same slots, beside the per-tensor FP8 write of the same
  rows; the fused bytes compared with the reference path's after the timed runs.

Device time is the median of CUDA-graph replays (``timing.py``), so host launch cost never enters
it; *cold*: a 96 MB L2 flush before every call, its own time subtracted. Decode sizes also report
the time per call in a graph of 64 calls cycling over 8 layers without a flush, and the wall time
per call of eager calls back to back. GB/s counts the bytes docs/contract.md defines ("How
performance is measured"). Inputs are random (never zeros), slots random and distinct. Copy ceiling:
a 2 GiB device-to-device ``copy_`` at the start and the end.

Usage (on a GPU): python benchmarks/bench_write.py --out DIR [--quick] [--sections host,write,moves,swa,plans,formats]
``--cpu-smoke`` runs every section on the CPU at toy sizes (kernels in Triton's interpreter).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

SMOKE = report.interpret_if_smoke()  # before kvpool and peers define their kernels

import torch  # noqa: E402

import peers  # noqa: E402
import write_formats  # noqa: E402
from timing import DryClock, GpuClock, same_bytes_copy_gbps  # noqa: E402

from kvpool import MHATokenToKVPool, SWAKVPool, SWATokenToKVPoolAllocator, reference_set_kv_buffer  # noqa: E402
from kvpool.config import KernelOptions  # noqa: E402
from kvpool.kernels.store_kv import writer as store_kv  # noqa: E402
from kvpool.kernels.launch import Tile  # noqa: E402
from kvpool.kernels.store_kv.writer import KVWriter  # noqa: E402
from kvpool.write_types import FUNCTION_NAMES, POOL_NAMES, Geometry  # noqa: E402
from kvpool.kernels.store_kv.plan import CHUNK, JOINED, PER_HEAD, ROW, ROW_JOINED  # noqa: E402

FP8 = torch.float8_e4m3fn
SCALE = 0.37
MODELS = {  # name: (KV heads per rank, head_dim)
    "Llama-3-8B (H=8, D=128)": (8, 128),
    "Llama-3-70B TP8 (H=1, D=128)": (1, 128),
    "Qwen3.5-397B TP8 (H=1, D=256)": (1, 256),
    "odd (H=3, D=96)": (3, 96),
}
MOVE_MODEL = "Llama-3-8B (H=8, D=128)"
SWA_MODEL = "gpt-oss (H=8, D=64)"
SWA_GEOMETRY = (8, 64)


class M:
    """Method labels, as they appear in the JSON and the tables."""

    COPY = "same-bytes copy"
    CEILING = "cast-only scatter (ceiling)"
    KVPOOL = "kvpool"
    DIVRN = "kvpool div.rn"
    REFERENCE = "kvpool reference"
    SGLANG = "SGLang fallback"
    COMPILE = "torch.compile index_copy_"
    PER_HEAD = "Triton, program per token x head"
    PER_TOKEN = "Triton, program per token"
    OBSERVE = "kvpool + observe_amax"
    PREFIX = "set_kv_buffer_prefix_valid"
    PREFIX_PLAIN = "set_kv_buffer of all bs x width tokens"
    PREFIX_MASKED = "torch.where mask + set_kv_buffer"
    MOVE = "kvpool move_kv_cache"
    MOVE_LOOP = "per-layer index copy loop"
    SWA = "SWAKVPool.set_kv_buffer (SWA layer, full slots)"
    SWA_PART = "SWA part's write at translated slots"
    CEILING_MAPPED = "cast-only scatter through the mapping"


WRITE_METHODS = [M.KVPOOL, M.DIVRN, M.REFERENCE, M.SGLANG, M.COMPILE, M.PER_HEAD, M.PER_TOKEN]
PORTS = [M.PER_HEAD, M.PER_TOKEN]  # the straightforward Triton ports the decode target compares against
LARGE_COPY_FRAC = 0.95  # at >= large_min tokens, >= 95% of the same-bytes copy
LARGE_PER_TOKEN = 1.05  # and >= 1.05x the one-program-per-token kernel
HOST_OVER_HAND_US = 3.0  # eager set_kv_buffer at most 3 us of host time over a hand launch


@dataclass(frozen=True)
class Plan:
    """What one run measures and how many calls each measurement takes."""

    name: str
    device: str
    models: tuple[str, ...]
    tokens: tuple[int, ...]  # token counts of the write section
    large_min: int  # the large-write targets apply from this token count
    decode_max: int  # token counts up to this are decode sizes (graph-of-64 and eager wall times too)
    calib_tokens: tuple[int, ...]
    prefix_models: tuple[str, ...]
    prefix_bs: tuple[int, ...]
    prefix_width: int
    move_slots: tuple[int, ...]
    plan_shapes: tuple[str, ...]
    plan_tokens: tuple[int, ...]
    slots: int  # per layer
    layers: int  # layers written in turn (graph replays cycle over them, as a model's step does)
    move_layers: int
    move_pool_slots: int
    cold_calls: int  # calls per graph when L2 is flushed before each
    graph_calls: int  # calls per graph without flushes
    wall_calls: int
    wall_runs: int
    host_calls: int
    host_runs: int
    budget_s: float


PLAN_SHAPES = {**MODELS, "H=8, D=96": (8, 96), "DeepSeek-V3 MLA row (512 + 64)": (1, 512, 1, 64)}
FULL = Plan(
    "full", "cuda", models=tuple(MODELS), tokens=(1, 32, 128, 256, 4096, 8192, 16384, 32768), large_min=8192,
    decode_max=256, calib_tokens=(1, 256, 16384), prefix_models=tuple(MODELS)[:2], prefix_bs=(1, 2, 4, 8, 16, 32, 64),
    prefix_width=16, move_slots=(1, 16, 256), plan_shapes=tuple(PLAN_SHAPES), plan_tokens=(1, 32, 256, 4096, 16384, 32768),
    slots=1 << 20, layers=8, move_layers=32, move_pool_slots=1 << 17, cold_calls=10, graph_calls=64, wall_calls=400,
    wall_runs=5, host_calls=3000, host_runs=7, budget_s=330,
)  # fmt: skip
QUICK = replace(
    FULL, name="quick", tokens=(1, 256, 8192, 16384), calib_tokens=(1, 16384), prefix_models=tuple(MODELS)[:1],
    prefix_bs=(1, 64), move_slots=(1, 256), plan_tokens=(1, 256, 16384), wall_calls=200, wall_runs=3, host_calls=2000,
    host_runs=5, budget_s=110,
)  # fmt: skip
SMOKE_PLAN = replace(
    FULL, name="cpu-smoke", device="cpu", models=("odd (H=3, D=96)",), tokens=(1, 8), large_min=8, decode_max=1,
    calib_tokens=(8,), prefix_models=("odd (H=3, D=96)",), prefix_bs=(2,), prefix_width=4, move_slots=(3,),
    plan_shapes=("DeepSeek-V3 MLA row (512 + 64)",), plan_tokens=(5,), slots=1 << 10, layers=2, move_pool_slots=64,
    host_calls=5, host_runs=2, budget_s=1e9,
)  # fmt: skip


def bytes_moved(t: int, h: int, d: int, hv: Optional[int] = None, dv: Optional[int] = None) -> int:
    """Bytes a write moves (docs/contract.md, "How performance is measured"), bf16 inputs, FP8 cache,
    int64 loc: T x (H x D + Hv x Dv) x (2 + 1) + T x 8."""
    hv, dv = (h, d) if hv is None else (hv, dv)
    return t * (h * d + hv * dv) * 3 + t * 8


class Run:
    """One run: plan, clock, the report, helpers for inputs."""

    def __init__(self, plan: Plan, clock, rep: report.Report) -> None:
        self.plan, self.clock, self.rep = plan, clock, rep
        self.result = rep.result
        self.result.update(plan=asdict(plan), records=[], host={}, prefix=[], moves={}, swa=[], plans=[], formats=[],
                           sections_s={})  # fmt: skip
        self.dev = torch.device(plan.device)

    def section(self, name: str, fn) -> None:
        """Run one section; a failure is reported, never fatal; the report is written either way."""
        t0 = time.perf_counter()
        self.rep.log(f"{name} (at {self.rep.elapsed():.0f} s)")
        try:
            fn()
        except Exception as exc:  # a broken section must not lose the others
            self.rep.error(f"section {name}", exc)
        self.result["sections_s"][name] = round(time.perf_counter() - t0, 1)
        self.rep.save()

    def randn(self, *shape: int, gen=None) -> torch.Tensor:
        return (torch.randn(*shape, device=self.dev, generator=gen) * 60.0).to(torch.bfloat16)

    def slots(self, n: int, rows: int, gen) -> torch.Tensor:
        """n distinct random slots in 1..rows-1 (slot 0 is the padding slot)."""
        return torch.randperm(rows - 1, device=self.dev, generator=gen)[:n] + 1


def kvpool_pool(slots: int, h: int, d: int, layers: int, dev: torch.device) -> MHATokenToKVPool:
    """A pool whose writes must take the fused kernel (``fused="always"`` raises rather than time the
    reference path by mistake; on the CPU it runs the kernel in the interpreter). No warmup: every
    variant a measurement uses is compiled by its untimed first call."""
    return MHATokenToKVPool(slots, 1, FP8, h, d, layers, dev, fused="always", warmup=False)


def first_call(run: Run, rec: dict, fn, check=None) -> bool:
    """The untimed first call (compilation, lazy allocation) and the agreement check."""
    try:
        fn(0)
        run.clock.sync()
        if check is not None:
            rec["mismatch_frac"] = check()
        return True
    except Exception as exc:
        rec["error"] = report.short_error(exc)
        return False


def measure(run: Run, rec: dict, fn, nbytes: Optional[int], decode: bool) -> None:
    """Cold device time (and GB/s), and for decode sizes the graph-of-N and eager wall times, into rec;
    a failure goes into rec["error"]."""
    plan, clock = run.plan, run.clock
    try:
        us = rec["device_us"] = clock.device_us(lambda i: fn(i % plan.layers), plan.cold_calls, cold=True)
        if nbytes is not None:
            rec["gbps"] = nbytes / (us * 1e-6) / 1e9
        if decode:
            rec["graph_us"] = clock.device_us(lambda i: fn(i % plan.layers), plan.graph_calls, cold=False)
            rec["wall_us"] = clock.wall_us(lambda i: fn(i % plan.layers), plan.wall_calls, plan.wall_runs)
    except Exception as exc:  # a failing peer is reported, never fatal
        rec["error"] = report.short_error(exc)


def cast_scatter_ceiling(run: Run, k, v, caches: list, loc, timer, slot_map=None) -> dict:
    """The cast-only scatter of ``k``, ``v`` to ``loc`` (the ceiling of that write), best of its tiles;
    with ``slot_map``, to ``slot_map[loc]``, read in the same launch."""
    best: dict = {}
    errors = []
    for block, warps in peers.CAST_SCATTER_TILES:
        rec: dict = {}
        fn = lambda i, b=block, w=warps: peers.cast_scatter(k, v, caches[i][0], caches[i][1], loc, b, w, slot_map)  # noqa: E731
        if first_call(run, rec, fn):
            timer(rec, fn)
        field = "device_us" if "device_us" in rec else "graph_us"
        if "error" in rec:
            errors.append(rec["error"])
        elif field in rec and rec[field] < best.get(field, math.inf):
            best = {**rec, "tile": f"{block}/{warps}"}
    return best or {"error": "; ".join(errors) or "not measured"}


# --- host time of one eager write ------------------------------------------------------------------


def recorded_launch(writer: KVWriter, call):
    """The direct launch ``call`` makes through ``writer`` (its second call on, once the first has
    compiled the variant). Raises where the writer launches through the JIT (interpreter,
    ``KVPOOL_DIRECT_LAUNCH=0``, a failed direct launch)."""
    call()
    call()
    if not writer.launches.enabled or not writer.launches.entries:
        raise RuntimeError(f"the writer launches through Triton's JIT (direct launches {'on' if writer.launches.enabled else 'off'})")
    with writer.launches.recording() as records:
        call()
    if len(records) != 1:
        raise RuntimeError(f"expected one direct launch, recorded {len(records)}")
    return records[0]


def host_overhead(run: Run) -> None:
    """Host microseconds of one eager call, T=1, H=1, D=128, each kind interleaved with the others."""
    plan, dev = run.plan, run.dev
    h, d = 1, 128
    pool = kvpool_pool(4096, h, d, 1, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = run.randn(1, h, d, gen=gen)
    loc = torch.tensor([5], device=dev)
    kb, vb = pool.k_buffer[0], pool.v_buffer[0]
    writer = pool.writer
    calls: dict = {}
    notes: list = []
    for label, scale in (("tensor scales", torch.tensor([SCALE], device=dev)), ("float scales", SCALE)):

        def pool_call(scale=scale):
            pool.set_kv_buffer(None, loc, x, x, scale, scale, layer_id_override=0)

        calls[f"set_kv_buffer ({label})"] = pool_call
        calls[f"KVWriter.write ({label})"] = lambda s=scale: writer.write(kb, vb, loc, x, x, s, s, POOL_NAMES)
        try:
            launch = recorded_launch(writer, pool_call)
            calls[f"hand launch ({label})"] = launch.replay
            calls[f"launcher entry alone ({label})"] = launch.replay_direct
            calls[f"Triton JIT launch ({label})"] = writer.jit_launch_of(launch)
        except Exception as exc:
            notes.append(f"hand launch ({label}) unavailable: {report.short_error(exc)}")
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
    run.rep.log("host us/call: " + ", ".join(f"{k}={v:.2f}" for k, v in host["us"].items() if v is not None))
    for n in notes:
        run.rep.log(f"note: {n}")


def interleaved_host_us(run: Run, calls: dict) -> dict:
    """Host microseconds per call: ``host_runs`` rounds, each timing ``host_calls`` back-to-back calls
    of every function in turn (interleaving spreads host noise over all of them alike)."""
    plan, clock = run.plan, run.clock
    alive = {}
    for name, fn in calls.items():
        try:
            for _ in range(1 if clock.dry else 50):
                fn()
            alive[name] = fn
        except Exception as exc:
            run.rep.error(f"host: {name}", exc)
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


# --- the write ---------------------------------------------------------------------------------------


def bench_write(run: Run) -> None:
    for i, name in enumerate(run.plan.models):
        h, d = MODELS[name]
        run.rep.log(f"shape {i + 1}/{len(run.plan.models)}: {name}")
        try:
            bench_shape(run, name, h, d)
        except Exception as exc:  # e.g. the pool does not fit: the other shapes still run
            run.rep.error(name, exc)
        run.rep.save()


def bench_shape(run: Run, name: str, h: int, d: int) -> None:
    plan, dev = run.plan, run.dev
    pool = kvpool_pool(plan.slots, h, d, plan.layers, dev)
    kb, vb = pool.k_buffer, pool.v_buffer
    kv = [pool.get_kv_buffer(i) for i in range(plan.layers)]
    divrn = KVWriter(
        Geometry(FP8, h, d, h, d, kb[0].device), kb[0].stride(), vb[0].stride(), pool.rows, "always",
        options=KernelOptions(fast_div=False), caches_aligned=True,
    )  # fmt: skip
    gen = torch.Generator(device=dev).manual_seed(0)
    scale = torch.tensor([SCALE], device=dev)
    one = torch.tensor([1.0], device=dev)  # SGLang divides its inputs in place: 1.0 keeps them unchanged
    records = run.result["records"]
    for t in plan.tokens:
        if run.rep.over_budget(f"{name} T={t}"):
            continue
        xk, xv = run.randn(t, h, d, gen=gen), run.randn(t, h, d, gen=gen)
        xk_s, xv_s = xk.clone(), xv.clone()
        loc = run.slots(t, pool.rows, gen)
        fns = {
            M.KVPOOL: lambda i: pool.set_kv_buffer(None, loc, xk, xv, scale, scale, layer_id_override=i),
            M.DIVRN: lambda i: divrn.write(kb[i], vb[i], loc, xk, xv, scale, scale, POOL_NAMES),
            M.REFERENCE: lambda i: reference_set_kv_buffer(xk, xv, kv[i][0], kv[i][1], loc, scale, scale),
            M.SGLANG: lambda i: peers.sglang_fallback(xk_s, xv_s, kb[i], vb[i], loc, one, one, FP8),
            M.COMPILE: lambda i: peers.compiled_index_copy(xk, xv, kv[i][0], kv[i][1], loc, scale, scale),
            M.PER_HEAD: lambda i: peers.straightforward_triton(xk, xv, kb[i], vb[i], loc, scale, scale, FP8),
            M.PER_TOKEN: lambda i: peers.per_token_triton(xk, xv, kv[i][0], kv[i][1], loc, scale, scale),
        }
        if run.clock.dry:  # inductor's CPU build takes longer than the rest of the smoke run
            del fns[M.COMPILE]
        nbytes = bytes_moved(t, h, d)
        decode = t <= plan.decode_max
        base = {"model": name, "H": h, "D": d, "T": t, "bytes": nbytes}
        try:
            records.append({**base, "method": M.COPY, "gbps": same_bytes_copy_gbps(run.clock, nbytes, dev, plan.cold_calls)})
        except Exception as exc:
            records.append({**base, "method": M.COPY, "error": report.short_error(exc)})
        timer = lambda rec, fn: measure(run, rec, fn, nbytes, decode)  # noqa: E731
        records.append({**base, "method": M.CEILING, **cast_scatter_ceiling(run, xk, xv, kv, loc, timer)})
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
                measure(run, rec, fn, nbytes, decode)
            records.append(rec)
            row.append(f"{method}=" + (f"{rec['gbps']:.0f}" if "gbps" in rec else "error"))
        if t in plan.calib_tokens:
            records.append(calibration(run, pool, fns[M.KVPOOL], base, nbytes, decode))
            row.append(f"{M.OBSERVE}=" + (f"{records[-1]['gbps']:.0f}" if "gbps" in records[-1] else "error"))
        run.rep.log(f"{name} T={t} (GB/s, {run.rep.elapsed():.0f} s): " + ", ".join(row))
        del xk, xv, xk_s, xv_s, loc, fns
    if name in plan.prefix_models:
        prefix_valid(run, pool, name, h, d, gen, scale)
    del pool, kb, vb, kv
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def calibration(run: Run, pool: MHATokenToKVPool, write, base: dict, nbytes: int, decode: bool) -> dict:
    """The same write while the pool observes per-head maxima (same pool, inputs and slots)."""
    rec = {**base, "method": M.OBSERVE}
    try:
        pool.observe_amax(True)  # the first time, this compiles the observing variants
        if first_call(run, rec, write):
            measure(run, rec, write, nbytes, decode)
            if pool.kv_amax is None or not bool(pool.kv_amax.amax() > 0):
                rec["error"] = "observe_amax(True) but no maximum was observed"
    except Exception as exc:
        rec["error"] = report.short_error(exc)
    finally:
        pool.observe_amax(False)
    return rec


def prefix_valid(run: Run, pool: MHATokenToKVPool, name: str, h: int, d: int, gen, scale) -> None:
    """The verify write at bs x width, against a plain write of the same tokens and against masking
    loc first: cold device time, per call in a graph of 64, eager wall time."""
    plan, dev = run.plan, run.dev
    width = plan.prefix_width
    for bs in plan.prefix_bs:
        if run.rep.over_budget(f"prefix-valid {name} bs={bs}"):
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
                measure(run, rec, fn, None, decode=True)
            run.result["prefix"].append(rec)
            line.append(f"{method}=" + (f"{rec['graph_us']:.2f}" if "graph_us" in rec else "error"))
        run.rep.log(f"prefix-valid {name} bs={bs} width={width} (us per call in a graph): " + ", ".join(line))


# --- a sliding-window layer ------------------------------------------------------------------------


def bench_swa(run: Run) -> None:
    """A sliding-window layer's write at full slots against the SWA part's own write at the translated
    slots and the cast-only scatter of the same bytes there (cold device time; graph and wall at
    decode sizes). The SWA part holds half the full part's slots; the tokens' full slots are handed
    out by the allocator, so their SWA slots are the mapping's."""
    plan, dev = run.plan, run.dev
    h, d = SWA_GEOMETRY
    size = plan.slots
    swa_ids, full_ids = list(range(0, 2 * plan.layers, 2)), list(range(1, 2 * plan.layers, 2))
    pool = SWAKVPool(size, size // 2, 1, FP8, h, d, swa_ids, full_ids, False, dev, fused="always", warmup=False)
    alloc = SWATokenToKVPoolAllocator(size, size // 2, 1, None, dev, pool)
    part = pool.swa_kv_pool
    kv = [part.get_kv_buffer(i) for i in range(plan.layers)]
    gen = torch.Generator(device=dev).manual_seed(1)
    scale = torch.tensor([SCALE], device=dev)
    for t in plan.tokens:
        if t > size // 2 or run.rep.over_budget(f"swa T={t}"):
            continue
        full = alloc.alloc(t)
        full = full[torch.randperm(t, device=dev, generator=gen)]
        swa_loc = pool.translate_loc_from_full_to_swa(full).to(torch.int64)
        xk, xv = run.randn(t, h, d, gen=gen), run.randn(t, h, d, gen=gen)
        nbytes, decode = bytes_moved(t, h, d), t <= plan.decode_max
        base = {"model": SWA_MODEL, "H": h, "D": d, "T": t, "bytes": nbytes}
        timer = lambda rec, fn: measure(run, rec, fn, nbytes, decode)  # noqa: E731
        run.result["swa"].append({**base, "method": M.CEILING, **cast_scatter_ceiling(run, xk, xv, kv, swa_loc, timer)})
        mapped = cast_scatter_ceiling(run, xk, xv, kv, full, timer, alloc.full_to_swa_index_mapping)
        run.result["swa"].append({**base, "method": M.CEILING_MAPPED, **mapped})
        fns = {
            M.SWA: lambda i: pool.set_kv_buffer(None, full, xk, xv, scale, scale, layer_id_override=swa_ids[i]),
            M.SWA_PART: lambda i: part.set_kv_buffer(None, swa_loc, xk, xv, scale, scale, layer_id_override=i),
        }
        stored = lambda: torch.cat([kv[0][0][swa_loc].reshape(-1), kv[0][1][swa_loc].reshape(-1)]).view(torch.uint8)  # noqa: E731
        expected: list = []  # the SWA layer write's bytes at the translated slots, after its first call
        line = []
        for method, fn in fns.items():
            rec = {**base, "method": method}
            check = (lambda: (stored() != expected[0]).float().mean().item()) if expected else None
            if first_call(run, rec, fn, check):
                expected.append(stored())
                measure(run, rec, fn, nbytes, decode)
            run.result["swa"].append(rec)
            line.append(f"{method}=" + (f"{rec['gbps']:.0f}" if "gbps" in rec else "error"))
        run.rep.log(f"swa T={t} (GB/s): " + ", ".join(line))
        alloc.free(full)
    del pool, alloc, part, kv
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# --- moves ---------------------------------------------------------------------------------------


def bench_moves(run: Run) -> None:
    """move_kv_cache across all layers of a 32-layer pool (Llama-3-8B geometry) against a loop."""
    plan, dev = run.plan, run.dev
    h, d = MODELS[MOVE_MODEL]
    pool = kvpool_pool(plan.move_pool_slots, h, d, plan.move_layers, dev)
    gen = torch.Generator(device=dev).manual_seed(2)
    for buf in (*pool.k_buffer, *pool.v_buffer):  # never move zeros
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device=dev, generator=gen))
    moves: dict = {"model": MOVE_MODEL, "layers": plan.move_layers, "records": []}
    run.result["moves"] = moves
    kb, vb = pool.k_buffer, pool.v_buffer
    row_bytes = h * d * kb[0].element_size()
    for n in plan.move_slots:
        if run.rep.over_budget(f"moves n={n}"):
            continue
        picked = run.slots(2 * n, pool.rows, gen)
        src, tgt = picked[:n], picked[n:]
        fns = {M.MOVE: lambda i: pool.move_kv_cache(tgt, src), M.MOVE_LOOP: lambda i: peers.per_layer_move(kb, vb, tgt, src)}
        nbytes = 2 * n * plan.move_layers * 2 * row_bytes  # K and V rows of every layer, read + written
        line = []
        for method, fn in fns.items():
            rec = {"slots": n, "bytes": nbytes, "method": method}
            for buf in (kb[0], vb[-1]):  # fresh targets, so the check sees this method's copy
                buf[tgt] = torch.randint(0, 256, buf[tgt].shape, dtype=torch.uint8, device=dev, generator=gen)

            def check() -> float:
                return max((kb[0][tgt] != kb[0][src]).float().mean().item(), (vb[-1][tgt] != vb[-1][src]).float().mean().item())

            if first_call(run, rec, fn, check):
                measure(run, rec, fn, nbytes, decode=True)
            moves["records"].append(rec)
            line.append(f"{method}=" + (f"{rec['device_us']:.1f} us" if "device_us" in rec else "error"))
        run.rep.log(f"move {n} slots x {plan.move_layers} layers (cold device time): " + ", ".join(line))
    del pool, kb, vb
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# --- plans ---------------------------------------------------------------------------------------

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
    """One figure per candidate: per write in a graph of graph_calls writes at decode sizes, else
    cold device time and GB/s; a failure goes into rec["error"]."""
    plan, clock = run.plan, run.clock
    try:
        if decode:
            rec["graph_us"] = clock.device_us(lambda i: fn(i % plan.layers), plan.graph_calls, cold=False)
        else:
            us = rec["device_us"] = clock.device_us(lambda i: fn(i % plan.layers), plan.cold_calls, cold=True)
            rec["gbps"] = nbytes / (us * 1e-6) / 1e9
    except Exception as exc:
        rec["error"] = report.short_error(exc)


def plan_sweep(run: Run) -> None:
    """Each shape and token count: the ceiling, every candidate (its bytes checked against the
    policy's), the one-program-per-token port."""
    plan, dev = run.plan, run.dev
    candidates = PLAN_CANDIDATES
    if run.clock.dry:  # one tile per layout: the interpreter takes seconds per launch
        candidates = [c for i, c in enumerate(PLAN_CANDIDATES) if i == 0 or c[0] != PLAN_CANDIDATES[i - 1][0]]
    for name in plan.plan_shapes:
        shape = PLAN_SHAPES[name]
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
            if run.rep.over_budget(f"plans {name} T={t}"):
                continue
            if mla:
                row = run.randn(t, 1, d + dv, gen=gen)
                k, v = row[:, :, :d], row[:, :, d:]
            else:
                k, v = run.randn(t, h, d, gen=gen), run.randn(t, hv, dv, gen=gen)
            loc = run.slots(t, slots, gen)
            nbytes = bytes_moved(t, h, d, hv, dv)
            decode = t <= plan.decode_max
            base = {"model": name, "T": t, "bytes": nbytes}
            timer = lambda rec, fn: plan_measure(run, rec, fn, nbytes, decode)  # noqa: E731
            line = [cast_scatter_ceiling(run, k.contiguous(), v.contiguous(), caches, loc, timer)]
            line[0].update(base, method=M.CEILING)
            expected: list = []
            seen: dict = {}
            for layout, tile in candidates:
                for chunk in PLAN_CHUNKS if layout == CHUNK else (32,):
                    size = "policy tiles" if tile is None else f"{tile.elems}/{tile.num_warps}"
                    label = f"{layout} {size}" + (f" chunk {chunk}" if layout == CHUNK else "")
                    w = store_kv.writer_for(*caches[0], "always", tile=tile, layout=layout, chunk=chunk)
                    chosen = w.plan(k.stride(), v.stride(), (2, 2), False, t)
                    rec = {**base, "method": label, "plan": chosen.__dict__}
                    if chosen in seen:  # a candidate this call cannot take falls back to another plan
                        rec["same_plan_as"] = seen[chosen]
                        line.append(rec)
                        continue
                    seen[chosen] = label
                    fn = lambda i, w=w: w.write(stores[i][0], stores[i][1], loc, k, v, scale, scale, FUNCTION_NAMES)  # noqa: E731
                    if first_call(run, rec, fn):
                        got = torch.cat([stores[0][0][loc].reshape(-1), stores[0][1][loc].reshape(-1)])
                        expected = expected or [got]
                        rec["exact"] = bool(torch.equal(got, expected[0]))
                        plan_measure(run, rec, fn, nbytes, decode)
                    line.append(rec)
            port = {**base, "method": M.PER_TOKEN}
            fn = lambda i: peers.per_token_triton(k, v, caches[i][0], caches[i][1], loc, scale, scale)  # noqa: E731
            if first_call(run, port, fn):
                plan_measure(run, port, fn, nbytes, decode)
            line.append(port)
            run.result["plans"].extend(line)
            run.rep.log("plans " + plan_row(name, t, line, decode).replace(" | ", "; "))
        del stores, caches
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        run.rep.save()


# --- formats ----------------------------------------------------------------------------------------


def bench_formats(run: Run) -> None:
    """The write section's shapes and the plan sweep's MLA rows, through ``write_formats``."""
    shapes = {name: MODELS[name] for name in run.plan.models}
    shapes.update({name: PLAN_SHAPES[name] for name in run.plan.plan_shapes if len(PLAN_SHAPES[name]) == 4})
    write_formats.bench_formats(run, shapes, SCALE)


# --- targets and the report ----------------------------------------------------------------------------


def _index(records: list) -> dict:
    return {(r["model"], r["T"], r["method"]): r for r in records}


def _value(rec: Optional[dict], field: str) -> Optional[float]:
    if rec is None or "error" in rec:
        return None
    v = rec.get(field)
    return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _tok(t: int) -> str:
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


def _f(v: Optional[float], fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def _status(values: list, ok) -> str:
    measured = [v for _, v in values if v is not None]
    if not measured:
        return "not measured"
    if not all(ok(v) for v in measured):
        return "missed"
    return "met" if len(measured) == len(values) else "met where measured"


def targets(result: dict) -> list[dict]:
    """Each target this run measured: what it asks, the figure, met or missed."""
    plan = result.get("plan", {})
    tokens = plan.get("tokens", [])
    large = [t for t in tokens if t >= plan.get("large_min", math.inf)]
    decode = [t for t in tokens if t <= plan.get("decode_max", 0)]
    by = _index([r for r in result.get("records", []) if "T" in r])
    at = f">= {_tok(plan.get('large_min', 0))} tokens"
    out = []

    def ratio_row(what: str, model: str, target: str, other: str, fmt, ok=None) -> None:
        vals = []
        for t in large:
            ours, peer = _value(by.get((model, t, M.KVPOOL)), "gbps"), _value(by.get((model, t, other)), "gbps")
            vals.append((t, ours / peer if ours and peer else None))
        if any(v for _, v in vals):
            out.append(dict(what=what, shape=model, target=target, figure=", ".join(f"{_tok(t)}: " + (fmt(v) if v else "n/a") for t, v in vals),
                            status=_status(vals, ok) if ok else "reported"))  # fmt: skip

    for model in MODELS:
        pct, times = (lambda v: f"{100 * v:.1f}%"), (lambda v: f"{v:.3f}x")
        ratio_row("large writes", model, f">= {100 * LARGE_COPY_FRAC:.0f}% of the same-bytes copy at {at}", M.COPY, pct, lambda v: v >= LARGE_COPY_FRAC)
        ratio_row("large writes", model, f"share of the cast-only scatter of the same bytes to the same slots at {at}", M.CEILING, pct)
        ratio_row("large writes", model, f">= {LARGE_PER_TOKEN:.2f}x the one-program-per-token kernel at {at}", M.PER_TOKEN, times,
                  lambda v: v >= LARGE_PER_TOKEN)  # fmt: skip
        vals, worst = [], None
        for t in decode:
            ours = _value(by.get((model, t, M.KVPOOL)), "graph_us")
            ports = [(p, us) for p in PORTS if (us := _value(by.get((model, t, p)), "graph_us"))]
            if not ours or not ports:
                continue
            peer, peer_us = min(ports, key=lambda pu: pu[1])
            vals.append((t, ours / peer_us))
            if worst is None or ours / peer_us > worst[0]:
                worst = (ours / peer_us, t, peer, ours, peer_us)
        if worst:
            r, t, peer, ours, peer_us = worst
            out.append(dict(
                what="decode writes", shape=model,
                target=f"at 1-{plan.get('decode_max', 0)} tokens, per write in a CUDA graph, no slower than the fastest Triton port",
                figure=f"worst at T={t}: {ours:.2f} us vs {peer_us:.2f} us ({peer}), {r:.3f}x; " + ", ".join(f"{_tok(t)}: {v:.3f}x" for t, v in vals),
                status=_status(vals, lambda v: v <= 1.0),
            ))  # fmt: skip
    host = result.get("host", {}).get("us", {})
    for label in ("tensor scales", "float scales"):
        s, hand = host.get(f"set_kv_buffer ({label})"), host.get(f"hand launch ({label})")
        if s is None or hand is None:
            continue
        out.append(dict(
            what="host time", shape="T=1, H=1, D=128",
            target=f"eager set_kv_buffer ({label}) at most {HOST_OVER_HAND_US:.0f} us of host time over a hand launch of the same compiled kernel",
            figure=f"set_kv_buffer {s:.2f} us, hand launch {hand:.2f} us: {s - hand:+.2f} us",
            status=_status([(1, s - hand)], lambda v: v <= HOST_OVER_HAND_US),
        ))  # fmt: skip
    return out


def _cell_us(rec: Optional[dict], fields=("device_us", "graph_us", "wall_us")) -> str:
    if rec is None:
        return ""
    if "error" in rec:
        return "error"
    return " / ".join(_f(rec.get(f), ".2f") or "-" for f in fields)


def _plan_figure(rec: Optional[dict], ceil: Optional[dict], decode: bool) -> str:
    """GB/s (% of the ceiling) for large writes, us (% = ceiling's time / it) at decode sizes."""
    field = "graph_us" if decode else "gbps"
    v, c = _value(rec, field), _value(ceil, field)
    if v is None:
        return "error" if rec and "error" in rec else ""
    frac = (c / v if decode else v / c) if c else None
    mark = "" if rec.get("exact", True) else " !"
    return (f"{v:.2f} us*" if decode else f"{v:.0f}") + (f" ({100 * frac:.1f}%)" if frac else "") + mark


def plan_cells(line: list, decode: bool) -> dict:
    """The ceiling, the policy, the best exact candidate and the port of one plan-sweep cell."""
    field = "graph_us" if decode else "gbps"
    timed = [r for r in line if r["method"] not in (M.CEILING, M.PER_TOKEN) and _value(r, field) and r.get("exact", True)]
    return {
        "ceiling": next((r for r in line if r["method"] == M.CEILING), None),
        "policy": next((r for r in line if r["method"].startswith("auto")), None),
        "best": (min if decode else max)(timed, key=lambda r: _value(r, field), default=None),
        "port": next((r for r in line if r["method"] == M.PER_TOKEN), None),
    }


def plan_row(model: str, t: int, line: list, decode: bool) -> str:
    """shape | T | ceiling | policy | best candidate | port | the policy's speed-up over the port."""
    c = plan_cells(line, decode)
    field = "graph_us" if decode else "gbps"
    p, q = _value(c["policy"], field), _value(c["port"], field)
    vs = (q / p if decode else p / q) if p and q else None
    best = c["best"]
    return (
        f"{model} | {t} | {_plan_figure(c['ceiling'], None, decode)} | {_plan_figure(c['policy'], c['ceiling'], decode)} | "
        + (f"{best['method']}: {_plan_figure(best, c['ceiling'], decode)}" if best else "")
        + f" | {_plan_figure(c['port'], c['ceiling'], decode)} | {f'{vs:.3f}x' if vs else ''}"
    )


def _sweep_cells(result: dict) -> dict:
    cells: dict = {}
    for r in result.get("plans", []):
        cells.setdefault((r["model"], r["T"]), []).append(r)
    return cells


def markdown(result: dict) -> str:
    meta, plan = result.get("meta", {}), result.get("plan", {})
    records = [r for r in result.get("records", []) if "T" in r]
    by = _index(records)
    ceiling = meta.get("ceiling_gbps")
    tokens = plan.get("tokens", []) if records else []
    out = [
        f"Copy ceiling (2 GiB device-to-device `copy_`, read + write): **{_f(ceiling, '.0f')} GB/s** at the start, "
        f"{_f(meta.get('ceiling_gbps_end'), '.0f')} GB/s at the end.",
        "",
        f"Pool: FP8 e4m3fn, {plan.get('slots')} slots per layer, {plan.get('layers')} layers written in turn; random distinct "
        "slots; inputs bf16 [T, H, D], random (x 60); one-element float32 scale tensor (0.37; SGLang's fallback, which "
        "divides its inputs in place, gets 1.0); int64 loc. *cold*: median of CUDA-graph replays with a 96 MB L2 flush "
        f"before each call, its time subtracted ({plan.get('cold_calls')} calls per graph); *graph*: per call in a graph "
        f"of {plan.get('graph_calls')} calls cycling over the layers, no flush; *wall*: eager calls back to back, median "
        f"of {plan.get('wall_runs')} runs of {plan.get('wall_calls')}, host time included. GB/s counts "
        "T x (H x D + Hv x Dv) x (input + cache element size) + T x loc element size bytes (docs/contract.md) from the "
        "cold time. First calls are never timed.",
    ]
    found = targets(result) + write_formats.targets(result)
    if found:
        out += ["", "## Targets", "", "| what | shape | target | figure | status |", "|---|---|---|---|---|"]
        out += [f"| {t['what']} | {t['shape']} | {t['target']} | {t['figure']} | **{t['status']}** |" for t in found]
    cols = [M.COPY, M.CEILING] + WRITE_METHODS + [M.OBSERVE]
    if records:
        out += [
            "", "## Throughput: GB/s (percent of the copy ceiling), cold device time", "",
            "| model | T | " + " | ".join(cols) + " | kvpool / copy | kvpool / ceiling | kvpool / per token | kvpool / compile |",
            "|---|---:|" + "---:|" * len(cols) + "---:|---:|---:|---:|",
        ]  # fmt: skip
    for model in MODELS:
        for t in tokens:
            cells = []
            for m in cols:
                r, g = by.get((model, t, m)), _value(by.get((model, t, m)), "gbps")
                cells.append("" if r is None else "error" if g is None else f"{g:.0f} ({100 * g / ceiling:.0f}%)" if ceiling else f"{g:.0f}")
            ours = _value(by.get((model, t, M.KVPOOL)), "gbps")

            def ratio(m: str, pct: bool = False) -> str:
                other = _value(by.get((model, t, m)), "gbps")
                return "" if not ours or not other else f"{100 * ours / other:.1f}%" if pct else f"{ours / other:.2f}x"

            if any(cells):
                out.append(f"| {model} | {t} | " + " | ".join(cells) + f" | {ratio(M.COPY, True)} | {ratio(M.CEILING, True)} | {ratio(M.PER_TOKEN)} | {ratio(M.COMPILE)} |")
    decode = [t for t in tokens if t <= plan.get("decode_max", 0)]
    if decode:
        out += ["", "## Decode sizes: microseconds per write, cold / graph / wall", "",
                "| model | T | " + " | ".join(WRITE_METHODS + [M.CEILING]) + " |", "|---|---:|" + "---:|" * (len(WRITE_METHODS) + 1)]  # fmt: skip
    for model in MODELS:
        for t in decode:
            cells = [_cell_us(by.get((model, t, m))) for m in WRITE_METHODS + [M.CEILING]]
            if any(cells):
                out.append(f"| {model} | {t} | " + " | ".join(cells) + " |")
    calib = [(m, t) for m in MODELS for t in plan.get("calib_tokens", []) if (m, t, M.OBSERVE) in by]
    if calib:
        out += ["", "## Calibration cost: the write with `observe_amax(True)` against the same write without", "",
                "Same pool, inputs and slots. Cold device time (and graph / wall at decode sizes), microseconds.", "",
                "| model | T | off: cold | on: cold | cold overhead | off: graph | on: graph | off: wall | on: wall |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for model, t in calib:
        off, on = by.get((model, t, M.KVPOOL)), by[(model, t, M.OBSERVE)]
        if "error" in on:
            out.append(f"| {model} | {t} | {_f(_value(off, 'device_us'), '.2f')} | error: {on['error'][:80]} | | | | | |")
            continue
        a, b = _value(off, "device_us"), _value(on, "device_us")
        over = f"{100 * (b / a - 1):+.1f}%" if a and b else ""
        out.append(f"| {model} | {t} | {_f(a, '.2f')} | {_f(b, '.2f')} | {over} | {_f(_value(off, 'graph_us'), '.2f')} | "
                   f"{_f(_value(on, 'graph_us'), '.2f')} | {_f(_value(off, 'wall_us'), '.1f')} | {_f(_value(on, 'wall_us'), '.1f')} |")  # fmt: skip
    host = result.get("host", {})
    if host:
        out += [
            "", f"## Host time per eager call: T=1, H=1, D=128; median of {host.get('runs')} runs of {host.get('calls')} calls, interleaved", "",
            "*hand launch*: the compiled kernel the pool's writer launched, called with the arguments it passed "
            "(`CompiledKernel[grid](...)`); *launcher entry alone*: the same launch through the compiled kernel's "
            "launcher without `CompiledKernel[grid]`'s lookups, as the writer makes it; *Triton JIT "
            "launch*: the same launch through `kernel[grid](...)` (Triton binds and specialises every call: what a caller "
            "without a launch cache pays); *KVWriter.write*: the pool's writer given the pool's caches; *set_kv_buffer*: the "
            "whole eager call; *control*: a one-kernel torch op, what any launch costs here. Writes through Triton's JIT "
            f"while timed: {host.get('jit_launches_while_timed', 'n/a')}.", "",
            "| call | us |", "|---|---:|",
        ]  # fmt: skip
        out += [f"| {k} | {_f(v, '.2f')} |" for k, v in host.get("us", {}).items()]
        out += [f"- note: {n}" for n in host.get("notes", [])]
    prefix = result.get("prefix", [])
    if prefix:
        pm = [M.PREFIX, M.PREFIX_PLAIN, M.PREFIX_MASKED]
        pby = {(r["model"], r["bs"], r["method"]): r for r in prefix}
        out += [
            "", "## Speculative-decoding verify write: microseconds per write, cold / graph / wall", "",
            "`set_kv_buffer_prefix_valid` writes the first `commit_lens[i]` of each request's `width` tokens (random commit "
            "lengths in 0..width); the plain write stores all bs x width tokens; the masked one sets uncommitted slots to -1 "
            "with `torch.where` and then writes.", "",
            "| model | bs x width | committed | " + " | ".join(pm) + " | prefix / plain (graph) |", "|---|---:|---:|" + "---:|" * len(pm) + "---:|",
        ]  # fmt: skip
        for model in MODELS:
            for bs in plan.get("prefix_bs", []):
                rs = [pby.get((model, bs, m)) for m in pm]
                if any(rs):
                    a, b = _value(rs[0], "graph_us"), _value(rs[1], "graph_us")
                    committed = next(r["committed"] for r in rs if r)
                    out.append(f"| {model} | {bs} x {plan.get('prefix_width')} | {committed} | " + " | ".join(_cell_us(r) for r in rs)
                               + f" | {_f(a / b if a and b else None, '.2f')} |")  # fmt: skip
    moves = result.get("moves", {})
    if moves.get("records"):
        mby = {(r["slots"], r["method"]): r for r in moves["records"]}
        out += ["", f"## move_kv_cache: {moves.get('layers')} layers, {moves.get('model')}; microseconds per call, cold / graph / wall", "",
                f"| slots | bytes (K+V, read + write) | {M.MOVE} | {M.MOVE_LOOP} | loop / kvpool (cold) | loop / kvpool (wall) |",
                "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for n in plan.get("move_slots", []):
            a, b = mby.get((n, M.MOVE)), mby.get((n, M.MOVE_LOOP))
            if a is None and b is None:
                continue
            rc = _value(b, "device_us") / _value(a, "device_us") if _value(a, "device_us") and _value(b, "device_us") else None
            rw = _value(b, "wall_us") / _value(a, "wall_us") if _value(a, "wall_us") and _value(b, "wall_us") else None
            out.append(f"| {n} | {(a or b).get('bytes', 0)} | {_cell_us(a)} | {_cell_us(b)} | {_f(rc, '.1f')}x | {_f(rw, '.1f')}x |")
    agree: dict = {}
    for r in records + moves.get("records", []) + result.get("swa", []):
        if "mismatch_frac" in r:
            agree.setdefault(r["method"], []).append(r["mismatch_frac"])
    if agree:
        out += ["", "## Agreement: fraction of bytes that differ from kvpool's write after each method's first call", "",
                "(moves: from the source rows). The Triton ports divide approximately, so a few differing bytes are expected there.", "",
                "| method | cells | max | mean |", "|---|---:|---:|---:|"]  # fmt: skip
        out += [f"| {m} | {len(v)} | {max(v):.2e} | {sum(v) / len(v):.2e} |" for m, v in agree.items()]
    swa = result.get("swa", [])
    if swa:
        sby = {(r["T"], r["method"]): r for r in swa}
        sm = [M.CEILING, M.CEILING_MAPPED, M.SWA, M.SWA_PART]
        timed = sm[2:]
        out += ["", f"## Sliding-window layer write: {SWA_MODEL}, SWA part of half the full part's slots", "",
                "GB/s from the cold device time: against the cast-only scatter of the same bytes to the translated slots, "
                "and against the same scatter reading the mapping in its launch (the plainest kernel with the fused "
                "write's memory traffic); at decode sizes also microseconds per write, cold / graph / wall.", "",
                "| T | " + " | ".join(sm) + " | set_kv_buffer / ceiling | set_kv_buffer / mapped ceiling | decode us: "
                + " | decode us: ".join(timed) + " |",
                "|---:|" + "---:|" * (len(sm) + 2 + len(timed))]  # fmt: skip
        for t in sorted({r["T"] for r in swa}):
            g = {m: _value(sby.get((t, m)), "gbps") for m in sm}
            cells = [_f(g[m], ".0f") for m in sm]
            pcts = [f"{100 * g[M.SWA] / g[c]:.1f}%" if g[M.SWA] and g[c] else "" for c in (M.CEILING, M.CEILING_MAPPED)]
            us = [_cell_us(sby.get((t, m))) if t <= plan.get("decode_max", 0) else "" for m in timed]
            out.append(f"| {t} | " + " | ".join(cells) + " | " + " | ".join(pcts) + " | " + " | ".join(us) + " |")
    cells = _sweep_cells(result)
    if cells:
        out += [
            "", "## Plan sweep: the write's launch-plan candidates, the one-program-per-token kernel, the ceiling", "",
            "Large writes: GB/s (percent of the cast-only scatter ceiling), cold device time; decode sizes (marked *): "
            "microseconds per write in a graph of graph_calls writes (percent: the ceiling's time over the candidate's). "
            "*policy*: what the pool takes; *port*: the one-program-per-token Triton kernel. A candidate that is not exact "
            "is marked !; every candidate is in the JSON (key `plans`).", "",
            "| shape | T | ceiling | policy | best candidate | port | policy speed-up over the port |", "|---|---:|---:|---:|---|---:|---:|",
        ]  # fmt: skip
        out += ["| " + plan_row(m, t, line, t <= plan.get("decode_max", 0)) + " |" for (m, t), line in cells.items()]
    out += write_formats.markdown_lines(result)
    if result.get("sections_s"):
        out += ["", "Section times (s): " + ", ".join(f"{k}: {v}" for k, v in result["sections_s"].items())]
    return "\n".join(out) + "\n"


def plot(result: dict, fig) -> None:
    """GB/s against tokens per write for each shape (the write section), or the plan sweep's policy,
    best candidate and port as a share of the ceiling (a run of the plans section alone), or each
    format's share of its ceiling (a run of the formats section alone)."""
    records = [r for r in result.get("records", []) if "T" in r]
    if records:
        models = [m for m in MODELS if any(r["model"] == m for r in records)]
        axes = fig.subplots(1, len(models), sharey=True, squeeze=False)[0]
        for ax, model in zip(axes, models):
            for m in WRITE_METHODS + [M.CEILING, M.COPY]:
                pts = sorted((r["T"], r["gbps"]) for r in records if r["model"] == model and r["method"] == m and _value(r, "gbps"))
                if pts:
                    style = dict(color="k", linestyle=":" if m == M.COPY else "--") if m in (M.COPY, M.CEILING) else dict(marker="o", markersize=3)
                    ax.plot(*zip(*pts), label=m, **style)
            ax.set_xscale("log", base=2)
            ax.set_title(model, fontsize=9)
            ax.set_xlabel("tokens per write")
        axes[0].set_ylabel("GB/s (bytes as in docs/contract.md)")
        axes[0].legend(fontsize=6)
        return
    swa = [r for r in result.get("swa", []) if _value(r, "gbps")]
    if swa and not _sweep_cells(result):  # a run of the swa section alone
        ax = fig.subplots()
        for m in dict.fromkeys(r["method"] for r in swa):
            pts = sorted((r["T"], r["gbps"]) for r in swa if r["method"] == m)
            ax.plot(*zip(*pts), label=m, marker="o", markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_title(f"sliding-window layer write, {SWA_MODEL}", fontsize=9)
        ax.set_xlabel("tokens per write")
        ax.set_ylabel("GB/s (bytes as in docs/contract.md)")
        ax.legend(fontsize=6)
        return
    cells = _sweep_cells(result)
    if not cells and result.get("formats"):
        write_formats.plot(result, fig)
        return
    decode_max = result.get("plan", {}).get("decode_max", 0)
    shapes = list(dict.fromkeys(m for m, _ in cells))
    axes = fig.subplots(1, len(shapes), sharey=True, squeeze=False)[0]
    names, width = ("policy", "best candidate", "one-program-per-token port"), 0.27
    for ax, shape in zip(axes, shapes):
        tokens = [t for m, t in cells if m == shape]
        for x, t in enumerate(tokens):
            decode = t <= decode_max
            field = "graph_us" if decode else "gbps"
            c = plan_cells(cells[(shape, t)], decode)
            ceil = _value(c["ceiling"], field)
            for i, rec in enumerate((c["policy"], c["best"], c["port"])):
                v = _value(rec, field)
                pct = 100 * ((ceil / v) if decode else (v / ceil)) if v and ceil else 0
                ax.bar(x + (i - 1) * width, pct, width, color=f"C{i}", label=names[i] if x == 0 else None)
        ax.axhline(100, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(tokens)), [_tok(t) for t in tokens], fontsize=8)
        ax.set_xlabel("tokens per write", fontsize=8)
        ax.set_title(shape.replace(" (", "\n("), fontsize=8)
    axes[0].set_ylabel("% of the cast-only scatter of the same bytes\n(decode sizes: its time over the write's)", fontsize=8)
    axes[0].set_ylim(0, 110)
    axes[0].legend(fontsize=7, loc="lower left")


SECTIONS = ("host", "moves", "write", "swa", "plans", "formats")  # in the order they run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(parser, "write")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and calls (fits one 10-minute GPU call)")
    parser.add_argument("--sections", default="host,write,moves", help="comma-separated subset of " + ",".join(SECTIONS))
    args = parser.parse_args()
    plan = SMOKE_PLAN if args.cpu_smoke else QUICK if args.quick else FULL
    args.budget_s = plan.budget_s if args.budget_s is None else args.budget_s
    sections = args.sections.split(",")
    if not set(sections) <= set(SECTIONS):
        parser.error(f"--sections takes {', '.join(SECTIONS)}; got {args.sections}")
    if plan.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark runs on a GPU (--cpu-smoke checks the script on the CPU)")
    rep = report.Report(args, "bench_write", "K/V write", markdown, plot)
    rep.meta["plan"] = plan.name
    run = Run(plan, DryClock() if args.cpu_smoke else GpuClock(), rep)
    run.section("copy ceiling", lambda: rep.meta.update(ceiling_gbps=run.clock.copy_ceiling_gbps()))
    stages = {"host": host_overhead, "moves": bench_moves, "write": bench_write, "swa": bench_swa, "plans": plan_sweep,
              "formats": bench_formats}  # fmt: skip
    for name in SECTIONS:  # moves before the long write section
        if name in sections:
            run.section(name, lambda fn=stages[name]: fn(run))
    run.section("copy ceiling (end)", lambda: rep.meta.update(ceiling_gbps_end=run.clock.copy_ceiling_gbps()))
    rep.save(final=True)
    return 1 if rep.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
