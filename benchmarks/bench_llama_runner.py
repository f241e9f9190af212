"""Decode speed of examples/llama_runner.py on a GPU, and the share of a step spent in set_kv_buffer.

The model is Llama-3-8B's shape with 4 of its 32 layers (hidden 4096, 32 query / 8 KV heads x 128,
intermediate 14336, the full 128256-token vocabulary, rope theta 5e5), random bf16 weights, and an
FP8 e4m3 pool (per-layer scale tensors of 1.0) with page size 16. For each batch size, ``batch``
prompts of ``--prompt-len`` tokens are prefilled in one step, then every step decodes all of them
(no request finishes while measured), each step being the runner's whole loop: schedule (slot
allocation, request table, attention metadata), forward, greedy token to the host, bookkeeping.

1. ``--warmup`` steps untimed, then ``--steps`` steps each timed between CUDA synchronisations:
   median step time -> decode steps/s and tokens/s.
2. ``--steps`` more with ``pool.set_kv_buffer`` wrapped in ``time.perf_counter`` calls: host time
   inside set_kv_buffer over the steps' wall time (the call is asynchronous, so its host time is its
   cost to a host-bound eager step), per call (median, p90, max, mean), against a one-kernel torch op
   timed the same way at the same place (the control: launch-queue waits hit both alike), and the
   pool writer's JIT launches during those steps (a call missing its direct-launch cache).
3. ``--profile-steps`` under ``torch.profiler`` with set_kv_buffer inside
   ``record_function("kvpool.set_kv_buffer")``: the same host share as the profiler sees it, and the
   GPU time of the K/V write kernels (names containing ``store_kv``) over the steps' wall time and
   over all GPU kernel time.

Usage (on a GPU): python benchmarks/bench_llama_runner.py --out DIR
Writes DIR/llama_runner.json (partial results after each batch size) and DIR/llama_runner.md.
``--config tiny --device cpu`` runs the same code at a toy size (no GPU figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
import triton
from torch.autograd import DeviceType

from kvpool import MHATokenToKVPool
from kvpool.checks import resolve_device

_PATH = Path(__file__).resolve().parents[1] / "examples" / "llama_runner.py"
_spec = importlib.util.spec_from_file_location("llama_runner", _PATH)
llama_runner = importlib.util.module_from_spec(_spec)
sys.modules["llama_runner"] = llama_runner  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(llama_runner)

WRITE_RANGE = "kvpool.set_kv_buffer"
WRITE_KERNEL = "store_kv"  # the fused kernel is _store_kv_kernel


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    """One batch size: a pool, a scheduler and a runner with ``batch`` requests prefilled."""

    def __init__(self, model: Any, args: argparse.Namespace, device: torch.device, batch: int) -> None:
        self.device = device
        self.batch = batch
        heads, head_dim, layers = llama_runner.kv_geometry(model)
        decode_steps = args.warmup + 2 * args.steps + args.profile_steps
        new_tokens = decode_steps + 2  # one from the prefill, one to spare: nobody finishes
        context = args.prompt_len + new_tokens
        pages = batch * -(-context // args.page_size)
        dtype = llama_runner.DTYPES[args.pool_dtype]
        self.pool = MHATokenToKVPool(pages * args.page_size, args.page_size, dtype, heads, head_dim, layers, device)
        self.sched = llama_runner.Scheduler(self.pool, batch, context)
        self.runner = llama_runner.LlamaRunner(model, self.pool)
        g = torch.Generator().manual_seed(args.seed + batch)
        vocab = model.config.vocab_size
        for rid in range(batch):
            tokens = torch.randint(vocab, (args.prompt_len,), generator=g).tolist()
            self.sched.add(llama_runner.Request(rid, tokens, new_tokens))
        self.sync()
        start = time.perf_counter()
        first = self.sched.schedule()
        if first is None or not first.is_prefill or len(first.requests) != batch:
            raise RuntimeError(f"expected one prefill of {batch} requests, got {first}")
        self.sched.advance(first, self.runner.forward(first), keep_logits=False)
        self.sync()
        self.prefill_s = time.perf_counter() - start

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> None:
        b = self.sched.schedule()
        if b is None or b.is_prefill or len(b.requests) != self.batch:
            raise RuntimeError(f"expected a decode step of {self.batch} requests")
        self.sched.advance(b, self.runner.forward(b), keep_logits=False)

    def timed_steps(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            self.sync()
            start = time.perf_counter()
            self.step()
            self.sync()
            times.append(time.perf_counter() - start)
        return times

    def wrap_write(self, wrapper: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
        """Route the runner's set_kv_buffer calls through ``wrapper(the bound method)``: an instance
        attribute shadows the method until ``unwrap_write`` deletes it."""
        self.pool.set_kv_buffer = wrapper(self.pool.set_kv_buffer)  # type: ignore[method-assign]

    def unwrap_write(self) -> None:
        del self.pool.set_kv_buffer


def _us_stats(prefix: str, seconds: list[float]) -> dict:
    us = sorted(1e6 * x for x in seconds)
    if not us:
        return {}
    return {
        f"{prefix}_us_median": statistics.median(us),
        f"{prefix}_us_p90": us[min(len(us) - 1, int(0.9 * len(us)))],
        f"{prefix}_us_max": us[-1],
        f"{prefix}_us_mean": sum(us) / len(us),
    }


def host_share(bench: Bench, steps: int) -> dict:
    """Host time inside set_kv_buffer over the wall time of ``steps`` synchronised steps, each call's
    time kept (median, p90 and max next to the mean: a few slow calls move the mean), and, right
    before each call, a one-kernel torch op timed the same way as a control: if the control takes as
    long, the time is the launch queue's (any launch waits), not the write's. The pool writer's JIT
    launches during the steps show a call that misses its direct-launch cache."""
    calls: list[float] = []
    control: list[float] = []
    tiny = torch.zeros(1, device=bench.device)
    out = torch.empty_like(tiny)
    clock = time.perf_counter

    def timing(write: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any, **kwargs: Any) -> None:
            t0 = clock()
            torch.add(tiny, 1.0, out=out)
            t1 = clock()
            write(*args, **kwargs)
            t2 = clock()
            control.append(t1 - t0)
            calls.append(t2 - t1)

        return timed

    writer = bench.pool._writer
    jit_before = writer.jit_launches
    bench.wrap_write(timing)
    try:
        wall = sum(bench.timed_steps(steps))
    finally:
        bench.unwrap_write()
    layers = len(bench.runner.layers)
    return {
        "set_kv_host_share": sum(calls) / wall,
        "set_kv_host_us_per_call": 1e6 * sum(calls) / (steps * layers),
        "control_host_share": sum(control) / wall,
        "step_ms_mean_with_timer": 1e3 * wall / steps,
        "writer_jit_launches_while_timed": writer.jit_launches - jit_before,
        **_us_stats("set_kv_host", calls),
        **_us_stats("control_host", control),
    }


def profile_share(bench: Bench, steps: int) -> dict:
    """The profiler's view: host time in the set_kv_buffer ranges and GPU time of the write kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def ranged(write: Callable[..., None]) -> Callable[..., None]:
        def in_range(*args: Any, **kwargs: Any) -> None:
            with record_function(WRITE_RANGE):
                write(*args, **kwargs)

        return in_range

    activities = [ProfilerActivity.CPU]
    if bench.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    bench.wrap_write(ranged)
    try:
        bench.sync()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                bench.step()
            bench.sync()
            wall_us = 1e6 * (time.perf_counter() - start)
    finally:
        bench.unwrap_write()
    host_us = write_us = gpu_us = 0.0
    write_kernels = 0
    for e in prof.events():
        us = e.time_range.elapsed_us()
        if e.device_type == DeviceType.CPU:
            if e.name == WRITE_RANGE:
                host_us += us
        elif e.name != WRITE_RANGE:  # skip the GPU-side span the profiler adds for a range
            gpu_us += us
            if WRITE_KERNEL in e.name:
                write_us += us
                write_kernels += 1
    layers = len(bench.runner.layers)
    out: dict = {
        "profiled_steps": steps,
        "profiled_step_ms": 1e-3 * wall_us / steps,
        "set_kv_host_share_profiled": host_us / wall_us,
    }
    if bench.device.type == "cuda":
        out.update(
            write_kernel_launches=write_kernels,
            write_kernel_us_per_call=write_us / max(write_kernels, 1),
            write_kernel_share_of_wall=write_us / wall_us,
            write_kernel_share_of_gpu_time=write_us / gpu_us if gpu_us else None,
            gpu_busy_share=gpu_us / wall_us,
            expected_write_calls=steps * layers,
        )
    return out


def bench_batch(model: Any, args: argparse.Namespace, device: torch.device, batch: int) -> dict:
    bench = Bench(model, args, device, batch)
    for _ in range(args.warmup):
        bench.step()
    times = bench.timed_steps(args.steps)
    median = statistics.median(times)
    rec: dict = {
        "batch": batch,
        "context_at_start": args.prompt_len + 1 + args.warmup,
        "prefill_s": bench.prefill_s,
        "step_ms_median": 1e3 * median,
        "step_ms_p10": 1e3 * statistics.quantiles(times, n=10, method="inclusive")[0],
        "step_ms_p90": 1e3 * statistics.quantiles(times, n=10, method="inclusive")[-1],
        "steps_per_s": 1.0 / median,
        "tokens_per_s": batch / median,
    }
    rec.update(host_share(bench, args.steps))
    try:  # the timings above stand even if the profiler fails
        rec.update(profile_share(bench, args.profile_steps))
    except Exception:
        rec["profile_error"] = traceback.format_exc()
    stats = bench.pool.stats
    rec.update(fused_calls=stats.fused_calls, reference_calls=stats.reference_calls, reasons=dict(stats.reasons))
    return rec


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _dist(r: dict, prefix: str, mean: Any = None) -> str:
    """mean; median / p90 / max of a per-call host time, microseconds."""
    mean = r.get(f"{prefix}_us_mean") if mean is None else mean
    if mean is None:
        return "-"
    return f"{mean:.1f}; " + " / ".join(f"{r.get(f'{prefix}_us_{q}', float('nan')):.1f}" for q in ("median", "p90", "max"))


def markdown(meta: dict, records: list) -> str:
    lines = [
        f"# llama_runner decode on {meta['device_name']} ({meta['date']})",
        "",
        f"{meta['model']}; {meta['pool']}; prompts of {meta['prompt_len']} tokens, then decode with every "
        f"request live. torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}. "
        f"Command: `{meta['command']}`",
        "",
        "| batch | decode steps/s | tokens/s | step ms (p10-p90) | set_kv_buffer host share | host us/call "
        "(mean; median / p90 / max) | control us/call (mean; median / p90 / max) | JIT launches while timed "
        "| profiled host share | write kernel share of step | of GPU time | GPU busy | fused / reference calls |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['batch']} | failed: {r['error'].splitlines()[-1]} |" + " |" * 11)
            continue
        lines.append(
            f"| {r['batch']} | {r['steps_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['step_ms_median']:.2f} "
            f"({r['step_ms_p10']:.2f}-{r['step_ms_p90']:.2f}) | {_pct(r['set_kv_host_share'])} "
            f"| {_dist(r, 'set_kv_host', r['set_kv_host_us_per_call'])} | {_dist(r, 'control_host')} "
            f"| {r.get('writer_jit_launches_while_timed', '-')} | {_pct(r.get('set_kv_host_share_profiled'))} "
            f"| {_pct(r.get('write_kernel_share_of_wall'))} | {_pct(r.get('write_kernel_share_of_gpu_time'))} "
            f"| {_pct(r.get('gpu_busy_share'))} | {r['fused_calls']} / {r['reference_calls']} |"
        )
    lines += [
        "",
        "Step: schedule + forward + greedy token to the host, timed between CUDA synchronisations (median of "
        f"{meta['steps']} after {meta['warmup']} warm-up steps). Host share: time inside `set_kv_buffer` "
        "(perf_counter around each call) over the steps' wall time; control: a one-kernel torch op timed "
        "the same way right before each call (as long as the write: the launch queue makes every launch "
        "wait; much shorter: the time is the write's own); JIT launches: the pool writer's launches through "
        "Triton's JIT during those steps (0 when every call hits its direct-launch cache); profiled: the "
        "same host share under torch.profiler "
        f"({meta['profile_steps']} steps, `record_function`). Write kernel: GPU time of kernels named "
        f"`*{WRITE_KERNEL}*` over the profiled steps' wall time and over all kernel time.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--config", choices=sorted(llama_runner.SHAPES), default="8b-4layer")
    p.add_argument("--vocab", type=int, help="override the vocabulary size (default: the preset's)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-dtype", choices=sorted(llama_runner.DTYPES), default="fp8_e4m3")
    p.add_argument("--model-dtype", choices=llama_runner.MODEL_DTYPES, default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: run on a GPU, or pass --device cpu --config tiny for a toy run")
        return 2
    device = resolve_device(args.device)  # "cuda" -> the current device, where the pool launches
    os.makedirs(args.out, exist_ok=True)
    shape = llama_runner.SHAPES[args.config]
    if args.vocab is not None:
        shape = replace(shape, vocab=args.vocab)
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": llama_runner.transformers.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/bench_llama_runner.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": f"LlamaForCausalLM ({shape.describe()}), {args.model_dtype} weights",
        "pool": f"{args.pool_dtype} pool, page size {args.page_size}, scale 1.0 tensors",
        "prompt_len": args.prompt_len,
        "warmup": args.warmup,
        "steps": args.steps,
        "profile_steps": args.profile_steps,
    }
    log(f"[bench] {meta['device_name']}: {meta['model']}, {meta['pool']}")
    start = time.perf_counter()
    model = llama_runner.build_model(shape, llama_runner.DTYPES[args.model_dtype], device, args.seed)
    meta["model_build_s"] = time.perf_counter() - start
    records: list = []
    status = 0
    json_path = os.path.join(args.out, "llama_runner.json")
    for batch in args.batches:
        log(f"[bench] batch {batch}")
        try:
            rec = bench_batch(model, args, device, batch)
            log(
                f"[bench] batch {batch}: {rec['steps_per_s']:.1f} steps/s, set_kv_buffer host share "
                f"{_pct(rec['set_kv_host_share'])}, write kernels {_pct(rec.get('write_kernel_share_of_wall'))} "
                f"of the step"
            )
            if rec["reference_calls"] and device.type == "cuda":
                log(f"[bench] batch {batch}: {rec['reference_calls']} writes took the reference path: {rec['reasons']}")
                status = 1
            if "profile_error" in rec:
                log(f"[bench] batch {batch}: profiling failed:\n{rec['profile_error']}")
                status = 1
        except Exception:
            rec = {"batch": batch, "error": traceback.format_exc()}
            log(rec["error"])
            status = 1
        records.append(rec)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        with open(json_path, "w") as f:  # partial results survive a later failure
            json.dump({"meta": meta, "records": records, "partial": True}, f, indent=1)
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    md = markdown(meta, records)
    with open(os.path.join(args.out, "llama_runner.md"), "w") as f:
        f.write(md)
    print(md)
    return status


if __name__ == "__main__":
    sys.exit(main())
