"""examples/llama_runner.py at a tiny size: an HF Llama served on kvpool's pool, allocators and request
table must generate what transformers generates. Skipped without transformers (the ``model`` extra)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvassert import load_example

pytest.importorskip("transformers", minversion="5")

from kvpool import MHATokenToKVPool  # noqa: E402

llama_runner = load_example("llama_runner")

# 2 layers, hidden 64, 4 query / 2 KV heads; 4 prompts for 3 request rows, so the last one is admitted
# when the first finishes; page size 4, so prompts span several pages and decode crosses page ends.
TINY = llama_runner.RunConfig(
    shape=llama_runner.SHAPES["tiny"], prompts=4, batch=3, prompt_len=(4, 24), new_tokens=(3, 8), page_size=4,
    seed=0, device="cpu", pool_dtypes=("fp32", "bf16", "fp8_e4m3"),
)  # fmt: skip
TINY_ARGS = [
    "--config", "tiny", "--prompts", "4", "--batch", "3", "--prompt-len", "4", "24", "--new-tokens", "3", "8",
    "--page-size", "4", "--seed", "0", "--device", "cpu",
]  # fmt: skip
# Against plain HF, measured on the CPU (seed 0): bf16 pool 8.9e-3 max rel logit error and 5.6e-6 mean
# KL; FP8 e4m3 mean KL 1.3e-3 at scale 1.0 and with CalibratingPool's scales. The bounds leave room
# for other devices.
BF16_LOGIT_RTOL, BF16_KL, FP8_KL = 0.05, 1e-3, 1e-2


@pytest.fixture(scope="module")
def report():
    return llama_runner.run(TINY)


def _runs(rep, dtype):
    return [r for r in rep.runs if r.dtype == dtype]


def _check_report(rep, steps_per_run: int) -> None:
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
        assert r.result.fused_calls + r.result.reference_calls == steps_per_run * TINY.shape.layers
    (bf16,) = _runs(rep, "bf16")
    assert bf16.vs_hf.max_rel_logit_err < BF16_LOGIT_RTOL and bf16.vs_hf.mean_kl < BF16_KL
    for r in _runs(rep, "fp8_e4m3"):
        assert 0 < r.vs_hf.mean_kl < FP8_KL


def test_tiny_model_generates_what_transformers_generates(report):
    prompts = llama_runner.make_prompts(TINY)
    assert len({len(p.tokens) for p in prompts}) == len(prompts)  # different lengths, no padding
    assert len({p.new_tokens for p in prompts}) > 1  # requests finish at different steps
    first = report.runs[0].result
    _check_report(report, first.prefill_steps + first.decode_steps)
    assert first.peak_running == TINY.batch
    assert first.prefill_steps >= 2  # the fourth prompt was admitted into a freed row
    assert first.generated_tokens == sum(p.new_tokens for p in prompts)
    if not torch.cuda.is_available():
        assert all(r.result.fused_calls == 0 for r in report.runs)


def test_summary_and_exit_status(capsys):
    assert llama_runner.main([*TINY_ARGS, "--dtypes", "fp32", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "pool fp32\n    vs HF       tokens identical" in out
    assert "pool fp8_e4m3, scale 1.0\n" in out and "vs rounded  tokens identical" in out
    assert "fp32 check  PASS" in out and out.rstrip().endswith("PASS")
    assert llama_runner.main([*TINY_ARGS, "--batch", "0"]) == 2
    assert "batch must be a positive int, got 0" in capsys.readouterr().err


def test_a_lost_write_fails_the_fp32_check(monkeypatch, capsys):
    """A pool that drops one token's K/V per write: attention reads a stale row, and the run says so."""
    make_pool = llama_runner.make_pool

    def leaky(cfg, model, dtype):
        pool = make_pool(cfg, model, dtype)
        write = pool.set_kv_buffer

        def drop_last(layer, loc, k, v, *args, **kwargs):
            loc = loc.clone()
            loc[-1] = -1  # a padding token: nothing is written
            write(layer, loc, k, v, *args, **kwargs)

        pool.set_kv_buffer = drop_last
        return pool

    monkeypatch.setattr(llama_runner, "make_pool", leaky)
    assert llama_runner.main([*TINY_ARGS, "--dtypes", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "fp32 check  FAILED" in out and out.rstrip().endswith("FAIL")


class CalibratingPool(MHATokenToKVPool):
    """Stands in for the pool's coming calibration API (``reset_amax``, ``observe_amax``,
    ``calibrated_scales``) so the runner's calibrated FP8 run is exercised before that lands."""

    def reset_amax(self) -> None:
        self.amax = [[0.0, 0.0] for _ in range(self.layer_num)]

    def observe_amax(self, on: bool) -> None:
        self.observing = on

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, layer_id_override=None):
        if getattr(self, "observing", False):
            i = (layer.layer_id if layer_id_override is None else layer_id_override) - self.start_layer
            self.amax[i][0] = max(self.amax[i][0], float(cache_k.abs().max()))
            self.amax[i][1] = max(self.amax[i][1], float(cache_v.abs().max()))
        super().set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override)

    def calibrated_scales(self, margin: float = 1.0, per_head: bool = False):
        fmax = torch.finfo(self.dtype).max
        return [
            tuple(torch.tensor([a * margin / fmax], dtype=torch.float32, device=self.device) for a in layer)
            for layer in self.amax
        ]


def test_calibrated_scales_run_when_the_pool_offers_them(monkeypatch):
    def calibrating(cfg, model, dtype):
        heads, head_dim, layers = llama_runner.kv_geometry(model)
        return CalibratingPool(
            cfg.batch * 64, cfg.page_size, dtype, heads, head_dim, layers, cfg.device
        )  # room for 3 requests of up to 31 tokens

    monkeypatch.setattr(llama_runner, "make_pool", calibrating)
    rep = llama_runner.run(replace(TINY, pool_dtypes=("fp8_e4m3",)))
    assert [r.label for r in rep.runs] == ["fp8_e4m3, scale 1.0", "fp8_e4m3, scale calibrated"]
    calibrated = rep.runs[1]
    assert calibrated.vs_rounded.identical, llama_runner.format_summary(rep)  # the scales reached both sides
    assert 0 < calibrated.vs_hf.mean_kl < FP8_KL
    assert not rep.notes


def test_the_fused_kernel_serves_the_same_tokens_and_logits(monkeypatch):
    """FP8 pool with every write on the fused kernel (Triton's interpreter without a GPU) against the
    reference path: the writes are bit-identical, so the generations are too."""
    cfg = replace(TINY, prompts=3, new_tokens=(2, 4), device="cuda" if torch.cuda.is_available() else "cpu")
    model = llama_runner.build_model(cfg.shape, torch.float32, cfg.device, cfg.seed)
    prompts = llama_runner.make_prompts(cfg)
    dtype = torch.float8_e4m3fn
    monkeypatch.setenv("KVPOOL_FUSED", "never")
    reference = llama_runner.serve(model, llama_runner.make_pool(cfg, model, dtype), prompts, cfg.batch)
    monkeypatch.setenv("KVPOOL_FUSED", "always")
    fused = llama_runner.serve(model, llama_runner.make_pool(cfg, model, dtype), prompts, cfg.batch)
    assert reference.fused_calls == 0 and fused.reference_calls == 0
    assert fused.fused_calls == reference.reference_calls > 0
    for a, b in zip(fused.generations, reference.generations):
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch": 0}, "batch must be a positive int, got 0"),
        ({"prompt_len": (5, 2)}, r"prompt_len must be a range \(lo, hi\) with 1 <= lo <= hi, got \(5, 2\)"),
        ({"pool_dtypes": ("int8",)}, "pool dtype must be one of fp8_e4m3, .*got 'int8'"),
        ({"model_dtype": "fp8_e4m3"}, "model_dtype must be one of fp32, bf16, fp16, got 'fp8_e4m3'"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(TINY, **kwargs)


def test_shape_rejects_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="kv_heads must divide heads = 4, got 3"):
        replace(llama_runner.SHAPES["tiny"], kv_heads=3)


@pytest.mark.gpu
def test_on_cuda_every_write_takes_the_fused_kernel():
    rep = llama_runner.run(replace(TINY, device="cuda"))
    first = rep.runs[0].result
    _check_report(rep, first.prefill_steps + first.decode_steps)
    for r in rep.runs:
        assert r.result.reference_calls == 0 and r.result.fused_calls > 0, llama_runner.format_summary(rep)


# --- --prefix-cache: prompts that share prefixes, each prefilling only what the tree does not hold ---

CACHED = replace(TINY, prompts=8, prompt_len=(4, 40), prefix_cache=True)


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
def cached_model():
    model = llama_runner.build_model(CACHED.shape, torch.float32, "cpu", CACHED.seed)
    prompts = llama_runner.make_prompts(CACHED)
    return model, prompts, llama_runner.hf_reference(model, prompts)


@pytest.mark.parametrize("dtype", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize("chunk_size", [None, 5], ids=["whole", "chunked"])
def test_the_prefix_cache_generates_the_same_tokens(cached_model, dtype, chunk_size):
    """The cache matches each prompt's cached prefix, the runner prefills only the rest and attends
    over the matched rows: the tokens (and logits) are the cache-off run's, and for fp32 HF's."""
    model, prompts, hf = cached_model
    assert sum(p.tokens[:4] == q.tokens[:4] for i, p in enumerate(prompts) for q in prompts[:i]) >= 3
    runs = {}
    for on in (False, True):
        pool = _counting_writes(llama_runner.make_pool(CACHED, model, llama_runner.DTYPES[dtype]))
        runs[on] = llama_runner.serve(model, pool, prompts, CACHED.batch, chunk_size=chunk_size, prefix_cache=on)
        runs[on].written = pool.written
    off, on = runs[False], runs[True]
    assert on.allocators_ok and on.cached_tokens > 0 and on.prompt_tokens == sum(len(p.tokens) for p in prompts)
    assert on.written == off.written - on.cached_tokens  # the matched tokens were not computed again
    same = llama_runner.compare(on.generations, off.generations)
    assert same.identical and same.max_rel_logit_err <= llama_runner.LOGIT_RTOL
    if dtype == "fp32":
        vs_hf = llama_runner.compare(on.generations, hf)
        assert vs_hf.identical and vs_hf.max_rel_logit_err <= llama_runner.LOGIT_RTOL


def test_a_match_the_runner_does_not_attend_over_fails_the_fp32_check(cached_model, monkeypatch):
    """Control: admissions whose matched slots are not written into the request's row (it attends
    over the padding slot instead) part from HF."""
    model, prompts, hf = cached_model
    runner_prefix = load_example("runner_prefix")
    match = runner_prefix.PrefixCaching._match

    def unwritten(self, r, free):
        taken = match(self, r, free)
        if taken is not None and r.kv_len:
            self.table.req_to_token[r.row, : r.kv_len] = 0
        return taken

    monkeypatch.setattr(runner_prefix.PrefixCaching, "_match", unwritten)
    res = llama_runner.serve(model, llama_runner.make_pool(CACHED, model, torch.float32), prompts, CACHED.batch,
                             prefix_cache=True)  # fmt: skip
    assert res.cached_tokens > 0 and not llama_runner.compare(res.generations, hf).identical


def test_prefix_cache_summary(capsys):
    assert llama_runner.main([*TINY_ARGS, "--prompts", "8", "--dtypes", "fp32", "--prefix-cache"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens matched in the prefix cache" in out and "fp32 check  PASS" in out


@pytest.mark.gpu
def test_on_cuda_the_prefix_cache_generates_what_transformers_generates():
    rep = llama_runner.run(replace(CACHED, device="cuda", pool_dtypes=("fp32", "fp8_e4m3")))
    assert rep.fp32_check is True and rep.ok, llama_runner.format_summary(rep)
    for r in rep.runs:
        assert r.result.cached_tokens > 0 and r.result.reference_calls == 0, llama_runner.format_summary(rep)
        if r.vs_rounded is not None:
            assert r.vs_rounded.identical, llama_runner.format_summary(rep)
