"""The model runners' decode step on a GPU (examples/llama_runner.py, examples/qwen35_runner.py), and
the shares of a step spent in the pool's K/V writes and in the scheduler's slot-allocator calls.

``--model llama``: Llama-3-8B's shape with 4 of its 32 layers (hidden 4096, 32 query / 8 KV heads x
128, intermediate 14336, the full 128256-token vocabulary), random bf16 weights, an FP8 e4m3 pool
(scales of 1.0) with page size 16. ``--model qwen3.5``: Qwen3.5-397B's attention and Gated DeltaNet
geometry in 4 layers (3 linear + 1 gated attention, 32 query / 2 KV heads x 256, DeltaNet 16 key /
64 value heads x 128), random bf16 weights, an FP8 KV pool with page size 64 and float32 recurrent
states in a MambaPool; with ``--spec-widths``, speculative decoding with verify blocks of that many
tokens (the runner's layer-skipping self-draft, whose acceptance on random weights says nothing
about a trained model's: read the step time at a width, the tokens per second only with that rate).

For each batch size (and width), ``batch`` prompts of ``--prompt-len`` tokens are prefilled in one
step, then every step decodes all of them (no request finishes while measured); a step is the
runner's whole loop: schedule, forward, greedy tokens to the host, bookkeeping.

1. ``--warmup`` steps untimed, then ``--steps`` steps each timed between CUDA synchronisations:
   the median step -> steps/s and tokens/s.
2. ``--steps`` more with the pool's K/V writes (``set_kv_buffer``, ``set_kv_buffer_prefix_valid``)
   timed by ``time.perf_counter`` around each call: their host time over the steps' wall time (the
   call is asynchronous, so its host time is its cost to a host-bound eager step), per call (median,
   p90, max, mean), against a one-kernel torch op timed the same way right before each call (the
   control: launch-queue waits hit both alike), and the writes that went through Triton's JIT; in
   the same steps, the host time inside the scheduler's slot-allocator calls over the wall time.
   Then ``--steps`` more in which each write is made twice in a row (the same bytes to the same
   slots), each timed: the second call finds the CPU's caches holding what the first loaded, so
   the two medians split a write's host time in the step into its own and what the model's work
   between writes evicted.
3. ``--profile-steps`` (0: none) under ``torch.profiler``: the same host share as the profiler sees
   it, and the GPU time of the K/V write kernels (names containing ``store_kv``) over the steps'
   wall time and over all GPU kernel time.

Usage (on a GPU): python benchmarks/bench_runner.py --model llama --out DIR
``--cpu-smoke`` runs the same code with the runner's ``tiny`` shape on the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import report  # noqa: E402

SMOKE = report.interpret_if_smoke()

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

import llama_runner  # noqa: E402
import qwen35_runner  # noqa: E402
from support import runners as rc  # noqa: E402  (examples/support/runners: the runners' shared code)

from kvpool.checks import resolve_device  # noqa: E402

WRITES = ("set_kv_buffer", "set_kv_buffer_prefix_valid")
WRITE_RANGE = "kvpool.kv_write"
WRITE_KERNEL = "store_kv"  # the fused write kernel's name contains it
MODELS = {
    "llama": dict(module=llama_runner, config="8b-4layer", page_size=16, prompt_len=512, batches=[1, 16, 64]),
    "qwen3.5": dict(module=qwen35_runner, config="397b-4layer", page_size=64, prompt_len=256, batches=[1, 8, 32]),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(args: argparse.Namespace, device: torch.device) -> Any:
    shape = MODELS[args.model]["module"].SHAPES[args.config]
    if args.vocab is not None:
        shape = replace(shape, vocab=args.vocab)
    dtype = rc.DTYPES[args.model_dtype]
    if args.model == "llama":
        return shape, llama_runner.build_model(shape, dtype, device, args.seed)
    return shape, qwen35_runner.build_model(qwen35_runner.text_config(shape).to_dict(), dtype, device, args.seed)


class Case:
    """One batch size (and verify width): pools, scheduler and runner with ``batch`` requests prefilled."""

    def __init__(self, model: Any, shape: Any, args: argparse.Namespace, device: torch.device, batch: int, width: Optional[int]) -> None:
        self.device, self.batch, self.width = device, batch, width
        steps = args.warmup + 3 * args.steps + args.profile_steps  # timed, host share, writes twice
        new_tokens = steps * (width or 1) + 2  # nobody finishes while measured
        cfg = rc.RunConfig(
            shape=shape, model_dtype=args.model_dtype, pool_dtypes=(args.pool_dtype,), batch=batch,
            prompt_len=(args.prompt_len, args.prompt_len), new_tokens=(new_tokens, new_tokens), page_size=args.page_size,
            device=str(device),
        )  # fmt: skip
        arch = llama_runner.LLAMA if args.model == "llama" else qwen35_runner.Qwen35(width)
        self.pool = arch.make_pool(cfg, model, rc.DTYPES[args.pool_dtype])
        #: The pool the attention layers write through, and the writer behind it.
        self.write_pool = getattr(self.pool, "kv", self.pool)
        self.writer = getattr(getattr(self.write_pool, "full_kv_pool", self.write_pool), "writer", None)
        self.sched = arch.scheduler(self.pool, batch, cfg.max_context_len, None)
        self.runner = arch.runner(model, self.pool, None)
        g = torch.Generator().manual_seed(args.seed + batch)
        for rid in range(batch):
            self.sched.add(rc.Request(rid, torch.randint(model.config.vocab_size, (args.prompt_len,), generator=g).tolist(), new_tokens))
        sync(device)
        start = time.perf_counter()
        if self.runner.step(self.sched, keep_logits=False) != "prefill" or len(self.sched.running) != batch:
            raise RuntimeError(f"expected one prefill of {batch} requests")
        sync(device)
        self.prefill_s = time.perf_counter() - start

    def step(self) -> int:
        """One step of every request; returns the tokens it made."""
        before = sum(len(r.output) for r in self.sched.running)
        kind = self.runner.step(self.sched, keep_logits=False)
        if kind not in ("decode", "verify") or len(self.sched.running) != self.batch:
            raise RuntimeError(f"expected a {'verify' if self.width else 'decode'} step of {self.batch} requests, got {kind}")
        return sum(len(r.output) for r in self.sched.running) - before

    def timed_steps(self, n: int) -> tuple[list[float], list[int]]:
        times, made = [], []
        for _ in range(n):
            sync(self.device)
            start = time.perf_counter()
            made.append(self.step())
            sync(self.device)
            times.append(time.perf_counter() - start)
        return times, made

    def wrapped(self, wrapper: Callable[[Callable[..., None]], Callable[..., None]]):
        """Route the pool's K/V writes through ``wrapper(bound method)`` while the block runs: an
        instance attribute shadows each method until it is deleted again."""
        return _Shadowed(self.write_pool, WRITES, wrapper)


class _Shadowed:
    """``wrapper(bound method)`` shadows each of ``names`` on ``obj`` (an instance attribute) while
    the block runs."""

    def __init__(self, obj: Any, names: tuple[str, ...], wrapper: Callable) -> None:
        self.obj, self.names, self.wrapper = obj, names, wrapper

    def __enter__(self) -> None:
        for name in self.names:
            setattr(self.obj, name, self.wrapper(getattr(self.obj, name)))

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            delattr(self.obj, name)


#: The scheduler's calls of its slot allocator in a step, timed for the allocator's share.
ALLOCATOR_CALLS = ("alloc", "alloc_extend", "alloc_decode", "free", "free_group_begin", "free_group_end")


def _us_stats(prefix: str, seconds: list[float]) -> dict:
    us = sorted(1e6 * x for x in seconds)
    if not us:
        return {}
    return {f"{prefix}_us_median": statistics.median(us), f"{prefix}_us_p90": us[min(len(us) - 1, int(0.9 * len(us)))],
            f"{prefix}_us_max": us[-1], f"{prefix}_us_mean": sum(us) / len(us)}  # fmt: skip


def host_share(case: Case, steps: int) -> dict:
    """Host time inside the K/V writes over the wall time of ``steps`` synchronised steps, each call's
    time kept, and a one-kernel torch op timed right before each call as a control."""
    calls: list[float] = []
    control: list[float] = []
    tiny = torch.zeros(1, device=case.device)
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

    allocator_calls: list[float] = []

    def allocator_timing(call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            out = call(*args, **kwargs)
            allocator_calls.append(clock() - t0)
            return out

        return timed

    allocator = case.sched.allocator
    jit_before = case.writer.jit_launches if case.writer is not None else 0
    with case.wrapped(timing), _Shadowed(allocator, ALLOCATOR_CALLS, allocator_timing):
        wall = sum(case.timed_steps(steps)[0])
    return {
        "allocator_host_share": sum(allocator_calls) / wall,
        "allocator_calls_per_step": len(allocator_calls) / steps,
        **_us_stats("allocator_host", allocator_calls),
        "set_kv_host_share": sum(calls) / wall,
        "set_kv_host_us_per_call": 1e6 * sum(calls) / max(len(calls), 1),
        "write_calls_per_step": len(calls) / steps,
        "control_host_share": sum(control) / wall,
        "writer_jit_launches_while_timed": case.writer.jit_launches - jit_before if case.writer is not None else None,
        **_us_stats("set_kv_host", calls),
        **_us_stats("control_host", control),
    }


def host_repeat(case: Case, steps: int) -> dict:
    """Host microseconds of each write in the step and of the same write made again right after it
    (idempotent: the same bytes to the same slots), medians over ``steps`` steps."""
    first: list[float] = []
    again: list[float] = []
    clock = time.perf_counter

    def twice(write: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any, **kwargs: Any) -> None:
            t0 = clock()
            write(*args, **kwargs)
            t1 = clock()
            write(*args, **kwargs)
            t2 = clock()
            first.append(t1 - t0)
            again.append(t2 - t1)

        return timed

    with case.wrapped(twice):
        case.timed_steps(steps)
    return {
        "set_kv_first_us_median": 1e6 * statistics.median(first) if first else None,
        "set_kv_again_us_median": 1e6 * statistics.median(again) if again else None,
    }


def profile_share(case: Case, steps: int) -> dict:
    """The profiler's view: host time in the K/V write ranges and GPU time of the write kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def ranged(write: Callable[..., None]) -> Callable[..., None]:
        def in_range(*args: Any, **kwargs: Any) -> None:
            with record_function(WRITE_RANGE):
                write(*args, **kwargs)

        return in_range

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if case.device.type == "cuda" else [])
    with case.wrapped(ranged):
        sync(case.device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                case.step()
            sync(case.device)
            wall_us = 1e6 * (time.perf_counter() - start)
    host_us = write_us = gpu_us = 0.0
    for e in prof.events():
        us = e.time_range.elapsed_us()
        if e.device_type == DeviceType.CPU:
            host_us += us if e.name == WRITE_RANGE else 0.0
        elif e.name != WRITE_RANGE:  # the GPU-side span the profiler adds for a range is not a kernel
            gpu_us += us
            write_us += us if WRITE_KERNEL in e.name else 0.0
    out: dict = {"profiled_steps": steps, "profiled_step_ms": 1e-3 * wall_us / steps, "set_kv_host_share_profiled": host_us / wall_us}
    if case.device.type == "cuda":
        out.update(write_kernel_share_of_wall=write_us / wall_us, write_kernel_share_of_gpu_time=write_us / gpu_us if gpu_us else None,
                   gpu_busy_share=gpu_us / wall_us)  # fmt: skip
    return out


def bench_case(model: Any, shape: Any, args: argparse.Namespace, device: torch.device, batch: int, width: Optional[int]) -> dict:
    case = Case(model, shape, args, device, batch, width)
    for _ in range(args.warmup):
        case.step()
    times, made = case.timed_steps(args.steps)
    median = statistics.median(times)
    deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [median] * 9
    tokens_per_step = sum(made) / len(made)
    rec: dict = {
        "batch": batch, "spec_width": width, "prefill_s": case.prefill_s, "step_ms_median": 1e3 * median,
        "step_ms_p10": 1e3 * deciles[0], "step_ms_p90": 1e3 * deciles[-1], "steps_per_s": 1.0 / median,
        "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / median,
    }  # fmt: skip
    rec.update(host_share(case, args.steps))
    if args.profile_steps:
        try:  # the timings above stand even if the profiler fails
            rec.update(profile_share(case, args.profile_steps))
        except Exception:
            rec["profile_error"] = traceback.format_exc()
    stats = case.write_pool.stats
    rec.update(fused_calls=stats.fused_calls, reference_calls=stats.reference_calls, reasons=dict(stats.reasons))
    rec.update(host_repeat(case, args.steps))  # last: its doubled writes stay out of the counts above
    return rec


# --- the report ---------------------------------------------------------------------------------------


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _us(x: Any) -> str:
    return "-" if x is None else f"{x:.1f}"


def _dist(r: dict, prefix: str, mean: Any = None) -> str:
    """mean; median / p90 / max of a per-call host time, microseconds."""
    mean = r.get(f"{prefix}_us_mean") if mean is None else mean
    if mean is None:
        return "-"
    return f"{mean:.1f}; " + " / ".join(f"{r.get(f'{prefix}_us_{q}', float('nan')):.1f}" for q in ("median", "p90", "max"))


def markdown(result: dict) -> str:
    meta, records = result["meta"], result["records"]
    profiled = meta.get("profile_steps", 0) > 0
    lines = [
        f"{meta['model']}; {meta['pool']}; prompts of {meta['prompt_len']} tokens, then decode with every request live. "
        f"transformers {meta.get('transformers', 'unknown')}.",
        "",
        "| batch | step | steps/s | tokens/s | step ms (p10-p90) | allocator host share (us/call median) "
        "| K/V write host share | host us/call (mean; median / p90 / max) "
        "| control us/call (mean; median / p90 / max) | write twice in a row: first / again (median us) "
        "| writes through the JIT while timed"
        + (" | profiled host share | write kernels of the step | of GPU time | GPU busy" if profiled else "") + " | fused / reference calls |",
        "|---|---|---:|---:|---|---|---:|---|---|---|---:|" + ("---:|---:|---:|---:|" if profiled else "") + "---|",
    ]  # fmt: skip
    for r in records:
        step = "decode" if not r.get("spec_width") else f"verify {r['spec_width']}"
        if "error" in r:
            lines.append(f"| {r['batch']} | {step} | failed: {r['error'].strip().splitlines()[-1]} |")
            continue
        prof = (f" | {_pct(r.get('set_kv_host_share_profiled'))} | {_pct(r.get('write_kernel_share_of_wall'))} "
                f"| {_pct(r.get('write_kernel_share_of_gpu_time'))} | {_pct(r.get('gpu_busy_share'))}") if profiled else ""  # fmt: skip
        lines.append(
            f"| {r['batch']} | {step} | {r['steps_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['step_ms_median']:.2f} "
            f"({r['step_ms_p10']:.2f}-{r['step_ms_p90']:.2f}) "
            f"| {_pct(r.get('allocator_host_share'))} ({_us(r.get('allocator_host_us_median'))}) | {_pct(r['set_kv_host_share'])} "
            f"| {_dist(r, 'set_kv_host', r['set_kv_host_us_per_call'])} | {_dist(r, 'control_host')} "
            f"| {_us(r.get('set_kv_first_us_median'))} / {_us(r.get('set_kv_again_us_median'))} "
            f"| {r.get('writer_jit_launches_while_timed', '-')}{prof} | {r['fused_calls']} / {r['reference_calls']} |"
        )
    lines += [
        "",
        "Step: schedule + forward + greedy tokens to the host, timed between CUDA synchronisations (median of "
        f"{meta['steps']} after {meta['warmup']} warm-up steps); tokens/s counts the tokens the steps made. Allocator host "
        "share: time inside the scheduler's slot-allocator calls (perf_counter around each) over the steps' wall time. Host share: "
        "time inside the pool's K/V writes (perf_counter around each call) over the steps' wall time; control: a "
        "one-kernel torch op timed the same way right before each call (as long as the write: the launch queue makes "
        "every launch wait; much shorter: the time is the write's own); write twice in a row: further steps in which "
        "each write is made again at once (the same bytes), each call timed: the second finds the CPU's caches warm; JIT: the writes that went through Triton's JIT "
        "instead of the compiled kernel (0 when every call hits its launch cache)"
        + (f"; profiled: the same host share under torch.profiler ({meta['profile_steps']} steps), and the GPU time of "
           f"kernels named `*{WRITE_KERNEL}*` over the steps' wall time and over all kernel time" if profiled else "") + ".",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict, fig) -> None:
    """Steps per second and the K/V writes' host share, per batch size (and verify width)."""
    rows = [r for r in result["records"] if "error" not in r]
    labels = [f"batch {r['batch']}" + (f"\nverify {r['spec_width']}" if r.get("spec_width") else "") for r in rows]
    left, right = fig.subplots(1, 2)
    left.bar(range(len(rows)), [r["steps_per_s"] for r in rows], color="C0")
    left.set_xticks(range(len(rows)), labels, fontsize=8)
    left.set_ylabel("decode steps per second")
    left.set_title(result["meta"].get("title", ""), fontsize=9)
    right.bar(range(len(rows)), [100 * r["set_kv_host_share"] for r in rows], color="C1", label="K/V writes")
    right.bar(range(len(rows)), [100 * r.get("control_host_share", 0) for r in rows], color="C2", width=0.4, label="control (one torch op)")
    right.set_xticks(range(len(rows)), labels, fontsize=8)
    right.set_ylabel("% of the step's wall time on the host")
    right.legend(fontsize=7)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(p, "runner-MODEL")
    p.add_argument("--model", choices=sorted(MODELS), default="llama", help="which runner")
    p.add_argument("--config", help="the runner's shape preset (default: llama 8b-4layer, qwen3.5 397b-4layer)")
    p.add_argument("--vocab", type=int, help="override the vocabulary size (default: the preset's)")
    p.add_argument("--batches", type=int, nargs="+", help="requests decoding at once (default: llama 1 16 64, qwen3.5 1 8 32)")
    p.add_argument("--spec-widths", type=int, nargs="*", default=None,
                   help="qwen3.5: verify block sizes (last token + drafts) measured beside plain decode (default 4 16)")
    p.add_argument("--prompt-len", type=int, help="tokens of each prompt (default: llama 512, qwen3.5 256)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps")
    p.add_argument("--steps", type=int, default=100, help="timed steps (and as many for the host share)")
    p.add_argument("--profile-steps", type=int, default=10, help="steps under torch.profiler (0: none)")
    p.add_argument("--page-size", type=int, help="slots per page (default: llama 16, qwen3.5 64)")
    p.add_argument("--pool-dtype", choices=sorted(rc.DTYPES), default="fp8_e4m3", help="KV pool dtype")
    p.add_argument("--model-dtype", choices=rc.MODEL_DTYPES, default="bf16", help="weights and activations")
    p.add_argument("--device", default="cuda", help="cuda, or cpu (with --config tiny) for a toy run")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and the prompts")
    args = p.parse_args(argv)
    spec = MODELS[args.model]
    if args.name == "runner-MODEL":
        args.name = f"runner-{args.model}"
    if args.cpu_smoke:
        args.config, args.device, args.batches = "tiny", "cpu", args.batches or [1, 2]
        args.prompt_len, args.warmup, args.steps, args.profile_steps = 8, 1, 2, 1
        args.spec_widths = [4] if args.model == "qwen3.5" and args.spec_widths is None else args.spec_widths
    if args.model == "llama" and args.spec_widths:
        p.error("--spec-widths needs --model qwen3.5 (the Llama runner has no verify step)")
    args.config = args.config or spec["config"]
    args.batches = args.batches or spec["batches"]
    args.prompt_len = args.prompt_len or spec["prompt_len"]
    args.page_size = args.page_size or spec["page_size"]
    widths = [None, *(args.spec_widths if args.spec_widths is not None else ([4, 16] if args.model == "qwen3.5" else []))]
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU, or pass --cpu-smoke for a toy run")
    device = resolve_device(args.device)  # "cuda" -> the current device, where the pool launches
    rep = report.Report(args, "bench_runner", f"{'Llama' if args.model == 'llama' else 'Qwen3.5'} runner decode", markdown, plot)
    shape, model = build_model(args, device)
    family = "LlamaForCausalLM" if args.model == "llama" else "Qwen3_5MoeForCausalLM"
    rep.meta.update(
        family=args.model, model=f"{family} ({shape.describe()}), {args.model_dtype} weights",
        pool=f"{args.pool_dtype} pool, page size {args.page_size}, scales 1.0", prompt_len=args.prompt_len, warmup=args.warmup,
        steps=args.steps, profile_steps=args.profile_steps, transformers=rc.transformers.__version__ if hasattr(rc, "transformers") else None,
    )  # fmt: skip
    rep.result["records"] = []
    with rc.cpu_threads(rc.RunConfig(shape=shape, device=str(device))), torch.no_grad():
        for batch in args.batches:
            for width in widths:
                what = f"batch {batch}" + (f", verify blocks of {width}" if width else "")
                if rep.over_budget(what):
                    continue
                rep.log(what)
                try:
                    rec = bench_case(model, shape, args, device, batch, width)
                    rep.log(f"{what}: {rec['steps_per_s']:.1f} steps/s, {rec['tokens_per_s']:,.0f} tokens/s, K/V write host share "
                            f"{_pct(rec['set_kv_host_share'])}")  # fmt: skip
                    if rec["reference_calls"] and device.type == "cuda":
                        rep.error(f"{what}: writes on the reference path", RuntimeError(str(rec["reasons"])))
                    if "profile_error" in rec:
                        rep.error(f"{what}: profiling", RuntimeError(rec["profile_error"].strip().splitlines()[-1]))
                except Exception as exc:
                    rec = {"batch": batch, "spec_width": width, "error": traceback.format_exc()}
                    rep.error(what, exc)
                rep.result["records"].append(rec)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rep.save()
    rep.save(final=True)
    return 1 if rep.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
