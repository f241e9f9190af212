"""examples/serve_sim.py --model qwen3.5 --prefix-cache --host-tier --storage file|mooncake: chats on
a HiMambaRadixCache whose KV pages and state snapshots are written through to a storage tier and
whose matches fetch both from it, as far as a stored state, when the small host tier dropped them.
The summary gives each tier's hit rate and the prefill saved; rows served from storage are
byte-checked like every reloaded row, and a state that came from storage is checked against its
recurrence like every forked one (a byte changed on the way fails the run); injected storage
failures and delays cost hits only. The Mooncake runs start their own master on 127.0.0.1 and skip,
with the import error, where Mooncake cannot load."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvassert import SMALL_SIM_ARGS, load_example, small_sim_config
from kvpool.storage.mooncake_config import import_store_class

serve_sim = load_example("serve_sim")  # puts examples/ on sys.path, where its parts are (support.sim)
from support.storage import StorageOptions  # noqa: E402

try:
    import_store_class()
    NO_MOONCAKE = None
except ImportError as e:
    NO_MOONCAKE = str(e)
BACKENDS = ["file", pytest.param("mooncake", marks=pytest.mark.skipif(NO_MOONCAKE is not None, reason=NO_MOONCAKE or ""))]

# Chats of 2-4 turns after a 40-token few-shot prompt on Qwen3.5's hybrid pools (1 full-attention
# layer's K/V, 3 linear layers' states) under memory pressure, a host tier of half the device's.
HYBRID_CHATS = replace(
    small_sim_config(), requests=24, prompt_len=(4, 24), output_len=(2, 16), arrival_every=1.0, kv_budget_mib=0.3,
    prefix_cache=True, few_shot_len=40, turns=(2, 4), host_tier=True, host_ratio=0.5, model="qwen3.5", layers=4,
)  # fmt: skip
HYBRID_ARGS = [
    *SMALL_SIM_ARGS, "--prefix-cache", "--few-shot-len", "40", "--turns", "2", "4", "--prompt-len", "4", "24",
    "--output-len", "2", "16", "--kv-budget-mib", "0.3", "--requests", "24", "--host-tier", "--host-ratio", "0.5",
    "--arrival-every", "1", "--model", "qwen3.5", "--layers", "4",
]  # fmt: skip


def run_chats(cfg):
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    assert res.ok and res.served == cfg.requests, summary
    return res, res.prefix, summary


@pytest.mark.parametrize("backend", BACKENDS)
def test_storage_serves_kv_and_states_the_host_tier_dropped_checked(tmp_path, backend):
    where = dict(directory=str(tmp_path / "pages")) if backend == "file" else {}
    res, stats, summary = run_chats(replace(HYBRID_CHATS, validate=True, storage=StorageOptions(backend, **where)))
    st = stats.storage
    assert stats.storage_tokens > 0 and st["pages_written"] > 0 and st["states_written"] > 0 and st["states_read"] > 0, summary
    assert res.reloaded_tokens == stats.loaded_tokens >= stats.storage_tokens and res.reload_mismatches == 0
    assert res.state_mismatches == 0 and res.state_checked == res.served + stats.forks and res.leaked_slots == 0
    m = re.search(r"hit rate by tier: device [\d.]+%, host [\d.]+%, storage [\d.]+% \((\d+) / (\d+) / (\d+) tokens\)", summary)
    assert m, summary
    device, host, storage = (int(g) for g in m.groups())
    assert (device, host, storage) == (stats.matched_tokens, stats.loaded_tokens - stats.storage_tokens, stats.storage_tokens)
    assert f"prefill tokens saved {device + host + storage} " in summary and "reload check    OK" in summary
    assert f"state snapshots in storage: {st['states_written']} written, {st['states_read']} read" in summary
    without = serve_sim.run(replace(HYBRID_CHATS, storage=None))
    assert without.ok and res.prefill_tokens < without.prefill_tokens  # storage hits are prefill saved


def test_storage_faults_lose_no_data_and_leave_the_tree_consistent():
    res, stats, summary = run_chats(replace(HYBRID_CHATS, validate=True, storage=StorageOptions("file", faults=0.25, seed=1)))
    assert stats.integrity_checks > res.steps // 2 and res.reload_mismatches == 0 and res.state_mismatches == 0
    assert sum(stats.faults.get(k, 0) for k in ("fail", "raise", "short")) > 0, summary
    assert "faults injected into storage calls: " in summary


def test_a_state_byte_changed_on_the_way_from_storage_fails_the_state_check(tmp_path, monkeypatch):
    """Control: a state read from storage has one byte flipped before it enters the host tier: the
    request that forks it computes from another state, and the state check catches it."""
    from kvpool.cache.himamba_storage import StateStorageTier

    reserve = StateStorageTier.reserve

    def flipped(self, op):
        if op.beside is not None:
            op.beside[op.beside.numel() // 2] ^= 0x5A
        return reserve(self, op)

    monkeypatch.setattr(StateStorageTier, "reserve", flipped)
    res = serve_sim.run(replace(HYBRID_CHATS, storage=StorageOptions("file", directory=str(tmp_path / "pages"))))
    assert res.prefix.storage_tokens > 0 and not res.ok and res.state_mismatches > 0 and res.reload_mismatches == 0


def test_hybrid_storage_command_line(capsys):
    assert serve_sim.main([*HYBRID_ARGS, "--storage", "file"]) == 0
    out = capsys.readouterr().out
    assert "prefix cache    HiMambaRadixCache(" in out and "hit rate by tier: device " in out
    assert "state snapshots in storage: " in out and out.rstrip().endswith("PASS")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_storage_on_cuda(backend):
    """The host pools' streams and events: KV pages and states written through once their backups
    complete, and every row and state reloaded, from storage or the host, verifies."""
    res, stats, summary = run_chats(replace(HYBRID_CHATS, device="cuda", validate=True, storage=StorageOptions(backend)))
    assert res.reload_mismatches == 0 and res.state_mismatches == 0 and stats.storage["states_written"] > 0, summary
