"""The ``formats`` section of ``bench_write.py``: the writes that quantize each row with scales of its
own, against the cast-only scatter of the same output bytes and beside the per-tensor FP8 write.

For each of the write section's shapes (``MHA_FORMATS``) and the plan sweep's MLA row
(``MLA_FORMATS``), at each token count: bf16 inputs (random, x 60), random distinct slots, int64
``loc``, pools of the run's slots and layers, ``layers`` layers written in turn:

* ``MHATokenToKVPoolFP4`` with SGLang's exponent scales (``fp4_mx_block16``) and with two-level NVFP4
  (``fp4_format="nvfp4"``, global scales 1.0), ``MHATokenToKVPoolFP8PerTokenHead`` (e4m3fn), and
  ``MLATokenToKVPoolFP4`` for the MLA row: ``set_kv_buffer``, the fused kernel (``fused="always"``);
* each one's ceiling, the cast-only scatter of the same output bytes to the same rows of the same
  buffers from the same inputs (``peers.cast_scatter_fp4``, ``peers.cast_scatter_token_head``: codes
  and scale bytes cut from the inputs' bits or cast, no maximum, no rounding), best of its tiles;
* the per-tensor FP8 write of the same rows (``MHATokenToKVPool`` / ``MLATokenToKVPool``, e4m3fn,
  a one-element float32 scale tensor), whose bytes are the write section's.

Bytes counted per write: T x (H x D + Hv x Dv) x 2 (the inputs) + the codes and scales stored (FP4:
1/2 + 1/16 byte per element; per-token-head FP8: 1 byte per element and 4 per token and head) + T x
8 (``loc``). Timing is the write section's: cold device time (CUDA-graph replays, L2 flushed before
each call), and at decode sizes also per write in a graph of ``graph_calls`` writes and eager wall
time. After the timed runs, each pool's layer 0 written by the fused kernel is compared byte for
byte (``.view(torch.uint8)``) with a pool of the same format written by the reference path (every
buffer, codes and scales); a difference is an error in the report.

Targets (the FP4 pools' performance target): each FP4 write (both formats, MHA and MLA) at >= 97% of
its ceiling's GB/s from the write section's large sizes on; at T=1, per write in a CUDA graph, each
format within 0.3 us of the per-tensor FP8 write of the same rows.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

import peers
import report
from kvpool import (
    MHATokenToKVPool,
    MHATokenToKVPoolFP4,
    MHATokenToKVPoolFP8PerTokenHead,
    MLATokenToKVPool,
    MLATokenToKVPoolFP4,
)

FP8 = torch.float8_e4m3fn
FP4 = getattr(torch, "float4_e2m1fn_x2", "fp4_e2m1")
FP4_MX = "FP4 (exponent scales)"
NVFP4 = "NVFP4"
TOKEN_HEAD = "FP8 (scale per token and head)"
FP4_MLA = "FP4 (MLA row)"
PER_TENSOR = "FP8 (per-tensor scale)"
MHA_FORMATS = (FP4_MX, NVFP4, TOKEN_HEAD)
MLA_FORMATS = (FP4_MLA,)
FP4_FORMATS = (FP4_MX, NVFP4, FP4_MLA)
WRITE, CEILING = "write", "cast-only scatter (ceiling)"
LARGE_CEILING_FRAC = 0.97  # an FP4 write at >= 97% of its ceiling at large sizes
DECODE_OVER_FP8_US = 0.3  # a T=1 write in a CUDA graph at most 0.3 us over the per-tensor FP8 write


def stored_bytes_per_token(fmt: str, h: int, d: int, hv: int, dv: int) -> int:
    """Code and scale bytes one token's row leaves in the pool."""
    elems = h * d + hv * dv
    if fmt == TOKEN_HEAD:
        return elems + 4 * (h + hv)
    if fmt == PER_TENSOR:
        return elems
    return elems // 2 + elems // 16


def bytes_moved(fmt: str, t: int, h: int, d: int, hv: int, dv: int) -> int:
    """Bytes a write of ``t`` tokens moves: bf16 inputs, the stored bytes, int64 loc."""
    return t * ((h * d + hv * dv) * 2 + stored_bytes_per_token(fmt, h, d, hv, dv) + 8)


class Shape:
    """One shape's pools: each format's (timed, ``layers`` layers), its reference pool (one layer,
    reference path) and the per-tensor FP8 pool."""

    def __init__(self, name: str, geometry: tuple, slots: int, layers: int, dev: torch.device) -> None:
        self.name = name
        self.mla = len(geometry) == 4
        self.h, self.d, self.hv, self.dv = self.geometry = geometry if self.mla else (*geometry, *geometry)
        self.formats = MLA_FORMATS if self.mla else MHA_FORMATS
        self.pools = {f: self.pool(f, slots, layers, dev, "always") for f in self.formats}
        if self.mla:
            self.fp8 = MLATokenToKVPool(slots, 1, FP8, self.d, self.dv, layers, dev, fused="always", warmup=False)
        else:
            self.fp8 = MHATokenToKVPool(slots, 1, FP8, self.h, self.d, layers, dev, fused="always", warmup=False)
        self.references: dict = {}
        self.stores = {f: [self.buffers(f, i) for i in range(layers)] for f in self.formats}

    def pool(self, fmt: str, slots: int, layers: int, dev: torch.device, fused: str):
        if fmt == FP4_MLA:
            return MLATokenToKVPoolFP4(slots, 1, FP4, self.d, self.dv, layers, dev, fused=fused)
        if fmt == TOKEN_HEAD:
            return MHATokenToKVPoolFP8PerTokenHead(slots, 1, FP8, self.h, self.d, layers, dev, fused=fused, warmup=False)
        return MHATokenToKVPoolFP4(slots, 1, FP4, self.h, self.d, layers, dev, fused=fused,
                                   fp4_format="nvfp4" if fmt == NVFP4 else "fp4_mx_block16")  # fmt: skip

    def buffers(self, fmt: str, i: int) -> tuple:
        """Layer ``i``'s ((K codes, K scales), (V codes, V scales)) of ``fmt``'s pool (an MLA row: its
        one part twice)."""
        pool = self.pools[fmt]
        if fmt == FP4_MLA:
            b = pool.get_fp4_buffers(i)
            return (b.kv, b.kv_scale), (b.kv, b.kv_scale)
        b = pool.get_fp8_buffers(i) if fmt == TOKEN_HEAD else pool.get_fp4_buffers(i)
        return (b.k, b.k_scale), (b.v, b.v_scale)

    def inputs(self, run, t: int, gen) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.mla:
            return run.randn(t, 1, self.d + self.dv, gen=gen), None
        return run.randn(t, self.h, self.d, gen=gen), run.randn(t, self.hv, self.dv, gen=gen)

    def write(self, fmt: str, k, v, loc) -> Callable[[int], None]:
        pool = self.pools[fmt]
        return lambda i: pool.set_kv_buffer(None, loc, k, v, layer_id_override=i)

    def ceiling(self, fmt: str, k, v, loc, block: int, warps: int) -> Callable[[int], None]:
        stores = self.stores[fmt]
        if fmt == TOKEN_HEAD:
            return lambda i: peers.cast_scatter_token_head(k, v, *stores[i], loc, block, warps)
        return lambda i: peers.cast_scatter_fp4(k, v, *stores[i], loc, block, warps)

    def fp8_write(self, k, v, loc, scale) -> Callable[[int], None]:
        return lambda i: self.fp8.set_kv_buffer(None, loc, k, v, scale, None if self.mla else scale, layer_id_override=i)

    def mismatches(self, fmt: str, k, v, loc) -> dict:
        """Layer 0 of ``fmt``'s pool written by the fused kernel against a pool written by the
        reference path, both zeroed first: differing bytes per buffer (every buffer of the layer)."""
        pool = self.pools[fmt]
        if fmt not in self.references:
            self.references[fmt] = self.pool(fmt, pool.size, 1, pool.device, "never")
        ref = self.references[fmt]
        for p in (pool, ref):
            for name in p.part_names:
                getattr(p, name)[0].zero_()
            p.set_kv_buffer(None, loc, k, v, layer_id_override=0)
        return {n: int((getattr(pool, n)[0].view(torch.uint8) != getattr(ref, n)[0].view(torch.uint8)).sum().item())
                for n in pool.part_names}  # fmt: skip


def timed(run, rec: dict, fn, nbytes: int, decode: bool) -> bool:
    """The untimed first call, then cold device time and GB/s (and at decode sizes per write in a
    graph and eager wall time) into ``rec``; a failure goes into ``rec["error"]``."""
    plan, clock = run.plan, run.clock
    try:
        fn(0)
        clock.sync()
        us = rec["device_us"] = clock.device_us(lambda i: fn(i % plan.layers), plan.cold_calls, cold=True)
        rec["gbps"] = nbytes / (us * 1e-6) / 1e9
        if decode:
            rec["graph_us"] = clock.device_us(lambda i: fn(i % plan.layers), plan.graph_calls, cold=False)
            rec["wall_us"] = clock.wall_us(lambda i: fn(i % plan.layers), plan.wall_calls, plan.wall_runs)
        return True
    except Exception as exc:  # reported in the record, never fatal
        rec["error"] = report.short_error(exc)
        return False


def best_ceiling(run, shape: Shape, fmt: str, k, v, loc, base: dict, decode: bool) -> dict:
    """The ceiling of ``fmt``'s write, the best of its tiles by cold device time (one tile in a
    smoke run: the interpreter takes seconds per launch)."""
    tiles = peers.CAST_SCATTER_TILES if fmt == TOKEN_HEAD else peers.CAST_SCATTER_FP4_TILES
    best: dict = {}
    errors = []
    for block, warps in tiles[:1] if run.clock.dry else tiles:
        rec = {**base, "method": CEILING, "tile": f"{block}/{warps}"}
        if timed(run, rec, shape.ceiling(fmt, k, v, loc, block, warps), base["bytes"], decode):
            if rec["device_us"] < best.get("device_us", math.inf):
                best = rec
        else:
            errors.append(rec["error"])
    return best or {**base, "method": CEILING, "error": "; ".join(errors) or "not measured"}


def failed(run, what: str, message: str) -> None:
    run.rep.result["errors"][what] = message
    run.rep.log(f"{what} failed: {message}")


def format_cell(run, shape: Shape, fmt: str, k, v, loc, base: dict, decode: bool) -> tuple[dict, dict]:
    """``fmt``'s ceiling and write at one size, then the write's bytes against the reference path's."""
    what = f"formats {shape.name} T={base['T']} {fmt}"
    ceiling = best_ceiling(run, shape, fmt, k, v, loc, base, decode)
    if "error" in ceiling:
        failed(run, f"{what} ceiling", ceiling["error"])
    rec = {**base, "method": WRITE}
    if not timed(run, rec, shape.write(fmt, k, v, loc), base["bytes"], decode):
        failed(run, what, rec["error"])
        return ceiling, rec
    try:
        bad = shape.mismatches(fmt, k, v, loc)
    except Exception as exc:
        failed(run, f"{what}: the check against the reference path", report.short_error(exc))
        return ceiling, rec
    rec["exact"] = not any(bad.values())
    if not rec["exact"]:
        failed(run, what, f"the fused kernel's bytes differ from the reference path's (bytes per buffer: {bad})")
    return ceiling, rec


def bench_formats(run, shapes: dict, scale_value: float) -> None:
    """Every shape of ``shapes`` (name: (H, D) or an MLA row (1, kv_lora_rank, 1, qk_rope_head_dim)),
    records into ``run.result["formats"]``; a failed measurement or a byte that differs from the
    reference path's is an error in the report too (every write here is kvpool's or its ceiling)."""
    plan, dev = run.plan, run.dev
    out = run.result.setdefault("formats", [])
    scale = torch.tensor([scale_value], device=dev)
    for name, geometry in shapes.items():
        run.rep.log(f"formats: {name}")
        try:
            shape = Shape(name, geometry, plan.slots, plan.layers, dev)
        except Exception as exc:  # e.g. the pools do not fit: the other shapes still run
            run.rep.error(f"formats {name}", exc)
            continue
        gen = torch.Generator(device=dev).manual_seed(4)
        for t in plan.tokens:
            if run.rep.over_budget(f"formats {name} T={t}"):
                continue
            k, v = shape.inputs(run, t, gen)
            loc = run.slots(t, shape.fp8.rows, gen)
            decode = t <= plan.decode_max
            base = {"model": name, "H": shape.h, "D": shape.d, "Hv": shape.hv, "Dv": shape.dv, "T": t}
            rec = {**base, "format": PER_TENSOR, "method": WRITE, "bytes": bytes_moved(PER_TENSOR, t, *shape.geometry)}
            if not timed(run, rec, shape.fp8_write(k, v, loc, scale), rec["bytes"], decode):
                failed(run, f"formats {name} T={t} {PER_TENSOR}", rec["error"])
            out.append(rec)
            line = [f"{PER_TENSOR} {_fig(rec)}"]
            for fmt in shape.formats:
                fbase = {**base, "format": fmt, "bytes": bytes_moved(fmt, t, *shape.geometry)}
                ceiling, rec = format_cell(run, shape, fmt, k, v, loc, fbase, decode)
                out += [ceiling, rec]
                line.append(f"{fmt} {_fig(rec)} of {_fig(ceiling)}")
            run.rep.log(f"formats {name} T={t} (GB/s cold): " + "; ".join(line))
            run.rep.save()
        del shape
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _fig(rec: dict) -> str:
    return "error" if "error" in rec else f"{rec['gbps']:.0f}"


# --- targets and the report ------------------------------------------------------------------------


def _value(rec: Optional[dict], field: str) -> Optional[float]:
    if rec is None or "error" in rec:
        return None
    v = rec.get(field)
    return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _index(result: dict) -> dict:
    return {(r["model"], r["T"], r["format"], r["method"]): r for r in result.get("formats", [])}


def _cells(result: dict) -> list[tuple[str, int, str]]:
    """(shape, T, format) of every measured format write, in the order measured."""
    return [(r["model"], r["T"], r["format"]) for r in result.get("formats", []) if r["method"] == WRITE and r["format"] != PER_TENSOR]


def share(by: dict, model: str, t: int, fmt: str) -> Optional[float]:
    """The write's GB/s over its ceiling's."""
    w, c = _value(by.get((model, t, fmt, WRITE)), "gbps"), _value(by.get((model, t, fmt, CEILING)), "gbps")
    return w / c if w and c else None


def over_fp8_us(by: dict, model: str, t: int, fmt: str) -> Optional[float]:
    """Microseconds per write in a graph over the per-tensor FP8 write of the same rows."""
    w, f = _value(by.get((model, t, fmt, WRITE)), "graph_us"), _value(by.get((model, t, PER_TENSOR, WRITE)), "graph_us")
    return w - f if w and f else None


def _status(values: list, ok) -> str:
    measured = [v for v in values if v is not None]
    if not measured:
        return "not measured"
    if not all(ok(v) for v in measured):
        return "missed"
    return "met" if len(measured) == len(values) else "met where measured"


def _tok(t: int) -> str:
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


def targets(result: dict) -> list[dict]:
    """The section's targets as rows of the report's target table (what, shape, target, figure, status)."""
    plan = result.get("plan", {})
    large_min = plan.get("large_min", math.inf)
    by = _index(result)
    cells = _cells(result)
    out = []
    for model, fmt in dict.fromkeys((m, f) for m, _, f in cells):
        large = [t for m, t, f in cells if m == model and f == fmt and t >= large_min]
        if large:
            vals = [share(by, model, t, fmt) for t in large]
            fp4 = fmt in FP4_FORMATS
            out.append(dict(
                what=f"{fmt} write, large", shape=model,
                target=(f">= {100 * LARGE_CEILING_FRAC:.0f}%" if fp4 else "share") + " of the cast-only scatter of the same "
                f"output bytes at >= {_tok(large_min)} tokens",
                figure=", ".join(f"{_tok(t)}: " + (f"{100 * s:.1f}%" if s else "n/a") for t, s in zip(large, vals)),
                status=_status(vals, lambda s: s >= LARGE_CEILING_FRAC) if fp4 else "reported",
            ))  # fmt: skip
        if any(m == model and f == fmt and t == 1 for m, t, f in cells):
            d = over_fp8_us(by, model, 1, fmt)
            w, f8 = _value(by.get((model, 1, fmt, WRITE)), "graph_us"), _value(by.get((model, 1, PER_TENSOR, WRITE)), "graph_us")
            out.append(dict(
                what=f"{fmt} write, decode", shape=model,
                target=f"T=1, per write in a CUDA graph, within {DECODE_OVER_FP8_US} us of the per-tensor FP8 write",
                figure=f"{w:.2f} us vs {f8:.2f} us: {d:+.2f} us" if d is not None else "n/a",
                status=_status([d], lambda x: x <= DECODE_OVER_FP8_US),
            ))  # fmt: skip
    return out


def _f(v: Optional[float], fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def _us(rec: Optional[dict]) -> str:
    if rec is None:
        return ""
    if "error" in rec:
        return "error"
    return " / ".join(_f(rec.get(f), ".2f") or "-" for f in ("device_us", "graph_us", "wall_us"))


def markdown_lines(result: dict) -> list[str]:
    """The section's tables: throughput against the ceiling, decode sizes against the FP8 write."""
    cells = _cells(result)
    if not cells:
        return []
    plan = result.get("plan", {})
    by = _index(result)
    out = [
        "", "## Formats: FP4, NVFP4 and per-token-head FP8 writes against the cast-only scatter of the same output bytes", "",
        "`set_kv_buffer` of `MHATokenToKVPoolFP4` (SGLang's exponent scales, and `fp4_format=\"nvfp4\"`), "
        "`MHATokenToKVPoolFP8PerTokenHead` and, for the MLA row, `MLATokenToKVPoolFP4`: bf16 inputs, random slots, int64 "
        "loc, the fused kernel. *ceiling*: the cast-only scatter of the same code and scale bytes to the same rows from the "
        "same inputs (FP4: each code nibble the top four bits of its input, each scale byte the exponent byte of its "
        "block's first input; per-token-head FP8: each input cast to e4m3fn, each scale the head's first input as "
        "float32), best of its tiles. GB/s from the cold device time, counting T x (H x D + Hv x Dv) x 2 + the stored "
        "code and scale bytes + T x 8; the per-tensor FP8 write's GB/s counts its own bytes (codes only). *exact*: layer "
        "0 written by the fused kernel is byte-identical to the reference path's, every buffer.", "",
        "| shape | T | write | stored bytes per token | write GB/s | ceiling GB/s (tile) | write / ceiling | per-tensor FP8 GB/s | exact |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for model, t, fmt in cells:
        w, c, f8 = by.get((model, t, fmt, WRITE)), by.get((model, t, fmt, CEILING)), by.get((model, t, PER_TENSOR, WRITE))
        s = share(by, model, t, fmt)
        per_token = stored_bytes_per_token(fmt, w["H"], w["D"], w["Hv"], w["Dv"])
        ceil = "error" if c is None or "error" in c else f"{_f(_value(c, 'gbps'), '.0f')} ({c.get('tile', '')})"
        exact = "error" if "error" in w else {True: "yes", False: "**no**"}.get(w.get("exact"), "not checked")
        out.append(f"| {model} | {t} | {fmt} | {per_token} | {_f(_value(w, 'gbps'), '.0f') or 'error'} | {ceil} | "
                   f"{_f(100 * s if s else None, '.1f')}{'%' if s else ''} | {_f(_value(f8, 'gbps'), '.0f')} | {exact} |")  # fmt: skip
    decode = [(m, t, f) for m, t, f in cells if t <= plan.get("decode_max", 0)]
    if decode:
        out += [
            "", "Decode sizes: microseconds per write, cold / graph / wall (graph: per write in a graph of "
            f"{plan.get('graph_calls')} writes cycling over the layers, no flush), and the graph time over the per-tensor "
            "FP8 write of the same rows.", "",
            "| shape | T | write | write us | ceiling us | per-tensor FP8 us | graph: over FP8 |", "|---|---:|---|---:|---:|---:|---:|",
        ]  # fmt: skip
        for model, t, fmt in decode:
            d = over_fp8_us(by, model, t, fmt)
            out.append(f"| {model} | {t} | {fmt} | {_us(by.get((model, t, fmt, WRITE)))} | {_us(by.get((model, t, fmt, CEILING)))} | "
                       f"{_us(by.get((model, t, PER_TENSOR, WRITE)))} | {_f(d, '+.2f')}{' us' if d is not None else ''} |")  # fmt: skip
    return out


def plot(result: dict, fig) -> None:
    """Each write's share of its ceiling against tokens per write, one panel per shape."""
    by = _index(result)
    cells = _cells(result)
    models = list(dict.fromkeys(m for m, _, _ in cells))
    axes = fig.subplots(1, max(1, len(models)), sharey=True, squeeze=False)[0]
    for ax, model in zip(axes, models):
        for fmt in dict.fromkeys(f for m, _, f in cells if m == model):
            pts = sorted((t, 100 * s) for m, t, f in cells if m == model and f == fmt and (s := share(by, m, t, f)))
            if pts:
                ax.plot(*zip(*pts), label=fmt, marker="o", markersize=3)
        ax.axhline(100 * LARGE_CEILING_FRAC, color="k", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("tokens per write")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("% of the cast-only scatter of the same output bytes")
