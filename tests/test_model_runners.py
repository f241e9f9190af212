"""The Llama and DeepSeek-V3 model runners at a tiny size: examples/llama_runner.py (an HF Llama served
on kvpool's pool) and examples/deepseek_runner.py (an HF DeepSeek-V3, multi-head latent attention and
MoE, on the MLA pool), with the allocators and the request table, and on a prefix cache: each must
generate what transformers generates. Skipped without transformers >= 5 (the ``model`` extra). The
Qwen3.5 runner has its own file (test_qwen35_runner.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvassert import dropping_last_token, fused_and_reference_serve, load_example

pytest.importorskip("transformers", minversion="5")

llama_runner = load_example("llama_runner")  # puts examples/ on sys.path, where the shared code is
deepseek_runner = load_example("deepseek_runner")
from support import runners  # noqa: E402  (the shared scheduler and checks the runners import)
from support.runners import prefix  # noqa: E402  (the scheduler on a prefix cache)


def _runs(rep, dtype):
    return [r for r in rep.runs if r.dtype == dtype]


# ==============================================================================================
# Llama.

# The Llama and DeepSeek-V3 runs: 4 prompts for 3 request rows, so the last one is admitted when the
# first finishes; page size 4, so prompts span several pages and decode crosses page ends. The same
# run as a RunConfig's fields and as the runners' command line.
TINY_RUN = dict(
    prompts=4, batch=3, prompt_len=(4, 24), new_tokens=(3, 8), page_size=4, seed=0, device="cpu",
    pool_dtypes=("fp32", "bf16", "fp8_e4m3"),
)  # fmt: skip
TINY_ARGS = [
    "--config", "tiny", "--prompts", "4", "--batch", "3", "--prompt-len", "4", "24", "--new-tokens", "3", "8",
    "--page-size", "4", "--seed", "0", "--device", "cpu",
]  # fmt: skip

# 2 layers, hidden 64, 4 query / 2 KV heads.
LLAMA_TINY = llama_runner.RunConfig(shape=llama_runner.SHAPES["tiny"], **TINY_RUN)
LLAMA_ARGS = TINY_ARGS
# Against plain HF, measured on the CPU (seed 0): bf16 pool 8.9e-3 max rel logit error and 5.6e-6 mean
# KL; FP8 e4m3 mean KL 1.3e-3 at scale 1.0 and with calibrated scales. The bounds leave room for
# other devices.
LLAMA_BF16_LOGIT_RTOL, LLAMA_BF16_KL, LLAMA_FP8_KL = 0.05, 1e-3, 1e-2


@pytest.fixture(scope="module")
def llama_report():
    return llama_runner.run(LLAMA_TINY)


def _check_llama_report(rep, steps_per_run: int) -> None:
    """What must hold on every device: the fp32 pool reproduces HF exactly, every pool reproduces HF
    with its cache rounded the same way, and the allocators end clean."""
    (fp32,) = _runs(rep, "fp32")
    assert fp32.vs_hf.identical, llama_runner.format_summary(rep)
    assert fp32.vs_hf.max_rel_logit_err <= llama_runner.LOGIT_RTOL
    assert fp32.vs_hf.compared_steps == fp32.vs_hf.tokens_total
    assert fp32.vs_rounded is None
    assert rep.fp32_check is True and rep.ok
    for r in rep.runs:
        if r.dtype != "fp32":
            assert r.vs_rounded is not None and r.vs_rounded.identical, llama_runner.format_summary(rep)
        assert r.result.allocators_ok
        assert r.result.fused_calls + r.result.reference_calls == steps_per_run * LLAMA_TINY.shape.layers
    (bf16,) = _runs(rep, "bf16")
    assert bf16.vs_hf.max_rel_logit_err < LLAMA_BF16_LOGIT_RTOL and bf16.vs_hf.mean_kl < LLAMA_BF16_KL
    for r in _runs(rep, "fp8_e4m3"):
        assert 0 < r.vs_hf.mean_kl < LLAMA_FP8_KL


def test_llama_tiny_model_generates_what_transformers_generates(llama_report):
    prompts = llama_runner.make_prompts(LLAMA_TINY)
    assert len({len(p.tokens) for p in prompts}) == len(prompts)  # different lengths, no padding
    assert len({p.new_tokens for p in prompts}) > 1  # requests finish at different steps
    first = llama_report.runs[0].result
    _check_llama_report(llama_report, first.prefill_steps + first.decode_steps)
    assert first.peak_running == LLAMA_TINY.batch
    assert first.prefill_steps >= 2  # the fourth prompt was admitted into a freed row
    assert first.generated_tokens == sum(p.new_tokens for p in prompts)
    # The FP8 pool also ran with the scales its own calibration gave (calibrated_scales).
    assert [r.label for r in llama_report.runs if r.dtype == "fp8_e4m3"] == ["fp8_e4m3, scale 1.0", "fp8_e4m3, scale calibrated"]
    [calibrated] = [r for r in llama_report.runs if r.label == "fp8_e4m3, scale calibrated"]
    assert calibrated.vs_rounded.identical, llama_runner.format_summary(llama_report)  # the scales reached both sides
    assert 0 < calibrated.vs_hf.mean_kl < LLAMA_FP8_KL
    assert not llama_report.notes
    if not torch.cuda.is_available():
        assert all(r.result.fused_calls == 0 for r in llama_report.runs)


def test_llama_summary_and_exit_status(capsys):
    assert llama_runner.main([*LLAMA_ARGS, "--dtypes", "fp32", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "pool fp32\n    vs HF       tokens identical" in out
    assert "pool fp8_e4m3, scale 1.0\n" in out and "vs rounded  tokens identical" in out
    assert "fp32 check  PASS" in out and out.rstrip().endswith("PASS")
    assert llama_runner.main([*LLAMA_ARGS, "--batch", "0"]) == 2
    assert "batch must be a positive int, got 0" in capsys.readouterr().err


def test_llama_a_lost_write_fails_the_fp32_check(monkeypatch, capsys):
    """A pool that drops one token's K/V per write: attention reads a stale row, and the run says so."""
    monkeypatch.setattr(llama_runner, "make_pool", dropping_last_token(llama_runner, "set_kv_buffer"))
    assert llama_runner.main([*LLAMA_ARGS, "--dtypes", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "fp32 check  FAILED" in out and out.rstrip().endswith("FAIL")


def test_llama_the_fused_kernel_serves_the_same_tokens_and_logits(monkeypatch):
    """FP8 pool with every write on the fused kernel (Triton's interpreter without a GPU) against the
    reference path: the writes are bit-identical, so the generations are too."""
    cfg = replace(LLAMA_TINY, prompts=3, new_tokens=(2, 4), device="cuda" if torch.cuda.is_available() else "cpu")
    model = llama_runner.build_model(cfg.shape, torch.float32, cfg.device, cfg.seed)
    prompts = llama_runner.make_prompts(cfg)
    fused_and_reference_serve(
        monkeypatch, lambda dtype: llama_runner.serve(model, llama_runner.make_pool(cfg, model, dtype), prompts, cfg.batch)
    )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch": 0}, "batch must be a positive int, got 0"),
        ({"prompt_len": (5, 2)}, r"prompt_len must be a range \(lo, hi\) with 1 <= lo <= hi, got \(5, 2\)"),
        ({"pool_dtypes": ("int8",)}, "pool dtype must be one of fp8_e4m3, .*got 'int8'"),
        ({"model_dtype": "fp8_e4m3"}, "model_dtype must be one of fp32, bf16, fp16, got 'fp8_e4m3'"),
    ],
)
def test_llama_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(LLAMA_TINY, **kwargs)


def test_llama_shape_rejects_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="kv_heads must divide heads = 4, got 3"):
        replace(llama_runner.SHAPES["tiny"], kv_heads=3)


@pytest.mark.gpu
def test_llama_on_cuda_every_write_takes_the_fused_kernel():
    rep = llama_runner.run(replace(LLAMA_TINY, device="cuda"))
    first = rep.runs[0].result
    _check_llama_report(rep, first.prefill_steps + first.decode_steps)
    for r in rep.runs:
        assert r.result.reference_calls == 0 and r.result.fused_calls > 0, llama_runner.format_summary(rep)


# --- --prefix-cache: prompts that share prefixes, each prefilling only what the tree does not hold ---

LLAMA_CACHED = replace(LLAMA_TINY, prompts=8, prompt_len=(4, 40), prefix_cache=True)


def _counting_writes(pool):
    """``pool`` whose layer-0 writes count their tokens into ``pool.written``."""
    write = pool.set_kv_buffer
    pool.written = 0

    def counted(layer, loc, *args, **kwargs):
        if layer.layer_id == pool.start_layer:
            pool.written += loc.numel()
        write(layer, loc, *args, **kwargs)

    pool.set_kv_buffer = counted
    return pool


@pytest.fixture(scope="module")
def llama_cached_model():
    model = llama_runner.build_model(LLAMA_CACHED.shape, torch.float32, "cpu", LLAMA_CACHED.seed)
    prompts = llama_runner.make_prompts(LLAMA_CACHED)
    return model, prompts, llama_runner.hf_reference(model, prompts)


@pytest.mark.parametrize("dtype", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole", "chunked"])
def test_llama_the_prefix_cache_generates_the_same_tokens(llama_cached_model, dtype, chunk_size):
    """The cache matches each prompt's cached prefix, the runner prefills only the rest and attends
    over the matched rows: the tokens (and logits) are the cache-off run's, and for fp32 HF's."""
    model, prompts, hf = llama_cached_model
    assert sum(p.tokens[:4] == q.tokens[:4] for i, p in enumerate(prompts) for q in prompts[:i]) >= 3
    runs = {}
    for on in (False, True):
        pool = _counting_writes(llama_runner.make_pool(LLAMA_CACHED, model, llama_runner.DTYPES[dtype]))
        runs[on] = llama_runner.serve(model, pool, prompts, LLAMA_CACHED.batch, chunk_size=chunk_size, prefix_cache=on)
        runs[on].written = pool.written
    off, on = runs[False], runs[True]
    assert on.allocators_ok and on.cached_tokens > 0 and on.prompt_tokens == sum(len(p.tokens) for p in prompts)
    assert on.written == off.written - on.cached_tokens  # the matched tokens were not computed again
    same = llama_runner.compare(on.generations, off.generations)
    assert same.identical and same.max_rel_logit_err <= llama_runner.LOGIT_RTOL
    if dtype == "fp32":
        vs_hf = llama_runner.compare(on.generations, hf)
        assert vs_hf.identical and vs_hf.max_rel_logit_err <= llama_runner.LOGIT_RTOL


def test_llama_a_match_the_runner_does_not_write_into_its_row_is_refused_by_the_cache(llama_cached_model, monkeypatch):
    """Control: admissions whose matched slots are not written into the request's row (it would
    attend over the padding slot instead): the cache refuses the row's slots at the next insert,
    naming the slot, before the wrong K/V can be read."""
    model, prompts, hf = llama_cached_model
    match = prefix.PrefixCaching._match

    def unwritten(self, r, free):
        taken = match(self, r, free)
        if taken is not None and r.kv_len:
            self.table.req_to_token[r.row, : r.kv_len] = 0
        return taken

    monkeypatch.setattr(prefix.PrefixCaching, "_match", unwritten)
    with pytest.raises(ValueError, match=r"value must hold slots handed out by the allocator, got slot 0 "):
        llama_runner.serve(model, llama_runner.make_pool(LLAMA_CACHED, model, torch.float32), prompts, LLAMA_CACHED.batch,
                           prefix_cache=True)  # fmt: skip


def test_llama_prefix_cache_summary(capsys):
    assert llama_runner.main([*LLAMA_ARGS, "--prompts", "8", "--dtypes", "fp32", "--prefix-cache"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens matched in the prefix cache" in out and "fp32 check  PASS" in out


@pytest.mark.gpu
def test_llama_on_cuda_the_prefix_cache_generates_what_transformers_generates():
    rep = llama_runner.run(replace(LLAMA_CACHED, device="cuda", pool_dtypes=("fp32", "fp8_e4m3")))
    assert rep.fp32_check is True and rep.ok, llama_runner.format_summary(rep)
    for r in rep.runs:
        assert r.result.cached_tokens > 0 and r.result.reference_calls == 0, llama_runner.format_summary(rep)
        if r.vs_rounded is not None:
            assert r.vs_rounded.identical, llama_runner.format_summary(rep)


# ==============================================================================================
# DeepSeek-V3: the MLA pool.

# 2 layers (a dense one, then an MoE one of 4 experts, top 2, + a shared expert), hidden 64, 4 heads,
# latent rows 32 + 8 rope (YaRN, interleaved); the Llama run's settings (TINY_RUN).
DEEPSEEK_TINY = runners.RunConfig(shape=deepseek_runner.SHAPES["tiny"], **TINY_RUN)
DEEPSEEK_ARGS = TINY_ARGS
# Against plain HF, measured on the CPU (seed 0, either attention form): fp32 pool 1.2e-6 max rel logit
# error; bf16 pool 7.5e-3 and mean KL 6.3e-6; FP8 e4m3 mean KL 2.8e-3 at scale 1.0, 2.2e-3 with
# calibrated scales (the MoE router turns small changes into different experts: with the MoE layer
# made dense the FP8 KL is 1.6e-3). The bounds leave room for other devices.
DEEPSEEK_BF16_LOGIT_RTOL, DEEPSEEK_BF16_KL, DEEPSEEK_FP8_KL = 0.05, 1e-3, 2e-2


@pytest.fixture(scope="module")
def deepseek_report():
    return deepseek_runner.run(DEEPSEEK_TINY, "absorbed")


def _check_deepseek_report(rep, cfg) -> None:
    """What must hold on every device: the fp32 pool reproduces HF exactly, every other pool reproduces
    HF with its cache rounded the same way, the allocators end clean, and every layer of every step
    wrote its latent rows once."""
    summary = runners.format_summary(rep)
    (fp32,) = _runs(rep, "fp32")
    assert fp32.vs_hf.identical, summary
    assert fp32.vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL, summary
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
        assert bf16.vs_hf.max_rel_logit_err < DEEPSEEK_BF16_LOGIT_RTOL and bf16.vs_hf.mean_kl < DEEPSEEK_BF16_KL, summary
    for r in _runs(rep, "fp8_e4m3"):
        assert 0 < r.vs_hf.mean_kl < DEEPSEEK_FP8_KL, summary


def test_tiny_deepseek_generates_what_transformers_generates(deepseek_report):
    prompts = runners.make_prompts(DEEPSEEK_TINY)
    assert len({len(p.tokens) for p in prompts}) == len(prompts)  # different lengths, no padding
    assert len({p.new_tokens for p in prompts}) > 1  # requests finish at different steps
    assert [r.label for r in deepseek_report.runs] == ["fp32", "bf16", "fp8_e4m3, scale 1.0", "fp8_e4m3, scale calibrated"]
    _check_deepseek_report(deepseek_report, DEEPSEEK_TINY)
    first = deepseek_report.runs[0].result
    assert first.peak_running == DEEPSEEK_TINY.batch
    assert first.prefill_steps >= 2  # the fourth prompt was admitted into a freed row
    assert first.generated_tokens == sum(p.new_tokens for p in prompts)
    if not torch.cuda.is_available():
        assert all(r.result.fused_calls == 0 for r in deepseek_report.runs)


def test_deepseek_expanded_attention_generates_the_same(deepseek_report):
    """HF's own form (rows gathered with get_mla_kv_buffer, expanded by kv_b_proj) passes the same
    checks and generates what the absorbed form generates."""
    rep = deepseek_runner.run(replace(DEEPSEEK_TINY, pool_dtypes=("fp32", "fp8_e4m3"), calibrate=False), "expanded")
    _check_deepseek_report(rep, DEEPSEEK_TINY)
    for a, b in zip(rep.runs, (deepseek_report.runs[0], deepseek_report.runs[2])):
        assert a.label == b.label
        assert [g.tokens for g in a.result.generations] == [g.tokens for g in b.result.generations]


def test_deepseek_the_pool_rows_are_what_hf_caches():
    """After a prefill, each token's row is HF's cached normalised latent followed by its roped key."""
    model = deepseek_runner.build_model(DEEPSEEK_TINY.shape, torch.float32, "cpu", DEEPSEEK_TINY.seed)
    pool = deepseek_runner.make_pool(DEEPSEEK_TINY, model, torch.float32)
    tokens = runners.make_prompts(DEEPSEEK_TINY)[0].tokens
    sched = runners.Scheduler(pool, 1, len(tokens) + 1)
    sched.add(runners.Request(0, tokens, 2))
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


def test_deepseek_summary_and_exit_status(capsys):
    assert deepseek_runner.main([*DEEPSEEK_ARGS, "--dtypes", "fp32", "fp8_e4m3", "--no-calibrate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kvpool deepseek_runner: DeepseekV3ForCausalLM, absorbed MLA attention (2 layers")
    assert "pool fp32\n    vs HF       tokens identical" in out
    assert "pool fp8_e4m3, scale 1.0\n" in out and "vs rounded  tokens identical" in out
    assert "fp32 check  PASS" in out and out.rstrip().endswith("PASS")
    assert deepseek_runner.main([*DEEPSEEK_ARGS, "--batch", "0"]) == 2
    assert "deepseek_runner: batch must be a positive int, got 0" in capsys.readouterr().err


def test_deepseek_a_lost_latent_row_fails_the_fp32_check(monkeypatch, capsys):
    """A pool that drops one token's latent row per write: attention reads a stale row, and the run
    says so."""
    monkeypatch.setattr(deepseek_runner, "make_pool", dropping_last_token(deepseek_runner, "set_mla_kv_buffer"))
    assert deepseek_runner.main([*DEEPSEEK_ARGS, "--dtypes", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "fp32 check  FAILED" in out and out.rstrip().endswith("FAIL")


def test_deepseek_the_fused_kernel_serves_the_same_tokens_and_logits(monkeypatch):
    """FP8 MLA pool with every write on the fused kernel (Triton's interpreter without a GPU) against
    the reference path: the writes are bit-identical, so the generations are too."""
    cfg = replace(DEEPSEEK_TINY, prompts=3, new_tokens=(2, 4), device="cuda" if torch.cuda.is_available() else "cpu")
    model = deepseek_runner.build_model(cfg.shape, torch.float32, cfg.device, cfg.seed)
    prompts = runners.make_prompts(cfg)
    arch = deepseek_runner.DeepseekV3()
    fused_and_reference_serve(
        monkeypatch,
        lambda dtype: runners.serve(model, deepseek_runner.make_pool(cfg, model, dtype), prompts, cfg.batch, arch=arch),
    )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
        ({"dense_layers": 3}, r"dense_layers must be in 0..layers = 2, got 3"),
        ({"experts_per_token": 5}, "experts_per_token must be at most routed_experts = 4, got 5"),
        ({"q_lora_rank": 0}, "q_lora_rank must be a positive int, got 0"),
    ],
)
def test_deepseek_shape_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(deepseek_runner.SHAPES["tiny"], **kwargs)


def _mla_pool(kv_lora_rank: int = 32):
    return deepseek_runner.MLATokenToKVPool(16, 4, torch.float32, kv_lora_rank, 8, 2, "cpu")


def test_deepseek_runner_rejects_a_pool_of_another_geometry():
    model = deepseek_runner.build_model(DEEPSEEK_TINY.shape, torch.float32, "cpu", DEEPSEEK_TINY.seed)
    geometry = r"\(kv_lora_rank, qk_rope_head_dim, layers\) = \(32, 8, 2\).*got \(16, 8, 2\)"
    with pytest.raises(ValueError, match=geometry):
        deepseek_runner.DeepseekV3Runner(model, _mla_pool(kv_lora_rank=16))
    with pytest.raises(ValueError, match="form must be one of absorbed, expanded, got 'naive'"):
        deepseek_runner.DeepseekV3Runner(model, _mla_pool(), form="naive")


@pytest.mark.gpu
@pytest.mark.parametrize("form", deepseek_runner.ATTENTION_FORMS)
def test_deepseek_on_cuda_every_mla_write_takes_the_fused_kernel(form):
    cfg = replace(DEEPSEEK_TINY, device="cuda")
    rep = deepseek_runner.run(cfg, form)
    _check_deepseek_report(rep, cfg)
    for r in rep.runs:
        assert r.result.reference_calls == 0 and r.result.fused_calls > 0, runners.format_summary(rep)


def test_deepseek_the_prefix_cache_serves_latent_rows_and_generates_what_transformers_generates():
    """Prompts that share prefixes on a prefix cache over the MLA pool: matched latent rows are
    attended over, not computed again, and the fp32 pool still reproduces HF."""
    rep = deepseek_runner.run(replace(DEEPSEEK_TINY, prompts=8, prompt_len=(4, 40), pool_dtypes=("fp32",), prefix_cache=True))
    (fp32,) = rep.runs
    assert fp32.result.cached_tokens > 0 and fp32.result.allocators_ok, runners.format_summary(rep)
    assert rep.fp32_check is True and rep.ok
