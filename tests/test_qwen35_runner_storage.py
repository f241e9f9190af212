"""examples/qwen35_runner.py --prefix-cache --host-tier --storage file|mooncake at a tiny size: the
hybrid tiered cache (a HiMambaRadixCache over a HybridPoolHost, its KV pages and state snapshots
written through to storage) generates the tokens of a device-only cache, of no cache and of
transformers; a second engine (a fresh pool, cache and host pool over the same store) serves the
prompts from what the first stored, KV with its states, storage -> host -> device; a store without
the states serves nothing; injected storage faults lose nothing. The Mooncake runs start their own
master on 127.0.0.1 and skip, with the import error, where Mooncake cannot load. Skipped without a
transformers >= 5 that has Qwen3.5 (the ``model`` extra)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvassert import load_example
from kvpool.storage.mooncake_config import import_store_class

pytest.importorskip("transformers", minversion="5")

try:
    from transformers import Qwen3_5MoeForCausalLM  # noqa: F401
except ImportError:
    Qwen3_5MoeForCausalLM = None
pytestmark = pytest.mark.skipif(Qwen3_5MoeForCausalLM is None, reason="needs a transformers with Qwen3.5 (qwen3_5_moe)")

try:
    import_store_class()
    NO_MOONCAKE = None
except ImportError as e:
    NO_MOONCAKE = str(e)
BACKENDS = ["file", pytest.param("mooncake", marks=pytest.mark.skipif(NO_MOONCAKE is not None, reason=NO_MOONCAKE or ""))]

if Qwen3_5MoeForCausalLM is not None:
    qwen35_runner = load_example("qwen35_runner")  # puts examples/ on sys.path, where the shared code is
    from support import runners  # noqa: E402
    from support.storage import StorageOptions  # noqa: E402

    # One request row, pages of 4, prefill chunks of 16: each prompt evicts the one before it to the
    # host, and the states at the chunk ends (16, 32) are tracked, stored and fetched.
    QWEN_STORED = runners.RunConfig(
        shape=qwen35_runner.SHAPES["tiny"], device="cpu", pool_dtypes=("fp32",), calibrate=False, prefix_cache=True,
        host_tier=True, **{**qwen35_runner.RUN_DEFAULTS, "prompts": 4, "batch": 1, "new_tokens": (2, 4)},
    )  # fmt: skip
    NO_SPEC = qwen35_runner.QwenOptions(spec_width=None)


def _prompts(cfg):
    """Two unrelated prompts of 36 tokens, then one that begins with the first's 32 tokens and one
    with the second's 20."""
    rng = torch.Generator().manual_seed(cfg.seed + 7)
    a, b, c, d = (torch.randint(cfg.shape.vocab, (n,), generator=rng).tolist() for n in (36, 36, 6, 3))
    return [runners.Prompt(a, 3), runners.Prompt(b, 3), runners.Prompt(a[:32] + c, 3), runners.Prompt(b[:20] + d, 2)]


@pytest.fixture
def prompts_hf(monkeypatch):
    """The runner's prompts are ``_prompts``'s; returns them with transformers' generations (the oracle)."""
    from support.runners import serving, verify

    prompts = _prompts(QWEN_STORED)
    for module in (serving, verify, runners):
        monkeypatch.setattr(module, "make_prompts", lambda cfg: prompts)
    model = qwen35_runner.Qwen35().build_model(QWEN_STORED)
    with qwen35_runner.exact_fp32(), runners.cpu_threads(QWEN_STORED):
        return prompts, runners.hf_reference(model, prompts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen_a_second_engine_serves_kv_and_states_from_storage_with_the_same_tokens(tmp_path, backend, prompts_hf):
    _, hf = prompts_hf
    where = dict(directory=str(tmp_path / "pages")) if backend == "file" else {}
    rep = qwen35_runner.run(replace(QWEN_STORED, storage=StorageOptions(backend, **where)), NO_SPEC)
    summary = qwen35_runner.format_summary(rep)
    (run,) = rep.runs
    t, first, second = run.tiers, run.result, run.tiers.second
    assert rep.ok and t.ok and t.required and t.identical and t.hits, summary
    assert first.storage["pages_written"] > 0 and first.storage["states_written"] > 0, summary
    assert second.storage_loaded_tokens > 0 and second.storage["states_read"] > 0 and second.host_loaded_states > 0, summary
    assert second.cached_tokens > t.device_only.cached_tokens  # the fresh engine's first prompt came from storage
    for served in (first, second, t.device_only, t.no_cache):
        vs_hf = runners.compare(served.generations, hf)
        assert vs_hf.identical and vs_hf.max_rel_logit_err <= runners.LOGIT_RTOL, summary
        assert served.integrity_error is None and served.leaked_slots == 0  # checked after every step, all given back
    assert f"a HiMambaRadixCache with a host tier over {rep.config.storage.describe()} storage" in summary
    assert f"{second.storage['states_written']} state snapshots written, {second.storage['states_read']} read" in summary


def test_qwen_a_store_without_the_states_serves_no_prefix_and_fails_the_check(tmp_path, prompts_hf, monkeypatch):
    """Control: the state snapshots never reach storage (their writes are dropped): the KV pages there
    are never served without them, so the second engine loads nothing from storage and the run fails."""
    from kvpool.cache.himamba_storage import StateStorageTier

    monkeypatch.setattr(StateStorageTier, "_write_state", lambda self, node, record: None)
    rep = qwen35_runner.run(replace(QWEN_STORED, storage=StorageOptions("file", directory=str(tmp_path / "p"))), NO_SPEC)
    (run,) = rep.runs
    t = run.tiers
    assert run.result.storage["pages_written"] > 0 and run.result.storage["states_written"] == 0
    assert t.second.storage_loaded_tokens == 0 and t.second.storage["states_missing"] > 0
    assert t.identical and not t.ok and not rep.ok  # the same tokens, computed again: the hit check fails
    assert "FAILED: engine 2 loaded nothing from storage and the host" in qwen35_runner.format_summary(rep)


def test_qwen_storage_faults_lose_no_data_and_leave_every_tree_consistent(prompts_hf):
    _, hf = prompts_hf
    rep = qwen35_runner.run(replace(QWEN_STORED, storage=StorageOptions("file", faults=0.25, seed=3)), NO_SPEC)
    (run,) = rep.runs
    t = run.tiers
    summary = qwen35_runner.format_summary(rep)
    assert rep.ok and t.identical and not t.expect_hits, summary
    assert sum(t.faults.values()) > 0, summary
    for served in (run.result, t.second):
        assert served.integrity_error is None and served.leaked_slots == 0
        assert runners.compare(served.generations, hf).identical


def test_qwen_storage_command_line_summary(prompts_hf, capsys):
    args = ["--device", "cpu", "--dtypes", "fp32", "--no-calibrate", "--batch", "1", "--new-tokens", "2", "4",
            "--prompts", "4", "--prefix-cache", "--host-tier", "--storage", "file", "--spec-width", "0"]  # fmt: skip
    assert qwen35_runner.main(args) == 0
    out = capsys.readouterr().out
    assert "a HiMambaRadixCache with a host tier over file (a temporary directory) storage" in out
    assert "    engine 2    " in out and "state snapshots written" in out and out.rstrip().endswith("PASS")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen_on_cuda_a_second_engine_serves_kv_and_states_from_storage(tmp_path, backend, prompts_hf):
    """The host pools' streams on a GPU: KV pages and states written through once their backups
    complete, fetched and loaded back; the tokens are still transformers'."""
    where = dict(directory=str(tmp_path / "pages")) if backend == "file" else {}
    rep = qwen35_runner.run(replace(QWEN_STORED, device="cuda", storage=StorageOptions(backend, **where)), NO_SPEC)
    (run,) = rep.runs
    summary = qwen35_runner.format_summary(rep)
    assert rep.ok and rep.fp32_check is True and run.tiers.identical and run.tiers.hits, summary
    assert run.tiers.second.storage["states_read"] > 0, summary
