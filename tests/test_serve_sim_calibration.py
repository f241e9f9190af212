"""examples/serve_sim.py --calibrate, run in-process at a small size: a calibration pass with
observe_amax on, then the run with the calibrated scales. The scales the run writes with must be the
pass's maxima (kept here independently, from the K/V its writes were given) over the format's largest
value, the byte check must pass with them, and the reported quantisation errors must be what they are
on this data."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvassert import SMALL_SIM_ARGS, load_example, small_sim_config
from kvpool import quantize

serve_sim = load_example("serve_sim")  # puts examples/ on sys.path, where its parts are (support.sim)

# The small run with memory pressure (kvassert): 256 B/token, ~200 slots.
SMALL = small_sim_config()


# The small run's configuration, calibrated on a short pass: 2 layers (layer 1's K reaches 1024, past
# e4m3's 448; layer 0's V stays below 2**-6).
CALIBRATED = replace(SMALL, calibrate=True, calibrate_steps=12)
CALIBRATED_ARGS = [*SMALL_SIM_ARGS, "--calibrate", "--calibrate-steps", "12"]
E4M3_MAX = 448.0


def _record_writes(monkeypatch):
    """Every forward step as (seed of the runner's request stream, rids, positions, [(layer, k_scale,
    v_scale) of each set_kv_buffer call])."""
    steps = []
    forward, write = serve_sim.ModelRunner.forward, serve_sim.MHATokenToKVPool.set_kv_buffer

    def recording_forward(self, batch):
        steps.append((self.cfg.seed, batch.rids.clone(), batch.positions.clone(), []))
        forward(self, batch)

    def recording_write(self, layer, loc, k, v, k_scale, v_scale, *args, **kwargs):
        steps[-1][3].append((layer.layer_id, k_scale.clone(), v_scale.clone()))
        return write(self, layer, loc, k, v, k_scale, v_scale, *args, **kwargs)

    monkeypatch.setattr(serve_sim.ModelRunner, "forward", recording_forward)
    monkeypatch.setattr(serve_sim.MHATokenToKVPool, "set_kv_buffer", recording_write)
    return steps


def _expected_scales(amax: torch.Tensor) -> torch.Tensor:
    """float32(amax / 448), divided in float64 and rounded once, as calibrated_scales promises."""
    return (amax.double() / E4M3_MAX).float()


@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_the_run_writes_with_the_observed_maxima_over_448(monkeypatch, per_head):
    steps = _record_writes(monkeypatch)
    res = serve_sim.run(replace(CALIBRATED, calibrate_per_head=per_head))
    assert res.ok, serve_sim.format_summary(res)  # the byte check regenerates with the calibrated scales
    cal = res.calibration
    calibration_steps = [s for s in steps if s[0] == CALIBRATED.seed + 1]
    run_steps = [s for s in steps if s[0] == CALIBRATED.seed]
    assert len(calibration_steps) + len(run_steps) == len(steps)
    assert 0 < len(calibration_steps) <= CALIBRATED.calibrate_steps and cal.result.steps == CALIBRATED.calibrate_steps
    assert len(run_steps) == res.forward_steps
    # The calibration pass's writes don't count as the run's.
    assert res.fused_calls + res.reference_calls == res.forward_steps * CALIBRATED.layers

    # Per layer, K/V and head: the largest |x| of every token the calibration pass wrote.
    amax = torch.zeros(CALIBRATED.layers, 2, CALIBRATED.heads)
    for _, rids, positions, _ in calibration_steps:
        for layer in range(CALIBRATED.layers):
            kv = serve_sim.kv_values(rids, positions, layer, CALIBRATED.heads, CALIBRATED.head_dim).float()
            amax[layer] = torch.maximum(amax[layer], kv.abs().amax(dim=(0, 3)))
    assert torch.equal(cal.amax, amax)

    for layer in range(CALIBRATED.layers):
        k_amax, v_amax = amax[layer] if per_head else amax[layer].amax(dim=1, keepdim=True)
        want = (_expected_scales(k_amax), _expected_scales(v_amax))
        assert all(torch.equal(got.cpu(), w) for got, w in zip(cal.scales[layer], want))
        # Every write of the run used them, not the checkpoint's.
        used = [(k, v) for *_, calls in run_steps for (i, k, v) in calls if i == layer]
        assert len(used) == res.forward_steps
        assert all(torch.equal(k, want[0]) and torch.equal(v, want[1]) for k, v in used)
        checkpoint = serve_sim.checkpoint_scales(CALIBRATED.layers, torch.device("cpu"))[layer]
        assert all(float(c) != float(w.max()) for c, w in zip(checkpoint, want))


def test_calibrated_error_is_what_this_data_gives():
    """e4m3 at scale 1.0 saturates layer 1's K (|k| up to 1024) and rounds layer 0's V (below 2**-6)
    into subnormals; the calibrated scales bring every layer to e4m3's ~2.5%. Where the range fits
    at scale 1.0, calibration gains nothing: the rows within a tenth of a percent say so."""
    res = serve_sim.run(CALIBRATED)
    assert res.ok, serve_sim.format_summary(res)
    errors = {(e.layer, e.part): e for e in res.calibration.errors}
    assert sorted(errors) == [(0, "K"), (0, "V"), (1, "K"), (1, "V")]
    assert errors[1, "K"].amax == 1024.0 and errors[0, "V"].amax == 2.0**-6
    assert errors[1, "K"].scale_one > 0.3 and errors[0, "V"].scale_one > 0.05
    assert all(0.02 < e.calibrated < 0.03 for e in errors.values())
    for key in ((0, "K"), (1, "V")):
        assert abs(errors[key].scale_one - errors[key].calibrated) < 0.003
    # The checkpoint's V scales saturate values on purpose: worse than calibrated on every layer.
    assert all(errors[layer, "V"].checkpoint > errors[layer, "V"].calibrated + 0.02 for layer in (0, 1))

    # One figure recomputed here: layer 1's K over the first 8 requests, with scale 1.0 and calibrated.
    requests = serve_sim.make_requests(CALIBRATED)[:8]
    rids = torch.cat([torch.full((r.prompt_len + r.output_len - 1,), r.rid) for r in requests])
    positions = torch.cat([torch.arange(r.prompt_len + r.output_len - 1) for r in requests])
    assert res.calibration.sample_tokens == rids.numel()
    k = serve_sim.kv_values(rids, positions, 1, CALIBRATED.heads, CALIBRATED.head_dim)[:, 0]
    for scale, reported in ((1.0, errors[1, "K"].scale_one), (1024.0 / E4M3_MAX, errors[1, "K"].calibrated)):
        s = torch.tensor([scale], dtype=torch.float32)
        x = k.double()
        err = ((quantize(k, torch.float8_e4m3fn, s).double() * s.double() - x).norm() / x.norm()).item()
        assert err == pytest.approx(reported, rel=1e-9)


def test_mla_calibrates_one_latent_scale_per_layer():
    res = serve_sim.run(replace(CALIBRATED, model="deepseek-v3", kv_budget_mib=0.25, calibrate_steps=6))
    assert res.ok, serve_sim.format_summary(res)
    cal = res.calibration
    assert cal.amax.shape == (CALIBRATED.layers, 2, 1)  # latent and rotary maxima
    for layer, (k_scale, v_scale) in enumerate(cal.scales):
        want = _expected_scales(cal.amax[layer].amax()).reshape(1)
        assert torch.equal(k_scale.cpu(), want) and torch.equal(v_scale.cpu(), want)
    assert [e.part for e in cal.errors] == ["latent", "latent"]
    assert cal.errors[1].scale_one > 0.3 and cal.errors[1].calibrated < 0.03
    assert "calibrated      latent" in serve_sim.format_summary(res)


def test_main_prints_the_comparison_and_the_check_still_catches_a_flipped_byte(capsys):
    assert serve_sim.main(CALIBRATED_ARGS) == 0
    out = capsys.readouterr().out
    assert "check           OK" in out and "written with observe_amax on; check OK" in out
    assert "layer  part         amax  scale 1.0" in out
    assert "calibrated      K " in out and out.rstrip().endswith("PASS")
    assert serve_sim.main([*CALIBRATED_ARGS, "--corrupt"]) == 1
    assert "FAILED: 1 tokens differ" in capsys.readouterr().out
    assert serve_sim.main([*CALIBRATED_ARGS, "--dtype", "bf16"]) == 2
    assert "--calibrate needs an FP8 --dtype (fp8_e4m3 or fp8_e5m2; other pools store no scale), got 'bf16'" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(calibrate_steps=0), "--calibrate-steps must be a positive int, got 0"),
        (dict(calibrate=False, calibrate_per_head=True), r"--calibrate-per-head \(the calibrated scales' shape\) needs --calibrate"),
        (dict(dtype="fp16"), "--calibrate needs an FP8 --dtype .*got 'fp16'"),
    ],
)
def test_calibrate_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(CALIBRATED, **kwargs)


def test_calibration_on_the_fused_kernel(monkeypatch):
    """The observing writes on the fused Triton kernel (compiled on a GPU, the interpreter on CPU CI):
    the same maxima as the reference path's, and the run verifies with the scales they give."""
    small = replace(CALIBRATED, requests=4, output_len=(2, 8), calibrate_steps=4)
    reference = serve_sim.run(small)
    monkeypatch.setenv("KVPOOL_FUSED", "always")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = serve_sim.run(replace(small, device=device))
    assert res.ok, serve_sim.format_summary(res)
    assert res.reference_calls == 0 and res.calibration.result.reference_calls == 0
    assert reference.calibration.amax.min() > 0
    assert torch.equal(res.calibration.amax, reference.calibration.amax)
