"""The report of ``bench_set_kv.py``: targets evaluated from the figures, the Markdown, the plot.

Everything here reads the result dictionary that ``bench_set_kv.py`` writes to bench.json, so a report
can be rebuilt from a saved run:

    python benchmarks/bench_report.py RUN/bench.json [--out RUN/bench.md] [--plot RUN/bench.png]

Every target line is computed from the figures of the same run; none is written by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

MODELS = {  # name: (KV heads per rank, head_dim)
    "Llama-3-8B (H=8, D=128)": (8, 128),
    "Llama-3-70B TP8 (H=1, D=128)": (1, 128),
    "Qwen3.5-397B TP8 (H=1, D=256)": (1, 256),
    "odd (H=3, D=96)": (3, 96),
}
MOVE_MODEL = "Llama-3-8B (H=8, D=128)"


class Method:
    """Method labels, as they appear in bench.json and in the tables."""

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


M = Method
WRITE_METHODS = [M.KVPOOL, M.DIVRN, M.REFERENCE, M.SGLANG, M.COMPILE, M.PER_HEAD, M.PER_TOKEN]
#: The straightforward Triton ports the decode target compares against.
PORTS = [M.PER_HEAD, M.PER_TOKEN]

LARGE_COPY_FRAC = 0.95  # at >= large_min tokens, >= 95% of the same-bytes copy
LARGE_PER_TOKEN = 1.05  # and >= 1.05x the one-program-per-token kernel
HOST_OVER_HAND_US = 3.0  # eager set_kv_buffer at most 3 us of host time over a hand launch


def _index(records: list) -> dict:
    return {(r["model"], r["T"], r["method"]): r for r in records}


def _value(rec: Optional[dict], field: str) -> Optional[float]:
    if rec is None or "error" in rec:
        return None
    v = rec.get(field)
    return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def _tok(t: int) -> str:
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


def _status(values: list[tuple[int, Optional[float]]], ok) -> str:
    measured = [v for _, v in values if v is not None]
    if not measured:
        return "not measured"
    if not all(ok(v) for v in measured):
        return "missed"
    return "met" if len(measured) == len(values) else "met where measured"


def targets(result: dict) -> list[dict]:
    """Each target: what it asks, the figure of this run, met or missed."""
    plan = result.get("plan", {})
    tokens = plan.get("tokens", [])
    large = [t for t in tokens if t >= plan.get("large_min", math.inf)]
    decode = [t for t in tokens if t <= plan.get("decode_max", 0)]
    by = _index([r for r in result.get("records", []) if "T" in r])
    out = []
    for model in MODELS:
        # Issue 15: large writes against the same-bytes copy.
        vals = []
        for t in large:
            ours, copy = _value(by.get((model, t, M.KVPOOL)), "gbps"), _value(by.get((model, t, M.COPY)), "gbps")
            vals.append((t, ours / copy if ours and copy else None))
        fig = ", ".join(f"{_tok(t)}: " + (f"{100 * v:.1f}%" if v else "n/a") for t, v in vals)
        out.append(dict(
            issue="large writes", model=model, target=f">= {100 * LARGE_COPY_FRAC:.0f}% of the same-bytes copy at >= {_tok(plan.get('large_min', 0))} tokens",
            figure=fig, worst=min((v for _, v in vals if v), default=None), status=_status(vals, lambda v: v >= LARGE_COPY_FRAC),
        ))  # fmt: skip
        vals = []
        for t in large:
            ours, ceil = _value(by.get((model, t, M.KVPOOL)), "gbps"), _value(by.get((model, t, M.CEILING)), "gbps")
            vals.append((t, ours / ceil if ours and ceil else None))
        out.append(dict(
            issue="large writes", model=model, target=f"against the cast-only scatter of the same bytes to the same slots at >= {_tok(plan.get('large_min', 0))} tokens",
            figure=", ".join(f"{_tok(t)}: " + (f"{100 * v:.1f}%" if v else "n/a") for t, v in vals),
            worst=min((v for _, v in vals if v), default=None), status="reported" if any(v for _, v in vals) else "not measured",
        ))  # fmt: skip
        vals = []
        for t in large:
            ours, peer = _value(by.get((model, t, M.KVPOOL)), "gbps"), _value(by.get((model, t, M.PER_TOKEN)), "gbps")
            vals.append((t, ours / peer if ours and peer else None))
        fig = ", ".join(f"{_tok(t)}: " + (f"{v:.3f}x" if v else "n/a") for t, v in vals)
        out.append(dict(
            issue="large writes", model=model, target=f">= {LARGE_PER_TOKEN:.2f}x the one-program-per-token kernel at >= {_tok(plan.get('large_min', 0))} tokens",
            figure=fig, worst=min((v for _, v in vals if v), default=None), status=_status(vals, lambda v: v >= LARGE_PER_TOKEN),
        ))  # fmt: skip
        # Issue 15: decode sizes as graph replays, no slower than either straightforward port.
        vals, worst = [], None
        for t in decode:
            ours = _value(by.get((model, t, M.KVPOOL)), "graph_us")
            ports = [(p, _value(by.get((model, t, p)), "graph_us")) for p in PORTS]
            ports = [(p, us) for p, us in ports if us]
            if not ours or not ports:
                vals.append((t, None))
                continue
            peer, peer_us = min(ports, key=lambda pu: pu[1])
            ratio = ours / peer_us
            vals.append((t, ratio))
            if worst is None or ratio > worst[0]:
                worst = (ratio, t, peer, ours, peer_us)
        if worst:
            r, t, peer, ours, peer_us = worst
            fig = f"worst at T={t}: {ours:.2f} us vs {peer_us:.2f} us ({peer}), {r:.3f}x; " + ", ".join(
                f"{_tok(t)}: {v:.3f}x" if v else f"{_tok(t)}: n/a" for t, v in vals
            )
        else:
            fig = "n/a"
        out.append(dict(
            issue="decode writes", model=model,
            target=f"at 1-{plan.get('decode_max', 0)} tokens, per write in a CUDA graph, no slower than the fastest Triton port (kvpool / port <= 1)",
            figure=fig, worst=worst[0] if worst else None, status=_status(vals, lambda v: v <= 1.0),
        ))  # fmt: skip
    host = result.get("host", {}).get("us", {})
    for label in ("tensor scales", "float scales"):
        s, hand = host.get(f"set_kv_buffer ({label})"), host.get(f"hand launch ({label})")
        diff = s - hand if s is not None and hand is not None else None
        fig = f"set_kv_buffer {s:.2f} us, hand launch {hand:.2f} us: {diff:+.2f} us" if diff is not None else "n/a"
        out.append(dict(
            issue="host time", model="T=1, H=1, D=128", target=f"eager set_kv_buffer ({label}) at most {HOST_OVER_HAND_US:.0f} us of host time over a hand launch of the same compiled kernel",
            figure=fig, worst=diff, status=_status([(1, diff)], lambda v: v <= HOST_OVER_HAND_US),
        ))  # fmt: skip
    return out


# --- Markdown ----------------------------------------------------------------------------------------


def _f(v: Optional[float], fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def _cell_us(rec: Optional[dict], fields=("device_us", "graph_us", "wall_us")) -> str:
    if rec is None:
        return ""
    if "error" in rec:
        return "error"
    return " / ".join(_f(rec.get(f), ".2f") or "-" for f in fields)


def _plan_figure(rec: Optional[dict], ceil: Optional[dict], decode: bool) -> str:
    """A plan-sweep cell: GB/s (% of the ceiling) for large writes, us (% = ceiling / it) at decode sizes."""
    field = "graph_us" if decode else "gbps"
    v, c = _value(rec, field), _value(ceil, field)
    if v is None:
        return "error" if rec and "error" in rec else ""
    frac = (c / v if decode else v / c) if c else None
    mark = "" if rec.get("exact", True) else " !"
    return (f"{v:.2f} us*" if decode else f"{v:.0f}") + (f" ({100 * frac:.1f}%)" if frac else "") + mark


def plan_row(model: str, t: int, line: list, decode: bool) -> str:
    """shape | T | ceiling | policy | best candidate | port | policy / port, for one plan-sweep cell."""
    field = "graph_us" if decode else "gbps"
    ceil = next((r for r in line if r["method"] == M.CEILING), None)
    port = next((r for r in line if r["method"] == M.PER_TOKEN), None)
    policy = next((r for r in line if r["method"].startswith("auto")), None)
    timed = [r for r in line if r["method"] not in (M.CEILING, M.PER_TOKEN) and _value(r, field) and r.get("exact", True)]
    best = (min if decode else max)(timed, key=lambda r: _value(r, field), default=None)
    p, q = _value(policy, field), _value(port, field)
    vs = (q / p if decode else p / q) if p and q else None
    return (
        f"{model} | {t} | {_plan_figure(ceil, None, decode)} | {_plan_figure(policy, ceil, decode)} | "
        + (f"{best['method']}: {_plan_figure(best, ceil, decode)}" if best else "")
        + f" | {_plan_figure(port, ceil, decode)} | {_f(vs, '.3f')}"
    )


def plan_line(line: list, decode: bool) -> str:
    """One plan-sweep cell as a log line."""
    return plan_row(line[0]["model"], line[0]["T"], line, decode).replace(" | ", "; ")


def markdown(result: dict) -> str:
    meta, plan = result.get("meta", {}), result.get("plan", {})
    records = [r for r in result.get("records", []) if "T" in r]
    by = _index(records)
    ceiling = meta.get("ceiling_gbps")
    tokens = plan.get("tokens", [])
    out = ["# kvpool K/V write benchmark", ""]
    if meta.get("dry_run"):
        out += ["**DRY RUN on the CPU: every figure below is a host wall time of an interpreted or CPU run, not a measurement.**", ""]
    if result.get("partial"):
        out += ["**Partial: the run did not finish (this file is a checkpoint).**", ""]
    out += [
        f"Date: {meta.get('date')}  ",
        f"GPU: {meta.get('gpu')}; torch {meta.get('torch')}, triton {meta.get('triton')}, Python {meta.get('python')}  ",
        f"Commit: {meta.get('commit')}; source sha256 (kvpool/ and benchmarks/ *.py): {meta.get('source_sha256')}  ",
        f"Command: `{meta.get('command')}` (plan {meta.get('plan')}, {meta.get('elapsed_s', 0):.0f} s)  ",
        f"Copy ceiling (2 GiB device-to-device `copy_`, read + write, eager events): **{_f(ceiling, '.0f')} GB/s** at the start, "
        f"{_f(meta.get('ceiling_gbps_end'), '.0f')} GB/s at the end  ",
        "",
        f"Pool: FP8 e4m3fn, {plan.get('slots')} slots per layer, {plan.get('layers')} layers written in turn; random distinct slots; "
        "inputs bf16 [T, H, D], random (x 60); one-element float32 scale tensor (0.37; SGLang's fallback, which divides "
        "its inputs in place, gets 1.0); int64 loc. Device time: median of CUDA-graph replays; *cold*: 96 MB L2 flush "
        f"before each call, its time subtracted ({plan.get('cold_calls')} calls per graph); *graph*: per call in a graph of "
        f"{plan.get('graph_calls')} calls cycling over the layers, no flush; *wall*: eager calls back to back, median of "
        f"{plan.get('wall_runs')} runs of {plan.get('wall_calls')}, host time included. GB/s counts "
        "T x (H x D + Hv x Dv) x (input + cache element size) + T x loc element size bytes (docs/contract.md) "
        "from the cold time. First calls are never timed.",
        "",
    ]
    # Targets.
    out += ["## Targets (computed from this run)", "", "| what | shape | target | figure | status |", "|---|---|---|---|---|"]
    for t in result.get("targets") or targets(result):
        out.append(f"| {t['issue']} | {t['model']} | {t['target']} | {t['figure']} | **{t['status']}** |")
    # Throughput.
    cols = [M.COPY, M.CEILING] + WRITE_METHODS + [M.OBSERVE]
    if not records:
        tokens = []  # nothing measured: no empty tables
    out += [
        "",
        "## Throughput: GB/s (percent of the copy ceiling), cold device time",
        "",
        "| model | T | " + " | ".join(cols) + " | kvpool / copy | kvpool / ceiling | kvpool / per token | kvpool / compile |",
        "|---|---:|" + "---:|" * len(cols) + "---:|---:|---:|---:|",
    ] if records else []
    for model in MODELS:
        for t in tokens:
            cells = []
            for m in cols:
                r = by.get((model, t, m))
                g = _value(r, "gbps")
                if r is None:
                    cells.append("")
                elif g is None:
                    cells.append("error")
                else:
                    cells.append(f"{g:.0f} ({100 * g / ceiling:.0f}%)" if ceiling else f"{g:.0f}")
            ours = _value(by.get((model, t, M.KVPOOL)), "gbps")

            def ratio(m: str, pct: bool = False) -> str:
                other = _value(by.get((model, t, m)), "gbps")
                if not ours or not other:
                    return ""
                return f"{100 * ours / other:.1f}%" if pct else f"{ours / other:.2f}x"

            if any(cells):
                out.append(f"| {model} | {t} | " + " | ".join(cells) + f" | {ratio(M.COPY, True)} | {ratio(M.CEILING, True)} | {ratio(M.PER_TOKEN)} | {ratio(M.COMPILE)} |")
    # Decode sizes.
    decode = [t for t in tokens if t <= plan.get("decode_max", 0)]
    out += [
        "",
        "## Decode sizes: microseconds per write, cold / graph / wall",
        "",
        "| model | T | " + " | ".join(WRITE_METHODS + [M.CEILING]) + " |",
        "|---|---:|" + "---:|" * (len(WRITE_METHODS) + 1),
    ] if decode else []
    for model in MODELS:
        for t in decode:
            cells = [_cell_us(by.get((model, t, m))) for m in WRITE_METHODS + [M.CEILING]]
            if any(cells):
                out.append(f"| {model} | {t} | " + " | ".join(cells) + " |")
    # Calibration.
    calib = plan.get("calib_tokens", []) if any(r["method"] == M.OBSERVE for r in records) else []
    out += [
        "",
        "## Calibration cost: the write with `observe_amax(True)` against the same write without",
        "",
        "Same pool, inputs and slots. Cold device time (and graph / wall at decode sizes), microseconds.",
        "",
        "| model | T | off: cold | on: cold | cold overhead | off: graph | on: graph | off: wall | on: wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ] if calib else []
    for model in MODELS:
        for t in calib:
            off, on = by.get((model, t, M.KVPOOL)), by.get((model, t, M.OBSERVE))
            if off is None and on is None:
                continue
            if on is not None and "error" in on:
                out.append(f"| {model} | {t} | {_f(_value(off, 'device_us'), '.2f')} | error: {on['error'][:80]} | | | | | |")
                continue
            a, b = _value(off, "device_us"), _value(on, "device_us")
            over = f"{100 * (b / a - 1):+.1f}%" if a and b else ""
            out.append(
                f"| {model} | {t} | {_f(a, '.2f')} | {_f(b, '.2f')} | {over} | {_f(_value(off, 'graph_us'), '.2f')} | "
                f"{_f(_value(on, 'graph_us'), '.2f')} | {_f(_value(off, 'wall_us'), '.1f')} | {_f(_value(on, 'wall_us'), '.1f')} |"
            )
    # Host time.
    host = result.get("host", {})
    if host:
        out += [
            "",
            f"## Host time per eager call: T=1, H=1, D=128; median of {host.get('runs')} runs of {host.get('calls')} calls, interleaved",
            "",
            "*hand launch*: the compiled kernel the pool's writer launched, called with the arguments it passed "
            "(recorded from its direct launch); *Triton JIT launch*: `kernel[grid](...)` with the same arguments "
            "(Triton specialises every call); *KVWriter.write*: the pool's writer given the pool's caches; "
            "*set_kv_buffer*: the whole eager call; *control*: a one-kernel torch op, what any launch costs here. "
            f"JIT launches of the pool's writer while timed: {host.get('jit_launches_while_timed', 'n/a')} "
            "(each variant's first call only; more would mean a call that misses the direct-launch cache).",
            "",
            "| call | us |",
            "|---|---:|",
        ]
        out += [f"| {k} | {_f(v, '.2f')} |" for k, v in host.get("us", {}).items()]
        out += [f"- note: {n}" for n in host.get("notes", [])]
    # Prefix-valid.
    prefix = result.get("prefix", [])
    if prefix:
        pm = [M.PREFIX, M.PREFIX_PLAIN, M.PREFIX_MASKED]
        pby = {(r["model"], r["bs"], r["method"]): r for r in prefix}
        out += [
            "",
            "## Speculative-decoding verify write: microseconds per write, cold / graph / wall",
            "",
            "`set_kv_buffer_prefix_valid` writes the first `commit_lens[i]` of each request's `width` tokens (random "
            "commit lengths in 0..width); the plain write stores all bs x width tokens; the masked one sets uncommitted "
            "slots to -1 with `torch.where` and then writes.",
            "",
            "| model | bs x width | committed | " + " | ".join(pm) + " | prefix / plain (graph) |",
            "|---|---:|---:|" + "---:|" * len(pm) + "---:|",
        ]
        for model in MODELS:
            for bs in plan.get("prefix_bs", []):
                rs = [pby.get((model, bs, m)) for m in pm]
                if not any(rs):
                    continue
                a, b = _value(rs[0], "graph_us"), _value(rs[1], "graph_us")
                committed = next((r["committed"] for r in rs if r), "")
                out.append(
                    f"| {model} | {bs} x {plan.get('prefix_width')} | {committed} | "
                    + " | ".join(_cell_us(r) for r in rs)
                    + f" | {_f(a / b if a and b else None, '.2f')} |"
                )
    # Moves.
    moves = result.get("moves", {})
    if moves:
        out += [
            "",
            f"## move_kv_cache: {moves.get('layers')} layers, {moves.get('model')}; microseconds per call, cold / graph / wall",
            "",
        ]
        if moves.get("kvpool_skipped"):
            out += [f"kvpool skipped: {moves['kvpool_skipped']}.", ""]
        mby = {(r["slots"], r["method"]): r for r in moves.get("records", [])}
        out += [f"| slots | bytes (K+V, read + write) | {M.MOVE} | {M.MOVE_LOOP} | loop / kvpool (cold) | loop / kvpool (wall) |", "|---:|---:|---:|---:|---:|---:|"]
        for n in plan.get("move_slots", []):
            a, b = mby.get((n, M.MOVE)), mby.get((n, M.MOVE_LOOP))
            if a is None and b is None:
                continue
            nbytes = (a or b).get("bytes", 0)
            rc = _value(b, "device_us") / _value(a, "device_us") if _value(a, "device_us") and _value(b, "device_us") else None
            rw = _value(b, "wall_us") / _value(a, "wall_us") if _value(a, "wall_us") and _value(b, "wall_us") else None
            out.append(
                f"| {n} | {nbytes} | {_cell_us(a) or 'skipped'} | {_cell_us(b)} | {_f(rc, '.1f') + 'x' if rc else ''} | {_f(rw, '.1f') + 'x' if rw else ''} |"
            )
    # Agreement.
    agree: dict = {}
    for r in records + moves.get("records", []):
        if "mismatch_frac" in r:
            agree.setdefault(r["method"], []).append(r["mismatch_frac"])
    if agree:
        out += [
            "",
            "## Agreement: fraction of bytes that differ from kvpool's write after each method's first call",
            "",
            "(moves: from the source rows). The Triton ports divide approximately, so a few differing bytes are expected there.",
            "",
            "| method | cells | max | mean |",
            "|---|---:|---:|---:|",
        ]
        for m, v in agree.items():
            out.append(f"| {m} | {len(v)} | {max(v):.2e} | {sum(v) / len(v):.2e} |")
    # Plans.
    sweep = result.get("plans", [])
    if sweep:
        out += [
            "",
            "## Plan sweep: the write's launch-plan candidates, the one-program-per-token kernel, the ceiling",
            "",
            "Large writes: GB/s (percent of the cast-only scatter ceiling), cold device time; decode sizes "
            "(marked *): microseconds per write in a graph of graph_calls writes (percent: ceiling's time over "
            "the candidate's). *policy*: what the pool takes. A candidate that is not exact is marked !.",
            "",
            "| shape | T | ceiling | policy | best candidate | port | policy / port |",
            "|---|---:|---:|---:|---|---:|---:|",
        ]
        by_cell: dict = {}
        for r in sweep:
            by_cell.setdefault((r["model"], r["T"]), []).append(r)
        for (model, t), line in by_cell.items():
            out.append("| " + plan_row(model, t, line, t <= plan.get("decode_max", 0)) + " |")
        out += ["", "Every candidate: `bench.json`, key `plans` (each with the plan it took)."]
    # Errors, skips, times.
    errors = [r for r in records + prefix + moves.get("records", []) if "error" in r]
    other = list(result.get("errors", [])) + [f"section {k}: {v}" for k, v in result.get("section_errors", {}).items()]
    if errors or other:
        out += ["", "## Errors", ""]
        for r in errors:
            where = " ".join(f"{k}={r[k]}" for k in ("model", "T", "bs", "slots") if k in r)
            out.append(f"- {where} {r['method']}: {r['error']}")
        out += [f"- {e}" for e in other]
    if result.get("skipped"):
        out += ["", "## Skipped", ""] + [f"- {s}" for s in result["skipped"]]
    if result.get("sections_s"):
        out += ["", "## Section times (s)", "", ", ".join(f"{k}: {v}" for k, v in result["sections_s"].items())]
    return "\n".join(out) + "\n"


# --- plot --------------------------------------------------------------------------------------------


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in result.get("records", []) if "T" in r]
    ceiling = result.get("meta", {}).get("ceiling_gbps")
    fig, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4.5), sharey=True)
    for ax, model in zip(axes, MODELS):
        for m in WRITE_METHODS + [M.COPY]:
            pts = sorted((r["T"], r["gbps"]) for r in records if r["model"] == model and r["method"] == m and _value(r, "gbps"))
            if pts:
                style = dict(color="k", linestyle=":", marker=".") if m == M.COPY else dict(marker="o")
                ax.plot(*zip(*pts), label=m, **style)
        if ceiling:
            ax.axhline(ceiling, color="k", linestyle="--", label=f"copy ceiling {ceiling:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_title(model)
        ax.set_xlabel("tokens per write")
    axes[0].set_ylabel("GB/s (bytes as in docs/contract.md)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="a bench.json written by bench_set_kv.py")
    parser.add_argument("--out", help="write the Markdown here (default: print it)")
    parser.add_argument("--plot", help="also draw the plot to this PNG (needs matplotlib)")
    args = parser.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    result["targets"] = targets(result)
    md = markdown(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    else:
        print(md)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
