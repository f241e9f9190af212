"""examples/llama_runner.py --prefix-cache --host-tier --storage file|mooncake at a tiny size: the
tiered cache (a HiRadixCache over a host pool, its host copies written through to storage) generates
the tokens of a device-only cache, of no cache and of transformers; a second engine (a fresh pool,
cache and host pool over the same store) serves the prompts from what the first stored, loading
tokens from storage and from the host; injected storage failures and delays lose nothing and leave
every tree, allocator and host pool consistent; the counters are in the summary and in --json
(the Qwen3.5 runner's storage runs are tests/test_qwen35_runner_storage.py). The Mooncake runs start their
own master on 127.0.0.1 (or join one) and skip, with the import error, where Mooncake cannot load.
Skipped without transformers >= 5 (the ``model`` extra)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import pytest
import torch

from kvassert import load_example
from kvpool.storage.mooncake_config import import_store_class
from kvpool.storage.mooncake_master import MooncakeMaster

pytest.importorskip("transformers", minversion="5")

llama_runner = load_example("llama_runner")  # puts examples/ on sys.path, where the shared code is
from support import storage as example_storage  # noqa: E402
from support.storage import StorageOptions  # noqa: E402

try:
    import_store_class()
    NO_MOONCAKE = None
except ImportError as e:
    NO_MOONCAKE = str(e)
needs_mooncake = pytest.mark.skipif(NO_MOONCAKE is not None, reason=NO_MOONCAKE or "")
BACKENDS = ["file", pytest.param("mooncake", marks=needs_mooncake)]

# 8 prompts sharing prefixes for 3 request rows, pages of 4: prompts span several pages.
TIERED = llama_runner.RunConfig(
    shape=llama_runner.SHAPES["tiny"], prompts=8, batch=3, prompt_len=(4, 40), new_tokens=(3, 8), page_size=4,
    seed=0, device="cpu", pool_dtypes=("fp32",), calibrate=False, prefix_cache=True, host_tier=True,
)  # fmt: skip
TIERED_ARGS = [
    "--config", "tiny", "--prompts", "8", "--batch", "3", "--prompt-len", "4", "40", "--new-tokens", "3", "8",
    "--page-size", "4", "--seed", "0", "--device", "cpu", "--dtypes", "fp32", "--no-calibrate", "--prefix-cache",
    "--host-tier",
]  # fmt: skip


@pytest.fixture(scope="module")
def hf_tokens():
    """transformers' own greedy generations of TIERED's prompts: the oracle."""
    model = llama_runner.build_model(TIERED.shape, torch.float32, "cpu", TIERED.seed)
    return llama_runner.hf_reference(model, llama_runner.make_prompts(TIERED))


def tiers_of(rep):
    (run,) = rep.runs
    assert run.tiers is not None, llama_runner.format_summary(rep)
    return run, run.tiers


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_engine_serves_the_prompts_from_storage_with_the_same_tokens(tmp_path, backend, hf_tokens):
    where = dict(directory=str(tmp_path / "pages")) if backend == "file" else {}
    rep = llama_runner.run(replace(TIERED, storage=StorageOptions(backend, **where)))
    run, t = tiers_of(rep)
    summary = llama_runner.format_summary(rep)
    assert rep.ok and t.ok and t.identical and t.required, summary
    second = t.second
    assert second.storage_loaded_tokens > 0 and second.host_loaded_tokens >= second.storage_loaded_tokens, summary
    assert second.cached_tokens > t.device_only.cached_tokens  # a fresh engine's first prompts came from storage
    assert run.result.storage["pages_written"] > 0 and second.storage["pages_read"] > 0
    for served in (run.result, second, t.device_only, t.no_cache):
        vs_hf = llama_runner.compare(served.generations, hf_tokens)
        assert vs_hf.identical and vs_hf.max_rel_logit_err <= llama_runner.LOGIT_RTOL, summary
        assert served.allocators_ok
    assert f"({second.storage_loaded_tokens} of them fetched from storage)" in summary
    assert "tiers       tokens identical: engine 1 vs no cache" in summary


def test_a_host_tier_without_storage_generates_the_same_tokens(hf_tokens):
    rep = llama_runner.run(TIERED)
    run, t = tiers_of(rep)
    assert rep.ok and t.ok and t.second is None and not t.expect_hits
    assert sorted(t.agreements) == ["engine 1 vs a device-only cache", "engine 1 vs no cache"] and t.identical
    assert run.result.storage == {} and llama_runner.compare(run.result.generations, hf_tokens).identical
    requests = next(line for line in llama_runner.format_summary(rep).split("\n") if line.startswith("  requests"))
    assert requests.endswith("; a HiRadixCache with a host tier")  # and no storage below it


@pytest.mark.parametrize("backend", BACKENDS)
def test_storage_faults_lose_no_data_and_leave_every_tree_consistent(backend, hf_tokens):
    """Failures, raised errors, short reads and writes and delays at p=0.25 each, seeded."""
    rep = llama_runner.run(replace(TIERED, storage=StorageOptions(backend, faults=0.25, seed=2)))
    run, t = tiers_of(rep)
    summary = llama_runner.format_summary(rep)
    assert rep.ok and t.identical and not t.expect_hits, summary
    assert sum(t.faults.get(k, 0) for k in ("fail", "raise", "short")) > 0 and t.faults.get("delay", 0) > 0
    failures = sum(s.storage["write_failures"] + s.storage["prefetch_failures"] for s in (run.result, t.second))
    assert failures > 0, summary
    for served in (run.result, t.second):
        assert served.integrity_error is None and served.leaked_slots == 0  # check_integrity passed, all given back
        assert llama_runner.compare(served.generations, hf_tokens).identical
    assert re.search(r"faults      \d+ injected into storage calls \(delay \d+, fail \d+, raise \d+, short \d+\)", summary)


def test_a_second_engine_that_finds_nothing_in_storage_fails_the_check(tmp_path, monkeypatch):
    """Control: a store that never reports a page: the second engine loads nothing from storage, and
    the run says so and fails."""
    monkeypatch.setattr(example_storage.HiCacheFile, "batch_exists", lambda self, keys, extra_info=None: 0)
    rep = llama_runner.run(replace(TIERED, storage=StorageOptions("file", directory=str(tmp_path / "pages"))))
    _, t = tiers_of(rep)
    assert t.second.storage_loaded_tokens == 0 and not t.ok and not rep.ok
    summary = llama_runner.format_summary(rep)
    assert "FAILED: engine 2 loaded nothing from storage and the host" in summary and summary.endswith("FAIL")


def test_command_line_summary_and_json(tmp_path, capsys, monkeypatch):
    made = []
    mkdtemp = example_storage.tempfile.mkdtemp
    monkeypatch.setattr(example_storage.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    path = tmp_path / "tiers.json"
    assert llama_runner.main([*TIERED_ARGS, "--storage", "file", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "a HiRadixCache with a host tier over file (a temporary directory) storage" in out
    assert "    engine 2    " in out and out.rstrip().endswith("PASS")
    assert len(made) == 1 and not os.path.exists(made[0])  # the temporary directory is removed at exit
    doc = json.loads(path.read_text())
    (run,) = doc["runs"]
    assert doc["ok"] and doc["storage"]["backend"] == "file" and run["tiers"]["ok"]
    assert run["tiers"]["second_engine"]["storage_loaded_tokens"] > 0 and run["tiers"]["second_engine"]["host_loaded_tokens"] > 0
    assert all(run["tiers"]["tokens_identical"].values()) and run["storage"]["pages_written"] > 0


@needs_mooncake
def test_mooncake_runs_start_and_stop_their_own_master_or_join_one(capsys, monkeypatch):
    started = []
    start = MooncakeMaster.start
    monkeypatch.setattr(MooncakeMaster, "start", lambda self, *a, **kw: started.append(self) or start(self, *a, **kw))
    assert llama_runner.main([*TIERED_ARGS, "--storage", "mooncake"]) == 0
    assert "over mooncake (its own mooncake_master on 127.0.0.1)" in capsys.readouterr().out
    assert len(started) == 1 and started[0].pid is None and started[0].host == "127.0.0.1"  # stopped at exit
    with MooncakeMaster() as master:
        join = ["--mooncake-master", master.master_server_address, "--mooncake-metadata", master.metadata_server]
        assert llama_runner.main([*TIERED_ARGS, "--storage", "mooncake", *join]) == 0
        assert f"over mooncake (master {master.master_server_address})" in capsys.readouterr().out
        assert master.pid is not None and len(started) == 2  # the joined master runs on


def test_bad_tier_options_exit_2_naming_them(capsys):
    plain = [a for a in TIERED_ARGS if a not in ("--prefix-cache", "--host-tier")]
    for args, message in (
        ([*plain, "--host-tier"], "--host-tier is the prefix cache's host tier: needs --prefix-cache"),
        ([*plain, "--prefix-cache", "--storage", "file"], "--storage file sits below the host tier: needs --prefix-cache --host-tier"),
        ([*TIERED_ARGS, "--storage-dir", "x"], "--storage-dir needs --storage file or --storage mooncake, got no --storage"),
        ([*TIERED_ARGS, "--storage", "file", "--mooncake-master", "127.0.0.1:1", "--mooncake-metadata", "http://127.0.0.1:2/m"],
         "--mooncake-master needs --storage mooncake, got --storage file"),
        ([*TIERED_ARGS, "--storage", "file", "--storage-faults", "-0.5"], r"--storage-faults must be a probability in \[0, 1\], got -0.5"),
    ):
        assert llama_runner.main(args) == 2
        assert re.search(message, capsys.readouterr().err)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_on_cuda_a_second_engine_serves_the_prompts_from_storage(tmp_path, backend):
    """The host tier's streams and events on a GPU: backups written through once complete, loads
    read layer by layer; the tokens are still transformers'."""
    where = dict(directory=str(tmp_path / "pages")) if backend == "file" else {}
    rep = llama_runner.run(replace(TIERED, device="cuda", storage=StorageOptions(backend, **where)))
    run, t = tiers_of(rep)
    summary = llama_runner.format_summary(rep)
    assert rep.ok and rep.fp32_check is True and t.identical and t.hits, summary
