"""MambaPool's speculative commit and fork against a same-bytes device copy, on a GPU.

The state is Qwen3.5-397B-A17B's on one of 8 ranks: 45 Gated DeltaNet layers, each slot a convolution
window (1536, 3) bf16 and an SSM state (8, 128, 128) fp32 (24,007,680 bytes over the layers), with 16
draft steps of scratch per batch position. For each request count ``n``:

* **commit**: ``MambaPool.commit(slots, accepted_steps)``, every request accepting between 1 and 16
  steps (random, never 0, so every request moves its state), plus the same with track slots (twice
  the bytes, one launch);
* **fork**: ``MambaPool.copy_from(src, dst)`` between distinct slots;
* **copy**: a contiguous ``copy_`` of the same bytes, the ceiling, timed the same way in the same run.

Each operation moves ``n * 24,007,680`` bytes read and as many written; GB/s counts both. Times are
device time: a sleep kernel holds the GPU while the host queues the call, the 96 MB L2 is flushed
before each call, and the median of ``--reps`` timed calls is taken (the first call is never timed).
Buffers hold random bytes, never zeros. Each operation's result is checked byte for byte against the
scratch rows it copies before it is timed. The target: commit and fork at >= 85% of the same-bytes
copy. Also reported: the 2 GiB copy ceiling, and the host-inclusive wall time of eager commits issued
back to back.

Usage (on a GPU): python benchmarks/bench_state.py --out DIR
``--cpu-smoke`` runs the same code on CPU pools of a toy geometry.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
from timing import DryClock, GpuClock, flush_buffer  # noqa: E402

from kvpool import MambaCacheParams, MambaPool, MambaStateShape  # noqa: E402

QWEN35 = dict(num_k_heads=16, num_v_heads=64, head_k_dim=128, head_v_dim=128, conv_kernel=4, tp_world_size=8)
LAYERS = [i for i in range(60) if (i + 1) % 4]  # 45 linear layers; every 4th is full attention
TARGET = 0.85


def make_pool(smoke: bool, requests: int, steps: int) -> MambaPool:
    if smoke:
        params = MambaCacheParams(MambaStateShape(conv=(24, 3), temporal=(2, 8, 8)), layers=[0, 1, 2])
        device = "cpu"
    else:
        params = MambaCacheParams(MambaStateShape.gated_delta_net(**QWEN35), layers=LAYERS)
        device = "cuda"
    # Room for the committed slots, their track slots and fork targets, all distinct.
    pool = MambaPool(size=3 * requests, spec_state_size=requests, cache_params=params, device=device,
                     speculative_num_draft_tokens=steps)  # fmt: skip
    g = torch.Generator(device=device).manual_seed(0)
    for t in (*pool.conv, pool.temporal, *pool.intermediate_conv_window, pool.intermediate_ssm):
        raw = t.view(torch.uint8).view(-1)
        for chunk in raw.split(1 << 30):  # random bytes, in pieces (randint's temporaries stay small)
            chunk.copy_(torch.randint(0, 256, chunk.shape, dtype=torch.uint8, device=device, generator=g))
    pool.alloc_slots(pool.size)  # every slot handed out: the pool refuses commits and forks into free slots
    return pool


def device_ms(clock, fn, reps: int, flush) -> float:
    """Median device milliseconds of ``fn()``: one untimed call, then ``reps`` calls each after an
    L2 flush, timed from events around the call while a sleep kernel held the GPU as the host
    queued it."""
    if clock.dry:
        return clock.device_us(lambda i: fn(), 2, False) / 1e3
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(2_000_000)  # ~1 ms: the host queues the call before the GPU reaches it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_commit(pool: MambaPool, slots: list[int], steps: list[int]) -> None:
    """Every layer's state of ``slots[i]`` equals scratch entry ``[i, steps[i] - 1]``, byte for byte."""
    for live, scratch in ((pool.temporal, pool.intermediate_ssm), (pool.conv[0], pool.intermediate_conv_window[0])):
        for i, (slot, s) in enumerate(zip(slots, steps)):
            if not torch.equal(live[:, slot].view(torch.uint8), scratch[:, i, s - 1].view(torch.uint8)):
                raise RuntimeError(f"commit check failed: slot {slot} differs from scratch [{i}, {s - 1}]")


def check_fork(pool: MambaPool, src: list[int], dst: list[int]) -> None:
    for t in (pool.temporal, pool.conv[0]):
        if not torch.equal(t[:, src].view(torch.uint8), t[:, dst].view(torch.uint8)):
            raise RuntimeError("fork check failed: a destination slot differs from its source")


def measure(pool: MambaPool, clock, n: int, reps: int, flush) -> dict:
    dev = pool.device
    k = pool.speculative_num_draft_tokens
    g = torch.Generator().manual_seed(n)
    order = torch.randperm(pool.size, generator=g)[: 3 * n] + 1  # distinct slots, scattered
    slots, track, fork_dst = order[:n], order[n : 2 * n], order[2 * n :]
    steps = torch.randint(1, k + 1, (n,), generator=g)
    slots_d, track_d, fork_d, steps_d = (t.to(dev) for t in (slots, track, fork_dst, steps))

    def commit():
        pool.commit(slots_d, steps_d)

    def commit_track():
        pool.commit(slots_d, steps_d, track_d, steps_d)

    def fork():
        pool.copy_from(slots_d, fork_d)

    commit()
    check_commit(pool, slots.tolist(), steps.tolist())
    commit_track()
    check_commit(pool, track.tolist(), steps.tolist())
    fork()
    check_fork(pool, slots.tolist(), fork_dst.tolist())

    nbytes = n * pool.cache_params.bytes_per_slot
    src = torch.randint(0, 256, (2 * nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_half = lambda: dst[:nbytes].copy_(src[:nbytes])  # noqa: E731
    copy_full = lambda: dst.copy_(src)  # noqa: E731
    row = {"requests": n, "bytes": nbytes}
    for name, fn, moved, ceiling in (("commit", commit, nbytes, copy_half), ("commit+track", commit_track, 2 * nbytes, copy_full),
                                     ("fork", fork, nbytes, copy_half)):  # fmt: skip
        op_ms = device_ms(clock, fn, reps, flush)
        copy_ms = device_ms(clock, ceiling, reps, flush)
        row[name] = {
            "us": op_ms * 1e3, "gbps": 2 * moved / (op_ms * 1e-3) / 1e9,
            "copy_us": copy_ms * 1e3, "copy_gbps": 2 * moved / (copy_ms * 1e-3) / 1e9, "of_copy": copy_ms / op_ms,
        }  # fmt: skip
    row["commit_eager_wall_us"] = clock.wall_us(lambda i: commit(), calls=20, runs=5)
    del src, dst
    return row


def markdown(result: dict) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = [
        f"State: {meta['state']}. Copy ceiling (2 GiB `copy_`): {meta['copy_ceiling_gbps']:.0f} GB/s. Device time, L2 flushed, "
        f"median of {meta['reps']} calls; GB/s counts bytes read and written; *of copy* is the same-bytes contiguous "
        f"`copy_` time over the operation's (target >= {TARGET:.0%}).", "",
        "| requests | MB | commit us | GB/s | of copy | commit+track us | of copy | fork us | GB/s | of copy | eager commit wall us |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        c, t, f = r["commit"], r["commit+track"], r["fork"]
        lines.append(
            f"| {r['requests']} | {r['bytes'] / 1e6:.1f} | {c['us']:.1f} | {c['gbps']:.0f} | {c['of_copy']:.1%} | "
            f"{t['us']:.1f} | {t['of_copy']:.1%} | {f['us']:.1f} | {f['gbps']:.0f} | {f['of_copy']:.1%} | "
            f"{r['commit_eager_wall_us']:.1f} |"
        )
    missed = [f"{name} at {r['requests']}" for r in rows for name in ("commit", "fork") if r[name]["of_copy"] < TARGET]
    if rows:
        lines += ["", "Target met at every request count." if not missed else "Target missed: " + ", ".join(missed) + "."]
    return "\n".join(lines) + "\n"


def plot(result: dict, fig) -> None:
    ax = fig.subplots()
    rows = result["rows"]
    n = [r["requests"] for r in rows]
    for name in ("commit", "commit+track", "fork"):
        ax.plot(n, [r[name]["gbps"] for r in rows], marker="o", label=name)
    ax.plot(n, [r["commit"]["copy_gbps"] for r in rows], color="k", linestyle="--", label="contiguous copy of the same bytes")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests per call")
    ax.set_ylabel("GB/s (read + written)")
    ax.legend(fontsize=8)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(p, "state")
    p.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="requests per call")
    p.add_argument("--steps", type=int, default=16, help="draft steps of scratch (K)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    args = p.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --cpu-smoke)")
    rep = report.Report(args, "bench_state", "MambaPool commit and fork", markdown, plot)
    clock = DryClock() if args.cpu_smoke else GpuClock()
    flush = None if args.cpu_smoke else flush_buffer()
    pool = make_pool(args.cpu_smoke, max(args.requests), args.steps)
    params = pool.cache_params
    rep.meta.update(
        state=f"{params.num_layers} layers x conv {params.shape.conv[0]} {params.dtype.conv} + SSM {params.shape.temporal} "
              f"{params.dtype.temporal}, {params.bytes_per_slot} B/slot, K={args.steps}",
        reps=args.reps, copy_ceiling_gbps=clock.copy_ceiling_gbps(),
    )  # fmt: skip
    rep.result["rows"] = []
    for n in args.requests:
        if rep.over_budget(f"{n} requests"):
            continue
        try:
            rep.result["rows"].append(measure(pool, clock, n, args.reps, flush))
        except Exception as exc:
            rep.error(f"{n} requests", exc)
            continue
        row = rep.result["rows"][-1]
        rep.log(f"{n:3d} requests: commit {row['commit']['of_copy']:.1%} of copy, fork {row['fork']['of_copy']:.1%}")
        rep.save()
    rep.save(final=True)
    return 1 if rep.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
