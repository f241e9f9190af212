"""Serving on a pool and comparing with HF: a model family plugs in through an ``Architecture``;
``serve`` serves prompts to completion, ``calibrate`` observes scales, ``run`` serves on a pool of
each dtype and compares, ``run_main`` is a runner's ``main``."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import transformers
from transformers import PreTrainedModel

from kvpool.pools.base import KVCache
from support.progress import Progress
from support.runners.prefix import HostTier, caching
from support.runners.config import DTYPES, LayerScales, RunConfig, Scales, pool_kind
from support.runners.formats import POOL_FORMATS, captured_kv, check_formats, round_trip_errors, round_trip_note
from support.runners.reference import Generation, Prompt, hf_reference, make_prompts
from support.runners.results import PoolRun, Report, ServeResult, compare
from support.runners.scheduler import ForwardBatch, Request, Scheduler
from support.runners.summary import format_summary
from support.runners import tiers as tier_checks

class ModelRunner:
    """A model runner: ``forward(batch) -> logits [B, vocab]`` of each request's last token, and
    ``step``, one scheduler step with it (a runner that verifies drafts overrides ``step``)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def step(self, sched: Scheduler, keep_logits: bool) -> Optional[str]:
        """Schedule, run and advance one step; its kind (``"prefill"``, ``"decode"``), None when idle."""
        batch = sched.schedule()
        if batch is None:
            return None
        sched.advance(batch, self.forward(batch), keep_logits)
        return "prefill" if batch.is_prefill else "decode"


class Architecture:
    """What ``serve``, ``calibrate`` and ``run`` need from a model family: build the seeded model of
    a ``RunConfig``, make a pool for it, make the model runner (a ``ModelRunner``) over that pool,
    and the scheduler. Each runner module subclasses it (``LLAMA`` in llama_runner.py); their methods
    look the module's functions up when called, so a test can replace ``make_pool`` in the module."""

    program = "model_runner"
    model_name = "PreTrainedModel"
    allocator_name = "PagedTokenToKVPoolAllocator"  # what the scheduler allocates with (the summary names it)
    #: Whether the speculative runs (``verify.add_spec_runs``) serve on the prefix cache too when
    #: the run has one; an architecture whose verify steps the cache does not take says False.
    speculative_prefix_cache = True
    #: The ``POOL_FORMATS`` names this model family has a pool for (value ``""``), and those it
    #: refuses with the reason (a name missing is refused as having no pool of its format).
    pool_formats: Mapping[str, str] = {}
    #: What HF's attention hands its cache as K and V (the round-trip note names them).
    kv_parts = ("K", "V")

    def build_model(self, cfg: RunConfig) -> PreTrainedModel:
        raise NotImplementedError

    def make_pool(self, cfg: RunConfig, model: PreTrainedModel, dtype: torch.dtype) -> KVCache:
        raise NotImplementedError

    def runner(self, model: PreTrainedModel, pool: KVCache, scales: Optional[Scales]) -> ModelRunner:
        raise NotImplementedError

    def scheduler(
        self, pool: KVCache, max_running: int, max_context_len: int, chunk_size: Optional[int],
        prefix_cache: bool = False, tiers: Optional[HostTier] = None,
    ) -> Scheduler:  # fmt: skip
        """The scheduler (on a prefix cache with ``prefix_cache``, with ``tiers`` below its device
        part; an architecture whose cache has no host tier leaves ``tiers`` out of its signature)."""
        if tiers is not None and not prefix_cache:
            raise ValueError("tiers (a host tier) need prefix_cache=True: the host tier is the prefix cache's")
        if not prefix_cache:
            return Scheduler(pool, max_running, max_context_len, chunk_size)
        return caching(Scheduler)(pool, max_running, max_context_len, chunk_size, tiers=tiers)

    def reference_scales(self, model: PreTrainedModel, scales: Optional[Scales]) -> Optional[LayerScales]:
        """``scales`` (the runner's) by HF layer index, for ``hf_reference``'s rounding cache."""
        return scales



def serve(
    model: PreTrainedModel,
    pool: KVCache,
    prompts: Sequence[Prompt],
    max_running: int,
    scales: Optional[Scales] = None,
    keep_logits: bool = True,
    arch: Optional[Architecture] = None,
    chunk_size: Optional[int] = None,
    prefix_cache: bool = False,
    tiers: Optional[HostTier] = None,
) -> ServeResult:
    """Serve ``prompts`` to completion with continuous batching, at most ``max_running`` at once,
    with ``arch``'s scheduler and model runner (on a prefix cache with ``prefix_cache``, with
    ``tiers`` a host tier and storage below it). The result's path counts are the pool writes of
    this run."""
    if arch is None:
        raise ValueError("arch must be a model family's Architecture, got None")
    max_context = max(len(p.tokens) + p.new_tokens for p in prompts)
    if tiers is None:
        sched = arch.scheduler(pool, max_running, max_context, chunk_size, prefix_cache)
    else:
        sched = arch.scheduler(pool, max_running, max_context, chunk_size, prefix_cache, tiers=tiers)  # type: ignore[call-arg]
    runner = arch.runner(model, pool, scales)
    for rid, p in enumerate(prompts):
        sched.add(Request(rid, list(p.tokens), p.new_tokens))
    stats = pool.stats
    fused0, ref0, reasons0 = stats.fused_calls, stats.reference_calls, dict(stats.reasons)
    res = ServeResult(generations=[])
    progress = Progress(arch.program, len(prompts))
    start = time.perf_counter()
    steps = 0
    while (kind := runner.step(sched, keep_logits)) is not None:
        setattr(res, f"{kind}_steps", getattr(res, f"{kind}_steps") + 1)
        steps += 1
        progress.update(len(sched.finished), f"step {steps}")
    progress.close(len(sched.finished), f"step {steps}")
    res.wall_s = time.perf_counter() - start
    done = sorted(sched.finished, key=lambda r: r.rid)
    res.generations = [Generation(r.output, torch.stack(r.logits) if keep_logits else None) for r in done]
    res.peak_running = sched.peak_running
    res.drafted_tokens = getattr(runner, "drafted_tokens", 0)
    res.accepted_tokens = getattr(runner, "accepted_tokens", 0)
    res.accept_lengths = list(getattr(runner, "accept_lengths", []))
    res.fused_calls = stats.fused_calls - fused0
    res.reference_calls = stats.reference_calls - ref0
    res.reasons = {k: v - reasons0.get(k, 0) for k, v in stats.reasons.items() if v != reasons0.get(k, 0)}
    res.prompt_tokens = getattr(sched, "prompt_tokens", 0)
    res.cached_tokens = getattr(sched, "cached_tokens", 0)
    res.memory = dict(getattr(sched, "memory", {}))
    res.host_loaded_tokens = getattr(sched, "host_loaded_tokens", 0)
    res.storage_loaded_tokens = getattr(sched, "storage_loaded_tokens", 0)
    res.host_loaded_states = getattr(sched, "host_loaded_states", None)
    try:
        sched.check_integrity()
    except RuntimeError as e:
        res.integrity_error = str(e)
    res.leaked_slots = sched.leaked_slots()
    res.storage = dict(getattr(sched, "storage_stats", {}))
    if not getattr(sched, "storage_drained", True):
        res.integrity_error = res.integrity_error or "the storage tier's writes did not finish"
    return res



def calibrate(
    cfg: RunConfig, model: PreTrainedModel, pool: KVCache, prompts: Sequence[Prompt], arch: Architecture
) -> LayerScales:
    """Per-layer scales from the K/V amax the pool observes while it serves ``prompts`` at scale 1.0:
    a list in layer order, or a mapping from layer id where the pool returns one (a hybrid model's).

    Uses the pool's ``reset_amax``/``observe_amax``/``calibrated_scales``, which a pool may not
    have: callers check ``hasattr(pool, "calibrated_scales")`` first.
    """
    pool.reset_amax()  # type: ignore[attr-defined]
    pool.observe_amax(True)  # type: ignore[attr-defined]
    try:
        serve(model, pool, prompts, cfg.batch, keep_logits=False, arch=arch, chunk_size=cfg.chunk_size,
              prefix_cache=cfg.prefix_cache)  # fmt: skip
    finally:
        pool.observe_amax(False)  # type: ignore[attr-defined]
    scales = pool.calibrated_scales(margin=1.0, per_head=False)  # type: ignore[attr-defined]
    return dict(scales) if isinstance(scales, Mapping) else [(k, v) for k, v in scales]


def run(cfg: RunConfig, arch: Architecture, progress: Optional[Callable[[str], None]] = None) -> Report:
    """Build ``arch``'s model, serve the prompts on a pool of each dtype, compare each run with HF;
    ``progress`` is told what starts."""
    with cpu_threads(cfg):
        return _run(cfg, arch, progress or (lambda msg: None))


class cpu_threads:
    """Within the block, torch uses ``cfg.cpu_threads`` threads when ``cfg.device`` is a CPU."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def __enter__(self) -> None:
        self.threads = torch.get_num_threads()
        if self.cfg.cpu_threads is not None and torch.device(self.cfg.device).type == "cpu":
            torch.set_num_threads(self.cfg.cpu_threads)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.threads)


def _run(cfg: RunConfig, arch: Architecture, progress: Callable[[str], None]) -> Report:
    formats = [name for name in cfg.pool_dtypes if name in POOL_FORMATS]
    check_formats(formats, arch.pool_formats, arch.program)
    if formats and cfg.host_tier:
        raise ValueError(f"--dtypes {formats[0]} runs without --host-tier (the host tier copies K and V, not the scales beside them)")
    progress(f"building the model ({cfg.shape.describe()}) on {cfg.device}")
    model = arch.build_model(cfg)
    prompts = make_prompts(cfg)
    progress(f"HF generate of {len(prompts)} prompts (the reference)")
    hf = hf_reference(model, prompts)
    report = Report(
        cfg, str(model.device), transformers.__version__, [], arch.program, arch.model_name,
        allocator_name=arch.allocator_name,
    )  # fmt: skip
    with tier_checks.site_for(cfg) as site:

        def record(name: str, pool: KVCache, scales: Optional[LayerScales], label: str) -> None:
            dtype = pool_kind(name)
            progress(f"serving on a {name} pool" + (f", scale {label}" if label != "-" else ""))
            namespace = f"{arch.model_name} seed {cfg.seed}, {name} pool, scale {label}"  # pages of one pool and scale
            faults = site.faults() if site is not None else {}
            res = serve(model, pool, prompts, cfg.batch, scales=scales, arch=arch, chunk_size=cfg.chunk_size,
                        prefix_cache=cfg.prefix_cache, tiers=tier_checks.engine_tiers(cfg, site, namespace))  # fmt: skip
            rounded = None
            if dtype != DTYPES[cfg.model_dtype]:
                progress(f"HF generate through a cache that rounds K/V as the {name} pool does")
                rounded = compare(res.generations, hf_reference(model, prompts, dtype, arch.reference_scales(model, scales)))
            run = PoolRun(name, label, res, compare(res.generations, hf), rounded)
            if cfg.host_tier:
                progress(f"the {name} pool's tiers against no cache, a device-only cache" + (" and a second engine" if site else ""))

                def serve_on(prefix_cache: bool, tiers: Any) -> ServeResult:
                    return serve(model, arch.make_pool(cfg, model, dtype), prompts, cfg.batch, scales=scales, arch=arch,
                                 chunk_size=cfg.chunk_size, prefix_cache=prefix_cache, tiers=tiers)  # fmt: skip

                run.tiers = tier_checks.check(cfg, res, serve_on, site, namespace, name, faults)
            report.runs.append(run)

        for name in cfg.pool_dtypes:
            kind = pool_kind(name)
            pool = arch.make_pool(cfg, model, kind)  # type: ignore[arg-type]
            if not isinstance(kind, torch.dtype):  # a format whose scales the write computes
                record(name, pool, None, kind.scale_label)
                continue
            fp8 = kind.itemsize == 1
            record(name, pool, None, "1.0" if fp8 else "-")
            if not (fp8 and cfg.calibrate):
                continue
            if hasattr(pool, "calibrated_scales"):
                progress(f"calibrating the {name} pool's scales on the same prompts")
                record(name, pool, calibrate(cfg, model, pool, prompts, arch), "calibrated")
            else:
                note = f"FP8 with calibrated scales: not run ({type(pool).__name__} has no calibrated_scales)"
                if note not in report.notes:
                    report.notes.append(note)
    if formats:
        progress("round-trip error of HF's K/V in each format")
        report.notes.append(round_trip_note(round_trip_errors(captured_kv(model, prompts), formats), arch.kv_parts))
    return report



def run_main(
    argv: Optional[Sequence[str]], parse: Callable[[Optional[Sequence[str]]], tuple[RunConfig, Architecture]],
    program: str, execute: Optional[Callable[[RunConfig, Architecture], Any]] = None,
    summary: Callable[[Any], str] = format_summary,
) -> int:  # fmt: skip
    """Parse ``argv`` into a config and an architecture, run (``execute``, default ``run``), print
    the summary; 0 when the report is ok, 1 when not, 2 on bad arguments (reported as ``program``'s)."""
    def phase(msg: str) -> None:  # what starts, on stderr
        print(f"{program}: {msg}", file=sys.stderr, flush=True)

    try:
        cfg, arch = parse(argv)
        report = execute(cfg, arch) if execute is not None else run(cfg, arch, phase)
    except ValueError as e:
        print(f"{program}: {e}", file=sys.stderr)
        return 2
    print(summary(report))
    return 0 if report.ok else 1
