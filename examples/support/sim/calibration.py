"""``serve_sim --calibrate``: a calibration pass on the run's pool, the calibrated scales, and the
quantisation error they give.

The pass serves the request stream of ``--seed + 1`` (data the run itself never writes, as a
calibration set would be) for ``--calibrate-steps`` steps with ``pool.observe_amax(True)``; the run
then writes and checks with ``pool.calibrated_scales()``. The error table compares, per layer and
part, the relative RMS error of the dequantised values against the bf16 input with scale 1.0, the
checkpoint's scales and the calibrated ones, on every token of the run's first requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvpool import MLATokenToKVPool, quantize
from support.sim.config import DTYPES
from support.sim.loop import SimResult, make_requests, make_runner, simulate


@dataclass(frozen=True)
class QuantError:
    """Relative RMS error of one layer's K, V or latent rows, quantised and dequantised with three scales."""

    layer: int
    part: str  # "K", "V" or "latent"
    amax: float  # observed by the calibration pass
    scale_one: float
    checkpoint: float
    calibrated: float
    checkpoint_scale: torch.Tensor
    calibrated_scale: torch.Tensor


@dataclass
class Calibration:
    """--calibrate: the calibration pass, what it observed and the scales the run then used."""

    result: Any  # the calibration pass, checked like any run
    amax: torch.Tensor  # pool.kv_amax after the pass, on the CPU
    scales: list  # pool.calibrated_scales(), on the pool's device: the run writes and checks with these
    errors: list[QuantError] = field(default_factory=list)
    sample_requests: int = 0
    sample_tokens: int = 0


#: --calibrate measures the quantisation error on every token of the run's first requests.
SAMPLE_REQUESTS = 8


def relative_rms_error(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> float:
    """||s * q(x, s) - x|| / ||x|| in float64, q being ``kvpool.quantize`` (what a write stores).
    ``x``: [T, H, D]; ``scale``: [1] or [H], on x's device."""
    dequantised = quantize(x, dtype, scale).double() * scale.double().view(1, -1, 1)
    exact = x.double()
    return float((dequantised - exact).norm() / exact.norm())


def quantisation_errors(runner: Any, checkpoint: list, amax: torch.Tensor) -> tuple[list[QuantError], int, int]:
    """--calibrate: the relative RMS error of every layer's K and V (an MLA pool: latent rows) over
    every token of the run's first SAMPLE_REQUESTS requests, with scale 1.0, the ``checkpoint``
    scales and ``runner``'s (the calibrated ones), on the CPU. Returns the rows, the requests and
    the tokens sampled."""
    cfg, dtype = runner.cfg, runner.pool.dtype
    mla = isinstance(runner.pool, MLATokenToKVPool)
    requests = make_requests(cfg)[:SAMPLE_REQUESTS]
    rids = torch.cat([torch.full((r.final_kv_len,), r.rid, dtype=torch.int64) for r in requests])
    positions = torch.cat([torch.arange(r.final_kv_len, dtype=torch.int64) for r in requests])
    one = torch.ones(1, dtype=torch.float32)
    rows = []
    for layer in runner.layers:
        i = layer.layer_id
        for j, (part, x) in enumerate(runner.parts(rids, positions, i)):
            ckpt, calibrated = checkpoint[i][j].cpu(), runner.scales[i][j].cpu()
            observed = amax[i] if mla else amax[i, j]  # MLA: one scale covers the latent and rotary maxima
            errors = [relative_rms_error(x, dtype, scale) for scale in (one, ckpt, calibrated)]
            rows.append(QuantError(i, part, float(observed.max()), *errors, ckpt, calibrated))
    return rows, len(requests), rids.numel()


def calibrate(cfg: Any, pool: Any, bytes_per_token: int) -> Calibration:
    """--calibrate: the request stream of seed + 1 (data the run itself never writes, as a
    calibration set would be) for ``calibrate_steps`` steps on ``pool`` with observation on, written
    with the checkpoint scales (observation records the inputs, whatever the scale); then the
    calibrated scales. The pass's requests simply end with it: the run gets a new allocator."""
    pass_cfg = replace(
        cfg, seed=cfg.seed + 1, max_steps=cfg.calibrate_steps, calibrate=False, calibrate_per_head=False,
        corrupt=False, progress=False,
    )  # fmt: skip
    result = SimResult(pass_cfg, pool.size, bytes_per_token, device=str(pool.device))
    pool.observe_amax(True)
    try:
        simulate(pass_cfg, pool, make_runner(pass_cfg, pool), result)
        scales = pool.calibrated_scales(per_head=cfg.calibrate_per_head)
    finally:
        pool.observe_amax(False)  # the run's writes take the variant with no observation code
    return Calibration(result, pool.kv_amax.cpu().clone(), scales)  # type: ignore[union-attr]


def _scale_text(scale: torch.Tensor) -> str:
    lo, hi = float(scale.min()), float(scale.max())
    return f"{lo:.4g}" if lo == hi else f"{lo:.4g}..{hi:.4g}"


def format_calibration(cal: Calibration, parts: str) -> list[str]:
    """--calibrate's lines: the calibration pass, the error table, and the means over layers."""
    p = cal.result
    cfg = p.config
    check = "check OK"
    if not p.ok:
        allocators = p.integrity_error or (f"{p.leaked_slots} slots leaked" if p.leaked_slots else "OK")
        check = f"check FAILED ({p.mismatched_tokens} tokens differ; allocators: {allocators})"
    per_head = any(k.numel() > 1 for k, _ in cal.scales)
    fmax = torch.finfo(DTYPES[cfg.dtype]).max
    pad = " " * 18
    lines = [
        f"  calibration     seed {cfg.seed}, {p.steps} steps, {p.prefill_tokens + p.decode_tokens} tokens "
        f"x {cfg.layers} layers x {parts} written with observe_amax on; {check}",
        f"{pad}scales: calibrated_scales({'per_head=True' if per_head else ''}) = observed amax / {fmax:g} "
        f"per layer{' and head' if per_head else ''}",
        f"  quant. error    relative RMS of dequantised values against the bf16 input, {cal.sample_tokens} tokens "
        f"(the run's first {cal.sample_requests} requests)",
        f"{pad}layer  part         amax  scale 1.0  checkpoint (scale)     calibrated (scale)",
    ]
    for e in cal.errors:
        checkpoint = f"({_scale_text(e.checkpoint_scale)})"
        lines.append(
            f"{pad}{e.layer:>5}  {e.part:<6} {e.amax:>10.4g}  {e.scale_one:>9.2%}  {e.checkpoint:>9.2%} "
            f"{checkpoint:<11}  {e.calibrated:>9.2%} ({_scale_text(e.calibrated_scale)})"
        )
    means = []
    for part in dict.fromkeys(e.part for e in cal.errors):
        rows = [e for e in cal.errors if e.part == part]
        one, ckpt, calibrated = (
            sum(getattr(e, name) for e in rows) / len(rows) for name in ("scale_one", "checkpoint", "calibrated")
        )
        lines.append(f"{pad}{'mean':>5}  {part:<6} {'':>10}  {one:>9.2%}  {ckpt:>9.2%} {'':<11}  {calibrated:>9.2%}")
        means.append(f"{part} {one:.2%} -> {calibrated:.2%}")
    lines.append(f"  calibrated      {', '.join(means)} (mean relative RMS error over layers, scale 1.0 -> calibrated)")
    return lines
