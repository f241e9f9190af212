"""The slot allocators' per-step calls, kvpool against SGLang's own ``allocator.py`` on the same inputs.

Rows (wall time per call, the device synchronised before and after each timed call, median of
``--reps``; the first calls are never timed; kvpool's and SGLang's calls of a row are timed in
turn, one call of each a round, so that the rest of the machine weighs on both alike):

* the floor: one launch of a one-kernel torch op, timed the same way (what any call that launches a
  kernel costs at least; SGLang's token ``alloc`` launches none);

* paged ``alloc_extend`` (page 64): 1, 8 and 64 new requests of 256..512 tokens each;
* paged ``alloc_decode``: 1, 16, 128 and 512 running requests of 100..2000 tokens;
* paged ``free`` of one finished request (1,000..3,000 tokens, whole pages);
* token ``alloc(64)`` and ``free(64)`` at pool sizes from 64k to 32M slots (CPU: to 8M);
* the request tables' calls for one request (``table_rows``): a ``ReqToTokenPool`` row taken and
  given back, a ``MambaPool`` state slot taken, zeroed and given back, and a
  ``HybridReqToTokenPool`` request admitted (a row and a state slot) and finished
  (``free_mamba_cache`` then ``free``), against SGLang's classes of the same names;
* the sliding-window allocator's ``free_swa(64)`` (a request's tokens leaving the window) at the
  smallest and largest pool size, kvpool's only (the target: flat in the pool's size).

The paged ``alloc_extend`` calls are undone with ``backup_state``/``restore_state`` outside the
timing, so every timed call sees the same allocator. The ``alloc_decode`` calls are not undone: each
repeats the same step of the same running requests and takes the few fresh pages that step starts,
as a server's steps follow each other with nothing restored in between (a restore before each call
made kvpool's next call up to twice as slow on an H200, a cost no serving step pays). Token
``alloc(64)`` is undone by freeing its slots, and ``free`` times giving back slots just handed out. Both allocators
get the same tensors. On a GPU each call is also run once after a queued matrix multiply under
``torch.cuda.set_sync_debug_mode("error")``: "waits" says whether it synchronised; and once under
the profiler: "kernels" counts the kernels it launched (kvpool's token ``alloc`` lends a view of its
free list and launches none; its slots are recorded held by the next ``free``'s one launch).

SGLang's ``allocator.py`` and its request tables (``memory_pool.py``'s ``ReqToTokenPool``,
``MambaPool``, ``HybridReqToTokenPool``) come from its wheel (``--sglang-wheel``, e.g. from ``pip
download sglang==0.5.9 --no-deps``), with stand-ins for the parts of SGLang they import
(``sglang_wheel.py``). Its paged ``alloc_extend``/``alloc_decode`` are Triton kernels: on the CPU
they are not measured.

Target (CPU or GPU): kvpool's token ``free(64)`` at 8M slots within 2x of its time at 64k. On the CPU
torch runs on one thread (a loaded machine's thread wake-ups would dominate calls this small).

Usage (from the repository root, so that this checkout's kvpool is the one measured):
    PYTHONPATH=. python benchmarks/bench_allocators.py --out DIR [--device cpu|cuda] [--quick] [--sglang-wheel PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import types
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
import sglang_wheel  # noqa: E402

from kvpool import HybridReqToTokenPool, MambaCacheParams, MambaPool, MambaStateShape, ReqToTokenPool, SWATokenToKVPoolAllocator  # noqa: E402
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402

PAGE = 64


# --- timing --------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device: torch.device, reps: int) -> None:
        self.cuda = device.type == "cuda"
        self.reps = reps
        self._profiler_counts: Optional[bool] = None  # whether the profiler counts kernels here

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def per_call_us(self, before: Callable[[], Any], call: Callable[[Any], Any], after: Callable[[Any, Any], None]) -> float:
        """Median microseconds of ``call(before())``, synchronised around; ``after(prepared, result)``
        undoes it, untimed."""
        return self.alternating({"": (before, call, after)})[""]

    def alternating(self, cases: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any, Any], None]]]) -> dict[str, float]:
        """``per_call_us`` of several cases timed in turn, call by call (one call of each, then the
        next round), so that whatever the machine does meanwhile falls on all of them alike."""
        times: dict[str, list[float]] = {name: [] for name in cases}
        for i in range(self.reps + 2):
            for name, (before, call, after) in cases.items():
                prepared = before()
                self.sync()
                t0 = time.perf_counter()
                out = call(prepared)
                self.sync()
                t1 = time.perf_counter()
                after(prepared, out)
                if i >= 2:
                    times[name].append((t1 - t0) * 1e6)
        return {name: statistics.median(ts) for name, ts in times.items()}

    def kernels(self, call: Callable[[], Any]) -> Optional[int]:
        """How many kernels ``call()`` launches on the GPU (None on the CPU, or where the profiler does
        not count one kernel for a one-kernel op)."""
        if not self.cuda:
            return None
        if self._profiler_counts is None:
            x = torch.zeros(64, device="cuda")
            self._profiler_counts = self._count(lambda: x.add_(1)) == 1
        return self._count(call) if self._profiler_counts else None

    def _count(self, call: Callable[[], Any]) -> Optional[int]:
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                self.sync()
        except RuntimeError:
            return None
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    def waits(self, call: Callable[[], Any]) -> Optional[bool]:
        """Whether ``call()`` synchronises with a kernel queued before it (None on the CPU)."""
        if not self.cuda:
            return None
        busy = torch.randn(2048, 2048, device="cuda")
        self.sync()
        for _ in range(4):
            busy = busy @ busy
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            return False
        except RuntimeError:
            return True
        finally:
            torch.cuda.set_sync_debug_mode(0)
            self.sync()


# --- rows ----------------------------------------------------------------------------------------------


def undo_alloc(a: Any) -> tuple[Callable[[], Any], Callable[[Any, Any], None]]:
    return (lambda: a.backup_state()), (lambda state, out: a.restore_state(state))


def extend_inputs(bs: int, device: torch.device, rng: random.Random) -> tuple:
    seq_c = torch.tensor([rng.randint(256, 512) for _ in range(bs)], dtype=torch.int64)
    pre_c = torch.zeros(bs, dtype=torch.int64)
    last = torch.full((bs,), -1, dtype=torch.int64, device=device)
    return pre_c.to(device), pre_c, seq_c.to(device), seq_c, last, int(seq_c.sum())


#: Requests per ``alloc_extend`` that sets up a decode batch: at most 8,000 tokens a call, as a
#: server's chunked prefill takes them (SGLang's extend kernel is built for the largest power of two
#: of a call's tokens it has seen, and one of 512 requests of 2,000 tokens would build one of 2**20
#: lanes for every later call).
SETUP_REQUESTS = 4


def running_requests(a: Any, bs: int, device: torch.device, rng: random.Random) -> tuple:
    """``bs`` requests of 100..2000 tokens held in ``a`` (through its alloc_extend, ``SETUP_REQUESTS``
    at a time); the decode inputs."""
    seq_c = torch.tensor([rng.randint(100, 2000) for _ in range(bs)], dtype=torch.int64)
    lasts = []
    for chunk in seq_c.split(SETUP_REQUESTS):
        zeros = torch.zeros(chunk.shape[0], dtype=torch.int64)
        out = a.alloc_extend(zeros.to(device), zeros, chunk.to(device), chunk,
                             torch.full(chunk.shape, -1, dtype=torch.int64, device=device), int(chunk.sum()))  # fmt: skip
        lasts.append(out[torch.cumsum(chunk, 0).to(device) - 1])
    return (seq_c + 1).to(device), seq_c + 1, torch.cat(lasts)


def measure(impls: dict, device: torch.device, timer: Timer, sizes: list[int], paged_slots: int, rep: Any,
            decode_bs: list[int], extend_bs: list[int], sglang_tables: Optional[tuple] = None) -> list[dict]:  # fmt: skip
    rows: list[dict] = []
    rng = random.Random(0)
    cpu = device.type == "cpu"

    def add(call: str, case: str, impl: str, us: Optional[float], waits: Optional[bool], note: str = "",
            kernels: Optional[int] = None) -> None:  # fmt: skip
        rows.append(dict(call=call, case=case, impl=impl, us=us, waits=waits, note=note, kernels=kernels))
        figure = f"{us:.1f} us" if us is not None else note
        rep.log(f"{call} {case} {impl}: {figure}" + ("" if waits is None else f", waits={waits}")
                + ("" if kernels is None else f", kernels={kernels}"))  # fmt: skip
        rep.result["rows"] = rows
        rep.save()

    # The floor of any call that launches a kernel: one launch of one small torch op, timed the same way.
    x = torch.zeros(64, dtype=torch.int64, device=device)
    add("one kernel launch (the floor)", "x.add_(1) on 64 int64", "torch", timer.per_call_us(lambda: None, lambda _: x.add_(1), lambda _, out: None), None)
    for bs in extend_bs:
        args = extend_inputs(bs, device, rng)
        cases, allocators = {}, {}
        for name, (_, Paged) in impls.items():
            if name == "sglang" and cpu:
                add("paged alloc_extend", f"{bs} requests", name, None, None, "Triton kernel: GPU only")
                continue
            a = allocators[name] = Paged(paged_slots, PAGE, None, device, None, False)
            before, after = undo_alloc(a)
            cases[name] = (before, lambda _, a=a: a.alloc_extend(*args), after)
        for name, us in timer.alternating(cases).items():
            a = allocators[name]
            add("paged alloc_extend", f"{bs} requests", name, us, timer.waits(lambda: a.alloc_extend(*args)))

    def decode_rows(bs: int) -> None:
        cases, inputs = {}, {}
        for name, (_, Paged) in impls.items():
            if name == "sglang" and cpu:
                add("paged alloc_decode", f"{bs} requests", name, None, None, "Triton kernel: GPU only")
                continue
            a = Paged(paged_slots, PAGE, None, device, None, False)
            inputs[name] = (a, running_requests(a, bs, device, random.Random(bs)))
            cases[name] = (lambda: None, lambda _, a=a, d=inputs[name][1]: a.alloc_decode(*d), lambda _, out: None)
        for name, us in timer.alternating(cases).items():
            a, dargs = inputs[name]
            add("paged alloc_decode", f"{bs} requests", name, us, timer.waits(lambda: a.alloc_decode(*dargs)))

    # The largest decode batch comes last, so that every other row is in the report however long it takes.
    for bs in decode_bs[:-1]:
        decode_rows(bs)
    n_req = rng.randint(1000, 3000) // PAGE * PAGE
    cases, allocators = {}, {}
    for name, (_, Paged) in impls.items():
        a = allocators[name] = Paged(paged_slots, PAGE, None, device, None, False)
        cases[name] = (lambda a=a: a.alloc(n_req), lambda s, a=a: a.free(s), lambda s, out: None)
    for name, us in timer.alternating(cases).items():
        slots = allocators[name].alloc(n_req)
        add("paged free", f"one request of {n_req} tokens", name, us, timer.waits(lambda: allocators[name].free(slots)))
    for size in sizes:
        if rep.over_budget(f"token calls at {size} slots"):
            continue
        allocators = {}
        for name, (Token, _) in impls.items():
            a = allocators[name] = Token(size, None, device, None, False)
            a.free(a.alloc(size // 2))  # a free list that has taken slots back
        alloc = timer.alternating({name: (lambda: None, lambda _, a=a: a.alloc(64), lambda _, out, a=a: a.free(out))
                                   for name, a in allocators.items()})  # fmt: skip
        free = timer.alternating({name: (lambda a=a: a.alloc(64), lambda s, a=a: a.free(s), lambda s, out: None)
                                  for name, a in allocators.items()})  # fmt: skip
        for name, a in allocators.items():
            add("token alloc(64)", f"{size:,} slots", name, alloc[name], timer.waits(lambda: a.alloc(64)),
                kernels=timer.kernels(lambda: a.alloc(64)))  # fmt: skip
            slots, more = a.alloc(64), a.alloc(64)
            add("token free(64)", f"{size:,} slots", name, free[name], timer.waits(lambda: a.free(slots)),
                kernels=timer.kernels(lambda: a.free(more)))  # fmt: skip
        del allocators, a
    table_rows(device, timer, add, sglang_tables)
    swa_rows(device, timer, add, [sizes[0], sizes[-1]])
    decode_rows(decode_bs[-1])
    return rows


#: A small linear-attention state (Qwen3.5's layout at toy sizes): what the table rows allocate.
STATES = MambaCacheParams(MambaStateShape(conv=(64, 3), temporal=(4, 16, 16)), (0, 1, 2))
TABLE_ROWS, STATE_SLOTS, CONTEXT = 256, 256, 4096


class Request:
    """What the request tables read and set of a scheduler's request (SGLang's ``Req``)."""

    def __init__(self) -> None:
        self.req_pool_idx = self.mamba_pool_idx = None
        self.is_chunked = self.kv_committed_len = 0

    def is_dllm(self) -> bool:
        return False


def sglang_state_params() -> types.SimpleNamespace:
    """``STATES`` in the form SGLang's ``MambaPool`` reads (its ``BaseLinearStateParams``)."""
    shape = types.SimpleNamespace(conv=list(STATES.shape.conv), temporal=STATES.shape.temporal)
    return types.SimpleNamespace(shape=shape, dtype=types.SimpleNamespace(conv=STATES.dtype.conv, temporal=STATES.dtype.temporal),
                                 layers=list(STATES.layers))  # fmt: skip


def table_rows(device: torch.device, timer: Timer, add: Callable[..., None], sglang: Optional[tuple]) -> None:
    """The request tables' calls for one request, kvpool's and (``sglang``: its three classes)
    SGLang's in alternation: a request's row taken and given back (``alloc([req])``, ``free(req)``),
    a state slot taken, zeroed and given back (SGLang's ``alloc(1)`` zeroes its states; kvpool's
    host-int form, ``alloc_slots`` then ``clear_slots`` and ``free`` of the ints, never waits), and a
    hybrid request admitted and finished (``alloc([req])``, ``free_mamba_cache(req)``, ``free(req)``)."""
    table = ReqToTokenPool(TABLE_ROWS, max_context_len=CONTEXT, device=device)
    states = MambaPool(size=STATE_SLOTS, cache_params=STATES, device=device)
    hybrid = HybridReqToTokenPool(size=TABLE_ROWS, mamba_size=STATE_SLOTS, max_context_len=CONTEXT, device=device,
                                  cache_params=STATES)  # fmt: skip

    def row(t: Any) -> None:
        req = Request()
        t.alloc([req])
        t.free(req)

    def state_slot(p: MambaPool) -> None:
        got = p.alloc_slots(1)
        p.clear_slots(p.slots_tensor(got))
        p.free(got)

    def admit_and_finish(h: Any) -> None:
        req = Request()
        h.alloc([req])
        h.free_mamba_cache(req)
        h.free(req)

    calls = {
        ("request row alloc([req]) + free(req)", "ReqToTokenPool"): {"kvpool": lambda: row(table)},
        ("state slot alloc(1) + zeroed + free", "MambaPool"): {"kvpool": lambda: state_slot(states)},
        ("request admitted + finished", "HybridReqToTokenPool"): {"kvpool": lambda: admit_and_finish(hybrid)},
    }
    if sglang is not None:
        req_table, mamba_pool, hybrid_table = sglang
        params = sglang_state_params()
        s_table = req_table(size=TABLE_ROWS, max_context_len=CONTEXT, device=str(device), enable_memory_saver=False)
        s_states = mamba_pool(size=STATE_SLOTS, spec_state_size=0, cache_params=params, device=str(device))
        s_hybrid = hybrid_table(size=TABLE_ROWS, mamba_size=STATE_SLOTS, mamba_spec_state_size=0, max_context_len=CONTEXT,
                                device=str(device), enable_memory_saver=False, cache_params=params,
                                enable_mamba_extra_buffer=False)  # fmt: skip
        calls[("request row alloc([req]) + free(req)", "ReqToTokenPool")]["sglang"] = lambda: row(s_table)
        calls[("state slot alloc(1) + zeroed + free", "MambaPool")]["sglang"] = lambda: s_states.free(s_states.alloc(1))
        calls[("request admitted + finished", "HybridReqToTokenPool")]["sglang"] = lambda: admit_and_finish(s_hybrid)
    for (call, case), impls in calls.items():
        times = timer.alternating({name: (lambda: None, lambda _, f=f: f(), lambda _, out: None) for name, f in impls.items()})
        for name, f in impls.items():
            add(call, case, name, times[name], timer.waits(f), kernels=timer.kernels(f))


def swa_rows(device: torch.device, timer: Timer, add: Callable[..., None], sizes: list[int]) -> None:
    """kvpool's sliding-window allocator at each pool size (the SWA part half the full part): one
    request's 64 tokens leaving the window (``free_swa``), timed on slots just handed out."""
    for size in sizes:
        a = SWATokenToKVPoolAllocator(size, size // 2, 1, None, device)
        a.free(a.alloc(size // 4))  # free lists that have taken slots back
        us = timer.per_call_us(lambda: a.alloc(64), lambda s: a.free_swa(s), lambda s, out: a.free(s))
        slots = a.alloc(64)
        add("SWA free_swa(64)", f"{size:,} full slots", "kvpool", us, timer.waits(lambda: a.free_swa(slots)))
        del a


# --- report --------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    rows = [r for r in result.get("rows", []) if r["impl"] != "torch"]
    floor = [r for r in result.get("rows", []) if r["impl"] == "torch"]
    lines = [result.get("sglang_note", ""), "",
             f"Device: {result.get('device')}; microseconds per call (median of {result.get('reps')}).", "",
             *[f"The floor, {r['call'].removesuffix(' (the floor)')} ({r['case']}), timed the same way: {r['us']:.1f} us." for r in floor],
             "",
             "| call | case | kvpool us | SGLang us | kvpool / SGLang | kvpool waits | SGLang waits | kvpool kernels | SGLang kernels |",
             "|---|---|---:|---:|---:|---|---|---:|---:|"]  # fmt: skip
    keys = list(dict.fromkeys((r["call"], r["case"]) for r in rows))
    for call, case in keys:
        got = {r["impl"]: r for r in rows if (r["call"], r["case"]) == (call, case)}
        k, s = got.get("kvpool"), got.get("sglang")

        def us(r: Optional[dict]) -> str:
            return "-" if r is None else (f"{r['us']:.1f}" if r["us"] is not None else r["note"])

        def waits(r: Optional[dict]) -> str:
            return "-" if r is None or r["waits"] is None else ("yes" if r["waits"] else "no")

        def kernels(r: Optional[dict]) -> str:
            return "-" if r is None or r.get("kernels") is None else str(r["kernels"])

        ratio = f"{k['us'] / s['us']:.2f}x" if k and s and k["us"] and s["us"] else "-"
        lines.append(f"| {call} | {case} | {us(k)} | {us(s)} | {ratio} | {waits(k)} | {waits(s)} | {kernels(k)} | {kernels(s)} |")
    if result.get("targets"):
        lines += ["", "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['name']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in result["targets"]]
    return "\n".join(lines)


def plot(result: dict, fig) -> None:
    ax = fig.add_subplot(1, 1, 1)
    for impl in ("kvpool", "sglang"):
        pts = [(int(r["case"].split()[0].replace(",", "")), r["us"]) for r in result.get("rows", [])
               if r["call"] == "token free(64)" and r["impl"] == impl and r["us"]]  # fmt: skip
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("token pool slots")
    ax.set_ylabel("free(64), us per call")
    ax.legend()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(ap, "allocators")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    ap.add_argument("--quick", action="store_true", help="fewer pool sizes and repeats")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per case (default 100, quick 40)")
    ap.add_argument("--sizes", default=None, help="comma-separated token pool sizes (default 64k..32M; CPU to 8M)")
    ap.add_argument("--paged-slots", type=int, default=None, help="slots of the paged allocators (default 4M; CPU 1M)")
    ap.add_argument("--sglang-wheel", default=None, help="a pure-Python sglang wheel (pip download sglang==0.5.9 --no-deps)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu_smoke else args.device)
    cpu = device.type == "cpu"
    if args.cpu_smoke:
        default_sizes, reps, paged = [1 << 12, 1 << 14], 2, 1 << 14
    else:
        default_sizes = [1 << 16, 1 << 23] if args.quick else [1 << 16, 1 << 20, 1 << 23] + ([] if cpu else [1 << 25])
        reps, paged = (40 if args.quick else 100), (1 << 20 if cpu else 1 << 22)
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else default_sizes
    reps = args.reps or reps
    paged = args.paged_slots or paged
    rep = report.Report(args, "bench_allocators", "Slot allocators, kvpool and SGLang", markdown, plot)
    if cpu:
        # One thread: on a loaded machine a parallel region waits for its second thread to be scheduled
        # (milliseconds for an index of a few thousand entries), which would measure the machine.
        torch.set_num_threads(1)
        rep.meta["cpu_threads"] = 1
    impls = {"kvpool": (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator)}
    sglang_tables = None
    note = "SGLang's allocator: not measured (no --sglang-wheel given)."
    if args.sglang_wheel:
        try:
            token, paged_cls, version = sglang_wheel.load_allocators(args.sglang_wheel)
            impls["sglang"] = (token, paged_cls)
            sglang_tables = sglang_wheel.load_tables(args.sglang_wheel)
            note = f"SGLang's allocator {version}: allocator.py imported from {os.path.basename(args.sglang_wheel)}."
        except Exception as e:  # reported, not fatal: kvpool is still measured
            note = f"SGLang's allocator could not be imported from {args.sglang_wheel}: {type(e).__name__}: {e}"
            rep.log(note)
    rep.result.update(device=str(device), reps=reps, sglang_note=note, paged_slots=paged, page_size=PAGE)
    extend_bs = [1, 8] if args.cpu_smoke else [1, 8, 64]
    decode_bs = [1, 16] if args.cpu_smoke else [1, 16, 128, 512]
    rows = measure(impls, device, Timer(device, reps), sizes, paged, rep, decode_bs, extend_bs, sglang_tables)
    targets = []
    free = {r["case"]: r["us"] for r in rows if r["call"] == "token free(64)" and r["impl"] == "kvpool" and r["us"]}
    small, large = f"{1 << 16:,} slots", f"{1 << 23:,} slots"
    if small in free and large in free:
        growth = free[large] / free[small]
        targets.append({"name": f"kvpool token free(64) at 8M slots / at 64k ({device.type}), <= 2x",
                        "value": f"{growth:.2f}x", "met": growth <= 2})  # fmt: skip
    rep.result["targets"] = targets
    rep.save(final=True)
    return 0 if args.cpu_smoke or all(t["met"] for t in targets) else 1  # a smoke run's timings judge nothing


if __name__ == "__main__":
    sys.exit(main())
