"""KV transfer between two GPUs: kvpool.transfer's staged and direct paths against NCCL send/recv of
one contiguous buffer, in the same run.

Starts one process per GPU (rank r on cuda:r, NCCL, ``NCCL_NVLS_ENABLE=0`` unless set). Each rank holds
a Llama-3-8B FP8 pool (32 layers x 8 KV heads x 128: 64 KiB a token) filled with a byte pattern, so
nothing is timed on zeros and every transfer is checked byte for byte afterwards.

Everything is timed as a ping-pong, which needs no clock shared by the two processes: rank 0 sends
and then receives, rank 1 receives and then sends the same rows back, ``n`` times in a row between two
synchronisations; one-way time = round time / (2 n). The reported value is the median over rounds
(the first round, a warm-up, is dropped). A kvpool transfer includes its handshake.

1. Ceiling: NCCL send/recv of one contiguous buffer of the same bytes, measured in this run.
2. Requests: 8k and 32k tokens, slots random single rows ("page 1") or random whole pages of 16
   ("page 16"), and page 1 on one side with page 16 on the other; default settings; % of ceiling;
   once per path of ``--paths``: ``staged`` (endpoints built with ``ipc=False``: staging and NCCL)
   and ``ipc`` (the receiver reads the sender's rows through CUDA IPC, one copy launch; each row
   records the path the transfers took, so a machine without CUDA IPC shows it).
3. Sweep: the grid of the gathers and scatters that run beside the transport (16 programs to one
   per task), staging chunk size, chunk ramp steps (wire.RAMP_STEPS).
4. Latency: a 1-token transfer on each path beside a bare 1-token (64 KiB) NCCL send; a 0-token
   transfer (the handshake alone) beside a bare 8-byte send.
5. The gather and scatter kernels alone on one GPU (what the pipeline's fill and drain cost).
6. Chunk plans (``--plans`` alone): each request's chunks sent as contiguous messages with no copies,
   plus its first gather and last scatter, against the one-message ceiling: the best a staged
   transfer with that plan can reach.

Usage (two GPUs): python benchmarks/bench_transfer.py --out DIR [--quick] [--paths staged,ipc]
``--direct`` measures only the ceiling, the requests and the latency (both paths; the targets of the
direct path: 90% of the ceiling at 8k tokens, 95% at 32k, a 1-token transfer within 3x of the bare
send). ``--ipc-programs N`` caps the direct copy's grid.
Writes DIR/transfer.{json,md,png} (``--name``), the JSON and Markdown after every section, so a failure
keeps what was measured. ``--cpu-smoke`` runs the same script on CPU pools over gloo with tiny requests: it checks the script,
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402
from pair import free_port, init_pair  # noqa: E402
from timing import event_ms  # noqa: E402

from kvpool import KVReceiver, KVSender, MHATokenToKVPool  # noqa: E402
from kvpool.kernels.copy_rows import copy_rows  # noqa: E402
from kvpool.transfer import endpoint as endpoint_module  # noqa: E402
from kvpool.transfer import wire  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
DTYPE = torch.float8_e4m3fn
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM  # 65536
REQUESTS = {"8k": 8192, "32k": 32768}
PAGE = 16
SIZE = 2 * 32768 + 1024 - PAGE  # two 32k requests fit side by side (rank 0 receives into other slots)
ROWS = SIZE + PAGE
TARGET = 0.90
#: The direct path's targets: fraction of the one-message ceiling per request, latency against a bare send.
DIRECT_TARGET = {"8k": 0.90, "32k": 0.95}
DIRECT_LATENCY_X = 3.0
PATHS = ("staged", "ipc")


# --cpu-smoke: CPU pools over gloo, tiny requests (set in each rank by configure()).
DEVICE_TYPE = "cuda"


def configure(smoke: bool) -> None:
    global DEVICE_TYPE, REQUESTS, SIZE, ROWS
    if smoke:
        DEVICE_TYPE = "cpu"
        REQUESTS = {"8k": 40, "32k": 160}
        SIZE = 2 * 160 + 64 - PAGE
        ROWS = SIZE + PAGE


def sync() -> None:
    if DEVICE_TYPE == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- pool contents and slots ---------------------------------------------------------------------------


def pattern(slots: torch.Tensor, row_bytes: int, buffer: int, salt: int) -> torch.Tensor:
    """uint8 [len(slots), row_bytes]: what buffer ``buffer`` of a pool with ``salt`` holds at ``slots``."""
    s = slots.to(torch.int64)[:, None]
    c = torch.arange(row_bytes, dtype=torch.int64, device=slots.device)[None, :]
    x = (s * 1_000_003 + c * 7_919 + buffer * 104_729 + salt * 15_485_863) & 0x7FFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0x5BD1E995) & 0x7FFFFFFF
    x = x ^ (x >> 15)
    return (x & 0xFF).to(torch.uint8)


def byte_buffers(pool: MHATokenToKVPool) -> list[torch.Tensor]:
    return [b.view(b.shape[0], -1) for kv in zip(pool.k_buffer, pool.v_buffer) for b in kv]


def fill(pool: MHATokenToKVPool, salt: int, slots: Optional[torch.Tensor] = None) -> None:
    """Write the pattern into ``slots`` (all rows by default) of every buffer."""
    for i, buf in enumerate(byte_buffers(pool)):
        rows = torch.arange(buf.shape[0], device=buf.device) if slots is None else slots.to(buf.device)
        for start in range(0, rows.numel(), 16384):
            part = rows[start : start + 16384]
            buf[part] = pattern(part, buf.shape[1], i, salt)


def slots(kind: str, n: int, seed: int) -> torch.Tensor:
    """``2 n`` distinct slots (slot 0, the padding slot, excluded): random rows for page 1, random
    whole pages of 16 for page 16. The first ``n`` and the last ``n`` are disjoint sets."""
    g = torch.Generator().manual_seed(seed)
    if kind == "p1":
        return torch.randperm(ROWS - 1, generator=g)[: 2 * n] + 1
    pages = torch.randperm(ROWS // PAGE - 1, generator=g)[: -(-2 * n // PAGE)] + 1
    return (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[: 2 * n]


# --- one rank ---------------------------------------------------------------------------------------------


class Rank:
    def __init__(self, rank: int, quick: bool, ipc_programs: Optional[int] = None) -> None:
        self.rank, self.peer, self.quick = rank, 1 - rank, quick
        self.dev = torch.device("cuda", rank) if DEVICE_TYPE == "cuda" else torch.device("cpu")
        self.sms = torch.cuda.get_device_properties(self.dev).multi_processor_count if DEVICE_TYPE == "cuda" else 1
        self.pool = MHATokenToKVPool(SIZE, PAGE, DTYPE, HEADS, HEAD_DIM, LAYERS, self.dev, warmup=False)
        fill(self.pool, salt=rank + 1)
        self.buf = torch.randint(0, 256, (REQUESTS["32k"] * TOKEN_BYTES,), dtype=torch.uint8, device=self.dev)
        self.sender = KVSender(self.pool, ipc=False)
        self.receiver = KVReceiver(self.pool, ipc=False)
        # The direct path needs no staging: the smallest one that holds a token (its fallback).
        small = dict(chunk_bytes=TOKEN_BYTES, max_programs=ipc_programs)
        self.direct = (KVSender(self.pool, **small), KVReceiver(self.pool, **small))
        sync()

    def endpoints(self, path: str) -> tuple[KVSender, KVReceiver]:
        return self.direct if path == "ipc" else (self.sender, self.receiver)

    # timing

    def pingpong(self, out: Callable[[], None], back: Callable[[], None], n: int, rounds: int) -> float:
        """Median one-way seconds: rank 0 runs ``out`` then ``back``, rank 1 the mirror, ``n`` times a round."""
        times = []
        for r in range(rounds + 1):
            sync()
            dist.barrier()
            sync()
            start = time.perf_counter()
            for _ in range(n):
                if self.rank == 0:
                    out()
                    back()
                else:
                    back()
                    out()
            sync()
            if r:
                times.append((time.perf_counter() - start) / (2 * n))
        return statistics.median(times)

    def nccl(self, nbytes: int, n: int, rounds: int) -> float:
        t = self.buf[:nbytes]
        if nbytes % 8 == 0:
            t = t.view(torch.int64)  # 2 GiB of uint8 would be 2**31 elements, past int32 counts
        return self.pingpong(lambda: dist.send(t, self.peer), lambda: dist.recv(t, self.peer), n, rounds)

    def nccl_chunks(self, sizes: list[int], n: int, rounds: int) -> float:
        """Median one-way seconds of ``sizes`` sent as contiguous messages back to back: what a chunk
        plan costs NCCL alone, without the gathers and scatters around it."""
        views, offset = [], 0
        for nbytes in sizes:
            t = self.buf[offset : offset + nbytes]
            views.append(t.view(torch.int64) if nbytes % 8 == 0 else t)
            offset += nbytes

        def out() -> None:
            for t in views:
                dist.send(t, self.peer)

        def back() -> None:
            for t in views:
                dist.recv(t, self.peer)

        return self.pingpong(out, back, n, rounds)

    def copy_alone_us(self, tokens: int, gather: bool) -> float:
        """Device microseconds of a gather (pool -> staging) or scatter of ``tokens`` random slots
        with the whole GPU, as the pipeline's first gather and last scatter run (CUDA only)."""
        layout, pool_table, stages = self.sender._tables_for(0, HEADS)
        idx = slots("p1", tokens, 98)[:tokens].to(self.dev)
        arange = torch.arange(tokens, device=self.dev)
        args = (stages[0], arange, pool_table, idx) if gather else (pool_table, idx, stages[0], arange)
        ms = event_ms(lambda: copy_rows(*args), 20)
        if not gather:  # the scatter wrote staging bytes into the pool: restore its pattern
            fill(self.pool, salt=self.rank + 1)
        return ms * 1e3

    def transfer(
        self, kinds: tuple[str, str], tokens: int, n: int, rounds: int, seed: int,
        sender: Optional[KVSender] = None, receiver: Optional[KVReceiver] = None,
    ) -> tuple[float, dict]:  # fmt: skip
        """Rank 0 sends ``tokens`` slots of kind ``kinds[0]`` to rank 1's slots of kind ``kinds[1]``,
        which sends them back into other slots of rank 0; returns (one-way seconds, check)."""
        sender, receiver = sender or self.sender, receiver or self.receiver
        s0 = slots(kinds[0], tokens, seed)
        s1 = slots(kinds[1], tokens, seed + 1)
        if self.rank == 0:
            loc_out, loc_back = s0[:tokens], s0[tokens:]
        else:
            loc_out = loc_back = s1[:tokens]  # receives into these rows, sends them back
        info: dict = {}

        def out() -> None:
            h = sender.send(loc_out, self.peer)
            h.wait()
            info["chunks"], info["path"] = h.chunks, h.path + (f" ({h.path_reason})" if h.path_reason else "")

        def back() -> None:
            receiver.recv(loc_back, self.peer).wait()

        seconds = self.pingpong(out, back, n, rounds)
        return seconds, self.check(s0[:tokens], loc_back, info.get("chunks", 0), info.get("path", ""))

    def check(self, sent: torch.Tensor, landed: torch.Tensor, chunks: int, path: str = "") -> dict:
        """Bytes at ``landed`` must be rank 0's original rows at ``sent`` (rank 1: after one leg;
        rank 0: after the round trip). Rank 0 then restores its landing rows."""
        sync()
        bad = 0
        sent_d, landed_d = sent.to(self.dev), landed.to(self.dev)
        for i, buf in enumerate(byte_buffers(self.pool)):
            for start in range(0, sent_d.numel(), 16384):
                got = buf[landed_d[start : start + 16384]]
                bad += int((got != pattern(sent_d[start : start + 16384], buf.shape[1], i, salt=1)).sum())
        if self.rank == 0:
            fill(self.pool, salt=1, slots=landed)
        theirs = torch.tensor([bad], dtype=torch.int64, device=self.dev)
        if self.rank == 1:
            dist.send(theirs, 0)
            return {}
        dist.recv(theirs, 1)
        return {"bad_bytes_rank0": bad, "bad_bytes_rank1": int(theirs.item()), "chunks": chunks, "path_taken": path}

    def kernels(self) -> list[dict]:
        """Gather (pool -> staging) and scatter (staging -> pool) of one default-sized chunk on rank 0 alone."""
        out = []
        if self.rank == 0 and DEVICE_TYPE == "cuda":
            layout, pool_table, stages = self.sender._tables_for(0, HEADS)
            count = self.sender.chunk_bytes // layout.token_bytes
            idx = slots("p1", count, 99)[:count].to(self.dev)
            arange = torch.arange(count, device=self.dev)
            for per_sm in (1, 2, 4, 8):
                gather, scatter = (stages[0], arange, pool_table, idx), (pool_table, idx, stages[0], arange)
                for name, args in (("gather", gather), ("scatter", scatter)):
                    t = event_ms(lambda: copy_rows(*args, max_programs=per_sm * self.sms), 20) / 1e3
                    out.append(dict(kernel=name, programs_per_sm=per_sm, bytes=count * layout.token_bytes,
                                    us=t * 1e6, gbps=count * layout.token_bytes / t / 1e9))  # fmt: skip
            fill(self.pool, salt=1)  # the scatter wrote staging bytes into the pool
        sync()
        dist.barrier()
        return out


def parse_sweep(spec: str, sms: int) -> list[tuple[int, int, int, int]]:
    """``CHUNK_MIB:PROGRAMS:RAMP_STEPS[:RAMP],...`` -> sweep entries (PROGRAMS may be ``default``;
    RAMP, the growth factor between chunks, defaults to wire.RAMP)."""
    out = []
    for item in spec.split(","):
        chunk, programs, steps, *factor = item.split(":")
        grid = endpoint_module.default_max_programs(sms) if programs == "default" else int(programs)
        out.append((int(chunk), grid, int(steps), int(factor[0]) if factor else wire.RAMP))
    return out


def sweep_phase(r: "Rank", rank: int, results: dict, save: Callable[[], None], ceiling: dict,
                sweep: list[tuple], rounds: int) -> None:  # fmt: skip
    """Page 1 -> page 1 requests of both sizes under each (chunk MiB, copy grid beside the
    transport (0: one program per task), ramp steps[, ramp factor]), ``rounds`` rounds of 2
    transfers each."""
    default_steps, default_factor = wire.RAMP_STEPS, wire.RAMP
    for chunk_mib, grid, ramp, *factor in sweep:
        wire.RAMP = factor[0] if factor else default_factor
        del r.sender, r.receiver
        torch.cuda.empty_cache() if DEVICE_TYPE == "cuda" else None
        programs = grid or 1 << 30
        r.sender = KVSender(r.pool, chunk_bytes=chunk_mib << 20, max_programs=programs)
        r.receiver = KVReceiver(r.pool, chunk_bytes=chunk_mib << 20, max_programs=programs)
        r.sender._alone_programs = r.receiver._alone_programs = None  # fill and drain as the default endpoint's
        wire.RAMP_STEPS = ramp  # both ranks alike: their chunk plans must agree
        for req in ("8k", "32k"):
            tokens = REQUESTS[req]
            s, check = r.transfer(("p1", "p1"), tokens, 2, rounds, seed=700)
            nbytes = tokens * TOKEN_BYTES
            results["sweep"].append(dict(request=req, chunk_mib=chunk_mib, programs=grid, ramp=ramp,
                                         ramp_factor=wire.RAMP, gbps=nbytes / s / 1e9, fraction=ceiling[nbytes] / s,
                                         **check))  # fmt: skip
        log(f"[rank {rank}] sweep chunk {chunk_mib} MiB, {grid} programs, ramp {ramp} x{wire.RAMP}: done")
        save()
    wire.RAMP_STEPS, wire.RAMP = default_steps, default_factor


def plan_bounds(r: "Rank", rounds: int, ceiling: dict) -> list[dict]:
    """What a staged transfer can reach at best with a given chunk plan: its chunks sent as
    contiguous NCCL messages back to back (no copies), plus the pipeline's fill and drain (the first
    chunk's gather and the last chunk's scatter, whole GPU, which nothing overlaps), against the
    one-message ceiling. Every copy in between is taken to be hidden behind the link (the real
    transfer's copies also share the GPU with NCCL's kernel). Plans: kvpool's (wire.chunk_plan) and
    alternatives with fewer, equal or steeper chunks."""
    out = []
    capacity = r.sender.chunk_bytes // TOKEN_BYTES
    for req, tokens in REQUESTS.items():
        if DEVICE_TYPE != "cuda":
            tokens = min(tokens, 64)
        plans = {"kvpool": [c for _, c in wire.chunk_plan(tokens, capacity)], "one message": [tokens],
                 "2 equal": [tokens // 2] * 2, "4 equal": [tokens // 4] * 4,
                 "1/8, 3/8, 3/8, 1/8": [tokens // 8, 3 * tokens // 8, 3 * tokens // 8, tokens // 8]}  # fmt: skip
        # Steeper ends: a smaller first gather and last scatter for one or two more messages.
        for name, parts in (("1/16, 3/16, 1/4, 1/4, 3/16, 1/16", (2, 6, 8, 8, 6, 2)),
                                 ("1/32, 3/32, 1/4, 1/4, 1/4, 3/32, 1/32", (1, 3, 8, 8, 8, 3, 1))):  # fmt: skip
            unit = tokens // sum(parts)
            counts = [unit * k for k in parts]
            counts[len(counts) // 2] += tokens - sum(counts)
            plans[name] = counts
        for name, counts in plans.items():
            nbytes = [c * TOKEN_BYTES for c in counts]
            s = r.nccl_chunks(nbytes, 3, rounds)
            fill = drain = 0.0
            if DEVICE_TYPE == "cuda":
                # Timed on each rank alike (each rank's GPU), so both stay in step.
                fill, drain = r.copy_alone_us(counts[0], True), r.copy_alone_us(counts[-1], False)
            total = s + (fill + drain) * 1e-6
            full = ceiling[sum(nbytes)] if sum(nbytes) in ceiling else r.nccl(sum(nbytes), 3, rounds)
            out.append(dict(request=req, plan=name, mib=[b >> 20 for b in nbytes], messages_us=s * 1e6,
                            messages_fraction=full / s, fill_us=fill, drain_us=drain, bound_fraction=full / total))  # fmt: skip
            log(f"[rank {r.rank}] plan {req} {name}: messages {full / s:.1%} of the ceiling, fill {fill:.0f} us, "
                f"drain {drain:.0f} us, bound {full / total:.1%}")
    return out


def run_rank(rank: int, quick: bool, smoke: bool, port: int, out_dir: str, only_sweep: Optional[str] = None,
             sweep_rounds: int = 3, only_plans: bool = False, paths: tuple[str, ...] = PATHS,
             only_direct: bool = False, ipc_programs: Optional[int] = None, env: Optional[dict] = None,
             name: str = "transfer", budget_s: Optional[float] = None) -> None:  # fmt: skip
    configure(smoke)
    if smoke:
        torch.set_num_threads(1)
    init_pair(rank, port, smoke, timeout_s=300)
    results: dict = {"meta": {**(env or {}), **meta(rank)}, "ceiling": [], "requests": [], "sweep": [], "latency": [],
                     "kernels": [], "plans": [], "errors": {}, "skipped": []}  # fmt: skip
    json_path = os.path.join(out_dir, f"{name}.json")
    start = time.perf_counter()

    def over_budget(what: str) -> bool:
        if budget_s is None or time.perf_counter() - start <= budget_s:
            return False
        results["skipped"].append(f"{what}: time budget of {budget_s:g} s spent")
        return True

    def save(final: bool = False) -> None:
        if rank == 0:
            results["meta"]["partial"] = not final
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1)
            with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
                f.write(report.render_markdown(results, markdown))

    try:
        r = Rank(rank, quick, ipc_programs)
        results["meta"]["sms"] = r.sms
        results["meta"]["paths"] = list(paths)
        results["meta"]["ipc_programs"] = ipc_programs
        results["meta"]["default_chunk_bytes"] = r.sender.chunk_bytes
        results["meta"]["default_max_programs"] = r.sender.max_programs
        rounds = 3 if quick else 7
        r.nccl(1 << 20, 2, 1)  # warm the pair's communicator
        for way in paths:  # and each path (the direct one's setup: handles opened once per pair)
            r.transfer(("p1", "p1"), 16, 2, 1, 1, *r.endpoints(way))
        log(f"[rank {rank}] warm")

        ceiling = {}
        sizes = sorted({1 << 20, 16 << 20, 256 << 20, 1 << 30} | {t * TOKEN_BYTES for t in REQUESTS.values()})
        if smoke:
            sizes = sorted({1 << 20} | {t * TOKEN_BYTES for t in REQUESTS.values()})
        for nbytes in sizes:
            n = 3 if nbytes >= 256 << 20 else 10
            s = r.nccl(nbytes, n, rounds)
            ceiling[nbytes] = s
            results["ceiling"].append(dict(bytes=nbytes, us=s * 1e6, gbps=nbytes / s / 1e9))
        save()

        if only_plans:
            results["plans"] = plan_bounds(r, rounds, ceiling)
            return
        if only_sweep:
            return sweep_phase(r, rank, results, save, ceiling, parse_sweep(only_sweep, r.sms), sweep_rounds)
        configs = [(("p1", "p1"), "8k"), (("p16", "p16"), "8k"), (("p1", "p16"), "8k"),
                   (("p1", "p1"), "32k"), (("p16", "p16"), "32k"), (("p16", "p1"), "32k")]  # fmt: skip
        if quick:
            configs = [c for c in configs if c[0][0] == c[0][1]]
        for i, (kinds, req) in enumerate(configs):
            tokens = REQUESTS[req]
            nbytes = tokens * TOKEN_BYTES
            for way in paths:  # side by side: the same slots, the same ceiling
                s, check = r.transfer(kinds, tokens, 3, rounds, 100 + 10 * i, *r.endpoints(way))
                results["requests"].append(dict(
                    request=req, tokens=tokens, pages=f"{kinds[0][1:]} -> {kinds[1][1:]}", bytes=nbytes, path=way,
                    us=s * 1e6, gbps=nbytes / s / 1e9, ceiling_gbps=nbytes / ceiling[nbytes] / 1e9,
                    fraction=ceiling[nbytes] / s, **check,
                ))  # fmt: skip
                log(f"[rank {rank}] {req} {kinds} {way}: {nbytes / s / 1e9:.0f} GB/s ({ceiling[nbytes] / s:.1%} of ceiling)")
            save()

        bare = {b: r.nccl(b, 20, rounds) for b in (TOKEN_BYTES, 8)}
        for per_token, label in ((1, "1 token"), (0, "0 tokens (handshake only)")):
            bare_bytes = per_token * TOKEN_BYTES or 8
            for way in paths:
                s, check = r.transfer(("p1", "p1"), per_token, 20, rounds, 500 + per_token, *r.endpoints(way))
                results["latency"].append(dict(transfer=label, path=way, transfer_us=s * 1e6, bare_bytes=bare_bytes,
                                               bare_us=bare[bare_bytes] * 1e6, **check))  # fmt: skip
        save()
        if only_direct or over_budget("the copy kernels, the chunk plans and the sweep"):
            return

        results["kernels"] = r.kernels()
        save()

        results["plans"] = plan_bounds(r, rounds, ceiling)
        save()
        if over_budget("the sweep"):
            return

        default_programs = endpoint_module.default_max_programs(r.sms)
        # (chunk MiB, programs of the copies beside the transport (0: one per task), ramp steps); the
        # pipeline's fill and drain copies take the whole GPU in every configuration.
        ramp = wire.RAMP_STEPS
        grids = (16, default_programs, 66, r.sms, 2 * r.sms, 0)
        sweep = [(128, g, ramp) for g in grids] + [(c, default_programs, ramp) for c in (64, 256)]
        sweep += [(128, default_programs, steps) for steps in (0, 1, 2) if steps != ramp]
        if quick:
            sweep = [(128, g, ramp) for g in (default_programs, 2 * r.sms)]
        if smoke:
            sweep = [(1, 2, 2), (1, 0, 0)]
        sweep_phase(r, rank, results, save, ceiling, sweep, 3)
    except Exception:  # noqa: BLE001 - keep what was measured; the other rank fails by timeout
        results["errors"][f"rank {rank}"] = traceback.format_exc()
        log(traceback.format_exc())
        save()
        raise
    finally:
        try:
            save(final=True)
            if rank == 0:
                report.draw(results, plot, os.path.join(out_dir, f"{name}.png"), log)
        except Exception:  # noqa: BLE001 - never hide the run's own error behind this one
            log(traceback.format_exc())
        dist.destroy_process_group()


def meta(rank: int) -> dict:
    try:
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # noqa: BLE001 - a CPU build has none
        nccl = "none"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "gpus": gpus or ["cpu (smoke run)"],
        **({"gpu": " + ".join(gpus)} if gpus else {}),
        "nccl": nccl,
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "model": f"Llama-3-8B FP8: {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM}, {TOKEN_BYTES} B/token",
        "rank": rank,
        "default_ramp_steps": wire.RAMP_STEPS,
    }


def _shown(path: str, q: dict) -> str:
    """The path asked for, and the one taken where they differ (a machine without CUDA IPC)."""
    taken = q.get("path_taken", path)
    return path if taken == path else f"{path} -> {taken}"


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        f"Paths: {', '.join(m.get('paths', ['staged']))} (staged: staging + NCCL; ipc: the receiver reads the "
        f"sender's rows through CUDA IPC, one launch, grid cap {m.get('ipc_programs')}). Targets: staged 90% of "
        f"the ceiling; ipc {', '.join(f'{100 * v:.0f}% at {k}' for k, v in DIRECT_TARGET.items())}, a 1-token "
        f"transfer within {DIRECT_LATENCY_X:g}x of a bare 1-token send.",
        "",
        f"NCCL {m['nccl']}, NCCL_NVLS_ENABLE={m['NCCL_NVLS_ENABLE']}. {m['model']}. One-way times from ping-pongs, medians. "
        f"Defaults: chunk {m.get('default_chunk_bytes', 0) >> 20} MiB, "
        f"{m.get('default_max_programs')} programs per copy beside the transport (the first gather and the "
        f"last scatter of a transfer take the whole GPU).",
        "",
        "## Requests against the NCCL ceiling (contiguous send/recv of the same bytes, same run)",
        "",
        "| request | pages (sender -> receiver) | path | MiB | kvpool GB/s | ceiling GB/s | % of ceiling "
        "| target | chunks | bytes wrong |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for q in res["requests"]:
        wrong = q.get("bad_bytes_rank0", "?"), q.get("bad_bytes_rank1", "?")
        path = q.get("path", "staged")
        target = DIRECT_TARGET.get(q["request"], TARGET) if path == "ipc" else TARGET
        lines.append(
            f"| {q['request']} | {q['pages']} | {_shown(path, q)} | {q['bytes'] >> 20} | "
            f"{q['gbps']:.1f} | {q['ceiling_gbps']:.1f} | {100 * q['fraction']:.1f}% | "
            f"{100 * target:.0f}% {'met' if q['fraction'] >= target else 'MISSED'} | {q.get('chunks', '?')} | "
            f"{wrong[0]} / {wrong[1]} |"
        )
    lines += ["", "## Latency", "", "| kvpool transfer | path | one-way us | bare NCCL send | one-way us | ratio |",
              "|---|---|---:|---|---:|---:|"]  # fmt: skip
    for q in res["latency"]:
        ratio = q["transfer_us"] / q["bare_us"] if q["bare_us"] else float("nan")
        verdict = ""
        if q.get("path") == "ipc" and q["bare_bytes"] == TOKEN_BYTES:
            verdict = f" (target {DIRECT_LATENCY_X:g}x {'met' if ratio <= DIRECT_LATENCY_X else 'MISSED'})"
        lines.append(f"| {q['transfer']} | {_shown(q.get('path', 'staged'), q)} | {q['transfer_us']:.1f} "
                     f"| {q['bare_bytes']} B | {q['bare_us']:.1f} | {ratio:.2f}x{verdict} |")  # fmt: skip
    lines += ["", "## NCCL ceiling curve", "", "| bytes | one-way us | GB/s |", "|---:|---:|---:|"]
    for q in res["ceiling"]:
        lines.append(f"| {q['bytes']} | {q['us']:.1f} | {q['gbps']:.1f} |")
    if res["sweep"]:
        lines += ["", "## Sweep (page 1 -> page 1): % of ceiling", ""]
        lines += ["| chunk MiB | programs per copy beside the transport (0: one per task) | ramp steps | 8k | 32k |",
                  "|---:|---:|---:|---:|---:|"]  # fmt: skip
        rows: dict = {}
        for q in res["sweep"]:
            rows.setdefault((q["chunk_mib"], q["programs"], q["ramp"]), {})[q["request"]] = q
        for (c, g, ramp), v in rows.items():
            cells = [f"{100 * v[k]['fraction']:.1f}% ({v[k]['gbps']:.0f} GB/s)" if k in v else "-" for k in ("8k", "32k")]
            lines.append(f"| {c} | {g} | {int(ramp)} | {cells[0]} | {cells[1]} |")
    if res.get("plans"):
        lines += ["", "## What a chunk plan allows at best (contiguous messages + fill + drain, no copy contention)", "",
                  "| request | plan | chunks MiB | messages alone, % of ceiling | fill us | drain us | bound, % of ceiling |",
                  "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for q in res["plans"]:
            lines.append(f"| {q['request']} | {q['plan']} | {'/'.join(map(str, q['mib']))} | {100 * q['messages_fraction']:.1f}% "
                         f"| {q['fill_us']:.0f} | {q['drain_us']:.0f} | {100 * q['bound_fraction']:.1f}% |")  # fmt: skip
    if res["kernels"]:
        chunk_mib = m.get("default_chunk_bytes", 0) >> 20
        lines += ["", f"## Copy kernels alone (one {chunk_mib} MiB chunk, random rows, one GPU)", ""]
        lines += ["| kernel | programs/SM | us | GB/s staged |", "|---|---:|---:|---:|"]
        for q in res["kernels"]:
            lines.append(f"| {q['kernel']} | {q['programs_per_sm']} | {q['us']:.1f} | {q['gbps']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, fig) -> None:
    """Each request's rate on each path against the one-message NCCL ceiling of the same bytes."""
    ax = fig.subplots()
    rows = res["requests"]
    labels = [f"{q['request']}, {q['pages']}\n{q.get('path', 'staged')}" for q in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [q["gbps"] for q in rows], 0.4, label="kvpool transfer")
    ax.bar([i + 0.2 for i in x], [q["ceiling_gbps"] for q in rows], 0.4, color="0.6", label="one NCCL message of the same bytes")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("GB/s one way")
    ax.legend(fontsize=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(parser, "transfer")
    parser.add_argument("--quick", action="store_true", help="fewer configurations and rounds")
    parser.add_argument("--sweep", help="only the ceiling and this sweep: comma-separated "
                        "CHUNK_MIB:PROGRAMS:RAMP_STEPS[:RAMP_FACTOR] (PROGRAMS 0: one per task, 'default': the "
                        "endpoint's), each timed over --sweep-rounds rounds")  # fmt: skip
    parser.add_argument("--sweep-rounds", type=int, default=3)
    parser.add_argument("--plans", action="store_true",
                        help="only the ceiling and what each chunk plan allows at best (messages alone + fill + drain)")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="comma-separated paths measured side by side in the requests and latency sections: staged, ipc")
    parser.add_argument("--direct", action="store_true",
                        help="only the ceiling, the requests and the latency (the direct path against the staged one)")
    parser.add_argument("--ipc-programs", type=int, default=None,
                        help="cap on the direct path's copy grid (default: the whole GPU)")
    args = parser.parse_args()
    paths = tuple(p for p in args.paths.split(",") if p)
    if not paths or set(paths) - set(PATHS):
        log(f"--paths must name some of {', '.join(PATHS)}, got {args.paths!r}")
        return 2
    if torch.cuda.device_count() < 2 and not args.cpu_smoke:
        log(f"this benchmark needs two GPUs, found {torch.cuda.device_count()}")
        return 2
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    env = {**report.environment(args.cpu_smoke), "benchmark": "bench_transfer", "title": "KV transfer between two GPUs",
           "command": report.command_line("bench_transfer", sys.argv[1:])}  # fmt: skip
    mp.start_processes(run_rank, args=(args.quick, args.cpu_smoke, free_port(), args.out, args.sweep, args.sweep_rounds,
                                         args.plans, paths, args.direct, args.ipc_programs, env, args.name, args.budget_s),
                       nprocs=2, start_method="spawn")  # fmt: skip
    log(f"[{args.name}] done: {os.path.join(args.out, args.name)}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
