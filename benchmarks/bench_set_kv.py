"""The K/V write on a GPU: kvpool's fused path against the alternatives, in one process.

For each model shape and token count it times (a) ``MHATokenToKVPool.set_kv_buffer`` on the fused
path (and the same kernel built with div.rn instead of the reciprocal-and-FMA division), (b)
kvpool's reference path, (c) SGLang's eager fallback, (d) ``torch.compile`` of an FP8 ``index_copy_``
write, (e) a straightforward Triton port of the seed kernel, and (f) measures the device-to-device
copy ceiling (a 2 GiB copy) and a copy of the same number of bytes as each write.

Device time is measured inside replayed CUDA graphs (benchmarks/timing.py) with L2 flushed before
every call, so host launch cost never leaks into it; GB/s by SPEC section 6 from that time. Decode
sizes also report the time per layer write in a graph of 64 writes cycling over 8 layers (no
flush), and the wall time per call issued eagerly back to back (host-bound). Medians throughout.
Writes JSON, a Markdown table and a PNG plot.

Usage (on a GPU): python benchmarks/bench_set_kv.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from timing import flush_buffer, graph_us  # noqa: E402

from kvpool import MHATokenToKVPool, reference_set_kv_buffer  # noqa: E402

MODELS = {  # name: (KV heads per rank, head_dim)
    "Llama-3-8B (H=8, D=128)": (8, 128),
    "Llama-3-70B TP8 (H=1, D=128)": (1, 128),
    "Qwen3.5-397B TP8 (H=1, D=256)": (1, 256),
    "odd (H=3, D=96)": (3, 96),
}
TOKENS = [1, 32, 128, 256, 4096, 8192, 16384, 32768]
DECODE_MAX = 256
SLOTS = 1 << 20
LAYERS = 8  # graph replays cycle through layers, as a model's step does
GRAPH_WRITES = 64
METHODS = [
    "kvpool fused",
    "kvpool fused (div.rn)",
    "kvpool reference",
    "SGLang fallback",
    "torch.compile index_copy_",
    "straightforward Triton",
]
FP8 = torch.float8_e4m3fn


def log(msg: str) -> None:
    print(msg, flush=True)


def copy_ceiling_gbps() -> float:
    """The device-to-device copy ceiling: a 2 GiB ``copy_`` timed eagerly with CUDA events (read +
    write counted). Eager on purpose: inside a CUDA graph a D2D memcpy becomes a memcpy node that
    ran markedly slower on the H200 (2.7 TB/s against 4.2 TB/s)."""
    n = 2 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(12):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    return 2 * n / (statistics.median(times[2:]) * 1e-3) / 1e9


def same_bytes_copy_gbps(nbytes: int, flush) -> float:
    """A copy kernel moving the same bytes as a write (nbytes/2 read, nbytes/2 written), timed like
    the writes (graph replay, L2 flushed): what any kernel of that size can reach."""
    n = max(1, nbytes // 8)
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us(lambda i: torch.bitwise_not(src, out=dst), calls=10, flush=flush)
    del src, dst
    return 8 * n / (us * 1e-6) / 1e9


def wall_us_per_call(fn, n: int = 400) -> float:
    """Host-inclusive time per call with calls issued back to back (what an eager decode pays)."""
    for i in range(10):
        fn(i % LAYERS)
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i % LAYERS)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def bytes_moved(t: int, h: int, d: int, in_size: int = 2, pool_size: int = 1, loc_size: int = 8) -> int:
    return t * (h * d + h * d) * (in_size + pool_size) + t * loc_size


def bench_shape(name: str, h: int, d: int, tokens: list[int], ceiling: float, records: list, flush) -> None:
    pool = MHATokenToKVPool(SLOTS, 1, FP8, h, d, LAYERS, "cuda")
    from kvpool.kernels import store_kv

    divrn = store_kv.PreparedLaunch(
        h, d, h, d, FP8, tuple(pool.k_buffer[0].stride()), tuple(pool.v_buffer[0].stride()),
        SLOTS + 1, soft_cast=False, fast_div=False,
    )  # fmt: skip
    kviews = [pool.get_key_buffer(i) for i in range(LAYERS)]
    vviews = [pool.get_value_buffer(i) for i in range(LAYERS)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = torch.tensor([0.37], device="cuda")
    one = torch.tensor([1.0], device="cuda")  # SGLang divides its inputs in place: 1.0 keeps them unchanged
    for t in tokens:
        xk = (torch.randn(t, h, d, device="cuda", generator=gen) * 60).to(torch.bfloat16)
        xv = (torch.randn(t, h, d, device="cuda", generator=gen) * 60).to(torch.bfloat16)
        xk_s, xv_s = xk.clone(), xv.clone()
        loc = torch.randperm(SLOTS, device="cuda", generator=gen)[:t] + 1
        fns = {
            "kvpool fused": lambda i: pool.set_kv_buffer(None, loc, xk, xv, scale, scale, layer_id_override=i),
            "kvpool fused (div.rn)": lambda i: divrn(xk, xv, pool.k_buffer[i], pool.v_buffer[i], loc, scale, scale),
            "kvpool reference": lambda i: reference_set_kv_buffer(xk, xv, kviews[i], vviews[i], loc, scale, scale),
            "SGLang fallback": lambda i: peers.sglang_fallback(
                xk_s, xv_s, pool.k_buffer[i], pool.v_buffer[i], loc, one, one, FP8
            ),
            "torch.compile index_copy_": lambda i: peers.compiled_index_copy(
                xk, xv, kviews[i], vviews[i], loc, scale, scale
            ),
            "straightforward Triton": lambda i: peers.straightforward_triton(
                xk, xv, pool.k_buffer[i], pool.v_buffer[i], loc, scale, scale, FP8
            ),
        }
        nbytes = bytes_moved(t, h, d)
        same = same_bytes_copy_gbps(nbytes, flush)
        records.append({"model": name, "H": h, "D": d, "T": t, "method": "same-bytes copy", "bytes": nbytes,
                        "gbps": same, "ceiling_frac": same / ceiling})  # fmt: skip
        row = [f"same-bytes copy={same:.0f}GB/s"]
        for method, fn in fns.items():
            rec = {"model": name, "H": h, "D": d, "T": t, "method": method, "bytes": nbytes}
            try:
                fn(0)
                torch.cuda.synchronize()
                us = graph_us(lambda i: fn(i % LAYERS), calls=10, flush=flush)
                rec["device_us"] = us
                rec["gbps"] = nbytes / (us * 1e-6) / 1e9
                rec["ceiling_frac"] = rec["gbps"] / ceiling
                if t <= DECODE_MAX:
                    rec["wall_us"] = wall_us_per_call(fn)
                    rec["graph_us"] = graph_us(lambda i: fn(i % LAYERS), calls=GRAPH_WRITES)
            except Exception as exc:  # a peer failing must not stop the run; it is reported
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            records.append(rec)
            row.append(f"{method}={rec.get('gbps', float('nan')):.0f}GB/s")
        log(f"  {name} T={t}: " + ", ".join(row))
        del xk, xv, xk_s, xv_s, loc
    del pool, kviews, vviews
    torch.cuda.empty_cache()


def host_overhead(records: dict) -> None:
    """Host time of an eager set_kv_buffer call against launching the same compiled kernel
    directly with prepared arguments (Triton's normal launch path, no checks, no gate)."""
    from kvpool.kernels import store_kv

    h, d = 1, 128
    pool = MHATokenToKVPool(4096, 1, FP8, h, d, 1, "cuda")
    x = torch.randn(1, h, d, device="cuda").to(torch.bfloat16)
    loc = torch.tensor([5], device="cuda")
    scale = torch.tensor([0.37], device="cuda")
    launch = pool._launch
    kb, vb = pool.k_buffer[0], pool.v_buffer[0]
    kst, vst = x.stride(), x.stride()
    args = (x, x, kb, vb, loc, scale, scale, 1.0, 1.0, 0, 0, 1, launch.capacity, 1, *kst, *vst, *launch.cache_strides)
    variant = launch.variant_for(x.stride(), x.stride(), (2, 2))
    consts = variant.constexprs[(2, 2)]
    grid = (1, variant.grid_y, 1)
    kernel = store_kv._k._store_kv_kernel
    compiled = kernel[grid](*args, **consts)
    const_args = variant.constexpr_args[(2, 2)]
    calls = {
        "direct kernel launch": lambda: kernel[grid](*args, **consts),
        "compiled kernel launch": lambda: compiled[grid](*args, *const_args),
        "PreparedLaunch": lambda: launch(x, x, kb, vb, loc, scale, scale),
        "set_kv_buffer": lambda: pool.set_kv_buffer(None, loc, x, x, scale, scale, layer_id_override=0),
        "set_kv_buffer (float scale)": lambda: pool.set_kv_buffer(None, loc, x, x, 0.37, 0.37, layer_id_override=0),
    }
    n = 3000
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        runs = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
        records[name] = statistics.median(runs)
    records["set_kv_buffer minus direct kernel launch"] = records["set_kv_buffer"] - records["direct kernel launch"]
    records["set_kv_buffer minus compiled kernel launch"] = records["set_kv_buffer"] - records["compiled kernel launch"]
    log("  host us/call: " + ", ".join(f"{k}={v:.2f}" for k, v in records.items()))


def markdown(meta: dict, records: list, host: dict) -> str:
    by = {(r["model"], r["T"], r["method"]): r for r in records}
    out = [
        f"Date: {meta['date']}  ",
        f"GPU: {meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}, Python {meta['python']}  ",
        f"Command: `{meta['command']}`  ",
        f"Copy ceiling (2 GiB device-to-device copy_, read + write, eager events): **{meta['ceiling_gbps']:.0f} GB/s** "
        f"(start of run; {meta.get('ceiling_gbps_end', float('nan')):.0f} GB/s at the end)  ",
        "Same-bytes copy: an elementwise int32 copy kernel moving the same bytes as the write, timed the same way.  ",
        "Pool: FP8 e4m3fn, 1M slots, random slots; inputs bf16 [T, H, D]; per-tensor float32 scale tensor; int64 loc.",
        "",
        "### Throughput: GB/s by SPEC section 6 (percent of the copy ceiling); device time in CUDA-graph replays, L2 flushed before each call",
        "",
        "| model | T | same-bytes copy | " + " | ".join(METHODS) + " | fused / straightforward | fused / compile |",
        "|---|---:|---:|" + "---:|" * len(METHODS) + "---:|---:|",
    ]
    for model in MODELS:
        for t in TOKENS:
            cells = []
            for m in ["same-bytes copy"] + METHODS:
                r = by.get((model, t, m))
                if r is None:
                    cells.append("")
                elif "error" in r:
                    cells.append("error")
                else:
                    cells.append(f"{r['gbps']:.0f} ({100 * r['ceiling_frac']:.0f}%)")
            ours = by.get((model, t, "kvpool fused"), {}).get("gbps")
            sf = by.get((model, t, "straightforward Triton"), {}).get("gbps")
            tc = by.get((model, t, "torch.compile index_copy_"), {}).get("gbps")
            r1 = f"{ours / sf:.2f}x" if ours and sf else ""
            r2 = f"{ours / tc:.2f}x" if ours and tc else ""
            if any(cells):
                out.append(f"| {model} | {t} | " + " | ".join(cells) + f" | {r1} | {r2} |")
    out += [
        "",
        "### Decode sizes: microseconds per layer write (device, L2 cold / wall time of eager calls back to back / per write in a graph of 64 writes)",
        "",
        "| model | T | " + " | ".join(METHODS) + " |",
        "|---|---:|" + "---:|" * len(METHODS),
    ]
    for model in MODELS:
        for t in TOKENS:
            if t > DECODE_MAX:
                continue
            cells = []
            for m in METHODS:
                r = by.get((model, t, m))
                if r is None or "error" in r:
                    cells.append("error" if r else "")
                else:
                    cells.append(f"{r['device_us']:.1f} / {r['wall_us']:.1f} / {r['graph_us']:.2f}")
            out.append(f"| {model} | {t} | " + " | ".join(cells) + " |")
    if host:
        out += ["", "### Host time per eager call (T=1, H=1, D=128, tensor scales; median of 7 x 3000 calls)", ""]
        out += [f"- {k}: {v:.2f} us" for k, v in host.items()]
    errors = [r for r in records if "error" in r]
    if errors:
        out += ["", "### Errors", ""] + [f"- {r['model']} T={r['T']} {r['method']}: {r['error']}" for r in errors]
    return "\n".join(out) + "\n"


def plot(records: list, ceiling: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4.5), sharey=True)
    for ax, model in zip(axes, MODELS):
        for m in METHODS:
            pts = sorted((r["T"], r["gbps"]) for r in records if r["model"] == model and r["method"] == m and "gbps" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        pts = sorted((r["T"], r["gbps"]) for r in records if r["model"] == model and r["method"] == "same-bytes copy")
        if pts:
            ax.plot(*zip(*pts), color="k", linestyle=":", marker=".", label="copy of the same bytes")
        ax.axhline(ceiling, color="k", linestyle="--", label=f"copy ceiling {ceiling:.0f} GB/s")
        ax.axhline(0.9 * ceiling, color="gray", linestyle=":", label="90% of ceiling")
        ax.set_xscale("log", base=2)
        ax.set_title(model)
        ax.set_xlabel("tokens per write")
    axes[0].set_ylabel("GB/s (SPEC 6 bytes)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="two token counts per shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device: this benchmark runs on a GPU only")
        return 2
    os.makedirs(args.out, exist_ok=True)
    tokens = [1, 16384] if args.quick else TOKENS
    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/bench_set_kv.py" + (" --quick" if args.quick else ""),
    }
    log(f"[bench] {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}")
    flush = flush_buffer()
    ceiling = copy_ceiling_gbps()
    meta["ceiling_gbps"] = ceiling
    log(f"[bench] copy ceiling {ceiling:.0f} GB/s")
    records: list = []
    for i, (name, (h, d)) in enumerate(MODELS.items()):
        log(f"[bench] shape {i + 1}/{len(MODELS)}: {name}")
        bench_shape(name, h, d, tokens, ceiling, records, flush)
        with open(os.path.join(args.out, "bench.json"), "w") as f:  # partial results survive a timeout
            json.dump({"meta": meta, "records": records, "partial": True}, f, indent=1)
    host: dict = {}
    try:
        host_overhead(host)
    except Exception as exc:
        log(f"[bench] host overhead failed: {exc}")
    meta["ceiling_gbps_end"] = copy_ceiling_gbps()
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"meta": meta, "records": records, "host_us": host}, f, indent=1)
    md = markdown(meta, records, host)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    try:
        plot(records, ceiling, os.path.join(args.out, "bench.png"))
    except Exception as exc:
        log(f"[bench] plot failed: {exc}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
