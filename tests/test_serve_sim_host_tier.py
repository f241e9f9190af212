"""examples/serve_sim.py --host-tier: retracted requests are parked in a host pool and reloaded
layer by layer instead of recomputed; every reloaded byte is checked, and a corrupted host byte fails
the run."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "examples" / "serve_sim.py"
_spec = importlib.util.spec_from_file_location("serve_sim_host", _PATH)
serve_sim = importlib.util.module_from_spec(_spec)
sys.modules["serve_sim_host"] = serve_sim
_spec.loader.exec_module(serve_sim)

# Small, with enough memory pressure to retract (as tests/test_serve_sim.py's pressure case).
PRESSURE = serve_sim.SimConfig(
    requests=20, layers=2, heads=2, head_dim=32, page_size=16, kv_budget_mib=0.05, max_running=12,
    chunk_size=128, prompt_len=(4, 80), output_len=(2, 24), arrival_every=0.0, device="cpu", seed=3,
)  # fmt: skip


@pytest.mark.parametrize(
    "layout, backend, page_size",
    [("page_first", "kernel", 16), ("layer_first", "direct", 16), ("page_first", "direct", 4), ("layer_first", "kernel", 1)],
)
def test_parked_requests_come_back_byte_exact(layout, backend, page_size):
    base = replace(PRESSURE, page_size=page_size)
    plain = serve_sim.run(base)
    res = serve_sim.run(replace(base, host_tier=True, host_layout=layout, host_io_backend=backend, validate=True))
    summary = serve_sim.format_summary(res)
    assert res.ok and res.served == 20, summary
    assert res.retractions > 0 and res.parked > 0 and res.reloaded > 0 and res.reloaded_tokens > 0
    assert res.reload_mismatches == 0 and res.host_bytes > 0
    # Reloaded tokens are not written again by the model.
    assert res.prefill_tokens < plain.prefill_tokens
    assert "reload check    OK: every byte of" in summary


def test_a_corrupted_host_byte_fails_the_reload_check(monkeypatch):
    real = serve_sim.HostParking.resume

    def corrupt_then_resume(self, r, slots):
        host_slots, _ = self.parked[r.rid]
        k = self.host.k_buffer
        first = int(host_slots[0])
        row = k[0, first] if self.host.layout == "layer_first" else k[first, 0]
        row.view(torch.uint8).view(-1)[0] ^= 0x5A
        return real(self, r, slots)

    monkeypatch.setattr(serve_sim.HostParking, "resume", corrupt_then_resume)
    res = serve_sim.run(replace(PRESSURE, host_tier=True))
    assert not res.ok and res.reload_mismatches > 0
    assert "reload check    FAILED" in serve_sim.format_summary(res)


def test_no_host_room_falls_back_to_recompute():
    res = serve_sim.run(replace(PRESSURE, host_tier=True, host_ratio=0.1))
    assert res.ok and res.host_full > 0 and res.served == 20


def test_command_line():
    cfg = serve_sim.parse_args(["--host-tier", "--host-layout", "layer_first", "--host-io-backend", "direct", "--host-ratio", "3"])
    assert cfg.host_tier and cfg.host_layout == "layer_first" and cfg.host_io_backend == "direct" and cfg.host_ratio == 3.0
    with pytest.raises(ValueError, match="host_layout must be one of"):
        replace(PRESSURE, host_layout="page_head")
