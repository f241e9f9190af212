"""The model runners on the pools that keep scales beside their codes, at a tiny size on the CPU: Llama
on SGLang's FP4 (``fp4_e2m1``), NVFP4 and per-token-head FP8 (and on the fnuz FP8 dtypes), DeepSeek-V3 on the FP4 MLA pool, Qwen3.5
on FP4, NVFP4 and per-token-head FP8 as its hybrid pool's full-attention part. Each run's tokens are identical to HF generating through a
cache that rounds K/V by the format's rule (written apart from kvpool, in
examples/support/runners/formats.py, and checked here bit for bit against what the pools read back),
the agreement with plain HF and the K/V round-trip errors are reported, the fused writes (Triton's
interpreter) serve what the reference path serves, and the formats a model's pools cannot hold are
refused before anything runs. Skipped without transformers >= 5 (the ``model`` extra)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvassert import load_example, needs_interpreter

pytest.importorskip("transformers", minversion="5")

llama_runner = load_example("llama_runner")  # puts examples/ on sys.path, where the shared code is
deepseek_runner = load_example("deepseek_runner")
qwen35_runner = load_example("qwen35_runner")
from support import runners  # noqa: E402
from support.runners.formats import POOL_FORMATS, round_trip_errors  # noqa: E402

FORMATS = tuple(POOL_FORMATS)
TINY = dict(prompts=4, batch=3, prompt_len=(4, 24), new_tokens=(3, 8), page_size=4, seed=0, device="cpu",
            calibrate=False)  # fmt: skip
FNUZ = ("fp8_e4m3fnuz", "fp8_e5m2fnuz")  # plain pool dtypes: per-tensor scales, the MI300 formats
LLAMA = llama_runner.RunConfig(shape=llama_runner.SHAPES["tiny"], pool_dtypes=("fp32", "fp8_e4m3", *FORMATS, *FNUZ), **TINY)
# DeepSeek-V3's tiny shape with a rotary part of 16 (the FP4 pool's blocks): latent rows 32 + 16.
DEEPSEEK = deepseek_runner.RunConfig(
    shape=replace(deepseek_runner.SHAPES["tiny"], qk_rope_head_dim=16), pool_dtypes=("fp32", "fp4_e2m1"), **TINY
)
QWEN = replace(
    runners.RunConfig(shape=qwen35_runner.SHAPES["tiny"], device="cpu", **qwen35_runner.RUN_DEFAULTS),
    pool_dtypes=("fp32", "fp4_e2m1", "nvfp4", "fp8_e4m3_per_token_head", "fp8_e5m2_per_token_head"), calibrate=False,
)  # fmt: skip


def _check(rep, formats):
    """fp32 pool exact; each format's tokens identical to the rounded reference, its logits within
    float noise of it; the round-trip note names every format."""
    assert rep.ok and rep.fp32_check, runners.format_summary(rep)
    runs = {r.dtype: r for r in rep.runs}
    for name in formats:
        r = runs[name]
        assert r.vs_rounded is not None and r.vs_rounded.identical, runners.format_summary(rep)
        assert r.vs_rounded.max_rel_logit_err < 1e-4
        assert r.vs_hf.tokens_total == r.vs_rounded.tokens_total > 0
        assert r.result.allocators_ok
    (note,) = [n for n in rep.notes if n.startswith("K/V round-trip error")]
    assert all(f" {name} " in note for name in ("bf16", "fp8_e4m3 per tensor", *formats) if name not in FNUZ)


@pytest.fixture(scope="module")
def llama_report():
    return llama_runner.run(LLAMA)


def test_llama_on_every_format_generates_what_the_rounded_reference_generates(llama_report):
    _check(llama_report, FORMATS + FNUZ)
    runs = {r.dtype: r for r in llama_report.runs}
    assert runs["fp4_e2m1"].scales == "exponent per 16" and runs["fp4_e2m1"].label == "fp4_e2m1, scale exponent per 16"
    # FP4 parts from plain HF more than FP8 does (its K/V error is ~4x per-tensor FP8's).
    assert runs["fp4_e2m1"].vs_hf.mean_kl > runs["fp8_e4m3"].vs_hf.mean_kl


def test_llama_summary_reports_each_format_and_the_round_trip_errors(llama_report):
    text = runners.format_summary(llama_report)
    for name in FORMATS:
        assert f"pool {name}, scale {POOL_FORMATS[name].scale_label}" in text
    assert "note        K/V round-trip error (relative RMS, K / V" in text and text.rstrip().endswith("PASS")


def test_deepseek_on_the_fp4_mla_pool_generates_what_the_rounded_reference_generates():
    for form in deepseek_runner.ATTENTION_FORMS:
        rep = runners.run(DEEPSEEK, deepseek_runner.DeepseekV3(form))
        _check(rep, ("fp4_e2m1",))
        assert "latent / rotary key" in rep.notes[-1]
        pool = deepseek_runner.make_pool(DEEPSEEK, deepseek_runner.build_model(DEEPSEEK.shape, torch.float32, "cpu", 0),
                                         POOL_FORMATS["fp4_e2m1"])  # fmt: skip
        assert type(pool).__name__ == "MLATokenToKVPoolFP4" and pool.out_dtype == torch.float32


def test_qwen35_on_fp4_nvfp4_and_per_token_head_parts_generates_what_the_rounded_reference_generates():
    rep = qwen35_runner.run(QWEN, qwen35_runner.QwenOptions(spec_width=None, spec_dtypes=()))
    _check(rep, ("fp4_e2m1", "nvfp4", "fp8_e4m3_per_token_head", "fp8_e5m2_per_token_head"))


@needs_interpreter
@pytest.mark.parametrize("name", FORMATS)
def test_the_llama_fused_writes_serve_what_the_reference_path_serves(monkeypatch, name):
    """Every write on the fused kernel (Triton's interpreter on the CPU) against every write on the
    reference path: bit-identical writes, so the same tokens and logits."""
    cfg = replace(LLAMA, prompts=2, new_tokens=(2, 3), prompt_len=(4, 9))
    model = llama_runner.build_model(cfg.shape, torch.float32, cfg.device, cfg.seed)
    prompts = llama_runner.make_prompts(cfg)
    served = {}
    for mode in ("never", "always"):
        monkeypatch.setenv("KVPOOL_FUSED", mode)
        served[mode] = llama_runner.serve(model, llama_runner.make_pool(cfg, model, POOL_FORMATS[name]), prompts, cfg.batch)
    reference, fused = served["never"], served["always"]
    assert reference.fused_calls == 0 and fused.reference_calls == 0 and fused.fused_calls == reference.reference_calls > 0
    for a, b in zip(fused.generations, reference.generations, strict=True):
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)


@needs_interpreter
def test_the_deepseek_fused_fp4_writes_serve_what_the_reference_path_serves(monkeypatch):
    cfg = replace(DEEPSEEK, prompts=2, new_tokens=(2, 3), prompt_len=(4, 9))
    model = deepseek_runner.build_model(cfg.shape, torch.float32, cfg.device, cfg.seed)
    prompts = runners.make_prompts(cfg)
    arch = deepseek_runner.DeepseekV3()
    served = {}
    for mode in ("never", "always"):
        monkeypatch.setenv("KVPOOL_FUSED", mode)
        pool = deepseek_runner.make_pool(cfg, model, POOL_FORMATS["fp4_e2m1"])
        served[mode] = runners.serve(model, pool, prompts, cfg.batch, arch=arch)
    reference, fused = served["never"], served["always"]
    assert reference.fused_calls == 0 and fused.reference_calls == 0 and fused.fused_calls == reference.reference_calls > 0
    for a, b in zip(fused.generations, reference.generations, strict=True):
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)


def _special_rows() -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(40, 3, 32) * torch.logspace(-4, 4, 40)[:, None, None]
    x[3, 1, 5], x[4, 0, 0], x[5], x[6, 0, :16], x[7, 0, 3], x[8, 1] = float("inf"), float("nan"), 0.0, -1e-30, -0.0, -0.0
    x[9, 2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # e2m1's ties at scale 1
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_the_reference_rounding_is_what_each_pool_reads_back_bit_for_bit(name, dtype):
    fmt = POOL_FORMATS[name]
    x = _special_rows().to(dtype)
    pool = fmt.mha_pool(48, 1, 3, 32, 1, "cpu", dtype)
    pool.set_kv_buffer(None, torch.arange(1, 41), x, x, layer_id_override=0)
    got, want = pool.get_key_buffer(0)[1:41], fmt.round(x)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    same = (got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} elements differ, first at {(~same).nonzero()[0].tolist()}"


def test_round_trip_errors_order_the_formats_on_gaussian_rows():
    """On rows with one outlier token, per-token-head FP8 beats per-tensor FP8, and FP4 is the
    coarsest; bf16 is ~2**-9."""
    torch.manual_seed(2)
    k = torch.randn(1, 2, 64, 32)
    k[0, 0, 7] *= 1000.0  # one token far larger than the rest
    err = round_trip_errors([(k, k.clone())], ("fp4_e2m1", "nvfp4", "fp8_e4m3_per_token_head"))
    assert err["bf16"][0] < 3e-3
    assert err["fp8_e4m3_per_token_head"][0] < err["fp8_e4m3 per tensor"][0] < err["fp4_e2m1"][0]
    assert err["nvfp4"][0] < err["fp4_e2m1"][0]  # e4m3 block scales are finer than powers of two


@pytest.mark.parametrize(
    "runner, argv, message",
    [
        (deepseek_runner, ["--config", "tiny", "--dtypes", "nvfp4"], "MLATokenToKVPoolFP4 stores exponent scales only"),
        (deepseek_runner, ["--config", "tiny", "--dtypes", "fp8_e4m3_per_token_head"], "no per-token-head MLA pool"),
        (load_example("gemma3_runner"), ["--dtypes", "fp4_e2m1"], "gemma3_runner: no pool of this format"),
        (llama_runner, ["--config", "tiny", "--dtypes", "fp4_e2m1", "--prefix-cache", "--host-tier"],
         "runs without --host-tier"),
    ],
    ids=["deepseek-nvfp4", "deepseek-token-head", "gemma3-fp4", "llama-host-tier"],
)  # fmt: skip
def test_a_format_a_model_has_no_pool_for_is_refused_before_the_model_is_built(runner, argv, message, capsys):
    assert runner.main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert message in err and "building the model" not in err, err
