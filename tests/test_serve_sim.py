"""examples/serve_sim.py run in-process at a small size: it must verify every request, and it must fail
when a stored byte is corrupted. The plain run (MHA and DeepSeek-V3's MLA pool, speculative decoding,
CPU parking), --host-tier (retracted requests parked in a host pool and reloaded layer by layer) and
--model qwen3.5 (a hybrid model's K/V and per-request states); --prefix-cache and --calibrate have
their own files (test_serve_sim_prefix_cache.py, test_serve_sim_calibration.py)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch

from kvassert import SMALL_SIM_ARGS, load_example, small_sim_config

serve_sim = load_example("serve_sim")  # puts examples/ on sys.path, where its parts are (support.sim)
from support.progress import Progress  # noqa: E402
from support.sim import hybrid  # noqa: E402

# The small run with memory pressure (kvassert): 256 B/token, ~200 slots.
SMALL = small_sim_config()


@pytest.mark.parametrize("page_size", [16, 4, 1], ids=["paged16", "paged4", "token"])
def test_small_run_serves_and_verifies_everything(page_size):
    res = serve_sim.run(replace(SMALL, page_size=page_size, validate=True))
    assert res.ok, serve_sim.format_summary(res)
    assert res.served == res.verified_requests == 12
    assert res.mismatched_tokens == 0 and res.leaked_slots == 0 and res.integrity_error is None
    assert res.prefill_tokens > 0 and res.decode_tokens > 0
    assert 0 < res.peak_slots <= res.pool_size
    assert res.fused_calls + res.reference_calls == res.forward_steps * SMALL.layers
    if not torch.cuda.is_available():
        assert res.fused_calls == 0 and any("cpu" in reason for reason in res.reasons)


def test_memory_pressure_retracts_and_still_verifies():
    res = serve_sim.run(replace(SMALL, requests=20, arrival_every=0.0, chunk_size=128, max_running=12))
    assert res.retractions > 0, "the small pool should force retractions"
    assert res.ok and res.served == 20


def test_a_corrupted_byte_fails_the_check():
    res = serve_sim.run(replace(SMALL, corrupt=True))
    assert not res.ok
    assert res.mismatched_tokens == 1
    assert res.first_mismatch is not None and res.first_mismatch.which == "V"
    assert res.first_mismatch.layer == SMALL.layers - 1
    assert "FAILED: 1 tokens differ" in serve_sim.format_summary(res)


def test_stopping_early_checks_the_live_requests():
    res = serve_sim.run(replace(SMALL, max_steps=10))
    assert res.steps == 10 and res.served < 12
    assert res.verified_requests > res.served  # the live ones were checked too
    assert res.ok


def test_main_exit_codes_and_summary(capsys):
    assert serve_sim.main(SMALL_SIM_ARGS) == 0
    out = capsys.readouterr().out
    assert "served          12/12 requests" in out and "check           OK" in out and out.rstrip().endswith("PASS")
    assert serve_sim.main([*SMALL_SIM_ARGS, "--corrupt"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")
    assert serve_sim.main([*SMALL_SIM_ARGS, "--kv-budget-mib", "0.01"]) == 2
    assert "--kv-budget-mib must hold the longest request" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_a_cuda_device_without_one_is_a_one_line_error(capsys):
    assert serve_sim.main([*SMALL_SIM_ARGS, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("serve_sim: --device must be a device this torch can use")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "qwen3.5", "--layers", "4", "--calibrate"], "--calibrate runs on the MHA and MLA pools only"),
        (["--prefix-cache", "--calibrate"], "--prefix-cache runs without --calibrate"),
        (["--host-tier", "--cpu-park"], "--host-tier and --cpu-park are two ways"),
        (["--kv-budget-mib", "0.01"], "--kv-budget-mib must hold the longest request"),
        (["--host-tier", "--host-ratio", "0.001"], "--host-ratio 0.001 is too small"),
    ],
)
def test_refused_combinations_are_named_by_their_flags_here_and_in_help(capsys, args, message):
    assert serve_sim.main([*SMALL_SIM_ARGS, *args]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        serve_sim.parse_args(["--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "options a run refuses" in help_text and "--prefix-cache with --spec-decode" in help_text


def test_a_prefix_cache_run_on_the_mla_pool_gets_a_budget_that_holds_its_conversations():
    cfg = serve_sim.parse_args(["--model", "deepseek-v3", "--prefix-cache", "--device", "cpu"])
    pool, geometry = serve_sim.make_pool(cfg)  # the default 4 MiB holds one last turn and no page more
    assert cfg.kv_budget_mib == 9.0 and pool.size >= 2 * cfg.max_context_len
    assert serve_sim.parse_args(["--model", "deepseek-v3", "--prefix-cache", "--kv-budget-mib", "4"]).kv_budget_mib == 4.0
    assert serve_sim.parse_args(["--prefix-cache"]).kv_budget_mib == 4.0  # the MHA pool's default holds it


def test_progress_off_a_terminal_is_a_line_every_few_seconds():
    out = io.StringIO()
    progress = Progress("serve_sim", 10, every_s=0.0, stream=out)
    progress.update(3, "step 7")
    progress.update(10, "step 12")
    progress.close(10, "step 12")
    lines = out.getvalue().splitlines()
    assert [line.split(", ")[:2] for line in lines] == [["serve_sim: 3/10 requests", "step 7"], ["serve_sim: 10/10 requests", "step 12"]]
    quiet = io.StringIO()
    Progress("serve_sim", 10, every_s=60.0, stream=quiet).update(3)
    assert quiet.getvalue() == ""  # not before every_s


def test_kv_values_do_not_depend_on_the_batch():
    rids = torch.tensor([5, 5, 9, 1])
    positions = torch.tensor([0, 7, 3, 100])
    together = serve_sim.kv_values(rids, positions, 2, 3, 16)
    alone = torch.cat([serve_sim.kv_values(rids[i : i + 1], positions[i : i + 1], 2, 3, 16) for i in range(4)])
    assert together.dtype == torch.bfloat16 and together.shape == (4, 2, 3, 16)
    assert torch.equal(together.view(torch.int16), alone.view(torch.int16))
    assert not torch.equal(together[0], together[1])  # positions differ, values differ
    assert not torch.equal(serve_sim.kv_values(rids, positions, 3, 3, 16), together)  # so do layers


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"requests": 0}, "--requests must be a positive int, got 0"),
        ({"prompt_len": (5, 2)}, "--prompt-len must be a range MIN MAX with 1 <= MIN <= MAX, got 5 2"),
        ({"dtype": "int8"}, "--dtype must be one of fp8_e4m3, .*got 'int8'"),
        ({"kv_budget_mib": 0}, "--kv-budget-mib must be > 0, got 0"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(SMALL, **kwargs)


def test_fused_kernel_path_verifies_too(monkeypatch):
    """The same run with every write on the fused Triton kernel (compiled on a GPU, the interpreter
    on CPU CI)."""
    monkeypatch.setenv("KVPOOL_FUSED", "always")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = serve_sim.run(replace(SMALL, requests=6, output_len=(2, 8), device=device))
    assert res.ok, serve_sim.format_summary(res)
    assert res.reference_calls == 0 and res.fused_calls == res.forward_steps * SMALL.layers


# --- --model deepseek-v3: the MLA pool ------------------------------------------------------------

# 1152 B/token (2 layers x 576 FP8 bytes): ~220 slots, as much pressure as SMALL.
SMALL_MLA = replace(SMALL, model="deepseek-v3", kv_budget_mib=0.25)


@pytest.mark.parametrize("page_size", [16, 1], ids=["paged16", "token"])
def test_mla_run_serves_and_verifies_the_latent_rows(page_size):
    res = serve_sim.run(replace(SMALL_MLA, page_size=page_size, validate=True))
    assert res.ok, serve_sim.format_summary(res)
    assert res.served == res.verified_requests == 12 and res.verified_tokens > 0
    assert res.bytes_per_token == 2 * 576
    assert res.fused_calls + res.reference_calls == res.forward_steps * SMALL.layers
    summary = serve_sim.format_summary(res)
    assert "deepseek-v3 MLA latent rows (512 + 64)" in summary and "x 2 layers x latent byte-equal" in summary


def test_mla_a_corrupted_latent_byte_fails_the_check():
    res = serve_sim.run(replace(SMALL_MLA, corrupt=True))
    assert not res.ok and res.mismatched_tokens == 1
    assert res.first_mismatch is not None and res.first_mismatch.which == "latent"
    assert res.first_mismatch.layer == SMALL.layers - 1


def test_mla_main_and_model_choice(capsys):
    assert serve_sim.main([*SMALL_SIM_ARGS, "--model", "deepseek-v3", "--kv-budget-mib", "0.25"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    with pytest.raises(ValueError, match="--model must be one of mha, deepseek-v3, qwen3.5, gemma3, gpt-oss, got 'llama'"):
        replace(SMALL, model="llama")


def test_mla_fused_kernel_path_verifies_too(monkeypatch):
    """Both MLA entry points on the fused Triton kernel (compiled on a GPU, the interpreter on CPU CI)."""
    monkeypatch.setenv("KVPOOL_FUSED", "always")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = serve_sim.run(replace(SMALL_MLA, requests=4, output_len=(2, 6), prompt_len=(4, 40), device=device))
    assert res.ok, serve_sim.format_summary(res)
    assert res.reference_calls == 0 and res.fused_calls == res.forward_steps * SMALL.layers


def test_mla_host_tier_parks_and_reloads_latent_rows():
    """--model deepseek-v3 --host-tier: retracted requests' latent rows go to an MLATokenToKVPoolHost
    and come back byte for byte."""
    res = serve_sim.run(replace(SMALL_MLA, requests=20, arrival_every=0.0, chunk_size=128, max_running=12,
                                host_tier=True, validate=True))  # fmt: skip
    assert res.ok, serve_sim.format_summary(res)
    assert res.retractions > 0 and res.parked > 0 and res.reloaded > 0 and res.reload_mismatches == 0
    assert "reloaded tokens x 2 layers x latent matches" in serve_sim.format_summary(res)


# --- --spec-decode and --cpu-park: the main job exercises the verify write, moves and CPU copies ---


@pytest.mark.parametrize("page_size", [1, 16])
def test_spec_decode_verifies_every_accepted_token(page_size):
    """Drafts written with set_kv_buffer_prefix_valid in reverse slot order, compacted with
    move_kv_cache, rejected slots freed: every accepted token's bytes check out at the end."""
    res = serve_sim.run(replace(SMALL, spec_k=4, page_size=page_size, validate=True))
    assert res.ok, serve_sim.format_summary(res)
    assert res.spec_steps > 0 and 0 < res.accepted_tokens < res.drafted_tokens
    assert res.moved_slots == res.accepted_tokens and res.retractions > 0


def test_spec_decode_check_fails_without_the_compaction(monkeypatch):
    """The move is what puts accepted drafts at their positions' slots: skip it and the check fails."""
    monkeypatch.setattr(serve_sim.MHATokenToKVPool, "move_kv_cache", lambda self, tgt, src: None)
    res = serve_sim.run(replace(SMALL, spec_k=4))
    assert not res.ok and res.mismatched_tokens > 0


def test_spec_decode_on_the_fused_kernel(monkeypatch):
    """Verify writes and moves on the fused kernels (compiled on a GPU, the interpreter on CPU CI)."""
    monkeypatch.setenv("KVPOOL_FUSED", "always")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = serve_sim.run(replace(SMALL, requests=5, output_len=(2, 10), spec_k=3, device=device))
    assert res.ok, serve_sim.format_summary(res)
    assert res.reference_calls == 0 and res.accepted_tokens > 0


def test_cpu_park_reloads_retracted_requests_byte_for_byte():
    res = serve_sim.run(replace(SMALL, cpu_park=True, arrival_every=0.0))
    assert res.ok, serve_sim.format_summary(res)
    assert res.parked > 0 and res.reloaded == res.parked and res.reload_mismatches == 0
    assert res.cpu_bytes > 0


def test_cpu_park_check_catches_a_corrupted_copy(monkeypatch):
    """A byte flipped in the host copy must show up in the reload check."""
    real = serve_sim.MHATokenToKVPool.get_cpu_copy

    def corrupt(self, indices):
        copy = real(self, indices)
        copy.k.view(-1)[0] ^= 0x55
        return copy

    monkeypatch.setattr(serve_sim.MHATokenToKVPool, "get_cpu_copy", corrupt)
    res = serve_sim.run(replace(SMALL, cpu_park=True, arrival_every=0.0))
    assert not res.ok and res.reload_mismatches > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(spec_k=-1), "--spec-decode must be a non-negative int"),
        (dict(spec_k=2, model="deepseek-v3"), "--spec-decode needs the MHA pool"),
        (dict(cpu_park=True, host_tier=True), "choose one"),
    ],
)
def test_spec_and_park_options_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(SMALL, **kwargs)


# --- --host-tier: retracted requests are parked in a host pool and reloaded layer by layer instead
# of recomputed; every reloaded byte is checked, and a corrupted host byte fails the run ------------

# The memory-pressure run: enough pressure to retract.
PRESSURE = replace(SMALL, requests=20, arrival_every=0.0, chunk_size=128, max_running=12)


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


def test_a_corrupted_parked_host_byte_fails_the_reload_check(monkeypatch):
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


def test_host_tier_command_line():
    cfg = serve_sim.parse_args(["--host-tier", "--host-layout", "layer_first", "--host-io-backend", "direct", "--host-ratio", "3"])
    assert cfg.host_tier and cfg.host_layout == "layer_first" and cfg.host_io_backend == "direct" and cfg.host_ratio == 3.0
    with pytest.raises(ValueError, match="--host-layout must be one of"):
        replace(PRESSURE, host_layout="page_head")


# --- --model qwen3.5: a hybrid model's K/V and per-request states under memory pressure
# (retraction, state slots that cap the running requests, speculative commits, parking in the host
# tier or with CPU copies), every state checked byte for byte; a corrupted state byte fails the run --

# Small, with memory pressure: 1 full-attention layer (256 B/token, 160 slots) and 3 linear layers'
# states (state slots for 9 of the 12 request rows).
HYBRID_SMALL = serve_sim.SimConfig(
    requests=20, layers=4, heads=4, head_dim=32, page_size=16, kv_budget_mib=0.12, max_running=12,
    chunk_size=128, prompt_len=(4, 80), output_len=(2, 24), arrival_every=0.0, device="cpu", seed=3,
    model="qwen3.5",
)  # fmt: skip


def run_hybrid_ok(cfg):
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    assert res.ok and res.served == cfg.requests, summary
    assert res.state_checked >= res.served and res.state_mismatches == 0, summary
    return res, summary


@pytest.mark.parametrize("page_size", [16, 1], ids=["paged16", "token"])
def test_pressure_retracts_and_every_state_verifies(page_size):
    res, summary = run_hybrid_ok(replace(HYBRID_SMALL, page_size=page_size, validate=True))
    assert res.retractions > 0, "the small pool should force retractions"
    assert "state check     OK: " in summary and "x 1 layers x K,V" in summary
    assert res.fused_calls + res.reference_calls == res.forward_steps  # one full-attention layer


def test_state_slots_cap_the_running_requests():
    res, _ = run_hybrid_ok(replace(HYBRID_SMALL, kv_budget_mib=4.0))
    assert res.retractions == 0
    assert res.peak_running == int(HYBRID_SMALL.max_running * hybrid.STATE_SHARE) < HYBRID_SMALL.max_running


def test_a_corrupted_state_byte_fails_the_run():
    res = serve_sim.run(replace(HYBRID_SMALL, corrupt=True))
    assert not res.ok and res.state_mismatches == 1 and res.mismatched_tokens == 0
    summary = serve_sim.format_summary(res)
    assert "state check     FAILED: 1 of" in summary and summary.endswith("FAIL")


def test_speculative_commits_keep_the_accepted_states():
    res, summary = run_hybrid_ok(replace(HYBRID_SMALL, kv_budget_mib=0.4, spec_k=3))
    assert res.spec_steps > 0 and 0 < res.accepted_tokens < res.drafted_tokens, summary


@pytest.mark.parametrize(
    "how", [dict(host_tier=True), dict(host_tier=True, host_io_backend="direct", host_layout="layer_first"),
            dict(cpu_park=True)],  # fmt: skip
    ids=["host-kernel", "host-direct", "cpu-park"],
)
def test_parked_states_come_back_with_their_kv(how):
    res, summary = run_hybrid_ok(replace(HYBRID_SMALL, validate=True, **how))
    assert res.parked > 0 and res.reloaded == res.parked and res.reload_mismatches == 0, summary
    assert res.state_checked == res.served + res.reloaded  # each reload is checked too


def test_hybrid_command_line():
    args = ["--model", "qwen3.5", "--requests", "8", "--heads", "4", "--head-dim", "32", "--kv-budget-mib", "0.12",
            "--max-running", "8", "--prompt-len", "4", "40", "--output-len", "2", "12", "--device", "cpu",
            "--no-progress"]  # fmt: skip
    assert serve_sim.main(args) == 0
    assert serve_sim.main(args + ["--corrupt"]) == 1
    assert serve_sim.main(args + ["--layers", "3"]) == 2  # every 4th layer is full attention: none here
    assert serve_sim.main(args + ["--kv-budget-mib", "0.01"]) == 2


@pytest.mark.gpu
def test_on_cuda_with_speculative_decoding_and_the_host_tier():
    res, summary = run_hybrid_ok(replace(HYBRID_SMALL, device="cuda", kv_budget_mib=0.4, spec_k=3, host_tier=True))
    assert res.fused_calls > 0 and res.spec_steps > 0 and res.parked > 0, summary
