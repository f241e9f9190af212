"""examples/serve_sim.py, every variant, run in-process at a small size: it must verify every request,
and it must fail when a stored byte is corrupted. The plain run (MHA and DeepSeek-V3's MLA pool,
speculative decoding, CPU parking), --calibrate (a calibration pass with observe_amax on, then the
run with the calibrated scales), --host-tier (retracted requests parked in a host pool and reloaded
layer by layer), --model qwen3.5 (a hybrid model's K/V and per-request states) and --prefix-cache."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from kvassert import load_example
from kvpool import quantize
from kvpool.errors import IntegrityError

serve_sim = load_example("serve_sim")  # puts examples/ on sys.path, where its parts are (support.sim)
from support.sim import hybrid  # noqa: E402
from support.sim import prefix as prefix_sim  # noqa: E402

# Small, with memory pressure: 256 B/token, ~200 slots for requests of up to 104 tokens.
SMALL = serve_sim.SimConfig(
    requests=12, layers=2, heads=2, head_dim=32, page_size=16, kv_budget_mib=0.05, max_running=6,
    chunk_size=48, prompt_len=(4, 80), output_len=(2, 24), arrival_every=0.5, device="cpu", seed=3,
)  # fmt: skip
SMALL_ARGS = [
    "--requests", "12", "--layers", "2", "--heads", "2", "--head-dim", "32", "--kv-budget-mib", "0.05",
    "--max-running", "6", "--chunk-size", "48", "--prompt-len", "4", "80", "--output-len", "2", "24",
    "--device", "cpu", "--seed", "3", "--no-progress",
]  # fmt: skip


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
    assert serve_sim.main(SMALL_ARGS) == 0
    out = capsys.readouterr().out
    assert "served          12/12 requests" in out and "check           OK" in out and out.rstrip().endswith("PASS")
    assert serve_sim.main([*SMALL_ARGS, "--corrupt"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")
    assert serve_sim.main([*SMALL_ARGS, "--kv-budget-mib", "0.01"]) == 2
    assert "kv_budget_mib must hold the longest request" in capsys.readouterr().err


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
    assert serve_sim.main([*SMALL_ARGS, "--model", "deepseek-v3", "--kv-budget-mib", "0.25"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    with pytest.raises(ValueError, match="--model must be one of mha, deepseek-v3, qwen3.5, got 'llama'"):
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


# --- --prefix-cache: chats on a prefix cache, the cached rows checked byte for byte ----------------


# Conversations of 1-3 turns after a 40-token few-shot prompt, 256 B/token, ~240 slots for turns of
# up to 160 tokens: the tree competes with the running requests for pages and gets evicted.
CHATS = replace(
    SMALL, requests=16, prompt_len=(4, 24), output_len=(2, 16), arrival_every=1.0, kv_budget_mib=0.06,
    prefix_cache=True, few_shot_len=40, turns=(1, 3),
)  # fmt: skip
# The hybrid model's states take most of a budget: 1 full-attention layer's K/V, 3 linear layers' states.
HYBRID_CHATS = replace(CHATS, model="qwen3.5", layers=4, kv_budget_mib=0.3)


def run_chats(cfg):
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    assert res.ok and res.served == cfg.requests, summary
    return res, res.prefix, summary


def test_a_token_s_kv_derives_from_its_prefix_not_its_request():
    arrivals = prefix_sim.make_chats(CHATS)
    first = sorted(arrivals.queue + list(arrivals.follow.values()), key=lambda r: r.rid)
    a, b = first[0], next(r for r in first if r.tokens[: CHATS.few_shot_len + 1] != first[0].tokens[: CHATS.few_shot_len + 1])
    n = CHATS.few_shot_len
    kv = lambda r, end: serve_sim.kv_values(r.keys(0, end, torch.device("cpu")), torch.arange(end), 1, 2, 32)
    assert torch.equal(kv(a, n).view(torch.int16), kv(b, n).view(torch.int16))  # the shared few-shot prompt
    assert not torch.equal(kv(a, n + 1)[n], kv(b, n + 1)[n])  # the first token after it differs: so does all after
    assert a.keys(0, 3, torch.device("cpu")).tolist() == prefix_sim.prefix_keys(a.tokens[:3])


def test_a_conversation_s_next_turn_holds_the_last_one_and_arrives_after_its_answer():
    arrivals = prefix_sim.make_chats(CHATS)
    assert len(arrivals.queue) + len(arrivals.follow) == CHATS.requests
    prev_rid, nxt = next(iter(arrivals.follow.items()))
    prev = next(r for r in arrivals.queue if r.rid == prev_rid)
    assert nxt.tokens[: len(prev.tokens)] == prev.tokens and nxt.prompt_len > len(prev.tokens)
    assert all(r.tokens[: CHATS.few_shot_len] == prev.tokens[: CHATS.few_shot_len] for r in arrivals.queue)
    arrivals.finished(prev, 50)
    assert nxt.arrival == 50 + nxt.think and nxt in arrivals.queue and prev_rid not in arrivals.follow
    assert [r.arrival for r in arrivals.queue] == sorted(r.arrival for r in arrivals.queue)


@pytest.mark.parametrize("page_size", [16, 4, 1], ids=["paged16", "paged4", "token"])
def test_chats_hit_the_cache_under_memory_pressure_and_every_cached_row_verifies(page_size):
    """With --validate, check_integrity of tree, allocator, table and running requests before every step."""
    res, stats, summary = run_chats(replace(CHATS, page_size=page_size, validate=True))
    assert stats.matched_tokens > 0 and stats.evict_calls > 0 and stats.evicted_tokens > 0, summary
    assert stats.integrity_checks == res.steps + 1  # every step, and once at the end
    assert res.verified_tokens > res.prefill_tokens + res.decode_tokens  # cached rows were checked too
    assert f"hit rate {100 * stats.hit_rate:.1f}%" in summary and "prefill tokens saved" in summary


def test_without_memory_pressure_the_cache_saves_exactly_what_it_matched():
    res, stats, summary = run_chats(replace(CHATS, kv_budget_mib=1.0))
    assert res.retractions == 0 and stats.evict_calls == 0 and stats.lookups == CHATS.requests, summary
    assert res.prefill_tokens == stats.prompt_tokens - stats.matched_tokens
    assert stats.hit_rate > 0.5, summary  # the few-shot prompt and every earlier turn


def test_slots_the_tree_still_holds_given_back_fail_the_byte_check(monkeypatch):
    """A scheduler that frees a finished request's matched prefix, which the tree keeps: the slots are
    handed out again and overwritten, and the next request matching them reads other K/V."""
    release = prefix_sim.PrefixScheduler.release

    def release_prefix_too(self, r):
        prefix = self.slots_of(r)[: r.cache_protected_len]
        release(self, r)
        self.allocator.free(prefix)

    monkeypatch.setattr(prefix_sim.PrefixScheduler, "release", release_prefix_too)
    res = serve_sim.run(CHATS)
    assert not res.ok and res.mismatched_tokens > 0 and "slots owned but free" in res.integrity_error
    with pytest.raises(IntegrityError, match="slots owned but free in the allocator"):
        serve_sim.run(replace(CHATS, validate=True))  # caught at the next step's check


def test_a_corrupted_cached_byte_fails_every_request_that_reads_it():
    res = serve_sim.run(replace(CHATS, corrupt=True))
    assert not res.ok and res.mismatched_tokens >= 1
    assert "FAILED" in serve_sim.format_summary(res)


@pytest.mark.parametrize(
    "policy, layout, backend",
    [("write_through", "page_first", "kernel"), ("write_back", "layer_first", "direct"),
     ("write_through_selective", "page_first", "direct")],  # fmt: skip
)
def test_host_tier_backs_up_evicted_nodes_and_loads_them_back_byte_exact(policy, layout, backend):
    cfg = replace(CHATS, host_tier=True, host_write_policy=policy, host_layout=layout, host_io_backend=backend)
    res, stats, summary = run_chats(replace(cfg, validate=True))
    assert stats.backed_up_tokens > 0 and stats.loaded_tokens > 0 and res.reloaded_tokens == stats.loaded_tokens
    assert res.reload_mismatches == 0 and "HiRadixCache" in summary and "reload check    OK" in summary
    plain = serve_sim.run(replace(cfg, host_tier=False))
    assert stats.hit_rate > plain.prefix.hit_rate and res.prefill_tokens < plain.prefill_tokens


def test_a_corrupted_host_byte_fails_the_reload_check(monkeypatch):
    load_back = prefix_sim.HiRadixCache.init_load_back

    def corrupt_then_load(self, node, *args, **kwargs):
        host = self.token_to_kv_pool_host
        slot = int(node.host_value[0])
        row = host.k_buffer[0, slot] if host.layout == "layer_first" else host.k_buffer[slot, 0]
        row.view(torch.uint8).view(-1)[0] ^= 0x5A
        return load_back(self, node, *args, **kwargs)

    monkeypatch.setattr(prefix_sim.HiRadixCache, "init_load_back", corrupt_then_load)
    res = serve_sim.run(replace(CHATS, host_tier=True))
    assert not res.ok and res.reload_mismatches > 0
    assert "reload check    FAILED" in serve_sim.format_summary(res)


def test_mla_latent_rows_are_cached_and_checked():
    res, stats, _ = run_chats(replace(CHATS, model="deepseek-v3", kv_budget_mib=0.3, validate=True))
    assert stats.matched_tokens > 0 and stats.evict_calls > 0


@pytest.mark.parametrize("page_size", [16, 1], ids=["track-slots", "token"])
def test_hybrid_matches_fork_checked_state_snapshots(page_size):
    """Pages of 16: requests snapshot their state into track slots at page boundaries; pages of 1:
    the state after a request's last token is cached. Every fork is checked against the recurrence,
    and state snapshots are evicted for room as KV is."""
    res, stats, summary = run_chats(replace(HYBRID_CHATS, page_size=page_size, validate=True))
    assert stats.forks > 0 and stats.matched_tokens > 0 and stats.evicted_states > 0, summary
    assert res.state_checked == res.served + stats.forks and res.state_mismatches == 0
    assert "MambaRadixCache" in summary and "forked into requests' slots (each checked)" in summary


def test_hybrid_a_match_without_its_state_fails_the_state_check(monkeypatch):
    monkeypatch.setattr(prefix_sim.MambaRadixCache, "_fork_into", lambda self, node, req: True)  # no copy
    res = serve_sim.run(HYBRID_CHATS)
    assert not res.ok and res.state_mismatches > 0 and res.mismatched_tokens == 0


def test_prefix_cache_command_line(capsys):
    args = [*SMALL_ARGS, "--prefix-cache", "--few-shot-len", "40", "--turns", "1", "3", "--prompt-len", "4", "24",
            "--output-len", "2", "16", "--kv-budget-mib", "0.06", "--requests", "16"]  # fmt: skip
    assert serve_sim.main(args) == 0
    out = capsys.readouterr().out
    assert "prefix cache    RadixCache(page_size=16, lru): " in out and out.rstrip().endswith("PASS")
    assert serve_sim.main([*args, "--host-tier", "--host-write-policy", "write_back"]) == 0
    assert "HiRadixCache" in capsys.readouterr().out
    for bad, message in (
        (["--cpu-park"], "--prefix-cache runs without --cpu-park"),
        (["--spec-decode", "2"], "--prefix-cache runs without --spec-decode"),
        (["--turns", "3", "1"], "--turns must be a range MIN MAX with 1 <= MIN <= MAX, got 3 1"),
        (["--model", "qwen3.5", "--layers", "4", "--host-tier"], "has no host tier"),
    ):
        assert serve_sim.main([*args, *bad]) == 2
        assert re.search(message, capsys.readouterr().err)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "how", [dict(), dict(host_tier=True), dict(host_tier=True, host_write_policy="write_back", host_io_backend="direct"),
            dict(model="qwen3.5", layers=4, kv_budget_mib=0.3)],  # fmt: skip
    ids=["radix", "hiradix-write-through", "hiradix-write-back-direct", "hybrid"],
)
def test_prefix_cache_on_cuda(how):
    """The fused writes, the host tier's streams and events (backups and layer-by-layer loads in
    flight keep their nodes locked), and the state pool's forks, on a GPU."""
    res, stats, summary = run_chats(replace(CHATS, device="cuda", validate=True, **how))
    assert res.fused_calls > 0 and stats.matched_tokens > 0 and res.leaked_slots == 0, summary
    if how.get("host_tier"):
        assert stats.loaded_tokens > 0 and res.reload_mismatches == 0, summary


# --- --calibrate: the scales the run writes with must be the calibration pass's maxima (kept here
# independently, from the K/V its writes were given) over the format's largest value, the byte check
# must pass with them, and the reported quantisation errors must be what they are on this data ------

# The small run's configuration, calibrated on a short pass: 2 layers (layer 1's K reaches 1024, past
# e4m3's 448; layer 0's V stays below 2**-6).
CALIBRATED = replace(SMALL, calibrate=True, calibrate_steps=12)
CALIBRATED_ARGS = [*SMALL_ARGS, "--calibrate", "--calibrate-steps", "12"]
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
    assert "calibrate needs an FP8 dtype (fp8_e4m3 or fp8_e5m2; other pools store no scale), got 'bf16'" in (
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
