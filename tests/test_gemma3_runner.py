"""examples/gemma3_runner.py at a tiny size: a Gemma 3 text model (five sliding-window layers to one
global) with its K/V in an ``SWAKVPool`` whose SWA slots the scheduler gives back as tokens leave the
window: it must generate what transformers generates, hold no more than the live windows in the SWA
part and give every slot back. Skipped without a transformers >= 5 that has Gemma 3."""

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
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402
except ImportError:  # a transformers 5 without Gemma 3: its runner's tests are skipped
    Gemma3ForCausalLM = Gemma3TextConfig = None
HAS_GEMMA3 = Gemma3ForCausalLM is not None
pytestmark = pytest.mark.skipif(not HAS_GEMMA3, reason="needs a transformers with Gemma 3 (gemma3)")

if HAS_GEMMA3:
    gemma3_runner = load_example("gemma3_runner")  # puts examples/ on sys.path, where the shared code is
    from support import runners  # noqa: E402  (the shared scheduler and checks)
    from support.runners import sliding  # noqa: E402  (the sliding-window frame both runners share)

    # 6 layers (5 local with a window of 10 tokens, 1 global), 6 prompts of 20-40 tokens asking 6-20
    # more for 3 request rows, prefill chunks of 16 tokens, pages of 4: the runner's defaults.
    TINY = runners.RunConfig(shape=gemma3_runner.SHAPES["tiny"], device="cpu", **gemma3_runner.RUN_DEFAULTS)
    # A shorter run for the command-line tests: 3 prompts for 2 rows.
    ARGS = [
        "--prompts", "3", "--batch", "2", "--prompt-len", "14", "30", "--new-tokens", "4", "12", "--device", "cpu",
    ]  # fmt: skip
    # On the prefix cache: 8 prompts of 30-60 tokens sharing prefixes, a window of 6, chunks of 8: the
    # tree outgrows both parts, so allocations evict from it and its SWA eviction makes tombstones.
    PREFIX_ARGS = ["--sliding-window", "6", "--prompts", "8", "--prompt-len", "30", "60", "--chunk-size", "8", "--device", "cpu"]
    PREFIX = replace(
        TINY, shape=replace(TINY.shape, sliding_window=6), prompts=8, prompt_len=(30, 60), chunk_size=8,
        prefix_cache=True, pool_dtypes=("fp32",),
    )  # fmt: skip
# Against plain HF, measured on the CPU (seed 0): bf16 pool 3.9e-3 max rel logit error and 8e-6 mean
# KL; FP8 e4m3 mean KL 1.9e-3 at scale 1.0, 1.8e-3 calibrated. The bounds leave room for other devices.
BF16_LOGIT_RTOL, BF16_KL, FP8_KL = 0.05, 1e-3, 2e-2


@pytest.fixture(scope="module")
def report():
    return gemma3_runner.run(TINY)


def test_tiny_gemma3_generates_what_transformers_generates(report):
    prompts = runners.make_prompts(TINY)
    window = TINY.shape.sliding_window
    assert min(len(p.tokens) for p in prompts) > window  # the window decides what local layers see
    assert max(len(p.tokens) for p in prompts) > 2 * TINY.chunk_size  # some prompt takes three chunks
    assert max(p.new_tokens for p in prompts) > window  # decode slides the window past the prompt
    assert len({p.new_tokens for p in prompts}) > 1  # requests finish at different steps
    summary = gemma3_runner.format_summary(report)
    (fp32,) = [r for r in report.runs if r.dtype == "fp32"]
    assert fp32.vs_hf.identical, summary
    assert fp32.vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL, summary
    assert fp32.vs_hf.compared_steps == fp32.vs_hf.tokens_total
    assert report.fp32_check is True and report.ok, summary
    assert [r.label for r in report.runs][:3] == ["fp32", "bf16", "fp8_e4m3, scale 1.0"]
    for r in report.runs:
        s = r.result
        if r.dtype != "fp32":
            assert r.vs_rounded is not None and r.vs_rounded.identical, summary
        assert s.allocators_ok, summary
        assert s.fused_calls + s.reference_calls == (s.prefill_steps + s.decode_steps) * TINY.shape.layers
        assert s.generated_tokens == sum(p.new_tokens for p in prompts)
        assert s.peak_running == TINY.batch
        assert s.prefill_steps > len(prompts)  # chunked: more prefill steps than prompts
        m = s.memory
        assert 0 < m["swa_peak"] <= m["swa_peak_bound"] and m["swa_peak"] < m["full_peak"], summary
        assert m["size_swa"] < m["size"] and m["pool_bytes"] < m["all_layers_bytes"]
    for r in report.runs:
        if r.dtype == "bf16":
            assert r.vs_hf.max_rel_logit_err < BF16_LOGIT_RTOL and r.vs_hf.mean_kl < BF16_KL, summary
        if r.dtype == "fp8_e4m3":
            assert 0 < r.vs_hf.mean_kl < FP8_KL, summary


def test_gemma3_the_window_changes_what_transformers_generates(report):
    """The same weights with a window longer than every request generate other tokens: the runs above
    reproduce a model whose local layers really slide."""
    cfg = replace(TINY, shape=replace(TINY.shape, sliding_window=4096))
    with runners.cpu_threads(cfg):
        model = gemma3_runner.GEMMA3.build_model(cfg)
        wide = runners.hf_reference(model, runners.make_prompts(cfg))
    (fp32,) = [r for r in report.runs if r.dtype == "fp32"]
    assert not runners.compare(fp32.result.generations, wide).identical


def test_gemma3_swa_slots_are_given_back_while_requests_run():
    """Step by step: the full part holds every token of the running requests, the SWA part only the
    pages of their live windows (at most a window and a page each), the mapping keeps every token in a
    window, the allocator's integrity check passes; at the end every slot of both parts is back."""
    serve_checking_swa_give_back(gemma3_runner.GEMMA3, TINY)


def test_gemma3_the_pool_rows_are_what_hf_caches():
    """After one prefill of one prompt, the global layer's full-part rows at the request's slots are
    HF's cached keys and values, and each local layer's SWA-part rows at the translated slots of the
    last window - 1 tokens are what HF's sliding cache keeps."""
    cfg = replace(TINY, chunk_size=None)
    arch = gemma3_runner.GEMMA3
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
        # Deeper layers' inputs went through attention computed two ways (ragged SDPA, HF's eager):
        # measured at most 4e-5 relative apart in float32; a wrong or stale row is off by O(1).
        torch.testing.assert_close(k_buf[rows], hf_k, rtol=runners.LOGIT_RTOL, atol=1e-5)
        torch.testing.assert_close(v_buf[rows], hf_v, rtol=runners.LOGIT_RTOL, atol=1e-5)


def test_gemma3_summary_help_and_exit_status(capsys):
    assert gemma3_runner.main([*ARGS, "--dtypes", "fp32", "fp8_e4m3", "--no-calibrate"]) == 0
    out = capsys.readouterr().out
    assert "SWATokenToKVPoolAllocator(page_size=4)" in out and "window      10 tokens" in out
    assert "pool fp32\n    vs HF       tokens identical" in out
    assert "vs rounded  tokens identical" in out and "memory      SWA part at most" in out
    assert "fp32 check  PASS" in out and out.rstrip().endswith("PASS")
    assert "speculative pool fp32, verify blocks of 4" in out and "spec check  PASS" in out  # on by default
    for bad, message in (
        (["--spec-width", "1"], "spec_width must be an int >= 2 (the last token and a draft) or None, got 1"),
        (["--json", "x.json", "--spec-dtypes", "bf16"], "--json with a speculative run describes its fp32 pool"),
        (["--page-size", "1"], "page_size must be at least 2"),
        (["--sliding-window", "1"], "sliding_window must be an int >= 2, got 1"),
        (["--json", "x.json", "--dtypes", "bf16"], "--json describes an fp32 model's fp32 pool"),
    ):
        assert gemma3_runner.main([*ARGS, *bad]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gemma3_runner.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "kvpool's sliding-window pool" in text and "--sliding-window SLIDING_WINDOW" in text
    assert "q - sliding_window < k <= q" in text and "2 on bad arguments (page size 1 is refused" in text


def test_gemma3_a_lost_write_fails_the_fp32_check(monkeypatch, capsys):
    """A pool that drops one token's K/V per write: attention reads a stale row, and the run says so."""
    monkeypatch.setattr(gemma3_runner, "make_pool", dropping_last_token(gemma3_runner, "set_kv_buffer", lambda m: m.kv))
    assert gemma3_runner.main([*ARGS, "--dtypes", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "fp32 check  FAILED" in out and out.rstrip().endswith("FAIL")


def test_gemma3_a_window_one_token_short_fails_the_fp32_check(monkeypatch, capsys):
    """The window rule is transformers' to the token: local layers that see one key fewer part from HF."""
    keys = sliding.window_keys
    monkeypatch.setattr(sliding, "window_keys", lambda batch, kv, window, groups: keys(batch, kv, window - 1, groups))
    assert gemma3_runner.main([*ARGS, "--dtypes", "fp32"]) == 1
    assert "fp32 check  FAILED" in capsys.readouterr().out


def test_gemma3_a_window_one_token_long_reads_a_slot_given_back(monkeypatch):
    """A local layer that would see one key more than transformers' window reaches a token whose SWA
    slot was given back, and the runner refuses to read it."""
    keys = sliding.window_keys
    monkeypatch.setattr(sliding, "window_keys", lambda batch, kv, window, groups: keys(batch, kv, window + 1, groups))
    cfg = replace(TINY, prompts=2, pool_dtypes=("fp32",))
    with pytest.raises(RuntimeError, match="a key inside a local layer's window has no SWA slot"):
        gemma3_runner.run(cfg)


@pytest.mark.parametrize("spec_width", [None, 4], ids=["decode", "verify"])
def test_gemma3_a_scheduler_that_frees_the_live_window_is_caught(monkeypatch, spec_width):
    """A scheduler that gives back one page too many (never its last token's): its own step check
    reports it, and the runner refuses to read the lost key at the next step (a decode step's, or a
    verify step's committed keys)."""
    live_from = gemma3_runner.SWAScheduler.live_from
    monkeypatch.setattr(
        gemma3_runner.SWAScheduler, "live_from",
        lambda self, r: min(live_from(self, r) + self.page_size, (r.kv_len - 1) // self.page_size * self.page_size),
    )  # fmt: skip
    cfg = replace(TINY, chunk_size=None)  # the whole prompt in one step: the next is a decode or verify step
    arch = gemma3_runner.Gemma3(spec_width)
    model = arch.build_model(cfg)
    pools = arch.make_pool(cfg, model, torch.float32)
    sched = arch.scheduler(pools, cfg.batch, cfg.max_context_len, cfg.chunk_size)
    runner = arch.runner(model, pools, None)
    pr = runners.make_prompts(cfg)[0]
    sched.add(runners.Request(0, list(pr.tokens), pr.new_tokens))
    with runners.cpu_threads(cfg):
        assert runner.step(sched, keep_logits=False) == "prefill" and not sched.running[0].prefilling
        assert "lost the SWA slot of a token inside its window" in sched.step_error
        with pytest.raises(RuntimeError, match="a key inside a local layer's window has no SWA slot"):
            runner.step(sched, keep_logits=False)
    with pytest.raises(RuntimeError, match="lost the SWA slot"):
        sched.check_integrity()


def test_gemma3_json_rebuilds_with_transformers_alone(tmp_path, capsys):
    path = tmp_path / "gemma3.json"
    assert gemma3_runner.main([*ARGS, "--dtypes", "fp32", "--json", str(path)]) == 0
    capsys.readouterr()
    out = json.loads(path.read_text())
    assert set(out) == {"model_type", "config", "seed", "prompts", "fp32_tokens", "spec_tokens"}
    assert out["spec_tokens"] == out["fp32_tokens"]  # the speculative run (on by default) generated the same
    assert out["model_type"] == "gemma3_text" and out["config"]["sliding_window"] == 10
    torch.manual_seed(out["seed"])
    model = Gemma3ForCausalLM(Gemma3TextConfig(**out["config"])).eval()
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
        ({"sliding_window_pattern": 1}, r"sliding_window_pattern must be in 2..layers = 6 .*got 1"),
        ({"kv_heads": 3}, "kv_heads must divide heads = 4, got 3"),
        ({"final_logit_softcapping": 0.0}, "final_logit_softcapping must be None or > 0, got 0.0"),
    ],
)
def test_gemma3_shape_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gemma3_runner.GemmaShape(**kwargs)


def test_gemma3_runner_rejects_pools_of_another_geometry():
    cfg = TINY
    model = gemma3_runner.GEMMA3.build_model(cfg)
    pools = gemma3_runner.make_pool(cfg, model, torch.float32)
    other = gemma3_runner.SWAPools(pools.kv, pools.window + 1, pools.sizing, pools.all_layers_bytes)
    with pytest.raises(ValueError, match=r"pools must have \(KV heads, head_dim, SWA layers, full layers, window\)"):
        gemma3_runner.Gemma3Runner(model, other)


def test_gemma3_the_fused_kernel_serves_the_same_tokens_and_logits(monkeypatch):
    """FP8 pool with every write on the fused kernel (Triton's interpreter without a GPU; a local
    layer's write at the slots the mapping translates to) against the reference path: the writes are
    bit-identical, so the generations are too."""
    cfg = replace(TINY, prompts=2, batch=2, prompt_len=(12, 16), new_tokens=(3, 4), chunk_size=None,
                  device="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
    arch = gemma3_runner.GEMMA3
    model = arch.build_model(cfg)
    prompts = runners.make_prompts(cfg)
    reference, fused = fused_and_reference_serve(
        monkeypatch, lambda dtype: runners.serve(model, arch.make_pool(cfg, model, dtype), prompts, cfg.batch, arch=arch)
    )  # fmt: skip
    assert fused.allocators_ok and reference.allocators_ok


@pytest.mark.gpu
def test_gemma3_on_cuda_every_write_takes_the_fused_kernel():
    assert_every_write_fused_on_cuda(gemma3_runner, TINY)


def test_gemma3_admission_waits_for_room_in_the_swa_part(report):
    """A full part with room for every request and a SWA part with room for one request's largest
    live window: requests run one at a time, and still generate what transformers generates."""
    cfg = TINY
    arch = gemma3_runner.GEMMA3
    model = arch.build_model(cfg)
    prompts = runners.make_prompts(cfg)
    roomy = arch.make_pool(cfg, model, torch.float32)
    step = min(cfg.prompt_len[1], cfg.chunk_size)
    one = gemma3_runner.swa_pages(cfg.shape.sliding_window, cfg.page_size, step, cfg.max_context_len) * cfg.page_size
    g = gemma3_runner.swa_geometry(model)
    kv = gemma3_runner.SWAKVPool(
        roomy.size, one, cfg.page_size, torch.float32, g.kv_heads, g.head_dim, g.swa_layers, g.full_layers, False, "cpu"
    )  # fmt: skip
    pools = gemma3_runner.SWAPools(kv, roomy.window, replace(roomy.sizing, size_swa=one), roomy.all_layers_bytes)
    with runners.cpu_threads(cfg):
        res = runners.serve(model, pools, prompts, cfg.batch, arch=arch, chunk_size=cfg.chunk_size)
    (fp32,) = [r for r in report.runs if r.dtype == "fp32"]  # identical to HF's
    assert res.peak_running == 1 and res.allocators_ok
    assert [g.tokens for g in res.generations] == [g.tokens for g in fp32.result.generations]


# --- speculative decoding ----------------------------------------------------------------------------


def test_gemma3_speculative_verify_generates_what_plain_decoding_and_transformers_generate():
    """Verify blocks of 4 on fp32 and FP8 pools: the drafts' K/V go into both parts with the verify
    write (a local layer's at the translated SWA slots), the rejected slots go back, and the greedy
    tokens are the plain run's on each dtype, and on fp32 transformers' with its logits."""
    cfg = replace(TINY, pool_dtypes=("fp32",), calibrate=False)
    rep = gemma3_runner.run(cfg, gemma3_runner.SlidingOptions(spec_width=4, spec_dtypes=("fp32", "fp8_e4m3")))
    summary = gemma3_runner.format_summary(rep)
    assert [s.dtype for s in rep.spec_runs] == ["fp32", "fp8_e4m3"]
    assert_speculative_runs(rep, summary, cfg.shape.layers, cfg.prompts)
    assert "spec check  PASS" in summary and "rejected slots freed" in summary


def test_gemma3_speculative_verify_at_page_64_gives_swa_pages_back():
    """Pages of 64 tokens, a window of 10 and prompts longer than a page: the speculative run gives
    back each whole page of SWA slots once it left the window while the full part keeps every token
    (checked step by step), and still generates what transformers generates."""
    cfg = replace(TINY, prompts=3, batch=2, prompt_len=(70, 90), new_tokens=(12, 20), page_size=64, chunk_size=None,
                  pool_dtypes=("fp32",))  # fmt: skip
    rep = gemma3_runner.run(cfg, gemma3_runner.SlidingOptions(spec_width=4))
    assert_speculative_runs(rep, gemma3_runner.format_summary(rep), cfg.shape.layers, cfg.prompts, every_length=False)
    runner = serve_checking_swa_give_back(gemma3_runner.Gemma3(4), cfg)
    assert runner.accepted_tokens > 0 and 0 in runner.accept_lengths  # drafts accepted, and drafts rejected


def test_gemma3_a_verify_write_one_token_short_fails_the_spec_check(monkeypatch):
    """A verify step that commits every accepted prefix but its last token: later steps read a row
    that was never written, and the speculative run parts from the plain one."""
    commit = sliding.PooledKV.commit
    monkeypatch.setattr(
        sliding.PooledKV, "commit", lambda self, loc_2d, lens, k_scale, v_scale: commit(self, loc_2d, lens - 1, k_scale, v_scale)
    )  # fmt: skip
    cfg = replace(TINY, prompts=3, pool_dtypes=("fp32",))
    rep = gemma3_runner.run(cfg, gemma3_runner.SlidingOptions(spec_width=4))
    (spec,) = rep.spec_runs
    assert rep.spec_check is False and not rep.ok and not spec.vs_plain.identical
    assert "spec check  FAILED" in gemma3_runner.format_summary(rep)


@pytest.mark.gpu
def test_gemma3_on_cuda_speculative_verify_writes_take_the_fused_kernel():
    """On a GPU every write of the speculative runs (prefill, and the verify write into both parts) is
    fused, and the speculative tokens are the plain runs' on fp32 and FP8 pools."""
    assert_speculative_writes_fused_on_cuda(gemma3_runner, TINY)


def test_gemma3_on_the_prefix_cache_requests_hit_and_tombstones_appear(tmp_path):
    """Shared prompts are matched, SWA eviction makes tombstones, each part holds exactly the tree's
    and the running requests' slots after every step, and the tokens are transformers' and the run's
    without a cache (with the speculative run's too)."""
    assert_swa_prefix_cache_serves(gemma3_runner, gemma3_runner.GEMMA3, PREFIX, PREFIX_ARGS, tmp_path / "prefix.json")


@pytest.mark.parametrize(
    "rule, message",
    [
        ("live window", "lacks SWA KV for 1 of its last 6 tokens"),
        ("the tree's slots", "is live but 8 of its slots map to no SWA slot"),
    ],
)
def test_gemma3_a_prefix_cache_scheduler_that_gives_back_too_much_is_caught(monkeypatch, rule, message):
    """A request that keeps only what the model reads (window - 1 tokens, not the tree's last window),
    or that gives back the SWA slots of its cached prefix (the tree's): the cache's check at the end
    of the step says so."""
    from support.runners import swa_prefix

    def release(r, window, page):
        if rule == "live window":
            start = max(r.swa_evicted_seqlen, r.cache_protected_len)
            return start, max(start, max(0, r.kv_len - window + 1) // page * page)
        return r.swa_evicted_seqlen, max(r.swa_evicted_seqlen, (r.kv_len - window) // page * page)

    monkeypatch.setattr(swa_prefix, "release_span", release)
    arch = gemma3_runner.GEMMA3
    model = arch.build_model(PREFIX)
    pools = arch.make_pool(PREFIX, model, torch.float32)
    sched = arch.scheduler(pools, PREFIX.batch, PREFIX.max_context_len, PREFIX.chunk_size, True)
    runner = arch.runner(model, pools, None)
    for rid, pr in enumerate(runners.make_prompts(PREFIX)):
        sched.add(runners.Request(rid, list(pr.tokens), pr.new_tokens))
    with runners.cpu_threads(PREFIX):
        while sched.step_error is None and runner.step(sched, keep_logits=False) is not None:
            pass
    assert sched.step_error is not None and message in sched.step_error
    with pytest.raises(RuntimeError, match=message):
        sched.check_integrity()
