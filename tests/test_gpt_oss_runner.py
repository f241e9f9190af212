"""examples/gpt_oss_runner.py at a tiny size: a gpt-oss model (sliding-window and full layers
alternating, attention sinks on every layer, a mixture of experts) with its K/V in an ``SWAKVPool``
whose SWA slots the scheduler gives back as tokens leave the window: it must generate what
transformers generates, hold no more than the live windows in the SWA part and give every slot back.
Skipped without a transformers >= 5 that has gpt-oss."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvassert import (
    assert_every_write_fused_on_cuda,
    assert_speculative_runs,
    assert_speculative_writes_fused_on_cuda,
    assert_swa_prefix_cache_serves,
    dropping_last_token,
    fused_and_reference_serve,
    load_example,
    serve_checking_swa_give_back,
)

pytest.importorskip("transformers", minversion="5")

try:
    from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402
except ImportError:  # a transformers 5 without gpt-oss: its runner's tests are skipped
    GptOssConfig = GptOssForCausalLM = None
HAS_GPT_OSS = GptOssForCausalLM is not None
pytestmark = pytest.mark.skipif(not HAS_GPT_OSS, reason="needs a transformers with gpt-oss (gpt_oss)")

if HAS_GPT_OSS:
    gpt_oss_runner = load_example("gpt_oss_runner")  # puts examples/ on sys.path, where the shared code is
    from support import runners  # noqa: E402  (the shared scheduler and checks)
    from support.runners import sliding, verify  # noqa: E402  (the sliding-window frame, the verify step)

    # 4 layers (2 sliding with a window of 8 tokens, 2 full), 4 prompts of 14-28 tokens asking 6-14
    # more for 2 request rows, prefill chunks of 12 tokens, pages of 4 (the window spans two pages).
    TINY = runners.RunConfig(
        shape=gpt_oss_runner.SHAPES["tiny"], device="cpu", prompts=4, batch=2, prompt_len=(14, 28),
        new_tokens=(6, 14), page_size=4, chunk_size=12,
    )  # fmt: skip
    FP32 = replace(TINY, pool_dtypes=("fp32",))
    ARGS = ["--prompts", "3", "--batch", "2", "--prompt-len", "14", "24", "--new-tokens", "4", "10", "--device", "cpu"]
    # On the prefix cache: 8 prompts of 20-40 tokens sharing prefixes, a window of 6, chunks of 8: the
    # tree outgrows both parts, so allocations evict from it and its SWA eviction makes tombstones.
    PREFIX = replace(
        TINY, shape=replace(TINY.shape, sliding_window=6), prompts=8, prompt_len=(20, 40), chunk_size=8,
        prefix_cache=True, pool_dtypes=("fp32",),
    )  # fmt: skip
    PREFIX_ARGS = [
        "--sliding-window", "6", "--prompts", "8", "--batch", "2", "--prompt-len", "20", "40", "--new-tokens", "6", "14",
        "--chunk-size", "8", "--device", "cpu",
    ]  # fmt: skip
# Against plain HF, measured on the CPU (seed 0): bf16 pool 9.7e-3 max rel logit error and 1.6e-5 mean
# KL; FP8 e4m3 mean KL 9.9e-3 at scale 1.0, 1.4e-2 calibrated (routing flips to other experts where
# the rounding crosses a near-tie). The bounds leave room for other devices.
BF16_LOGIT_RTOL, BF16_KL, FP8_KL = 0.05, 1e-3, 5e-2


@pytest.fixture(scope="module")
def report():
    return gpt_oss_runner.run(TINY)


def test_tiny_gpt_oss_generates_what_transformers_generates(report):
    prompts = runners.make_prompts(TINY)
    window = TINY.shape.sliding_window
    assert min(len(p.tokens) for p in prompts) > window  # the window decides what sliding layers see
    assert max(len(p.tokens) for p in prompts) > 2 * TINY.chunk_size  # some prompt takes three chunks
    assert max(p.new_tokens for p in prompts) > window  # decode slides the window past the prompt
    summary = gpt_oss_runner.format_summary(report)
    (fp32,) = [r for r in report.runs if r.dtype == "fp32"]
    assert fp32.vs_hf.identical, summary
    assert fp32.vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL, summary
    assert fp32.vs_hf.compared_steps == fp32.vs_hf.tokens_total == sum(p.new_tokens for p in prompts)
    assert report.fp32_check is True and report.ok, summary
    assert [r.label for r in report.runs] == ["fp32", "bf16", "fp8_e4m3, scale 1.0", "fp8_e4m3, scale calibrated"]
    for r in report.runs:
        s = r.result
        if r.dtype != "fp32":
            assert r.vs_rounded is not None and r.vs_rounded.identical, summary
            assert r.vs_hf.mean_kl > 0, summary  # the rounding reached the logits
        if r.dtype == "bf16":
            assert r.vs_hf.max_rel_logit_err < BF16_LOGIT_RTOL and r.vs_hf.mean_kl < BF16_KL, summary
        if r.dtype == "fp8_e4m3":
            assert r.vs_hf.mean_kl < FP8_KL, summary
        assert s.allocators_ok and s.leaked_slots == 0 and s.integrity_error is None, summary
        assert s.fused_calls + s.reference_calls == (s.prefill_steps + s.decode_steps) * TINY.shape.layers
        assert s.peak_running == TINY.batch and s.prefill_steps > len(prompts)  # chunked prefill
        m = s.memory
        assert 0 < m["swa_peak"] <= m["swa_peak_bound"] and m["swa_peak"] < m["full_peak"], summary
        assert m["size_swa"] < m["size"] and m["pool_bytes"] < m["all_layers_bytes"]


def test_gpt_oss_a_bf16_model_on_a_bf16_pool_generates_what_transformers_generates():
    """A pool of the model's own dtype stores what HF's cache holds, so the runner's sink attention,
    in bf16 as HF's eager attention computes it, generates HF's tokens (measured: identical logits)."""
    cfg = replace(FP32, model_dtype="bf16", pool_dtypes=("bf16",), prompts=3)
    rep = gpt_oss_runner.run(cfg)
    (bf16,) = rep.runs
    assert bf16.vs_rounded is None and rep.ok, gpt_oss_runner.format_summary(rep)
    assert bf16.vs_hf.identical and bf16.vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL, gpt_oss_runner.format_summary(rep)


def _fp32_run_with(monkeypatch, name, replacement, module=None):
    monkeypatch.setattr(module or gpt_oss_runner, name, replacement)
    rep = gpt_oss_runner.run(FP32)
    (fp32,) = rep.runs
    return rep, fp32


@pytest.mark.parametrize("variant", ["sinks zeroed", "sinks left out of the denominator"])
def test_gpt_oss_attention_without_its_sinks_parts_from_transformers(monkeypatch, variant):
    """The sinks are part of HF's softmax on every layer: a runner that zeroes them, or leaves their
    column out, is off by far more than the fp32 tolerance and fails the check."""
    attend = gpt_oss_runner.sink_attention

    def no_sinks(q, keys, values, batch, mask, scale, sinks):
        return attend(q, keys, values, batch, mask, scale, torch.zeros_like(sinks) if variant == "sinks zeroed" else None)

    rep, fp32 = _fp32_run_with(monkeypatch, "sink_attention", no_sinks)
    assert rep.fp32_check is False and not rep.ok and not fp32.vs_hf.identical
    assert fp32.vs_hf.max_rel_logit_err > 100 * runners.LOGIT_RTOL, gpt_oss_runner.format_summary(rep)


def test_gpt_oss_the_sinks_change_what_transformers_generates():
    """The oracle's side: HF's own model with its sinks zeroed generates other tokens than with them,
    so the identity above is one a model without sinks could not reach."""
    with runners.cpu_threads(FP32):
        model = gpt_oss_runner.GPT_OSS.build_model(FP32)
        prompts = runners.make_prompts(FP32)
        with_sinks = runners.hf_reference(model, prompts)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.zero_()
        without = runners.hf_reference(model, prompts)
    assert not runners.compare(without, with_sinks).identical


def test_gpt_oss_the_window_changes_what_transformers_generates(report):
    """The same weights with a window longer than every request generate other tokens: the runs above
    reproduce a model whose sliding layers really slide."""
    cfg = replace(TINY, shape=replace(TINY.shape, sliding_window=4096))
    with runners.cpu_threads(cfg):
        wide = runners.hf_reference(gpt_oss_runner.GPT_OSS.build_model(cfg), runners.make_prompts(cfg))
    (fp32,) = [r for r in report.runs if r.dtype == "fp32"]
    assert not runners.compare(fp32.result.generations, wide).identical


def test_gpt_oss_a_window_one_token_short_fails_the_fp32_check(monkeypatch):
    """The window rule is transformers' to the token: sliding layers that see one key fewer part from HF."""
    keys = sliding.window_keys
    rep, fp32 = _fp32_run_with(monkeypatch, "window_keys", lambda batch, kv, w, groups: keys(batch, kv, w - 1, groups), sliding)
    assert rep.fp32_check is False and not fp32.vs_hf.identical


def test_gpt_oss_a_window_one_token_long_reads_a_slot_given_back(monkeypatch):
    """A sliding layer that would see one key more than transformers' window reaches a token whose SWA
    slot was given back, and the runner refuses to read it."""
    keys = sliding.window_keys
    with pytest.raises(RuntimeError, match="a key inside a local layer's window has no SWA slot"):
        _fp32_run_with(monkeypatch, "window_keys", lambda batch, kv, w, groups: keys(batch, kv, w + 1, groups), sliding)


def test_gpt_oss_swa_slots_are_given_back_while_requests_run():
    """Step by step: the full part holds every token of the running requests, the SWA part only the
    pages of their live windows (at most a window and a page each), the mapping keeps every token in a
    window, the allocator's integrity check passes; at the end every slot of both parts is back."""
    serve_checking_swa_give_back(gpt_oss_runner.GPT_OSS, TINY)


def test_gpt_oss_the_pool_rows_are_what_hf_caches():
    """After one prefill of one prompt, each full layer's rows at the request's slots are HF's cached
    keys and values, and each sliding layer's SWA rows at the translated slots of the last window - 1
    tokens are what HF's sliding cache keeps."""
    cfg = replace(TINY, chunk_size=None)
    arch = gpt_oss_runner.GPT_OSS
    model = arch.build_model(cfg)
    pools = arch.make_pool(cfg, model, torch.float32)
    tokens = runners.make_prompts(cfg)[0].tokens
    sched = arch.scheduler(pools, 1, len(tokens) + 1, None)
    sched.add(runners.Request(0, tokens, 2))
    batch = sched.schedule()
    with runners.cpu_threads(cfg), torch.no_grad():
        sched.advance(batch, arch.runner(model, pools, None).forward(batch), keep_logits=False)
        out = model(torch.tensor([tokens]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    full = sched.table.req_to_token[0, : len(tokens)].to(torch.int64)
    w = cfg.shape.sliding_window
    swa = pools.kv.translate_loc_from_full_to_swa(full[-(w - 1) :]).to(torch.int64)
    assert bool((swa > 0).all())
    for i, kind in enumerate(model.config.layer_types):
        k_buf, v_buf = pools.kv.get_kv_buffer(i)
        hf_k, hf_v = cache.layers[i].keys[0].transpose(0, 1), cache.layers[i].values[0].transpose(0, 1)  # [T, H, D]
        rows = full if kind == "full_attention" else swa
        assert hf_k.shape[0] == rows.shape[0]  # HF's sliding cache keeps window - 1 tokens
        # Deeper layers' inputs went through attention computed on batched rows and by HF's eager
        # attention: float32 rounding apart; a wrong or stale row is off by O(1).
        torch.testing.assert_close(k_buf[rows], hf_k, rtol=runners.LOGIT_RTOL, atol=1e-5)
        torch.testing.assert_close(v_buf[rows], hf_v, rtol=runners.LOGIT_RTOL, atol=1e-5)


def test_gpt_oss_summary_help_and_exit_status(capsys):
    assert gpt_oss_runner.main([*ARGS, "--dtypes", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "SWATokenToKVPoolAllocator(page_size=4)" in out and "window      8 tokens" in out
    assert "pool fp32\n    vs HF       tokens identical" in out and "memory      SWA part at most" in out
    assert "fp32 check  PASS" in out and out.rstrip().endswith("PASS")
    assert "speculative pool fp32, verify blocks of 4" in out and "spec check  PASS" in out  # on by default
    for bad, message in (
        (["--spec-width", "1"], "spec_width must be an int >= 2 (the last token and a draft) or None, got 1"),
        (["--page-size", "1"], "page_size must be at least 2"),
        (["--sliding-window", "1"], "sliding_window must be an int >= 2, got 1"),
        (["--top-k", "5"], "top_k must be at most experts = 4, got 5"),
        (["--json", "x.json", "--dtypes", "bf16"], "--json describes an fp32 model's fp32 pool"),
    ):
        assert gpt_oss_runner.main([*ARGS, *bad]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpt_oss_runner.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "kvpool's sliding-window pool" in text and "--sliding-window SLIDING_WINDOW" in text
    assert "q - sliding_window < k <= q" in text and "the sink's column dropped" in text
    assert "Exit status: 0 when the checks pass, 1 otherwise, 2 on bad arguments" in text


def test_gpt_oss_a_lost_write_fails_the_fp32_check(monkeypatch, capsys):
    """A pool that drops one token's K/V per write: attention reads a stale row, and the run says so."""
    monkeypatch.setattr(gpt_oss_runner, "make_pool", dropping_last_token(gpt_oss_runner, "set_kv_buffer", lambda m: m.kv))
    assert gpt_oss_runner.main([*ARGS, "--dtypes", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "fp32 check  FAILED" in out and out.rstrip().endswith("FAIL")


def test_gpt_oss_json_rebuilds_with_transformers_alone(tmp_path, capsys):
    path = tmp_path / "gpt_oss.json"
    assert gpt_oss_runner.main([*ARGS, "--dtypes", "fp32", "--json", str(path)]) == 0
    capsys.readouterr()
    out = json.loads(path.read_text())
    assert set(out) == {"model_type", "config", "seed", "prompts", "fp32_tokens", "spec_tokens"}
    assert out["spec_tokens"] == out["fp32_tokens"]  # the speculative run (on by default) generated the same
    assert out["model_type"] == "gpt_oss" and out["config"]["sliding_window"] == 8
    torch.manual_seed(out["seed"])
    model = GptOssForCausalLM(GptOssConfig(**out["config"])).eval()
    with torch.no_grad():
        for prompt, tokens in zip(out["prompts"], out["fp32_tokens"]):
            ids = torch.tensor([prompt])
            res = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=len(tokens), min_new_tokens=len(tokens))  # fmt: skip
            assert res[0, len(prompt) :].tolist() == tokens


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sliding_window": 1}, "sliding_window must be an int >= 2, got 1"),
        ({"layers": 1}, "layers must be at least 2"),
        ({"kv_heads": 3}, "kv_heads must divide heads = 4, got 3"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"top_k": 5}, "top_k must be at most experts = 4, got 5"),
    ],
)
def test_gpt_oss_shape_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gpt_oss_runner.GptOssShape(**kwargs)


def test_gpt_oss_runner_rejects_pools_of_another_geometry():
    cfg = TINY
    model = gpt_oss_runner.GPT_OSS.build_model(cfg)
    pools = gpt_oss_runner.make_pool(cfg, model, torch.float32)
    other = gpt_oss_runner.SWAPools(pools.kv, pools.window + 1, pools.sizing, pools.all_layers_bytes)
    with pytest.raises(ValueError, match=r"pools must have \(KV heads, head_dim, SWA layers, full layers, window\)"):
        gpt_oss_runner.GptOssRunner(model, other)


def test_gpt_oss_the_fused_kernel_serves_the_same_tokens_and_logits(monkeypatch):
    """FP8 pool with every write on the fused kernel (Triton's interpreter without a GPU; a sliding
    layer's write at the slots the mapping translates to) against the reference path: the writes are
    bit-identical, so the generations are too."""
    cfg = replace(TINY, prompts=2, batch=2, prompt_len=(10, 12), new_tokens=(3, 4), chunk_size=None,
                  device="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    arch = gpt_oss_runner.GPT_OSS
    model = arch.build_model(cfg)
    prompts = runners.make_prompts(cfg)
    reference, fused = fused_and_reference_serve(
        monkeypatch, lambda dtype: runners.serve(model, arch.make_pool(cfg, model, dtype), prompts, cfg.batch, arch=arch)
    )  # fmt: skip
    assert fused.allocators_ok and reference.allocators_ok


@pytest.mark.gpu
def test_gpt_oss_on_cuda_every_write_takes_the_fused_kernel():
    assert_every_write_fused_on_cuda(gpt_oss_runner, TINY)


# --- speculative decoding ----------------------------------------------------------------------------


def test_gpt_oss_speculative_verify_generates_what_plain_decoding_and_transformers_generate():
    """Verify blocks of 4: the drafts' K/V go into both parts with the verify write (a sliding
    layer's at the translated SWA slots), the rejected slots go back, and the greedy tokens are the
    plain run's and transformers', with its logits."""
    rep = gpt_oss_runner.run(FP32, gpt_oss_runner.SlidingOptions(spec_width=4))
    summary = gpt_oss_runner.format_summary(rep)
    assert [s.dtype for s in rep.spec_runs] == ["fp32"]
    assert_speculative_runs(rep, summary, FP32.shape.layers, FP32.prompts)


def test_gpt_oss_speculative_verify_at_page_64_gives_swa_pages_back():
    """Pages of 64 tokens, a window of 8 and prompts longer than a page: the speculative run gives
    back each whole page of SWA slots once it left the window while the full part keeps every token
    (checked step by step), and still generates what transformers generates."""
    cfg = replace(FP32, prompts=3, prompt_len=(66, 80), new_tokens=(10, 16), page_size=64, chunk_size=None)
    rep = gpt_oss_runner.run(cfg, gpt_oss_runner.SlidingOptions(spec_width=4))
    assert_speculative_runs(rep, gpt_oss_runner.format_summary(rep), cfg.shape.layers, cfg.prompts, every_length=False)
    runner = serve_checking_swa_give_back(gpt_oss_runner.GptOss(4), cfg)
    assert runner.accepted_tokens > 0 and 0 in runner.accept_lengths  # drafts accepted, and drafts rejected


def test_gpt_oss_rejected_drafts_that_keep_their_swa_slots_are_caught(monkeypatch):
    """A verify step that gives back only the full part of its rejected slots: the SWA part leaks
    and the allocators' check reports it."""
    advance_verify = verify.VerifyScheduling.advance_verify

    def full_part_only(self, batch, tokens, logits):
        self.allocator.free = self.allocator.full_attn_allocator.free  # this step's frees skip the SWA part
        try:
            advance_verify(self, batch, tokens, logits)
        finally:
            del self.allocator.free

    monkeypatch.setattr(verify.VerifyScheduling, "advance_verify", full_part_only)
    rep = gpt_oss_runner.run(replace(FP32, prompts=2), gpt_oss_runner.SlidingOptions(spec_width=4))
    (spec,) = rep.spec_runs
    assert not spec.result.allocators_ok and not rep.ok
    assert "allocators  FAILED" in gpt_oss_runner.format_summary(rep)


@pytest.mark.gpu
def test_gpt_oss_on_cuda_speculative_verify_writes_take_the_fused_kernel():
    """On a GPU every write of the speculative runs (prefill, and the verify write into both parts) is
    fused, and the speculative tokens are the plain runs' on fp32 and FP8 pools."""
    assert_speculative_writes_fused_on_cuda(gpt_oss_runner, TINY)


def test_gpt_oss_on_the_prefix_cache_requests_hit_and_tombstones_appear(tmp_path):
    """Shared prompts are matched, SWA eviction makes tombstones, each part holds exactly the tree's
    and the running requests' slots after every step, and the tokens are transformers' and the run's
    without a cache (with the speculative run's too)."""
    assert_swa_prefix_cache_serves(gpt_oss_runner, gpt_oss_runner.GPT_OSS, PREFIX, PREFIX_ARGS, tmp_path / "prefix.json")
