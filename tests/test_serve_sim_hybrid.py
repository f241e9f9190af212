"""examples/serve_sim.py --model qwen3.5: a hybrid model's K/V and per-request states under memory
pressure (retraction, state slots that cap the running requests, speculative commits, parking in the
host tier or with CPU copies), every state checked byte for byte; a corrupted state byte fails the run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvassert import load_example

serve_sim = load_example("serve_sim")
hybrid = load_example("serve_sim_hybrid")

# Small, with memory pressure: 1 full-attention layer (256 B/token, 160 slots) and 3 linear layers'
# states (state slots for 9 of the 12 request rows).
SMALL = serve_sim.SimConfig(
    requests=20, layers=4, heads=4, head_dim=32, page_size=16, kv_budget_mib=0.12, max_running=12,
    chunk_size=128, prompt_len=(4, 80), output_len=(2, 24), arrival_every=0.0, device="cpu", seed=3,
    model="qwen3.5",
)  # fmt: skip


def run_ok(cfg):
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    assert res.ok and res.served == cfg.requests, summary
    assert res.state_checked >= res.served and res.state_mismatches == 0, summary
    return res, summary


@pytest.mark.parametrize("page_size", [16, 1], ids=["paged16", "token"])
def test_pressure_retracts_and_every_state_verifies(page_size):
    res, summary = run_ok(replace(SMALL, page_size=page_size, validate=True))
    assert res.retractions > 0, "the small pool should force retractions"
    assert "state check     OK: " in summary and "x 1 layers x K,V" in summary
    assert res.fused_calls + res.reference_calls == res.forward_steps  # one full-attention layer


def test_state_slots_cap_the_running_requests():
    res, _ = run_ok(replace(SMALL, kv_budget_mib=4.0))
    assert res.retractions == 0
    assert res.peak_running == int(SMALL.max_running * hybrid.STATE_SHARE) < SMALL.max_running


def test_a_corrupted_state_byte_fails_the_run():
    res = serve_sim.run(replace(SMALL, corrupt=True))
    assert not res.ok and res.state_mismatches == 1 and res.mismatched_tokens == 0
    summary = serve_sim.format_summary(res)
    assert "state check     FAILED: 1 of" in summary and summary.endswith("FAIL")


def test_speculative_commits_keep_the_accepted_states():
    res, summary = run_ok(replace(SMALL, kv_budget_mib=0.4, spec_k=3))
    assert res.spec_steps > 0 and 0 < res.accepted_tokens < res.drafted_tokens, summary


@pytest.mark.parametrize(
    "how", [dict(host_tier=True), dict(host_tier=True, host_io_backend="direct", host_layout="layer_first"),
            dict(cpu_park=True)],  # fmt: skip
    ids=["host-kernel", "host-direct", "cpu-park"],
)
def test_parked_states_come_back_with_their_kv(how):
    res, summary = run_ok(replace(SMALL, validate=True, **how))
    assert res.parked > 0 and res.reloaded == res.parked and res.reload_mismatches == 0, summary
    assert res.state_checked == res.served + res.reloaded  # each reload is checked too


def test_command_line():
    args = ["--model", "qwen3.5", "--requests", "8", "--heads", "4", "--head-dim", "32", "--kv-budget-mib", "0.12",
            "--max-running", "8", "--prompt-len", "4", "40", "--output-len", "2", "12", "--device", "cpu",
            "--no-progress"]  # fmt: skip
    assert serve_sim.main(args) == 0
    assert serve_sim.main(args + ["--corrupt"]) == 1
    assert serve_sim.main(args + ["--layers", "3"]) == 2  # every 4th layer is full attention: none here
    assert serve_sim.main(args + ["--kv-budget-mib", "0.01"]) == 2


@pytest.mark.gpu
def test_on_cuda_with_speculative_decoding_and_the_host_tier():
    res, summary = run_ok(replace(SMALL, device="cuda", kv_budget_mib=0.4, spec_k=3, host_tier=True))
    assert res.fused_calls > 0 and res.spec_steps > 0 and res.parked > 0, summary
