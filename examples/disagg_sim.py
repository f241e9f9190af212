"""Disaggregated serving, simulated: rank 0 prefills, rank 1 decodes, and KV moves between their pools.

One command starts both processes (torch.multiprocessing; CPU pools over gloo by default, CUDA pools
over NCCL when two GPUs are present). Rank 0 runs the prefill half of ``serve_sim``'s scheduler: it
admits arriving requests, prefills them in chunks into its pool, and offers each finished prefill to
rank 1. Rank 1 accepts the offers it has room for, allocates slots in its own pool (its page size
differs), and both call ``kvpool.send_kv`` / ``kvpool.recv_kv``; rank 0 then frees the request's slots,
and rank 1 decodes the request to its end with its own scheduler. K/V values are a function of
(request, position, layer), so rank 1 checks every transferred byte on arrival (all positions, layers,
K and V) and every request once more when it finishes.

With ``--model qwen3.5`` both ranks hold a hybrid model's pools: as in Qwen3.5 every 4th layer is full
attention, its K/V in a ``HybridLinearKVPool``, and the other layers are Gated DeltaNet layers whose
per-request state (a convolution window and an SSM state per layer) lives in a ``MambaPool`` slot. The
state bytes of a request after ``n`` tokens are a function of (request, n, layer), written after every
step; ``send_kv``/``recv_kv`` move a finished prefill's state slot with its KV rows, and rank 1 checks
the state byte for byte on arrival, as the KV, and again when the request finishes.

    python examples/disagg_sim.py                      # two GPUs if present, else CPU + gloo
    python examples/disagg_sim.py --device cpu --requests 8
    python examples/disagg_sim.py --model qwen3.5      # hybrid pools: KV rows and linear-attention states
    python examples/disagg_sim.py --no-ipc             # the staged path even where a direct one is possible
    python examples/disagg_sim.py --corrupt            # flip one received byte: the check must fail

Exit status 0 when every byte checked, 1 on a mismatch, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: its shared code, support/
from support.progress import Progress  # noqa: E402
from support.sim.config import DTYPES, SimConfig  # noqa: E402
from support.sim.loop import make_requests  # noqa: E402
from support.sim.runner import ModelRunner  # noqa: E402
from support.sim.scheduler import Request, Scheduler  # noqa: E402

from kvpool import (  # noqa: E402
    HybridLinearKVPool,
    MambaCacheParams,
    MambaPool,
    MambaStateShape,
    MHATokenToKVPool,
    recv_kv,
    send_kv,
)
from kvpool.pools.sizing import KVGeometry  # noqa: E402

MAX_OFFERS = 16  # finished prefills offered to the decode rank per step
MODELS = ("mha", "qwen3.5")
#: --model qwen3.5: a small Gated DeltaNet (Qwen3.5's is 16 key / 64 value heads of 128 over 8 ranks):
#: convolution windows (128, 3) bf16 and SSM states (4, 16, 16) float32 per linear layer.
GDN = MambaStateShape.gated_delta_net(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_kernel=4)


@dataclass(frozen=True)
class DisaggConfig:
    requests: int = 32
    layers: int = 4
    heads: int = 4
    head_dim: int = 64
    prefill_page_size: int = 16
    decode_page_size: int = 1
    kv_budget_mib: float = 4.0  # per rank
    max_running: int = 16
    chunk_size: int = 256
    prompt_len: tuple[int, int] = (8, 256)
    output_len: tuple[int, int] = (8, 64)
    arrival_every: float = 1.0
    dtype: str = "fp8_e4m3"
    device: str = "auto"  # cuda with two GPUs, else cpu
    seed: int = 0
    corrupt: bool = False
    model: str = "mha"  # "qwen3.5": hybrid pools, every 4th of `layers` full attention
    ipc: bool = True  # let the ranks take the direct path (CUDA IPC) when they can

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.model == "qwen3.5" and not self.full_layers():
            raise ValueError(f"--model qwen3.5 needs at least 4 layers (every 4th is full attention), got {self.layers}")

    def full_layers(self) -> list[int]:
        """The full-attention layers' ids: all of them, or Qwen3.5's every 4th."""
        if self.model == "mha":
            return list(range(self.layers))
        return [i for i in range(self.layers) if (i + 1) % 4 == 0]

    def linear_layers(self) -> list[int]:
        return [i for i in range(self.layers) if i not in self.full_layers()]

    def sim(self, page_size: int, device: str) -> SimConfig:
        """The single-rank simulation settings of one side (checks the shared values too); its
        ``layers`` are the full-attention layers, whose K/V the scheduler and runner write."""
        return SimConfig(
            requests=self.requests, layers=len(self.full_layers()), heads=self.heads, head_dim=self.head_dim,
            page_size=page_size, kv_budget_mib=self.kv_budget_mib, max_running=self.max_running,
            chunk_size=self.chunk_size, prompt_len=self.prompt_len, output_len=self.output_len,
            arrival_every=self.arrival_every, dtype=self.dtype, device=device, seed=self.seed,
        )  # fmt: skip

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.device_count() >= 2 else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and torch.cuda.device_count() < 2:
            raise ValueError(f"--device cuda needs two GPUs, found {torch.cuda.device_count()}")
        return self.device


# --- both ranks -------------------------------------------------------------------------------------------


class Link:
    """Small control messages between the ranks (offers and answers), on the wire device."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.peer = 1 - rank
        self.device = device

    def send(self, values: list[int]) -> None:
        dist.send(torch.tensor(values, dtype=torch.int64, device=self.device), self.peer)

    def recv(self, n: int) -> list[int]:
        t = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.recv(t, self.peer)
        return t.tolist()


def pool_size(cfg: SimConfig) -> int:
    """Slots of one rank's pool within the budget; it must hold the longest request plus a page."""
    geometry = KVGeometry(cfg.heads, cfg.head_dim, cfg.layers, DTYPES[cfg.dtype])
    size = geometry.max_pool_size(int(cfg.kv_budget_mib * 2**20), cfg.page_size)
    if -(-cfg.max_context_len // cfg.page_size) + 1 > size // cfg.page_size:
        raise ValueError(
            f"kv_budget_mib must hold the longest request ({cfg.max_context_len} tokens) plus a page, "
            f"got {cfg.kv_budget_mib} MiB = {size} slots at page size {cfg.page_size}"
        )
    return size


def make_pool(cfg: SimConfig, device: torch.device) -> MHATokenToKVPool:
    return MHATokenToKVPool(pool_size(cfg), cfg.page_size, DTYPES[cfg.dtype], cfg.heads, cfg.head_dim, cfg.layers, device)


def make_pools(cfg: DisaggConfig, sim: SimConfig, device: torch.device) -> tuple[object, MHATokenToKVPool, Optional["States"]]:
    """The pool the transfers move (a ``HybridLinearKVPool`` for qwen3.5), the KV pool the scheduler
    and runner use (its full-attention layers, dense ids), and the states (qwen3.5 only)."""
    if cfg.model == "mha":
        pool = make_pool(sim, device)
        return pool, pool, None
    # One state slot per request: a finished prefill holds its slot until its KV has left.
    mamba = MambaPool(size=cfg.requests, cache_params=MambaCacheParams(GDN, cfg.linear_layers()), device=device)
    hybrid = HybridLinearKVPool(pool_size(sim), DTYPES[sim.dtype], sim.page_size, sim.heads, sim.head_dim,
                                cfg.full_layers(), False, device, mamba)  # fmt: skip
    return hybrid, hybrid.full_kv_pool, States(mamba)


class States:
    """--model qwen3.5: the linear layers' state of each request in a ``MambaPool`` slot, as bytes
    that are a function of (request, tokens so far, layer), written after every step and checked on
    arrival and at finish."""

    def __init__(self, mamba: MambaPool) -> None:
        self.mamba = mamba
        self.slot: dict[int, int] = {}  # rid -> state slot
        self.rows = [b[i].view(b.shape[1], -1).view(torch.uint8) for i in range(mamba.num_mamba_layers)
                     for b in (mamba.conv[0], mamba.temporal)]  # fmt: skip

    def expected(self, rid: int, n: int, buffer: int) -> torch.Tensor:
        """uint8 [row bytes]: buffer ``buffer`` (2 per layer: window, SSM state) after ``n`` tokens."""
        lanes = torch.arange(self.rows[buffer].shape[1], dtype=torch.int64, device=self.mamba.device)
        h = ((rid * 65_537 + n) * 131 + buffer) * 4_099 + lanes
        for _ in range(2):
            h = (h * 48_271) % 2_147_483_647
            h = h ^ (h >> 11)
        return (h & 0xFF).to(torch.uint8)

    def take(self, rid: int) -> Optional[int]:
        """A slot for ``rid`` (its own if it has one), or None when none is free."""
        if rid not in self.slot:
            got = self.mamba.alloc_slots(1)
            if got is None:
                return None
            self.slot[rid] = got[0]
        return self.slot[rid]

    def write(self, rid: int, n: int) -> None:
        slot = self.take(rid)
        if slot is None:
            raise RuntimeError(f"no state slot for request {rid}: the pool holds one per request")
        for b, rows in enumerate(self.rows):
            rows[slot] = self.expected(rid, n, b)

    def bad(self, rid: int, n: int) -> Optional[str]:
        """The first layer buffer of ``rid``'s slot that is not its state after ``n`` tokens, or None."""
        slot = self.slot[rid]
        for b, rows in enumerate(self.rows):
            if not torch.equal(rows[slot], self.expected(rid, n, b)):
                return f"request {rid} state after {n} tokens, linear layer {self.mamba.layers[b // 2]} {('conv', 'ssm')[b % 2]}"
        return None

    def release(self, rid: int) -> None:
        self.mamba.free([self.slot.pop(rid)])

    def after_step(self, batch) -> None:  # noqa: ANN001 - support.sim.scheduler.Batch
        for r in [r for r, _, _ in batch.prefill] + list(batch.decode):
            self.write(r.rid, r.kv_len)


def prefill_rank(cfg: DisaggConfig, device: torch.device, link: Link) -> dict:
    """Rank 0: prefill arriving requests; offer finished ones to rank 1 and send their KV."""
    sim = cfg.sim(cfg.prefill_page_size, device.type)
    moved, pool, states = make_pools(cfg, sim, device)
    sched, runner = Scheduler(sim, pool), ModelRunner(sim, pool)
    output_len = {}
    arrivals = []
    for r in make_requests(sim):
        output_len[r.rid] = r.output_len
        arrivals.append(Request(r.rid, r.prompt_len, 1, r.arrival))  # done here once the prefill yields a token
    arrivals.reverse()
    outbox: list[Request] = []
    stats = dict(prefill_tokens=0, steps=0, sent=0, sent_tokens=0, retractions=0)
    step = 0
    while True:
        while arrivals and arrivals[-1].arrival <= step:
            sched.waiting.append(arrivals.pop())
        batch = sched.schedule()
        step += 1
        if batch is not None:
            runner.forward(batch)
            stats["prefill_tokens"] += batch.prefill_tokens
            sched.advance(batch)
            if states is not None:
                states.after_step(batch)
            for r in sched.finished():
                sched.running.remove(r)  # keeps its slots and table row until the KV has left
                outbox.append(r)
        elif sched.running and not outbox:
            sched.retract(sched.running[-1])  # every prefill waits for pages: make room
        elif not sched.waiting and not sched.running and not outbox and arrivals:
            step = max(step, arrivals[-1].arrival)  # idle until the next arrival
        done = not (arrivals or sched.waiting or sched.running or outbox)
        offers = outbox[:MAX_OFFERS]
        message = [len(offers), int(done)]
        for r in offers:
            message += [r.rid, r.prompt_len, output_len[r.rid]]
        link.send(message + [0] * (2 + 3 * MAX_OFFERS - len(message)))
        if done:
            break
        accepted = link.recv(1)[0]
        handles = []
        for r in offers[:accepted]:
            slots = sched.slots_of(r)
            state_slots = None if states is None else torch.tensor([states.slot[r.rid]])
            handles.append((r, slots, send_kv(moved, slots.cpu(), dst=1, state_slots=state_slots, ipc=cfg.ipc)))
            stats["sent"] += 1
            stats["sent_tokens"] += slots.numel()
        for r, slots, h in handles:
            h.wait()  # the gathers are ordered before any later write to these slots
            stats["path"] = h.path
            if states is not None:
                states.release(r.rid)
            sched.allocator.free(slots)
            sched.table.free(r.row)
            r.row = None
            outbox.remove(r)
    stats["steps"] = step
    stats["retractions"] = sched.retractions
    stats["device"] = str(device)
    return stats


def decode_rank(cfg: DisaggConfig, device: torch.device, link: Link) -> dict:
    """Rank 1: accept offers it has room for, receive their KV, check it, decode to the end."""
    sim = cfg.sim(cfg.decode_page_size, device.type)
    moved, pool, states = make_pools(cfg, sim, device)
    sched, runner = Scheduler(sim, pool), ModelRunner(sim, pool)
    bytes_per_token = sum(b.numel() // b.shape[0] * b.element_size() for b in pool.k_buffer + pool.v_buffer)
    stats = dict(received=0, received_tokens=0, received_bytes=0, received_states=0, transfer_s=0.0,
                 decode_tokens=0, steps=0, arrival_bad_tokens=0, arrival_bad_states=0, finished=0,
                 finish_bad_tokens=0, finish_bad_states=0, first_bad="", path="", path_reason="")  # fmt: skip
    latencies = []
    corrupt = cfg.corrupt
    done = False
    step = 0
    progress = Progress("disagg_sim", cfg.requests, unit="requests decoded")
    while not done or sched.running or sched.waiting:
        if not done:
            message = link.recv(2 + 3 * MAX_OFFERS)
            count, done = message[0], bool(message[1])
            offers = [message[2 + 3 * i : 5 + 3 * i] for i in range(count)]
            accepted = []
            free = sched.allocator.available_size() - len(sched.running) * sim.page_size  # a page each to grow
            rows = sched.table.available_size()
            state_slots = states.mamba.available_size() if states is not None else len(offers)
            for rid, prompt_len, out_len in offers:
                need = sched.pages_for(prompt_len) * sim.page_size
                if need > free or rows == 0 or state_slots == 0:
                    break  # offers are taken in order; the rest wait on the prefill rank
                free -= need
                rows -= 1
                state_slots -= 1
                accepted.append(Request(rid, prompt_len, out_len, arrival=step))
            if not done:
                link.send([len(accepted)])
            for r in accepted:
                r.row = sched.table.alloc(1)[0]
                r.prefill_target = r.prompt_len
                slots = sched.alloc_prefill([(r, 0, r.prompt_len)])
                positions = torch.arange(r.prompt_len, device=device)
                sched.table.write((torch.full_like(positions, r.row), positions), slots.to(torch.int32))
                state_slot = None if states is None else torch.tensor([states.take(r.rid)])
                start = time.perf_counter()
                h = recv_kv(moved, slots.cpu(), src=0, state_slots=state_slot, ipc=cfg.ipc)
                h.wait()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                latencies.append(time.perf_counter() - start)
                stats["received"] += 1
                stats["received_tokens"] += h.tokens
                stats["received_bytes"] += h.nbytes
                stats["received_states"] += h.states
                stats["path"], stats["path_reason"] = h.path, h.path_reason or ""
                if corrupt and states is None:
                    pool.get_value_buffer(sim.layers - 1).view(torch.uint8)[slots[h.tokens // 2], 0, 0] ^= 0x5A
                    corrupt = False
                elif corrupt:  # a state byte: the state check must catch it
                    states.rows[-1][states.slot[r.rid], 3] ^= 0x5A
                    corrupt = False
                bad, first = runner.verify(r, slots)  # every transferred byte: all positions, layers, K and V
                stats["arrival_bad_tokens"] += bad
                if first is not None and not stats["first_bad"]:
                    stats["first_bad"] = f"on arrival: {describe(first)}"
                state_bad = None if states is None else states.bad(r.rid, r.prompt_len)
                stats["arrival_bad_states"] += state_bad is not None
                if state_bad is not None and not stats["first_bad"]:
                    stats["first_bad"] = f"on arrival: {state_bad}"
                r.kv_len, r.generated = r.prompt_len, 1
                sched.running.append(r)
        batch = sched.schedule()  # decode (and re-prefill of requests it had to retract)
        step += 1
        if batch is None:
            if sched.running:
                sched.retract(sched.running[-1])
            continue
        runner.forward(batch)
        stats["decode_tokens"] += len(batch.decode)
        sched.advance(batch)
        if states is not None:
            states.after_step(batch)
        for r in sched.finished():
            bad, first = runner.verify(r, sched.slots_of(r))
            stats["finished"] += 1
            stats["finish_bad_tokens"] += bad
            if first is not None and not stats["first_bad"]:
                stats["first_bad"] = f"at finish: {describe(first)}"
            if states is not None:
                state_bad = states.bad(r.rid, r.kv_len)
                stats["finish_bad_states"] += state_bad is not None
                if state_bad is not None and not stats["first_bad"]:
                    stats["first_bad"] = f"at finish: {state_bad}"
                states.release(r.rid)
            sched.release(r)
        progress.update(stats["finished"], f"step {step}")
    progress.close(stats["finished"], f"step {step}")
    stats["steps"] = step
    stats["retractions"] = sched.retractions
    stats["transfer_s"] = sum(latencies)
    stats["median_transfer_ms"] = 1e3 * sorted(latencies)[len(latencies) // 2] if latencies else 0.0
    stats["bytes_per_token"] = bytes_per_token
    stats["bytes_per_state"] = 0 if states is None else states.mamba.cache_params.bytes_per_slot
    stats["device"] = str(device)
    return stats


def describe(m) -> str:  # noqa: ANN001 - support.sim.result.Mismatch
    return f"request {m.rid} position {m.position} layer {m.layer} {m.which}"


def rank_main(rank: int, cfg: DisaggConfig, device_type: str, port: int, results) -> None:  # noqa: ANN001
    torch.set_num_threads(1)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # plain NVLink point-to-point, no multicast
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=120), device_id=device)  # fmt: skip
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))  # fmt: skip
    try:
        link = Link(rank, device)
        stats = (prefill_rank if rank == 0 else decode_rank)(cfg, device, link)
        results.put((rank, stats))
    finally:
        dist.destroy_process_group()


def format_summary(cfg: DisaggConfig, backend: str, pre: dict, dec: dict, wall_s: float) -> tuple[str, bool]:
    moved_mib = dec["received_bytes"] / 2**20
    rate = dec["received_bytes"] / dec["transfer_s"] / 1e9 if dec["transfer_s"] > 0 else float("nan")
    hybrid = cfg.model != "mha"
    ok = (
        dec["arrival_bad_tokens"] == 0 and dec["finish_bad_tokens"] == 0
        and dec["arrival_bad_states"] == 0 and dec["finish_bad_states"] == 0
        and dec["received"] == cfg.requests and dec["finished"] == cfg.requests and pre["sent"] == cfg.requests
        and (not hybrid or dec["received_states"] == cfg.requests)
    )  # fmt: skip
    n_full = len(cfg.full_layers())
    model = (f"{cfg.layers} layers x {cfg.heads} KV heads x {cfg.head_dim}" if not hybrid else
             f"qwen3.5-like: {n_full} full-attention layers x {cfg.heads} KV heads x {cfg.head_dim} and "
             f"{cfg.layers - n_full} Gated DeltaNet layers (state {GDN.conv[0]} bf16 + {GDN.temporal} fp32 each)")  # fmt: skip
    path = dec["path"] + (f" ({dec['path_reason']})" if dec["path_reason"] else "")
    lines = [
        f"kvpool disagg_sim: {cfg.requests} requests, {model}, {cfg.dtype} pools, seed {cfg.seed}",
        f"  ranks           prefill rank 0 on {pre['device']} (page {cfg.prefill_page_size}) -> decode rank 1 on "
        f"{dec['device']} (page {cfg.decode_page_size}), {backend}, path {path}",
        f"  prefill         {pre['prefill_tokens']} tokens in {pre['steps']} steps ({pre['retractions']} retractions), "
        f"{pre['sent']} requests sent",
        f"  transfers       {dec['received']} requests, {dec['received_tokens']} tokens"
        f"{', %d states' % dec['received_states'] if hybrid else ''}, {moved_mib:.2f} MiB "
        f"({dec['bytes_per_token']} B/token{', %d B/state' % dec['bytes_per_state'] if hybrid else ''}); {rate:.3f} GB/s over {1e3 * dec['transfer_s']:.1f} ms in transfers "
        f"(median {dec['median_transfer_ms']:.2f} ms per request, handshake included)",
        f"  decode          {dec['decode_tokens']} tokens in {dec['steps']} steps ({dec['retractions']} retractions), "
        f"{dec['finished']} requests finished",
    ]
    states = f" and {dec['received_states']} states x {cfg.layers - n_full} linear layers" if hybrid else ""
    if ok:
        lines.append(
            f"  check           OK: {dec['received_tokens']} transferred tokens x {n_full} layers x K,V{states} "
            f"byte-equal on arrival; {dec['finished']} requests byte-equal at finish"
        )
    else:
        state_bad = (f"; {dec['arrival_bad_states']} states differ on arrival, {dec['finish_bad_states']} at finish"
                     if hybrid else "")  # fmt: skip
        lines.append(
            f"  check           FAILED: {dec['arrival_bad_tokens']} tokens differ on arrival, "
            f"{dec['finish_bad_tokens']} at finish{state_bad}; first {dec['first_bad'] or '-'}; "
            f"{pre['sent']}/{dec['received']}/{dec['finished']} sent/received/finished of {cfg.requests}"
        )
    lines.append(f"  wall time       {wall_s:.2f} s (both processes, startup included)")
    if not ok and cfg.corrupt:
        what = "state byte" if hybrid else "byte"
        lines.append(f"  expected        --corrupt flipped one received {what} on purpose: the FAIL below is the check catching it")
    lines.append("PASS" if ok else "FAIL")
    return "\n".join(lines), ok


def parse_args(argv: Optional[Sequence[str]] = None) -> DisaggConfig:
    d = DisaggConfig()
    p = argparse.ArgumentParser(prog="disagg_sim", description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=d.requests, help="requests to serve end to end")
    p.add_argument("--model", choices=MODELS, default=d.model, help="mha: every layer full attention; qwen3.5: hybrid pools, every 4th layer full attention and the others' state in a MambaPool")
    p.add_argument("--layers", type=int, default=None, help=f"layers of the model (default {d.layers}; qwen3.5: full-attention and linear together, default 8)")
    p.add_argument("--heads", type=int, default=d.heads, help="KV heads of each pool")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="K and V head dim")
    p.add_argument("--prefill-page-size", type=int, default=d.prefill_page_size, help="page size of the prefill rank's pool (1: token allocator)")
    p.add_argument("--decode-page-size", type=int, default=d.decode_page_size, help="page size of the decode rank's pool (may differ from the prefill rank's)")
    p.add_argument("--kv-budget-mib", type=float, default=d.kv_budget_mib, help="KV-cache memory per rank")
    p.add_argument("--max-running", type=int, default=d.max_running, help="requests each rank runs at once")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="prefill tokens per step")
    p.add_argument("--prompt-len", type=int, nargs=2, default=d.prompt_len, metavar=("MIN", "MAX"), help="prompt lengths, drawn uniformly")
    p.add_argument("--output-len", type=int, nargs=2, default=d.output_len, metavar=("MIN", "MAX"), help="tokens each request decodes, drawn uniformly")
    p.add_argument("--arrival-every", type=float, default=d.arrival_every, help="mean steps between arrivals")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="element type of both pools")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device, help="auto: CUDA pools over NCCL when two GPUs are present, else CPU pools over gloo")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the workload (arrivals, lengths)")
    p.add_argument("--no-ipc", action="store_true", help="always take the staged path (by default, CUDA pools on one host read each other's rows directly)")
    p.add_argument("--corrupt", action="store_true", help="flip one received byte after a transfer: the run then reports FAIL and exits 1, which is the expected outcome")
    a = p.parse_args(argv)
    layers = a.layers if a.layers is not None else 8 if a.model == "qwen3.5" else d.layers
    cfg = DisaggConfig(
        requests=a.requests, layers=layers, heads=a.heads, head_dim=a.head_dim,
        prefill_page_size=a.prefill_page_size, decode_page_size=a.decode_page_size,
        kv_budget_mib=a.kv_budget_mib, max_running=a.max_running, chunk_size=a.chunk_size,
        prompt_len=tuple(a.prompt_len), output_len=tuple(a.output_len), arrival_every=a.arrival_every,
        dtype=a.dtype, device=a.device, seed=a.seed, corrupt=a.corrupt, model=a.model, ipc=not a.no_ipc,
    )  # fmt: skip
    return cfg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_args(argv)
        device_type = cfg.resolved_device()
        for page in (cfg.prefill_page_size, cfg.decode_page_size):
            pool_size(cfg.sim(page, "cpu"))
    except ValueError as e:
        print(f"disagg_sim: {e}", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    start = time.perf_counter()
    mp.start_processes(rank_main, args=(cfg, device_type, free_port(), results), nprocs=2, start_method="spawn")
    got = dict(results.get() for _ in range(2))
    text, ok = format_summary(cfg, "nccl" if device_type == "cuda" else "gloo", got[0], got[1], time.perf_counter() - start)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
