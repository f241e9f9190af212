"""examples/serve_sim.py --prefix-cache --host-tier --storage file|mooncake: chats on a HiRadixCache
whose host copies are written through to a storage tier and whose matches fetch from it what the
small host tier dropped. The summary gives each tier's hit rate (device, host, storage) and the
prefill saved; rows served from storage are byte-checked like every row reloaded from the host (a
byte changed on the way from storage fails the run); injected storage failures and delays cost hits
only: every request still verifies and every integrity check passes. The Mooncake runs start their
own master on 127.0.0.1 (or join one) and skip, with the import error, where Mooncake cannot load."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest

from kvassert import SMALL_SIM_ARGS, load_example, small_sim_config
from kvpool.storage.mooncake_config import import_store_class

serve_sim = load_example("serve_sim")  # puts examples/ on sys.path, where its parts are (support.sim)
from support import storage as example_storage  # noqa: E402
from support.storage import StorageOptions  # noqa: E402

try:
    import_store_class()
    NO_MOONCAKE = None
except ImportError as e:
    NO_MOONCAKE = str(e)
needs_mooncake = pytest.mark.skipif(NO_MOONCAKE is not None, reason=NO_MOONCAKE or "")

# Chats of 2-4 turns after a 40-token few-shot prompt under memory pressure (256 B/token, ~300
# slots), with a host tier of half the device's slots: the host drops backed-up pages that storage
# then serves back.
CHATS = replace(
    small_sim_config(), requests=24, prompt_len=(4, 24), output_len=(2, 16), arrival_every=1.0, kv_budget_mib=0.08,
    prefix_cache=True, few_shot_len=40, turns=(2, 4), host_tier=True, host_ratio=0.5,
)  # fmt: skip
CHAT_ARGS = [
    *SMALL_SIM_ARGS, "--prefix-cache", "--few-shot-len", "40", "--turns", "2", "4", "--prompt-len", "4", "24",
    "--output-len", "2", "16", "--kv-budget-mib", "0.08", "--requests", "24", "--host-tier", "--host-ratio", "0.5",
    "--arrival-every", "1",
]  # fmt: skip


def run_chats(cfg):
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    assert res.ok and res.served == cfg.requests, summary
    return res, res.prefix, summary


def tier_rates(summary):
    m = re.search(r"hit rate by tier: device [\d.]+%, host [\d.]+%, storage [\d.]+% \((\d+) / (\d+) / (\d+) tokens\)", summary)
    assert m, summary
    return tuple(int(g) for g in m.groups())


def check_served_from_storage(res, stats, summary):
    """Storage served tokens, each reloaded row was byte-checked, and the summary's rates add up."""
    assert stats.storage_tokens > 0 and stats.storage["pages_written"] > 0 and stats.storage["pages_read"] > 0, summary
    assert res.reloaded_tokens == stats.loaded_tokens >= stats.storage_tokens and res.reload_mismatches == 0
    device, host, storage = tier_rates(summary)
    assert (device, host, storage) == (stats.matched_tokens, stats.loaded_tokens - stats.storage_tokens, stats.storage_tokens)
    assert f"prefill tokens saved {device + host + storage} " in summary and "reload check    OK" in summary


def test_file_storage_serves_what_the_host_tier_dropped_byte_exact(tmp_path):
    cfg = replace(CHATS, validate=True, storage=StorageOptions("file", directory=str(tmp_path / "pages")))
    res, stats, summary = run_chats(cfg)
    check_served_from_storage(res, stats, summary)
    assert stats.host_evicted_tokens > 0 and "storage tier file (" in summary
    files = sum(name.endswith(".kvpage") for name in os.listdir(tmp_path / "pages"))
    assert 0 < files <= stats.storage["pages_written"]  # a page stored again keeps its one file
    without = serve_sim.run(replace(cfg, storage=None))
    assert without.ok and res.prefill_tokens < without.prefill_tokens  # storage hits are prefill saved


@needs_mooncake
def test_mooncake_storage_serves_what_the_host_tier_dropped_byte_exact():
    res, stats, summary = run_chats(replace(CHATS, validate=True, storage=StorageOptions("mooncake")))
    check_served_from_storage(res, stats, summary)
    assert "storage tier mooncake (its own mooncake_master on 127.0.0.1)" in summary


@pytest.mark.parametrize("backend", ["file", pytest.param("mooncake", marks=needs_mooncake)])
def test_storage_faults_lose_no_data_and_leave_the_tree_consistent(backend):
    """Failures, raised errors, short reads and writes and delays at p=0.25 each: every request's K/V
    verifies, check_integrity passes before every step (validate), and the failures are counted."""
    res, stats, summary = run_chats(replace(CHATS, validate=True, storage=StorageOptions(backend, faults=0.25, seed=1)))
    assert stats.integrity_checks > res.steps // 2 and res.reload_mismatches == 0
    assert sum(stats.faults.get(k, 0) for k in ("fail", "raise", "short")) > 0 and stats.faults.get("delay", 0) > 0
    assert stats.storage["write_failures"] + stats.storage["prefetch_failures"] > 0, summary
    assert "faults injected into storage calls: " in summary


def test_a_byte_changed_on_the_way_from_storage_fails_the_reload_check(tmp_path, monkeypatch):
    """Control: a page read from storage with one byte flipped after its checksum was checked reaches
    the device, and the reload check catches it."""
    get = example_storage.HiCacheFile.get

    def flipped(self, key, target_location=None, target_sizes=None):
        page = get(self, key, target_location, target_sizes)
        if page is not None:
            page.view(-1)[page.numel() // 3] ^= 0x5A
        return page

    monkeypatch.setattr(example_storage.HiCacheFile, "get", flipped)
    res = serve_sim.run(replace(CHATS, storage=StorageOptions("file", directory=str(tmp_path / "pages"))))
    assert res.prefix.storage_tokens > 0 and not res.ok and res.reload_mismatches > 0
    assert "reload check    FAILED" in serve_sim.format_summary(res)


def test_storage_command_line(capsys, monkeypatch):
    made = []
    mkdtemp = example_storage.tempfile.mkdtemp
    monkeypatch.setattr(example_storage.tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    assert serve_sim.main([*CHAT_ARGS, "--storage", "file"]) == 0
    out = capsys.readouterr().out
    assert "hit rate by tier: device " in out and "storage tier file (a temporary directory)" in out
    assert out.rstrip().endswith("PASS") and len(made) == 1 and not os.path.exists(made[0])  # removed at exit
    for bad, message in (
        (["--storage", "mooncake", "--storage-dir", "x"], "--storage-dir is the file backend's directory: needs --storage file, got --storage mooncake"),
        (["--storage-faults", "0.1"], "--storage-faults needs --storage file or --storage mooncake, got no --storage"),
        (["--storage", "file", "--storage-faults", "2"], r"--storage-faults must be a probability in \[0, 1\], got 2.0"),
        (["--storage", "mooncake", "--mooncake-master", "127.0.0.1:1"], "give both or neither"),
    ):
        assert serve_sim.main([*CHAT_ARGS, *bad]) == 2
        assert re.search(message, capsys.readouterr().err)
    no_host = [a for a in CHAT_ARGS if a != "--host-tier"]
    assert serve_sim.main([*no_host, "--storage", "file"]) == 2
    assert "--storage file sits below the prefix cache's host tier: needs --prefix-cache --host-tier" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["file", pytest.param("mooncake", marks=needs_mooncake)])
def test_storage_on_cuda(backend):
    """The fused writes and the host tier's streams and events: a backup is written through to
    storage once its copy completes, and every row reloaded, from storage or the host, verifies."""
    res, stats, summary = run_chats(replace(CHATS, device="cuda", validate=True, storage=StorageOptions(backend)))
    assert res.fused_calls > 0 and res.reload_mismatches == 0 and stats.storage["pages_written"] > 0, summary
