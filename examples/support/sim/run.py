"""``run``: one serve_sim run of a ``SimConfig``, whichever variant it asks for."""

from __future__ import annotations

import torch

from kvpool import MLATokenToKVPool
from support.sim import calibration, hybrid, prefix, sliding
from support.sim.config import HYBRID_MODEL, SWA_MODELS, SimConfig
from support.sim.loop import SimResult, make_pool, make_runner, simulate
from support.sim.values import checkpoint_scales


def run(cfg: SimConfig) -> SimResult:
    """Run the simulation and return what happened; ``result.ok`` says whether every check passed."""
    threads = torch.get_num_threads()
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: SimConfig) -> SimResult:
    if cfg.prefix_cache:
        return prefix.run(cfg)
    if cfg.model == HYBRID_MODEL:
        return hybrid.run(cfg)
    if cfg.model in SWA_MODELS:
        return sliding.run(cfg)
    pool, geometry = make_pool(cfg)
    cal = calibration.calibrate(cfg, pool, geometry.bytes_per_token) if cfg.calibrate else None
    runner = make_runner(cfg, pool, None if cal is None else cal.scales)
    result = SimResult(cfg, pool.size, geometry.bytes_per_token, device=str(pool.device), calibration=cal)
    simulate(cfg, pool, runner, result)
    if cal is not None:
        checkpoint = checkpoint_scales(cfg.layers, torch.device("cpu"), mla=isinstance(pool, MLATokenToKVPool))
        cal.errors, cal.sample_requests, cal.sample_tokens = calibration.quantisation_errors(runner, checkpoint, cal.amax)
    return result
