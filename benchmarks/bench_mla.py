"""The MLA write on a GPU: kvpool's two entry points against the alternatives and the ceiling.

DeepSeek-V3's latent rows (512 latent + 64 rotary values per token and layer) written into an FP8
e4m3fn ``MLATokenToKVPool`` of 1M slots per layer at random slots, from bf16 inputs with a
per-tensor float32 scale tensor and int64 ``loc``. For each token count it times

* ``set_mla_kv_buffer`` (latent part a contiguous [T, 1, 512], rotary part a [T, 1, 64] slice of the
  [T, 576] projection output, as a DeepSeek layer has them) and ``set_kv_buffer`` (a contiguous
  [T, 1, 576] row), both one launch of kvpool's K/V kernel over the two column views of the buffer;
* kvpool's reference path;
* ``torch.compile`` of concatenate, divide, clamp, cast and ``index_copy_`` into the FP8 cache;
* a straightforward Triton port of SGLang's MLA write design (one program per token and 128-column
  block), with the divide, clamp and cast inside so it does the same job (it divides with Triton's
  approximate ``/`` and checks no slot: less work than kvpool's exact write);
* the cast-only scatter of the same bytes to the same slots (no division, no checks: the ceiling a
  write can reach, docs/contract.md "How performance is measured"), and a copy kernel moving the
  same bytes;

with the 2 GiB device-copy ceiling at the start and the end. Device time: CUDA-graph replays with
L2 flushed before each call (``timing.py``); decode sizes also per write in a graph of 64 writes
cycling over 8 layers (no flush) and the wall time of eager calls back to back. Each method's first
call is untimed and its rows are compared byte for byte with ``kvpool.quantize``, again after the
timed replays. The plan candidates of the row are in ``bench_write.py --sections plans``.

Usage (on a GPU): python benchmarks/bench_mla.py --out DIR [--quick]
``--cpu-smoke`` runs everything on the CPU at toy sizes (kernels in Triton's interpreter, whose FP8
conversion is known to be wrong, so the straightforward port reads "inexact" there).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

SMOKE = report.interpret_if_smoke()  # before kvpool and peers define their kernels

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import peers  # noqa: E402
from timing import DryClock, GpuClock, same_bytes_copy_gbps  # noqa: E402

from kvpool import MLATokenToKVPool, quantize, reference_set_kv_buffer  # noqa: E402
from kvpool.kernels.store_kv.layout import storage_view  # noqa: E402
from kvpool.kernels.store_kv.plan import SMALL_TOKENS, plan_write  # noqa: E402

R, ROPE, W = 512, 64, 576  # DeepSeek-V3 / R1, Kimi K2
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Plan:
    """What one run measures and how many calls each measurement takes."""

    name: str
    device: str
    tokens: tuple[int, ...]
    decode_max: int  # token counts up to this also get a graph of graph_writes writes and eager wall times
    slots: int  # per layer
    layers: int  # written in turn (graph replays cycle over them, as a model's step does)
    cold_calls: int
    graph_writes: int
    wall_calls: int
    wall_runs: int
    budget_s: float  # past this, the remaining token counts are skipped (and reported as skipped)


FULL = Plan("full", "cuda", tokens=(1, 32, 128, 256, 4096, 8192, 16384, 32768), decode_max=256, slots=1 << 20,
            layers=8, cold_calls=10, graph_writes=64, wall_calls=400, wall_runs=5, budget_s=300)  # fmt: skip
QUICK = replace(FULL, name="quick", tokens=(1, 256, 16384), wall_calls=200, wall_runs=3, budget_s=120)
SMOKE_PLAN = replace(FULL, name="cpu-smoke", device="cpu", tokens=(1, 8), decode_max=1, slots=1 << 10, layers=1, budget_s=1e9)
OURS = ["kvpool set_mla_kv_buffer", "kvpool set_kv_buffer"]
PEER_COMPILE = "torch.compile cat-divide-cast-index_copy_"
PEER_TRITON = "straightforward Triton (SGLang design)"
CEILING = "cast-only scatter (ceiling)"
METHODS = OURS + ["kvpool reference", PEER_COMPILE, PEER_TRITON, CEILING]


def bytes_moved(t: int, in_size: int = 2, pool_size: int = 1, loc_size: int = 8) -> int:
    """Bytes a write moves (docs/contract.md, "How performance is measured") with H = Hv = 1, D = 512,
    Dv = 64."""
    return t * (R + ROPE) * (in_size + pool_size) + t * loc_size


# --- the peers ----------------------------------------------------------------------------------


def _cat_divide_cast_index_copy(nope, rope, cache, loc, scale):
    fmax = torch.finfo(cache.dtype).max
    row = torch.cat((nope, rope), dim=2)
    cache.index_copy_(0, loc, (row.float() / scale).clamp(-fmax, fmax).to(cache.dtype))


_compiled = None


def compiled_write(nope, rope, cache, loc, scale):
    """cache: the FP8 [slots, 1, 576] view; loc int64; scale a [1] float32 tensor."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_cat_divide_cast_index_copy, fullgraph=True, dynamic=True)
    _compiled(nope, rope, cache, loc, scale)


@triton.jit
def _sglang_design_kernel(
    buf_ptr,  # [slots, 1, NOPE + ROPE] uint8 (FP8 storage)
    nope_ptr,  # [T, 1, NOPE] bf16, contiguous along the row
    rope_ptr,  # [T, 1, ROPE] bf16, contiguous along the row
    loc_ptr,  # [T] int64
    scale_ptr,  # [1] float32
    buf_stride,
    nope_stride,
    rope_stride,
    NOPE: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    FMAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    if blk * BLOCK + BLOCK <= NOPE:  # a whole block of the latent part (NOPE is a multiple of BLOCK here)
        x = tl.load(nope_ptr + t * nope_stride + offs)
    else:
        x = tl.load(rope_ptr + t * rope_stride + (offs - NOPE), mask=offs < NOPE + ROPE_DIM, other=0.0)
    y = x.to(tl.float32) / tl.load(scale_ptr)
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
    tl.store(buf_ptr + slot * buf_stride + offs, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True),
             mask=offs < NOPE + ROPE_DIM)  # fmt: skip


def sglang_design_write(nope, rope, buf_store, loc, scale):
    """buf_store: the uint8 [slots, 1, 576] buffer; nope/rope [T, 1, *] with unit column stride."""
    t = nope.shape[0]
    block = 128
    _sglang_design_kernel[(t, triton.cdiv(R + ROPE, block))](
        buf_store, nope, rope, loc, scale, buf_store.stride(0), nope.stride(0), rope.stride(0),
        NOPE=R, ROPE_DIM=ROPE, BLOCK=block, FMAX=torch.finfo(FP8).max,
    )  # fmt: skip


# --- one token count ------------------------------------------------------------------------------


def bench_tokens(t: int, plan: Plan, clock, pool: MLATokenToKVPool, rep: report.Report) -> None:
    dev = pool.device
    layers = plan.layers
    gen = torch.Generator(device=dev).manual_seed(t)
    caches = [pool.get_key_buffer(i) for i in range(layers)]  # FP8 [slots + 1, 1, 576] views
    stores = [storage_view(c) for c in caches]  # uint8
    nope_views = [c[:, :, :R] for c in caches]
    rope_views = [c[:, :, R:] for c in caches]
    projection = (torch.randn(t, W, device=dev, generator=gen) * 60).to(torch.bfloat16)  # kv_a_proj output
    nope = (torch.randn(t, 1, R, device=dev, generator=gen) * 60).to(torch.bfloat16)  # normalised latent
    rope = projection[:, R:].unsqueeze(1)  # [T, 1, 64], token stride 576
    row = torch.cat((nope, rope), dim=2)  # [T, 1, 576] contiguous
    loc = torch.randperm(plan.slots, device=dev, generator=gen)[:t] + 1
    scale = torch.tensor([0.37], device=dev)
    expected = quantize(row, FP8, scale).view(torch.uint8)
    fns = {
        "kvpool set_mla_kv_buffer": lambda i: pool.set_mla_kv_buffer(None, loc, nope, rope, scale, layer_id_override=i),
        "kvpool set_kv_buffer": lambda i: pool.set_kv_buffer(None, loc, row, None, scale, layer_id_override=i),
        "kvpool reference": lambda i: reference_set_kv_buffer(nope, rope, nope_views[i], rope_views[i], loc, scale, scale),
        PEER_COMPILE: lambda i: compiled_write(nope, rope, caches[i], loc, scale),
        PEER_TRITON: lambda i: sglang_design_write(nope, rope, stores[i], loc, scale),
    }
    if clock.dry:  # inductor's CPU build takes longer than the rest of the smoke run
        del fns[PEER_COMPILE]
    rope_rows = rope.contiguous()  # the same bytes, as the cast-only scatter reads them
    fns[CEILING] = lambda i: peers.cast_scatter(nope, rope_rows, nope_views[i], rope_views[i], loc)
    nbytes = bytes_moved(t)
    ceiling = rep.meta["ceiling_gbps"]
    records = rep.result["records"]
    same = same_bytes_copy_gbps(clock, nbytes, dev, plan.cold_calls)
    records.append({"T": t, "method": "same-bytes copy", "bytes": nbytes, "gbps": same, "ceiling_frac": same / ceiling})
    row_log = [f"same-bytes copy={same:.0f}GB/s"]
    for method, fn in fns.items():
        rec: dict = {"T": t, "method": method, "bytes": nbytes}
        try:
            fn(0)  # untimed; every method rewrites all of loc's rows, so its output is what is checked
            clock.sync()
            if method != CEILING:  # it writes x, not x / scale
                rec["exact"] = bool(torch.equal(stores[0][loc], expected))
            us = clock.device_us(lambda i: fn(i % layers), plan.cold_calls, cold=True)
            rec["device_us"] = us
            rec["gbps"] = nbytes / (us * 1e-6) / 1e9
            rec["ceiling_frac"] = rec["gbps"] / ceiling
            rec["same_bytes_frac"] = rec["gbps"] / same
            if t <= plan.decode_max:
                rec["wall_us"] = clock.wall_us(lambda i: fn(i % layers), plan.wall_calls, plan.wall_runs)
                rec["graph_us"] = clock.device_us(lambda i: fn(i % layers), plan.graph_writes, cold=False)
            clock.sync()
            if method != CEILING:
                rec["exact_after"] = bool(torch.equal(stores[layers - 1][loc], expected))
        except Exception as exc:  # a method failing must not stop the run; it is reported
            rec["error"] = report.short_error(exc)
        records.append(rec)
        row_log.append(f"{method}={rec.get('gbps', float('nan')):.0f}GB/s")
    rep.log(f"T={t}: " + ", ".join(row_log))


# --- the report -----------------------------------------------------------------------------------


def targets(by: dict, tokens: list, decode_max: int) -> list[str]:
    """The targets, per entry point and token count: >= 90% of the same-bytes copy at >= 8k
    tokens, >= 1.5x torch.compile at >= 4k, and at decode sizes no slower than the straightforward
    port as a CUDA-graph replay."""
    out = []
    for ours in OURS:
        for t in tokens:
            r = by.get((t, ours))
            if r is None or "error" in r:
                continue
            checks = []
            if t >= 8192:
                frac = r["same_bytes_frac"]
                checks.append(f"{100 * frac:.0f}% of same-bytes copy (target 90%): {'met' if frac >= 0.9 else 'MISSED'}")
                c = by.get((t, CEILING), {})
                if "gbps" in c:
                    checks.append(f"{100 * r['gbps'] / c['gbps']:.1f}% of the cast-only scatter of the same bytes")
            if t >= 4096:
                c = by.get((t, PEER_COMPILE), {})
                if "gbps" in c:
                    ratio = r["gbps"] / c["gbps"]
                    checks.append(f"{ratio:.2f}x torch.compile (target 1.5x): {'met' if ratio >= 1.5 else 'MISSED'}")
            if t <= decode_max:
                p = by.get((t, PEER_TRITON), {})
                if "graph_us" in p and "graph_us" in r:
                    ok = r["graph_us"] <= p["graph_us"]
                    checks.append(f"graph replay {r['graph_us']:.2f} us vs straightforward {p['graph_us']:.2f} us: "
                                  f"{'met' if ok else 'MISSED'}")  # fmt: skip
            if checks:
                out.append(f"- {ours}, T={t}: " + "; ".join(checks))
    return out


def markdown(result: dict) -> str:
    meta, plan, records = result["meta"], result["plan"], result["records"]
    tokens, decode_max = list(plan["tokens"]), plan["decode_max"]
    by = {(r["T"], r["method"]): r for r in records}
    out = [
        f"Copy ceiling (2 GiB device-to-device `copy_`, read + write): **{meta.get('ceiling_gbps', 0):.0f} GB/s** at the "
        f"start, {meta.get('ceiling_gbps_end', float('nan')):.0f} GB/s at the end.",
        "",
        f"Pool: MLATokenToKVPool, FP8 e4m3fn, DeepSeek-V3 rows (512 + 64), {plan['slots']} slots x {plan['layers']} "
        "layers, random slots; bf16 inputs (latent part contiguous, rotary part a slice of the 576-wide projection "
        f"output); per-tensor float32 scale tensor; int64 loc. kvpool's launch plan for the row: {meta.get('plan')}.",
        "",
        "## Throughput: GB/s of T x 576 x (input + cache element size) + T x loc element size bytes "
        "(percent of the same-bytes copy); CUDA-graph replays, L2 flushed before each call",
        "",
        "| T | same-bytes copy (share of the ceiling) | " + " | ".join(METHODS) + " |",
        "|---:|---:|" + "---:|" * len(METHODS),
    ]
    for t in tokens:
        same = by.get((t, "same-bytes copy"))
        if same is None:
            continue
        cells = []
        for m in METHODS:
            r = by.get((t, m))
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("error")
            else:
                mark = "" if m == CEILING or (r.get("exact") and r.get("exact_after")) else " (inexact)"
                cells.append(f"{r['gbps']:.0f} ({100 * r['same_bytes_frac']:.0f}%){mark}")
        out.append(f"| {t} | {same['gbps']:.0f} ({100 * same['ceiling_frac']:.0f}% of ceiling) | " + " | ".join(cells) + " |")
    out += [
        "",
        "## Decode sizes: microseconds per write (device with L2 cold / wall time of eager calls back to back / "
        f"per write in a graph of {plan['graph_writes']} writes)",
        "",
        "| T | " + " | ".join(METHODS) + " |",
        "|---:|" + "---:|" * len(METHODS),
    ]
    for t in tokens:
        if t > decode_max or (t, "same-bytes copy") not in by:
            continue
        cells = []
        for m in METHODS:
            r = by.get((t, m))
            if r is None or "error" in r or "graph_us" not in r:
                cells.append("error" if r and "error" in r else "")
            else:
                cells.append(f"{r['device_us']:.1f} / {r['wall_us']:.1f} / {r['graph_us']:.2f}")
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    out += ["", "## Targets", ""] + (targets(by, tokens, decode_max) or ["- (no results)"])
    return "\n".join(out) + "\n"


def plot(result: dict, fig) -> None:
    """GB/s against tokens per write, each method and the two ceilings."""
    ax = fig.subplots()
    records = result["records"]
    for m in [*METHODS, "same-bytes copy"]:
        pts = sorted((r["T"], r["gbps"]) for r in records if r["method"] == m and "gbps" in r)
        if pts:
            style = dict(color="k", linestyle=":" if m == "same-bytes copy" else "--") if m in (CEILING, "same-bytes copy") else dict(marker="o", markersize=3)
            ax.plot(*zip(*pts), label=m, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per write")
    ax.set_ylabel("GB/s (bytes as in docs/contract.md)")
    ax.set_title("MLA write, DeepSeek-V3 rows (512 + 64), FP8", fontsize=10)
    ax.legend(fontsize=7)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(parser, "mla")
    parser.add_argument("--quick", action="store_true", help="three token counts")
    args = parser.parse_args()
    plan = SMOKE_PLAN if args.cpu_smoke else QUICK if args.quick else FULL
    args.budget_s = plan.budget_s if args.budget_s is None else args.budget_s
    if plan.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark runs on a GPU (--cpu-smoke checks the script on the CPU)")
    rep = report.Report(args, "bench_mla", "MLA write", markdown, plot)
    launch_plan = plan_write(1, R, 1, ROPE, SMALL_TOKENS + 1, joined=True)
    small_plan = plan_write(1, R, 1, ROPE, 1, joined=True)
    rep.meta["plan"] = (
        f"joined (one program writes both parts of its tokens' rows), latent block {launch_plan.block_d}, rotary block "
        f"{launch_plan.block_dv}: BLOCK_T={launch_plan.block_t} and {launch_plan.num_warps} warps above {SMALL_TOKENS} "
        f"tokens, BLOCK_T={small_plan.block_t} and {small_plan.num_warps} warps up to it"
    )
    rep.result.update(plan=asdict(plan), records=[])
    clock = DryClock() if args.cpu_smoke else GpuClock()
    rep.meta["ceiling_gbps"] = clock.copy_ceiling_gbps()
    rep.log(f"copy ceiling {rep.meta['ceiling_gbps']:.0f} GB/s; plan: {rep.meta['plan']}")
    # fused="always": a write the gate refused would raise rather than time the reference path by
    # mistake (on the CPU it runs the kernel in the interpreter).
    pool = MLATokenToKVPool(plan.slots, 1, FP8, R, ROPE, plan.layers, plan.device, fused="always")
    for t in plan.tokens:
        if rep.over_budget(f"T={t}"):
            continue
        try:
            bench_tokens(t, plan, clock, pool, rep)
        except Exception as exc:  # inputs or the copy for this T failed: report, go on
            rep.error(f"T={t}", exc)
        rep.save()
    rep.meta["ceiling_gbps_end"] = clock.copy_ceiling_gbps()
    rep.meta["stats"] = {"fused_calls": pool.stats.fused_calls, "reference_calls": pool.stats.reference_calls,
                         "reasons": dict(pool.stats.reasons)}  # fmt: skip
    rep.save(final=True)
    return 1 if rep.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
