"""examples/serve_sim.py on the pools that keep scales beside their codes (--dtype fp4_e2m1, with
--model deepseek-v3 too; --dtype nvfp4; --kv-scales per-token-head) and on the fnuz FP8 dtypes, run
in-process at a small size under memory pressure: every request's codes and scales verify, a
flipped byte fails the check, the pool is as large as the sizing says, the summary reports tokens
per GiB, and the combinations the run cannot check are refused naming the flags."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvassert import SMALL_SIM_ARGS, load_example, small_sim_config

serve_sim = load_example("serve_sim")  # puts examples/ on sys.path, where its parts are (support.sim)
from kvpool import KVGeometry  # noqa: E402

SMALL = small_sim_config()

#: (id, config changes, bytes per token): budgets that give ~180-230 slots for requests of up to 104 tokens.
FORMATS = [
    ("fp4", dict(dtype="fp4_e2m1", kv_budget_mib=0.025), 2 * 2 * 64 * 9 // 16),
    ("nvfp4", dict(dtype="nvfp4", kv_budget_mib=0.025), 2 * 2 * 64 * 9 // 16),
    ("fp4-mla", dict(dtype="fp4_e2m1", model="deepseek-v3", kv_budget_mib=0.14), 2 * 576 * 9 // 16),
    ("token-head", dict(kv_scales="per-token-head"), 2 * 2 * (64 + 8)),
    ("token-head-e5m2", dict(kv_scales="per-token-head", dtype="fp8_e5m2"), 2 * 2 * (64 + 8)),
    ("e4m3fnuz", dict(dtype="fp8_e4m3fnuz"), 2 * 2 * 64),
    ("e5m2fnuz", dict(dtype="fp8_e5m2fnuz"), 2 * 2 * 64),
]


@pytest.mark.parametrize("changes, bytes_per_token", [f[1:] for f in FORMATS], ids=[f[0] for f in FORMATS])
def test_every_request_verifies_under_memory_pressure(changes, bytes_per_token):
    cfg = replace(SMALL, requests=16, arrival_every=0.0, validate=True, **changes)
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    assert res.ok, summary
    assert res.served == res.verified_requests == 16 and res.retractions > 0
    assert res.mismatched_tokens == 0 and res.leaked_slots == 0 and res.integrity_error is None
    assert res.bytes_per_token == bytes_per_token
    geometry = serve_sim.make_pool(cfg)[1]
    assert res.pool_size == geometry.max_pool_size(int(cfg.kv_budget_mib * 2**20), cfg.page_size)
    assert f"{2**30 // bytes_per_token:,} tokens/GiB" in summary


@pytest.mark.parametrize("changes", [f[1] for f in FORMATS[:4]], ids=[f[0] for f in FORMATS[:4]])
def test_a_corrupted_code_byte_fails_the_check(changes):
    res = serve_sim.run(replace(SMALL, corrupt=True, **changes))
    assert not res.ok and res.mismatched_tokens == 1
    m = res.first_mismatch
    assert m is not None and m.layer == SMALL.layers - 1
    assert m.which == ("latent" if changes.get("model") == "deepseek-v3" else "V")


def test_the_pool_of_each_format_is_the_sizings():
    pool, geometry = serve_sim.make_pool(replace(SMALL, dtype="nvfp4", kv_budget_mib=0.025))
    assert type(pool).__name__ == "MHATokenToKVPoolFP4" and pool.fp4_format == "nvfp4"
    assert geometry == KVGeometry(2, 32, 2, "nvfp4")
    # The checkpoint's per-layer scales are the global scales (their powers of two differ by layer).
    assert len(set(pool.global_scale_values)) == 2
    pool, _ = serve_sim.make_pool(replace(SMALL, kv_scales="per-token-head"))
    assert type(pool).__name__ == "MHATokenToKVPoolFP8PerTokenHead"
    pool, _ = serve_sim.make_pool(replace(SMALL, dtype="fp4_e2m1", model="deepseek-v3", kv_budget_mib=0.14))
    assert type(pool).__name__ == "MLATokenToKVPoolFP4"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "nvfp4", "--model", "qwen3.5", "--layers", "4"], "--dtype nvfp4 runs with --model mha .*HybridLinearKVPool"),
        (["--dtype", "fp4_e2m1", "--model", "gpt-oss"], "runs with --model mha or deepseek-v3"),
        (["--dtype", "nvfp4", "--model", "deepseek-v3"], "MLATokenToKVPoolFP4 stores exponent scales only"),
        (["--kv-scales", "per-token-head", "--dtype", "bf16"], "--kv-scales per-token-head needs --dtype fp8_e4m3 or"),
        (["--kv-scales", "per-token-head", "--dtype", "fp8_e4m3fnuz"], "needs --dtype fp8_e4m3 or fp8_e5m2"),
        (["--kv-scales", "per-token-head", "--model", "qwen3.5", "--layers", "4"], "per-token-head rows in the MHA pool"),
        (["--dtype", "fp4_e2m1", "--host-tier"], "--dtype fp4_e2m1 runs without --host-tier"),
        (["--dtype", "fp4_e2m1", "--cpu-park"], "runs without --cpu-park"),
        (["--kv-scales", "per-token-head", "--spec-decode", "2"], "per-token-head runs without --spec-decode"),
        (["--dtype", "nvfp4", "--prefix-cache"], "runs without --prefix-cache"),
        (["--dtype", "fp4_e2m1", "--head-dim", "40"], "--head-dim that is a multiple of 16"),
    ],
    ids=["nvfp4-hybrid", "fp4-swa", "nvfp4-mla", "token-head-bf16", "token-head-fnuz", "token-head-hybrid",
         "host-tier", "cpu-park", "spec-decode", "prefix-cache", "head-dim"],
)  # fmt: skip
def test_a_combination_the_run_cannot_check_is_refused(argv, message, capsys):
    assert serve_sim.main([*SMALL_SIM_ARGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("serve_sim: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_main_runs_fp4_and_reports_tokens_per_gib(capsys):
    assert serve_sim.main([*SMALL_SIM_ARGS, "--dtype", "fp4_e2m1"]) == 0
    out = capsys.readouterr().out
    assert "FP4 fp4_mx_block16 (fp4_e2m1) pool" in out and "144 B/token, 7,456,540 tokens/GiB" in out
    assert "byte-equal to the reference quantizer, codes and scales" in out and out.rstrip().endswith("PASS")
