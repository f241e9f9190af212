"""serve_sim's loop: the request stream, the run's parts and pool, and the scheduler loop, tallied in a
``SimResult``."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from kvpool import MHATokenToKVPool, MLATokenToKVPool
from kvpool.pools.sizing import KVGeometry
from support.progress import Progress
from support.sim.config import DTYPES, MLA_MODELS, SimConfig
from support.sim.formats import ScaledMLAModelRunner, ScaledModelRunner, make_scaled_pool, scaled_geometry
from support.sim.parking import CpuParking, HostParking, SpecDecode
from support.sim.result import SimResult
from support.sim.runner import Checker, MLAModelRunner, ModelRunner
from support.sim.scheduler import Request, Scheduler
from support.sim.values import Scales


#: How a prefix-cache run's longest request is counted (a conversation's last turn holds the others).
LONGEST_NOTE = ": --few-shot-len + the most --turns x (the longest --prompt-len + --output-len)"


def make_requests(cfg: SimConfig) -> list[Request]:
    rng = random.Random(cfg.seed)
    out, t = [], 0.0
    for rid in range(cfg.requests):
        out.append(Request(rid, rng.randint(*cfg.prompt_len), rng.randint(*cfg.output_len), int(t)))
        t += rng.expovariate(1.0 / cfg.arrival_every) if cfg.arrival_every > 0 else 0.0
    return out


class Arrivals:
    """The request stream in arrival order. A workload whose requests follow others' answers (a
    chat's next turn, support/sim/prefix.py) queues them when those finish."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.queue = deque(requests)

    def __bool__(self) -> bool:
        return bool(self.queue)

    def due(self, step: int) -> list[Request]:
        """The requests that have arrived by ``step``, taken from the stream."""
        out = []
        while self.queue and self.queue[0].arrival <= step:
            out.append(self.queue.popleft())
        return out

    def next_arrival(self) -> int:
        return self.queue[0].arrival

    def finished(self, r: Request, step: int) -> None:
        """``r`` finished at ``step`` (no request follows it here)."""


@dataclass(frozen=True)
class Parts:
    """What a run is made of; a model with more to keep than K/V swaps some (support/sim/hybrid.py),
    and so does a prefix-cache run (support/sim/prefix.py)."""

    scheduler: Callable[..., Scheduler] = Scheduler
    host_parking: Callable[..., Optional[HostParking]] = HostParking
    cpu_parking: Callable[..., CpuParking] = CpuParking
    spec: Callable[..., SpecDecode] = SpecDecode
    checker: Callable[..., Checker] = Checker
    arrivals: Callable[[SimConfig], Arrivals] = lambda cfg: Arrivals(make_requests(cfg))


def geometry_of(cfg: SimConfig) -> KVGeometry:
    """The K/V geometry of ``cfg``'s pool (MHA, or MLA for an ``MLA_MODELS`` name; scales included)."""
    if cfg.scaled_format:
        return scaled_geometry(cfg)
    mla = MLA_MODELS.get(cfg.model)
    if mla is None:
        return KVGeometry(cfg.heads, cfg.head_dim, cfg.layers, DTYPES[cfg.dtype])
    return KVGeometry.mla(*mla, cfg.layers, DTYPES[cfg.dtype])


def budget_for(cfg: SimConfig) -> float:
    """``cfg.kv_budget_mib``, or, when that does not hold the longest request plus two pages (a
    prefix-cache run's last turns are long), the whole MiB that holds two of them: the budget a
    command line without ``--kv-budget-mib`` gets."""
    need = (-(-cfg.max_context_len // cfg.page_size) + 2) * cfg.page_size * geometry_of(cfg).bytes_per_token
    if need <= cfg.kv_budget_mib * 2**20:
        return cfg.kv_budget_mib
    return float(-(-2 * need // 2**20))


def make_pool(cfg: SimConfig) -> tuple[Union[MHATokenToKVPool, MLATokenToKVPool], KVGeometry]:
    """The run's pool (MHA, or MLA for an ``MLA_MODELS`` name), as large as ``kv_budget_mib`` allows.

    Raises
    ------
    ValueError
        If the budget does not hold the longest request plus a page.
    """
    dtype = DTYPES.get(cfg.dtype)
    mla = MLA_MODELS.get(cfg.model)
    geometry = geometry_of(cfg)
    try:
        size = geometry.max_pool_size(int(cfg.kv_budget_mib * 2**20), cfg.page_size)
    except ValueError:  # less than two pages
        size = 0
    longest = cfg.max_context_len
    if -(-longest // cfg.page_size) + 1 > size // cfg.page_size:
        need = (-(-longest // cfg.page_size) + 2) * cfg.page_size * geometry.bytes_per_token / 2**20
        raise ValueError(
            f"--kv-budget-mib must hold the longest request ({longest} tokens{LONGEST_NOTE if cfg.prefix_cache else ''}) "
            f"plus a page, about {need:.2f} MiB here, got {cfg.kv_budget_mib:g} MiB = {size} slots"
        )
    if cfg.scaled_format:
        return make_scaled_pool(cfg, size), geometry  # type: ignore[return-value]
    if mla is None:
        return MHATokenToKVPool(size, cfg.page_size, dtype, cfg.heads, cfg.head_dim, cfg.layers, cfg.device), geometry
    return MLATokenToKVPool(size, cfg.page_size, dtype, *mla, cfg.layers, cfg.device), geometry

def make_runner(cfg: SimConfig, pool: MHATokenToKVPool, scales: Optional[Scales] = None) -> ModelRunner:
    if cfg.scaled_format:
        return (ScaledMLAModelRunner if cfg.model in MLA_MODELS else ScaledModelRunner)(cfg, pool, scales)  # type: ignore[arg-type]
    if isinstance(pool, MLATokenToKVPool):
        return MLAModelRunner(cfg, pool, scales)
    return ModelRunner(cfg, pool, scales)

def simulate(
    cfg: SimConfig, pool: MHATokenToKVPool, runner: ModelRunner, result: SimResult, parts: Parts = Parts()
) -> None:
    """The scheduler loop over ``cfg``'s request stream on ``pool``, tallied in ``result``."""
    stats_before = (pool.stats.fused_calls, pool.stats.reference_calls, dict(pool.stats.reasons))
    sched = parts.scheduler(cfg, pool)
    arrivals = parts.arrivals(cfg)
    progress = Progress("serve_sim", cfg.requests, enabled=cfg.progress)
    checker = parts.checker(runner, result, corrupt=cfg.corrupt)
    if cfg.host_tier:
        sched.host = parts.host_parking(cfg, pool, runner, result)
    elif cfg.cpu_park:
        sched.host = parts.cpu_parking(pool, runner, result)
    spec = parts.spec(cfg, sched, runner, result) if cfg.spec_k else None

    start = time.perf_counter()
    step = 0
    while arrivals or sched.waiting or sched.running:
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
        sched.waiting.extend(arrivals.due(step))
        accepted = spec.step() if spec is not None else 0
        batch = sched.schedule(with_decode=spec is None)
        step += 1
        if batch is None and not accepted:
            if sched.running:  # every running request waits for pages: make room
                sched.retract(sched.running[-1])
            elif not sched.waiting and arrivals:  # idle until the next arrival
                step = max(step, arrivals.next_arrival())
            continue
        result.peak_slots = max(result.peak_slots, sched.slots_in_use())
        result.peak_running = max(result.peak_running, len(sched.running))
        result.decode_tokens += accepted
        if batch is not None:
            runner.forward(batch)
            result.prefill_tokens += batch.prefill_tokens
            result.decode_tokens += len(batch.decode)
            sched.advance(batch)
        result.forward_steps += 1

        finished = sched.finished()
        sched.allocator.free_group_begin()  # as SGLang frees a step's finished requests together
        for r in finished:
            checker.check(r, sched.slots_of(r))  # before the slots can be handed out again
            sched.release(r)
            arrivals.finished(r, step)
        sched.allocator.free_group_end()
        result.served += len(finished)
        progress.update(result.served, f"step {step}")
    progress.close(result.served, f"step {step}")

    for r in sched.running:  # stopped by --max-steps: check what is still live
        checker.check(r, sched.slots_of(r))
    result.wall_s = time.perf_counter() - start
    result.steps = step
    result.retractions = sched.retractions
    # The pool's statistics also count a calibration pass's writes on the same pool.
    fused, reference, reasons = stats_before
    result.fused_calls = pool.stats.fused_calls - fused
    result.reference_calls = pool.stats.reference_calls - reference
    result.reasons = {k: n - reasons.get(k, 0) for k, n in pool.stats.reasons.items() if n > reasons.get(k, 0)}
    try:
        sched.check_integrity()
    except RuntimeError as e:
        result.integrity_error = str(e)
    if not sched.running:
        result.leaked_slots = sched.leaked_slots()
