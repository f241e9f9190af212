"""examples/qwen35_runner.py at a tiny size: a hybrid Qwen3.5 (Gated DeltaNet + gated attention and
MoE) with its K/V in a KV pool and its linear-attention state in a state pool, with and without
speculative decoding, with the allocators and the request table, and on a prefix cache
(MambaRadixCache, and HiMambaRadixCache with a host tier): it must generate what transformers generates. Skipped without a transformers >= 5
that has Qwen3.5 (the ``model`` extra)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvassert import dropping_last_token, load_example

pytest.importorskip("transformers", minversion="5")

from kvpool import MambaPool  # noqa: E402

try:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
except ImportError:  # a transformers 5 without Qwen3.5: its runner's tests are skipped
    Qwen3_5MoeForCausalLM = Qwen3_5MoeTextConfig = None
HAS_QWEN35 = Qwen3_5MoeForCausalLM is not None
qwen35 = pytest.mark.skipif(not HAS_QWEN35, reason="needs a transformers with Qwen3.5 (qwen3_5_moe)")

if HAS_QWEN35:
    qwen35_runner = load_example("qwen35_runner")  # puts examples/ on sys.path, where the shared code is
    from support import runners  # noqa: E402  (the shared scheduler and checks)


def _runs(rep, dtype):
    return [r for r in rep.runs if r.dtype == dtype]


# ==============================================================================================
# Qwen3.5: a hybrid model's K/V and states.

# 4 layers (3 Gated DeltaNet, 1 gated attention), 6 prompts of 4-40 tokens for 3 request rows, prefill
# chunks of 16 tokens (the longer prompts take several steps), pages of 4: the runner's defaults.
if HAS_QWEN35:
    QWEN_TINY = runners.RunConfig(
        shape=qwen35_runner.SHAPES["tiny"], device="cpu", pool_dtypes=("fp32", "bf16", "fp8_e4m3"),
        **qwen35_runner.RUN_DEFAULTS,
    )  # fmt: skip
    QWEN_SPEC = qwen35_runner.QwenOptions(spec_width=4, spec_dtypes=("fp32", "fp8_e4m3"))
    # The prefix cache's runs: a match forks its state snapshot into the request's slot.
    QWEN_CACHED = replace(QWEN_TINY, prompts=8, batch=2, prefix_cache=True)
# Against plain HF, measured on the CPU (seed 0): bf16 pool 9e-4 max rel logit error and 1e-7 mean KL;
# FP8 e4m3 mean KL 3e-6 at scale 1.0 and with calibrated scales. The bounds leave room for other devices.
QWEN_BF16_LOGIT_RTOL, QWEN_BF16_KL, QWEN_FP8_KL = 0.05, 1e-3, 1e-2


@pytest.fixture(scope="module")
def qwen_report():
    return qwen35_runner.run(QWEN_TINY, QWEN_SPEC)


def _full_layers(cfg) -> int:
    return cfg.shape.layer_types.count("full_attention")


def _check_qwen_report(rep, cfg) -> None:
    """What must hold on every device: the fp32 pool reproduces HF exactly, every other pool reproduces
    HF with its cache rounded the same way, the speculative runs reproduce the plain ones, the
    allocators, table and state slots end clean, and every full-attention layer of every step wrote once."""
    summary = qwen35_runner.format_summary(rep)
    (fp32,) = [r for r in rep.runs if r.dtype == "fp32"]
    assert fp32.vs_hf.identical, summary
    assert fp32.vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL, summary
    assert fp32.vs_hf.compared_steps == fp32.vs_hf.tokens_total
    assert rep.fp32_check is True and rep.spec_check is True and rep.ok, summary
    for r in rep.runs:
        if r.dtype != "fp32":
            assert r.vs_rounded is not None and r.vs_rounded.identical, summary
        s = r.result
        assert s.allocators_ok, summary
        assert s.fused_calls + s.reference_calls == (s.prefill_steps + s.decode_steps) * _full_layers(cfg)
    for r in rep.runs:
        if r.dtype == "bf16":
            assert r.vs_hf.max_rel_logit_err < QWEN_BF16_LOGIT_RTOL and r.vs_hf.mean_kl < QWEN_BF16_KL, summary
        if r.dtype == "fp8_e4m3":
            assert 0 < r.vs_hf.mean_kl < QWEN_FP8_KL, summary
    assert rep.spec_runs
    for s in rep.spec_runs:
        assert s.vs_plain.identical, summary
        assert s.vs_plain.max_rel_logit_err <= runners.LOGIT_RTOL, summary
        res = s.result
        assert res.allocators_ok and res.verify_steps > 0 and res.decode_steps == 0, summary
        # plain writes for prefill chunks, one verify write per verify step, per full-attention layer
        assert res.fused_calls + res.reference_calls == (res.prefill_steps + res.verify_steps) * _full_layers(cfg)
        assert len(res.accept_lengths) >= res.verify_steps and res.drafted_tokens > res.accepted_tokens > 0


@qwen35
def test_tiny_qwen_generates_what_transformers_generates(qwen_report):
    prompts = runners.make_prompts(QWEN_TINY)
    assert len({len(p.tokens) for p in prompts}) == len(prompts)  # different lengths, no padding
    assert max(len(p.tokens) for p in prompts) > 2 * QWEN_TINY.chunk_size  # some prompt takes three chunks
    assert len({p.new_tokens for p in prompts}) > 1  # requests finish at different steps
    assert [r.label for r in qwen_report.runs] == ["fp32", "bf16", "fp8_e4m3, scale 1.0", "fp8_e4m3, scale calibrated"]
    _check_qwen_report(qwen_report, QWEN_TINY)
    first = qwen_report.runs[0].result
    assert first.peak_running == QWEN_TINY.batch
    assert first.prefill_steps > len(prompts)  # chunked: more prefill steps than prompts
    assert first.generated_tokens == sum(p.new_tokens for p in prompts)
    if not torch.cuda.is_available():
        assert all(r.result.fused_calls == 0 for r in qwen_report.runs)
    # The layer-skipping draft is accepted for none, some and all of a block's drafts, so every commit
    # length (and the draft's two-token catch-up after a full acceptance) is exercised.
    for s in qwen_report.spec_runs:
        assert {0, 1, QWEN_SPEC.spec_width - 1} <= set(s.result.accept_lengths), qwen35_runner.format_summary(qwen_report)


@qwen35
def test_qwen_the_state_is_in_sglangs_layout():
    """After a one-chunk prefill, each linear layer's state slot holds HF's cache converted: the window is
    HF's last conv_kernel - 1 columns, the recurrent state HF's with its last two dims swapped; the
    full-attention layer's pool rows are HF's cached keys and values."""
    cfg = replace(QWEN_TINY, chunk_size=None)
    arch = qwen35_runner.Qwen35()
    model = arch.build_model(cfg)
    pools = arch.make_pool(cfg, model, torch.float32)
    tokens = runners.make_prompts(cfg)[0].tokens
    sched = arch.scheduler(pools, 1, len(tokens) + 1, None)
    sched.add(runners.Request(0, tokens, 2))
    batch = sched.schedule()
    with runners.cpu_threads(cfg), torch.no_grad():
        arch.runner(model, pools, None).forward(batch)
        out = model(torch.tensor([tokens]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    state, slot = pools.table.mamba_pool, int(batch.state_slots[0])
    for i, kind in enumerate(model.config.layer_types):
        layer = cache.layers[i]
        if kind == "linear_attention":
            conv, ssm = layer.conv_states[0][0], layer.recurrent_states[0][0]  # [conv_dim, K], [v_heads, k, v]
            torch.testing.assert_close(state.get_conv_state(i)[slot], conv[:, 1:], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state.get_ssm_state(i)[slot], ssm.transpose(-1, -2), rtol=1e-5, atol=1e-6)
        else:
            k, v = pools.kv.get_kv_buffer(i)
            torch.testing.assert_close(k[batch.loc], layer.keys[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v[batch.loc], layer.values[0].transpose(0, 1), rtol=1e-5, atol=1e-6)


@qwen35
def test_qwen_no_arguments_mean_the_tiny_run():
    """Run with no arguments, the runner serves QWEN_TINY (this file's run) with speculative decoding on fp32."""
    cfg, opts = qwen35_runner.parse_args([])
    assert cfg == replace(QWEN_TINY, device=cfg.device)
    assert opts == replace(QWEN_SPEC, spec_dtypes=("fp32",))


@qwen35
def test_qwen_summary_exit_status_and_a_json_others_can_rebuild(tmp_path, capsys):
    """The summary says what passed; ``--json`` names a config and seed from which HF alone rebuilds the
    model and generates the runner's tokens, with and without speculative decoding."""
    path = tmp_path / "qwen.json"
    args = ["--prompts", "3", "--dtypes", "fp32", "fp8_e4m3", "--no-calibrate", "--device", "cpu", "--json", str(path)]
    assert qwen35_runner.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("kvpool qwen35_runner: Qwen3_5MoeForCausalLM (4 layers (3 Gated DeltaNet, 1 gated attention)")
    assert "  why         a pool of another dtype than the model's rounds every K/V it stores" in out
    assert "pool fp32\n    vs HF       tokens identical" in out
    assert "pool fp8_e4m3, scale 1.0\n" in out and "vs rounded  tokens identical" in out
    assert "  speculative pool fp32, verify blocks of 4" in out and "    vs plain    tokens identical" in out
    assert "fp32 check  PASS" in out and "spec check  PASS" in out and out.rstrip().endswith("PASS")
    data = json.loads(path.read_text())
    assert set(data) == {"config", "seed", "prompts", "fp32_tokens", "spec_tokens"}
    assert len(data["prompts"]) == 3 and all(len(t) >= 4 for t in data["fp32_tokens"])
    assert data["spec_tokens"] == data["fp32_tokens"]
    torch.manual_seed(data["seed"])
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**data["config"])).eval()
    with runners.cpu_threads(QWEN_TINY):
        for prompt, tokens in zip(data["prompts"], data["fp32_tokens"], strict=True):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=len(tokens), min_new_tokens=len(tokens))  # fmt: skip
            assert gen[0, len(prompt) :].tolist() == tokens


@qwen35
def test_qwen_help_names_every_option_and_bad_arguments_exit_2(capsys):
    parser = qwen35_runner.make_parser()
    assert all(a.help for a in parser._actions)
    text = parser.format_help()
    for a in parser._actions:
        for opt in a.option_strings:
            assert opt in text
    assert qwen35_runner.main(["--batch", "0"]) == 2
    assert "qwen35_runner: batch must be a positive int, got 0" in capsys.readouterr().err
    assert qwen35_runner.main(["--spec-width", "1"]) == 2
    assert "spec_width must be an int >= 2" in capsys.readouterr().err
    assert qwen35_runner.main(["--json", "x.json", "--model-dtype", "bf16"]) == 2
    assert "--json describes an fp32 model: model_dtype must be fp32, got 'bf16'" in capsys.readouterr().err


@qwen35
def test_qwen_a_16bit_model_reports_the_speculative_agreement_without_checking_it(capsys):
    args = ["--prompts", "2", "--model-dtype", "bf16", "--dtypes", "bf16", "--spec-dtypes", "bf16", "--device", "cpu"]
    assert qwen35_runner.main(args) == 0
    out = capsys.readouterr().out
    assert "fp32 check  not run" in out and "spec check  not run (needs --model-dtype fp32" in out
    assert "    vs plain    tokens" in out and out.rstrip().endswith("PASS")


QWEN_ARGS = ["--prompts", "4", "--dtypes", "fp32", "--spec-width", "0", "--device", "cpu"]


@qwen35
def test_qwen_a_lost_kv_write_fails_the_fp32_check(monkeypatch, capsys):
    """A pool that drops one token's K/V per write: attention reads a stale row, and the run says so."""
    leaky = dropping_last_token(qwen35_runner, "set_kv_buffer", pool_of=lambda pools: pools.kv)
    monkeypatch.setattr(qwen35_runner, "make_pool", leaky)
    assert qwen35_runner.main(QWEN_ARGS) == 1
    out = capsys.readouterr().out
    assert "fp32 check  FAILED" in out and out.rstrip().endswith("FAIL")


@qwen35
def test_qwen_a_changed_state_fails_the_fp32_check(monkeypatch, capsys):
    """One recurrent-state value of one request changed after a step: the run says so."""
    advance = qwen35_runner.HybridScheduler.advance
    done = []

    def corrupting(self, batch, logits, keep_logits):
        advance(self, batch, logits, keep_logits)
        if not done and not batch.is_prefill:
            self.table.mamba_pool.get_ssm_state(0)[int(batch.state_slots[0]), 0, 0, 0] += 1.0
            done.append(True)

    monkeypatch.setattr(qwen35_runner.HybridScheduler, "advance", corrupting)
    assert qwen35_runner.main(QWEN_ARGS) == 1
    assert "fp32 check  FAILED" in capsys.readouterr().out


@qwen35
def test_qwen_committing_the_wrong_step_fails_the_spec_check(monkeypatch, capsys):
    """A state commit one verify step late (the state after the first rejected draft): the speculative
    tokens part from the plain run's and the run says so."""
    commit = MambaPool.commit

    def late(self, slots, accepted_steps, *args, **kwargs):
        commit(self, slots, (accepted_steps + 1).clamp(max=self.speculative_num_draft_tokens), *args, **kwargs)

    monkeypatch.setattr(MambaPool, "commit", late)
    assert qwen35_runner.main(["--prompts", "4", "--dtypes", "fp32", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "spec check  FAILED" in out and out.rstrip().endswith("FAIL")


@qwen35
def test_qwen_the_fused_kernel_serves_the_same_tokens_and_logits(monkeypatch):
    """FP8 pools with every write (prefill chunks and the verify write) on the fused kernel (Triton's
    interpreter without a GPU) against the reference path: the writes are bit-identical, so the
    generations are too."""
    cfg = replace(QWEN_TINY, prompts=2, new_tokens=(3, 4), prompt_len=(4, 20), device="cuda" if torch.cuda.is_available() else "cpu")
    arch = qwen35_runner.Qwen35(3)
    model = arch.build_model(cfg)
    prompts = runners.make_prompts(cfg)
    runs = {}
    for mode in ("never", "always"):
        monkeypatch.setenv("KVPOOL_FUSED", mode)
        pools = arch.make_pool(cfg, model, torch.float8_e4m3fn)
        with runners.cpu_threads(cfg):
            runs[mode] = runners.serve(model, pools, prompts, cfg.batch, arch=arch, chunk_size=cfg.chunk_size)
    reference, fused = runs["never"], runs["always"]
    assert reference.fused_calls == 0 and fused.reference_calls == 0
    assert fused.fused_calls == reference.reference_calls > 0 and fused.verify_steps > 0
    for a, b in zip(fused.generations, reference.generations):
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits)


@qwen35
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kv_heads": 3}, "kv_heads must divide heads = 4, got 3"),
        ({"linear_k_heads": 3}, "linear_k_heads must divide linear_v_heads = 4, got 3"),
        ({"experts_per_token": 5}, "experts_per_token must be at most experts = 4, got 5"),
        ({"full_attention_interval": 5}, r"full_attention_interval must be in 2..layers = 4"),
        ({"partial_rotary": 0.1}, r"partial_rotary \* head_dim must be an even int >= 2"),
        ({"conv_kernel": 1}, "conv_kernel must be an int >= 2, got 1"),
        ({"init_std": 0.0}, "init_std must be None or > 0, got 0.0"),
    ],
)
def test_qwen_shape_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replace(qwen35_runner.SHAPES["tiny"], **kwargs)


# --- --prefix-cache: a match forks its state snapshot into the request's slot -----------------------


def _serve_qwen_cached(cfg, dtype, on, hf=None):
    arch = qwen35_runner.Qwen35()
    with qwen35_runner.exact_fp32(), runners.cpu_threads(cfg):
        model = arch.build_model(cfg)
        prompts = runners.make_prompts(cfg)
        pools = arch.make_pool(replace(cfg, prefix_cache=on), model, dtype)
        write, written = pools.kv.set_kv_buffer, []

        def counted(layer, loc, *args):  # the tokens each step computes (one full-attention layer holds K/V)
            written.append(loc.numel())
            write(layer, loc, *args)

        pools.kv.set_kv_buffer = counted
        res = runners.serve(model, pools, prompts, cfg.batch, arch=arch, chunk_size=cfg.chunk_size, prefix_cache=on)
        res.written = sum(written)
        return res, (runners.hf_reference(model, prompts) if hf else None)


@qwen35
@pytest.mark.parametrize("page_size", [4, 1], ids=["track-slots", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qwen_the_prefix_cache_generates_the_same_tokens(page_size, dtype):
    """Pages of 4: chunks end at page boundaries and the state is tracked there, so matches end on
    snapshots; pages of 1: the state after each cached prefix. The tokens (and logits) are the
    cache-off run's, and for fp32 HF's."""
    cfg = replace(QWEN_CACHED, page_size=page_size)
    on, hf = _serve_qwen_cached(cfg, dtype, True, hf=dtype == torch.float32)
    off, _ = _serve_qwen_cached(cfg, dtype, False)
    assert on.allocators_ok and on.cached_tokens > 0 and on.cached_tokens % page_size == 0
    assert on.written == off.written - on.cached_tokens  # the matched tokens were not computed again
    same = runners.compare(on.generations, off.generations)
    assert same.identical and same.max_rel_logit_err <= runners.LOGIT_RTOL
    if hf is not None:
        vs_hf = runners.compare(on.generations, hf)
        assert vs_hf.identical and vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL


@qwen35
def test_qwen_a_match_without_its_state_fails_the_fp32_check(monkeypatch):
    """Control: matches whose snapshot is not copied into the request's slot (it continues from a
    zero state) part from HF."""
    from kvpool.cache import MambaRadixCache

    monkeypatch.setattr(MambaRadixCache, "_fork_into", lambda self, node, req, dst=None: True)
    res, hf = _serve_qwen_cached(QWEN_CACHED, torch.float32, True, hf=True)
    assert res.cached_tokens > 0 and not runners.compare(res.generations, hf).identical


@qwen35
def test_qwen_the_speculative_runs_serve_without_the_cache(capsys):
    assert qwen35_runner.main(["--prompts", "4", "--dtypes", "fp32", "--device", "cpu", "--prefix-cache"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens matched in the prefix cache" in out and "spec check  PASS" in out
    assert "the speculative runs serve without the prefix cache" in out
    with pytest.raises(ValueError, match="prefix_cache must be False for a speculative run"):
        qwen35_runner.Qwen35(4).scheduler(None, 1, 8, None, prefix_cache=True)


@qwen35
@pytest.mark.gpu
def test_qwen_on_cuda_the_prefix_cache_generates_what_transformers_generates():
    """Track slots, forks and the fused writes on a GPU: the fp32 pool still reproduces HF, every
    other pool its rounded reference."""
    rep = qwen35_runner.run(replace(QWEN_CACHED, device="cuda"), qwen35_runner.QwenOptions(spec_width=None))
    summary = qwen35_runner.format_summary(rep)
    assert rep.fp32_check is True and rep.ok, summary
    for r in rep.runs:
        assert r.result.cached_tokens > 0 and r.result.reference_calls == 0, summary
        assert r.vs_rounded is None or r.vs_rounded.identical, summary


@qwen35
@pytest.mark.gpu
def test_qwen_on_cuda_every_kv_write_takes_the_fused_kernel():
    cfg = replace(QWEN_TINY, device="cuda")
    rep = qwen35_runner.run(cfg, QWEN_SPEC)
    _check_qwen_report(rep, cfg)
    for r in [*rep.runs, *rep.spec_runs]:
        res = r.result
        assert res.reference_calls == 0 and res.fused_calls > 0, qwen35_runner.format_summary(rep)


@qwen35
@pytest.mark.gpu
def test_qwen_on_cuda_head_dim_256_with_fp8_speculative_runs():
    """Qwen3.5's head_dim 256 with bf16 and FP8 pools, speculative runs on fp32 and FP8 pools: the fused
    writes, the rounded references and the speculative runs must agree exactly."""
    cfg = replace(QWEN_TINY, device="cuda", shape=replace(QWEN_TINY.shape, head_dim=256))
    rep = qwen35_runner.run(cfg, QWEN_SPEC)
    _check_qwen_report(rep, cfg)
    for r in [*rep.runs, *rep.spec_runs]:
        assert r.result.reference_calls == 0, qwen35_runner.format_summary(rep)


@qwen35
@pytest.mark.gpu
def test_qwen_on_cuda_a_bf16_model_reports_without_failing_on_rounding():
    """A bf16 model: no fp32 check and no speculative check (rounding may part the tokens at near-ties);
    the run still ends clean and every write is fused."""
    cfg = replace(QWEN_TINY, device="cuda", model_dtype="bf16", pool_dtypes=("bf16", "fp8_e4m3"), calibrate=False)
    rep = qwen35_runner.run(cfg, qwen35_runner.QwenOptions(4, ("bf16",)))
    summary = qwen35_runner.format_summary(rep)
    assert rep.fp32_check is None and rep.spec_check is None and rep.ok, summary
    assert "spec check  not run (needs --model-dtype fp32" in summary
    for r in [*rep.runs, *rep.spec_runs]:
        assert r.result.allocators_ok and r.result.reference_calls == 0, summary


# --- --prefix-cache --host-tier: KV pages and state snapshots parked on the host and loaded back -----

if HAS_QWEN35:
    # One request row: the device pool holds one request's pages, so each prompt evicts the tree
    # nodes of the one before it to the host.
    QWEN_HOST = replace(QWEN_TINY, prompts=4, batch=1, new_tokens=(2, 4), pool_dtypes=("fp32",), calibrate=False,
                        prefix_cache=True, host_tier=True)  # fmt: skip


def _host_tier_prompts(cfg):
    """Two unrelated prompts of 36 tokens, then one that begins with the first's 32 tokens and one
    with the second's 20: the first's nodes are on the host when the third arrives, and come back
    with their state snapshots (tracked at the chunk ends 16 and 32)."""
    rng = torch.Generator().manual_seed(cfg.seed)
    a, b, c, d = (torch.randint(cfg.shape.vocab, (n,), generator=rng).tolist() for n in (36, 36, 6, 3))
    Prompt = runners.Prompt
    return [Prompt(a, 3), Prompt(b, 3), Prompt(a[:32] + c, 3), Prompt(b[:20] + d, 2)]


@pytest.fixture
def host_tier_prompts(monkeypatch):
    """The runner's prompts are ``_host_tier_prompts``'s; returns them with HF's generations."""
    from support.runners import serving, verify

    prompts = _host_tier_prompts(QWEN_HOST)
    for module in (serving, verify, runners):  # the plain runs, the speculative runs, --json
        monkeypatch.setattr(module, "make_prompts", lambda cfg: prompts)
    model = qwen35_runner.Qwen35().build_model(QWEN_HOST)
    with qwen35_runner.exact_fp32(), runners.cpu_threads(QWEN_HOST):
        return prompts, runners.hf_reference(model, prompts)


@qwen35
def test_qwen_a_host_tier_loads_kv_and_states_back_with_the_same_tokens(host_tier_prompts, monkeypatch):
    """HiMambaRadixCache: the tokens of the tiered run, of a device-only MambaRadixCache and of no
    cache are transformers'; KV and states came back from the host; the cache's integrity is
    checked after every step; every device and host slot is given back."""
    from kvpool.cache import HiMambaRadixCache

    _, hf = host_tier_prompts
    checks, check = [], HiMambaRadixCache.check_integrity
    monkeypatch.setattr(HiMambaRadixCache, "check_integrity", lambda self, *a: checks.append(1) or check(self, *a))
    rep = qwen35_runner.run(QWEN_HOST, qwen35_runner.QwenOptions(spec_width=None))
    summary = qwen35_runner.format_summary(rep)
    (run,) = rep.runs
    t, s = run.tiers, run.result
    assert rep.ok and t.ok and t.required and t.identical and t.second is None, summary
    assert s.host_loaded_tokens >= 32 and s.host_loaded_states > 0 and s.storage_loaded_tokens == 0, summary
    assert len(checks) >= s.prefill_steps + s.decode_steps + 1  # after every step, and at the end
    assert s.cached_tokens > t.device_only.cached_tokens  # the device alone had evicted what the host served
    for served in (s, t.device_only, t.no_cache):
        vs_hf = runners.compare(served.generations, hf)
        assert vs_hf.identical and vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL, summary
        assert served.integrity_error is None and served.leaked_slots == 0  # host pages and host states too
    assert "; a HiMambaRadixCache with a host tier" in summary
    assert f"{s.host_loaded_tokens} loaded back from the host (0 of them fetched from storage), with " \
           f"{s.host_loaded_states} state snapshots loaded back beside their KV" in summary  # fmt: skip


@qwen35
def test_qwen_a_loaded_prefix_served_without_its_loaded_state_fails_the_fp32_check(host_tier_prompts, monkeypatch):
    """Control: the loads start but the loaded state is not forked into the request's slot (no second
    match): the request continues the loaded KV from the device part's state, and its logits part
    from HF's far beyond LOGIT_RTOL."""
    from support.runners import prefix

    monkeypatch.setattr(prefix.PrefixCaching, "_fork_loaded", lambda self, params, node, indices: self.cache.ready_to_load_host_cache())
    rep = qwen35_runner.run(QWEN_HOST, qwen35_runner.QwenOptions(spec_width=None))
    (run,) = rep.runs
    assert run.result.host_loaded_tokens > 0 and run.vs_hf.max_rel_logit_err > 10 * runners.LOGIT_RTOL
    assert rep.fp32_check is False and not rep.ok and qwen35_runner.format_summary(rep).endswith("FAIL")


@qwen35
def test_qwen_a_failed_integrity_check_after_a_step_fails_the_run(host_tier_prompts, monkeypatch):
    from kvpool.cache import HiMambaRadixCache
    from kvpool.errors import IntegrityError
    from support.runners.prefix import HostTier

    calls, check = [], HiMambaRadixCache.check_integrity

    def failing_third(self, *a):
        calls.append(1)
        if len(calls) == 3:
            raise IntegrityError("a planted contradiction")
        return check(self, *a)

    monkeypatch.setattr(HiMambaRadixCache, "check_integrity", failing_third)
    prompts, _ = host_tier_prompts
    arch = qwen35_runner.Qwen35()
    model = arch.build_model(QWEN_HOST)
    pools = arch.make_pool(QWEN_HOST, model, torch.float32)
    res = runners.serve(model, pools, prompts, 1, arch=arch, chunk_size=QWEN_HOST.chunk_size, prefix_cache=True,
                        tiers=HostTier())  # fmt: skip
    assert res.integrity_error == "after step 3: a planted contradiction" and not res.allocators_ok


@qwen35
def test_qwen_host_tier_command_line_summary_and_json(host_tier_prompts, tmp_path, capsys):
    path = tmp_path / "qwen.json"
    args = ["--device", "cpu", "--dtypes", "fp32", "--no-calibrate", "--batch", "1", "--new-tokens", "2", "4",
            "--prefix-cache", "--host-tier", "--spec-width", "2", "--json", str(path)]  # fmt: skip
    assert qwen35_runner.main(args) == 0
    out = capsys.readouterr().out
    assert "    engine 1    " in out and "state snapshots loaded back beside their KV" in out and out.rstrip().endswith("PASS")
    doc = json.loads(path.read_text())
    (run,) = doc["runs"]
    assert run["host_loaded_tokens"] > 0 and run["host_loaded_states"] > 0 and run["allocators_ok"]
    assert run["tokens_identical_to_hf"] and run["tiers"]["ok"] and all(run["tiers"]["tokens_identical"].values())
    assert doc["prompts"] == [p.tokens for p in host_tier_prompts[0]]


@qwen35
@pytest.mark.gpu
def test_qwen_on_cuda_a_host_tier_loads_kv_and_states_back_with_the_same_tokens(host_tier_prompts):
    """The host pools' streams on a GPU: KV loaded layer by layer, the state's load before the fork."""
    rep = qwen35_runner.run(replace(QWEN_HOST, device="cuda"), qwen35_runner.QwenOptions(spec_width=None))
    (run,) = rep.runs
    summary = qwen35_runner.format_summary(rep)
    assert rep.ok and rep.fp32_check is True and run.tiers.identical and run.result.host_loaded_states > 0, summary
