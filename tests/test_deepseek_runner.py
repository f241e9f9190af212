"""examples/deepseek_runner.py at a tiny size: an HF DeepSeek-V3 (multi-head latent attention, MoE)
served on kvpool's MLA pool, allocators and request table must generate what transformers generates.
Skipped without transformers >= 5 (the ``model`` extra)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvassert import load_example

pytest.importorskip("transformers", minversion="5")

deepseek_runner = load_example("deepseek_runner")
runner_common = load_example("runner_common")  # the shared scheduler and checks, imported by deepseek_runner

# 2 layers (a dense one, then an MoE one of 4 experts, top 2, + a shared expert), hidden 64, 4 heads,
# latent rows 32 + 8 rope (YaRN, interleaved); 4 prompts for 3 request rows, so the last one is
# admitted when the first finishes; page size 4, so prompts span several pages and decode crosses page ends.
TINY = runner_common.RunConfig(
    shape=deepseek_runner.SHAPES["tiny"], prompts=4, batch=3, prompt_len=(4, 24), new_tokens=(3, 8), page_size=4,
    seed=0, device="cpu", pool_dtypes=("fp32", "bf16", "fp8_e4m3"),
)  # fmt: skip
TINY_ARGS = [
    "--config", "tiny", "--prompts", "4", "--batch", "3", "--prompt-len", "4", "24", "--new-tokens", "3", "8",
    "--page-size", "4", "--seed", "0", "--device", "cpu",
]  # fmt: skip
# Against plain HF, measured on the CPU (seed 0, either attention form): fp32 pool 1.2e-6 max rel logit
# error; bf16 pool 7.5e-3 and mean KL 6.3e-6; FP8 e4m3 mean KL 2.8e-3 at scale 1.0, 2.2e-3 with
# calibrated scales (the MoE router turns small changes into different experts: with the MoE layer
# made dense the FP8 KL is 1.6e-3). The bounds leave room for other devices.
BF16_LOGIT_RTOL, BF16_KL, FP8_KL = 0.05, 1e-3, 2e-2


@pytest.fixture(scope="module")
def report():
    return deepseek_runner.run(TINY, "absorbed")


def _runs(rep, dtype):
    return [r for r in rep.runs if r.dtype == dtype]


def _check_report(rep, cfg) -> None:
    """What must hold on every device: the fp32 pool reproduces HF exactly, every other pool reproduces
    HF with its cache rounded the same way, the allocators end clean, and every layer of every step
    wrote its latent rows once."""
    summary = runner_common.format_summary(rep)
    (fp32,) = _runs(rep, "fp32")
    assert fp32.vs_hf.identical, summary
    assert fp32.vs_hf.max_rel_logit_err <= runner_common.LOGIT_RTOL, summary
    assert fp32.vs_hf.compared_steps == fp32.vs_hf.tokens_total
    assert fp32.vs_rounded is None
    assert rep.fp32_check is True and rep.ok
    for r in rep.runs:
        if r.dtype != "fp32":
            assert r.vs_rounded is not None and r.vs_rounded.identical, summary
        s = r.result
        assert s.allocators_ok
        assert s.fused_calls + s.reference_calls == (s.prefill_steps + s.decode_steps) * cfg.shape.layers
    for bf16 in _runs(rep, "bf16"):
        assert bf16.vs_hf.max_rel_logit_err < BF16_LOGIT_RTOL and bf16.vs_hf.mean_kl < BF16_KL, summary
    for r in _runs(rep, "fp8_e4m3"):
        assert 0 < r.vs_hf.mean_kl < FP8_KL, summary


def test_tiny_deepseek_generates_what_transformers_generates(report):
    prompts = runner_common.make_prompts(TINY)
    assert len({len(p.tokens) for p in prompts}) == len(prompts)  # different lengths, no padding
    assert len({p.new_tokens for p in prompts}) > 1  # requests finish at different steps
    assert [r.label for r in report.runs] == ["fp32", "bf16", "fp8_e4m3, scale 1.0", "fp8_e4m3, scale calibrated"]
    _check_report(report, TINY)
    first = report.runs[0].result
    assert first.peak_running == TINY.batch
    assert first.prefill_steps >= 2  # the fourth prompt was admitted into a freed row
    assert first.generated_tokens == sum(p.new_tokens for p in prompts)
    if not torch.cuda.is_available():
        assert all(r.result.fused_calls == 0 for r in report.runs)


def test_expanded_attention_generates_the_same(report):
    """HF's own form (rows gathered with get_mla_kv_buffer, expanded by kv_b_proj) passes the same
    checks and generates what the absorbed form generates."""
    rep = deepseek_runner.run(replace(TINY, pool_dtypes=("fp32", "fp8_e4m3"), calibrate=False), "expanded")
    _check_report(rep, TINY)
    for a, b in zip(rep.runs, (report.runs[0], report.runs[2])):
        assert a.label == b.label
        assert [g.tokens for g in a.result.generations] == [g.tokens for g in b.result.generations]


def test_the_pool_rows_are_what_hf_caches():
    """After a prefill, each token's row is HF's cached normalised latent followed by its roped key."""
    model = deepseek_runner.build_model(TINY.shape, torch.float32, "cpu", TINY.seed)
    pool = deepseek_runner.make_pool(TINY, model, torch.float32)
    tokens = runner_common.make_prompts(TINY)[0].tokens
    sched = runner_common.Scheduler(pool, 1, len(tokens) + 1)
    sched.add(runner_common.Request(0, tokens, 2))
    batch = sched.schedule()
    deepseek_runner.DeepseekV3Runner(model, pool).forward(batch)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=True)
    # transformers renamed the output's cache (past_key_values up to 5.17, cache in 5.24)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    for i, layer in enumerate(cache.layers):
        hf = torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1)  # [L, kv_lora_rank + qk_rope_head_dim]
        rows = pool.get_key_buffer(i)[batch.loc, 0]
        if i == 0:  # the same modules on the same inputs
            assert torch.equal(rows, hf)
        torch.testing.assert_close(rows, hf, rtol=1e-5, atol=1e-5)


def test_summary_and_exit_status(capsys):
    assert deepseek_runner.main([*TINY_ARGS, "--dtypes", "fp32", "fp8_e4m3", "--no-calibrate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kvpool deepseek_runner: DeepseekV3ForCausalLM, absorbed MLA attention (2 layers")
    assert "pool fp32\n    vs HF       tokens identical" in out
    assert "pool fp8_e4m3, scale 1.0\n" in out and "vs rounded  tokens identical" in out
    assert "fp32 check  PASS" in out and out.rstrip().endswith("PASS")
    assert deepseek_runner.main([*TINY_ARGS, "--batch", "0"]) == 2
    assert "deepseek_runner: batch must be a positive int, got 0" in capsys.readouterr().err


def test_a_lost_latent_row_fails_the_fp32_check(monkeypatch, capsys):
    """A pool that drops one token's latent row per write: attention reads a stale row, and the run
    says so."""
    make_pool = deepseek_runner.make_pool

    def leaky(cfg, model, dtype):
        pool = make_pool(cfg, model, dtype)
        write = pool.set_mla_kv_buffer

        def drop_last(layer, loc, nope, rope, *args, **kwargs):
            loc = loc.clone()
            loc[-1] = -1  # a padding token: nothing is written
            write(layer, loc, nope, rope, *args, **kwargs)

        pool.set_mla_kv_buffer = drop_last
        return pool

    monkeypatch.setattr(deepseek_runner, "make_pool", leaky)
    assert deepseek_runner.main([*TINY_ARGS, "--dtypes", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "fp32 check  FAILED" in out and out.rstrip().endswith("FAIL")


def test_the_fused_kernel_serves_the_same_tokens_and_logits(monkeypatch):
    """FP8 MLA pool with every write on the fused kernel (Triton's interpreter without a GPU) against
    the reference path: the writes are bit-identical, so the generations are too."""
    cfg = replace(TINY, prompts=3, new_tokens=(2, 4), device="cuda" if torch.cuda.is_available() else "cpu")
    model = deepseek_runner.build_model(cfg.shape, torch.float32, cfg.device, cfg.seed)
    prompts = runner_common.make_prompts(cfg)
    dtype, arch = torch.float8_e4m3fn, deepseek_runner.DeepseekV3()
    monkeypatch.setenv("KVPOOL_FUSED", "never")
    reference = runner_common.serve(model, deepseek_runner.make_pool(cfg, model, dtype), prompts, cfg.batch, arch=arch)
    monkeypatch.setenv("KVPOOL_FUSED", "always")
    fused = runner_common.serve(model, deepseek_runner.make_pool(cfg, model, dtype), prompts, cfg.batch, arch=arch)
    assert reference.fused_calls == 0 and fused.reference_calls == 0
    assert fused.fused_calls == reference.reference_calls > 0
    for a, b in zip(fused.generations, reference.generations):
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
        ({"dense_layers": 3}, r"dense_layers must be in 0..layers = 2, got 3"),
        ({"experts_per_token": 5}, "experts_per_token must be at most routed_experts = 4, got 5"),
        ({"q_lora_rank": 0}, "q_lora_rank must be a positive int, got 0"),
    ],
)
def test_shape_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(deepseek_runner.SHAPES["tiny"], **kwargs)


def _mla_pool(kv_lora_rank: int = 32):
    return deepseek_runner.MLATokenToKVPool(16, 4, torch.float32, kv_lora_rank, 8, 2, "cpu")


def test_runner_rejects_a_pool_of_another_geometry():
    model = deepseek_runner.build_model(TINY.shape, torch.float32, "cpu", TINY.seed)
    geometry = r"\(kv_lora_rank, qk_rope_head_dim, layers\) = \(32, 8, 2\).*got \(16, 8, 2\)"
    with pytest.raises(ValueError, match=geometry):
        deepseek_runner.DeepseekV3Runner(model, _mla_pool(kv_lora_rank=16))
    with pytest.raises(ValueError, match="form must be one of absorbed, expanded, got 'naive'"):
        deepseek_runner.DeepseekV3Runner(model, _mla_pool(), form="naive")


@pytest.mark.gpu
@pytest.mark.parametrize("form", deepseek_runner.ATTENTION_FORMS)
def test_on_cuda_every_mla_write_takes_the_fused_kernel(form):
    cfg = replace(TINY, device="cuda")
    rep = deepseek_runner.run(cfg, form)
    _check_report(rep, cfg)
    for r in rep.runs:
        assert r.result.reference_calls == 0 and r.result.fused_calls > 0, runner_common.format_summary(rep)


def test_the_prefix_cache_serves_latent_rows_and_generates_what_transformers_generates():
    """Prompts that share prefixes on a prefix cache over the MLA pool: matched latent rows are
    attended over, not computed again, and the fp32 pool still reproduces HF."""
    rep = deepseek_runner.run(replace(TINY, prompts=8, prompt_len=(4, 40), pool_dtypes=("fp32",), prefix_cache=True))
    (fp32,) = rep.runs
    assert fp32.result.cached_tokens > 0 and fp32.result.allocators_ok, runner_common.format_summary(rep)
    assert rep.fp32_check is True and rep.ok
