"""examples/serve_sim.py --prefix-cache: multi-turn chats after a common few-shot prompt on a prefix
cache (RadixCache; HiRadixCache with --host-tier; MambaRadixCache with --model qwen3.5; HiMambaRadixCache
with both), run in-process at a small size: every row the tree hands out, reloads or forks is checked
byte for byte, and a slot given back while the tree holds it, a corrupted cached or host byte, or a
fork without its copy fails the run."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from kvassert import SMALL_SIM_ARGS, load_example, small_sim_config
from kvpool.errors import IntegrityError

serve_sim = load_example("serve_sim")  # puts examples/ on sys.path, where its parts are (support.sim)
from support.sim import prefix as prefix_sim  # noqa: E402

# The small run with memory pressure (kvassert): 256 B/token, ~200 slots.
SMALL = small_sim_config()



# Conversations of 1-3 turns after a 40-token few-shot prompt, 256 B/token, ~240 slots for turns of
# up to 160 tokens: the tree competes with the running requests for pages and gets evicted.
CHATS = replace(
    SMALL, requests=16, prompt_len=(4, 24), output_len=(2, 16), arrival_every=1.0, kv_budget_mib=0.06,
    prefix_cache=True, few_shot_len=40, turns=(1, 3),
)  # fmt: skip
# The hybrid model's states take most of a budget: 1 full-attention layer's K/V, 3 linear layers' states.
HYBRID_CHATS = replace(CHATS, model="qwen3.5", layers=4, kv_budget_mib=0.3)


def run_chats(cfg):
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    assert res.ok and res.served == cfg.requests, summary
    return res, res.prefix, summary


def test_a_token_s_kv_derives_from_its_prefix_not_its_request():
    arrivals = prefix_sim.make_chats(CHATS)
    first = sorted(arrivals.queue + list(arrivals.follow.values()), key=lambda r: r.rid)
    a, b = first[0], next(r for r in first if r.tokens[: CHATS.few_shot_len + 1] != first[0].tokens[: CHATS.few_shot_len + 1])
    n = CHATS.few_shot_len
    kv = lambda r, end: serve_sim.kv_values(r.keys(0, end, torch.device("cpu")), torch.arange(end), 1, 2, 32)
    assert torch.equal(kv(a, n).view(torch.int16), kv(b, n).view(torch.int16))  # the shared few-shot prompt
    assert not torch.equal(kv(a, n + 1)[n], kv(b, n + 1)[n])  # the first token after it differs: so does all after
    assert a.keys(0, 3, torch.device("cpu")).tolist() == prefix_sim.prefix_keys(a.tokens[:3])


def test_a_conversation_s_next_turn_holds_the_last_one_and_arrives_after_its_answer():
    arrivals = prefix_sim.make_chats(CHATS)
    assert len(arrivals.queue) + len(arrivals.follow) == CHATS.requests
    prev_rid, nxt = next(iter(arrivals.follow.items()))
    prev = next(r for r in arrivals.queue if r.rid == prev_rid)
    assert nxt.tokens[: len(prev.tokens)] == prev.tokens and nxt.prompt_len > len(prev.tokens)
    assert all(r.tokens[: CHATS.few_shot_len] == prev.tokens[: CHATS.few_shot_len] for r in arrivals.queue)
    arrivals.finished(prev, 50)
    assert nxt.arrival == 50 + nxt.think and nxt in arrivals.queue and prev_rid not in arrivals.follow
    assert [r.arrival for r in arrivals.queue] == sorted(r.arrival for r in arrivals.queue)


@pytest.mark.parametrize("page_size", [16, 4, 1], ids=["paged16", "paged4", "token"])
def test_chats_hit_the_cache_under_memory_pressure_and_every_cached_row_verifies(page_size):
    """With --validate, check_integrity of tree, allocator, table and running requests before every step."""
    res, stats, summary = run_chats(replace(CHATS, page_size=page_size, validate=True))
    assert stats.matched_tokens > 0 and stats.evict_calls > 0 and stats.evicted_tokens > 0, summary
    assert stats.integrity_checks == res.steps + 1  # every step, and once at the end
    assert res.verified_tokens > res.prefill_tokens + res.decode_tokens  # cached rows were checked too
    assert f"hit rate {100 * stats.hit_rate:.1f}%" in summary and "prefill tokens saved" in summary


def test_without_memory_pressure_the_cache_saves_exactly_what_it_matched():
    res, stats, summary = run_chats(replace(CHATS, kv_budget_mib=1.0))
    assert res.retractions == 0 and stats.evict_calls == 0 and stats.lookups == CHATS.requests, summary
    assert res.prefill_tokens == stats.prompt_tokens - stats.matched_tokens
    assert stats.hit_rate > 0.5, summary  # the few-shot prompt and every earlier turn


def test_slots_the_tree_still_holds_given_back_are_refused(monkeypatch):
    """A scheduler that frees a finished request's matched prefix, which the tree keeps: the cache
    refuses those slots when a request continues on them, and the integrity check names them."""
    release = prefix_sim.PrefixScheduler.release

    def release_prefix_too(self, r):
        prefix = self.slots_of(r)[: r.cache_protected_len]
        release(self, r)
        self.allocator.free(prefix)

    monkeypatch.setattr(prefix_sim.PrefixScheduler, "release", release_prefix_too)
    # The cache refuses the tree's own slots once they are free: the next request continuing on them
    # is refused before its K/V is written over.
    with pytest.raises(ValueError, match="must hold slots handed out by the allocator, got slot .* which is free"):
        serve_sim.run(CHATS)
    with pytest.raises(IntegrityError, match="slots owned but free in the allocator"):
        serve_sim.run(replace(CHATS, validate=True))  # caught at the next step's check


def test_a_corrupted_cached_byte_fails_every_request_that_reads_it():
    res = serve_sim.run(replace(CHATS, corrupt=True))
    assert not res.ok and res.mismatched_tokens >= 1
    assert "FAILED" in serve_sim.format_summary(res)


@pytest.mark.parametrize(
    "policy, layout, backend",
    [("write_through", "page_first", "kernel"), ("write_back", "layer_first", "direct"),
     ("write_through_selective", "page_first", "direct")],  # fmt: skip
)
def test_host_tier_backs_up_evicted_nodes_and_loads_them_back_byte_exact(policy, layout, backend):
    cfg = replace(CHATS, host_tier=True, host_write_policy=policy, host_layout=layout, host_io_backend=backend)
    res, stats, summary = run_chats(replace(cfg, validate=True))
    assert stats.backed_up_tokens > 0 and stats.loaded_tokens > 0 and res.reloaded_tokens == stats.loaded_tokens
    assert res.reload_mismatches == 0 and "HiRadixCache" in summary and "reload check    OK" in summary
    plain = serve_sim.run(replace(cfg, host_tier=False))
    assert stats.hit_rate > plain.prefix.hit_rate and res.prefill_tokens < plain.prefill_tokens


def test_a_corrupted_host_byte_fails_the_reload_check(monkeypatch):
    load_back = prefix_sim.HiRadixCache.init_load_back

    def corrupt_then_load(self, node, *args, **kwargs):
        host = self.token_to_kv_pool_host
        slot = int(node.host_value[0])
        row = host.k_buffer[0, slot] if host.layout == "layer_first" else host.k_buffer[slot, 0]
        row.view(torch.uint8).view(-1)[0] ^= 0x5A
        return load_back(self, node, *args, **kwargs)

    monkeypatch.setattr(prefix_sim.HiRadixCache, "init_load_back", corrupt_then_load)
    res = serve_sim.run(replace(CHATS, host_tier=True))
    assert not res.ok and res.reload_mismatches > 0
    assert "reload check    FAILED" in serve_sim.format_summary(res)


def test_mla_latent_rows_are_cached_and_checked():
    res, stats, _ = run_chats(replace(CHATS, model="deepseek-v3", kv_budget_mib=0.3, validate=True))
    assert stats.matched_tokens > 0 and stats.evict_calls > 0


@pytest.mark.parametrize("page_size", [16, 1], ids=["track-slots", "token"])
def test_hybrid_matches_fork_checked_state_snapshots(page_size):
    """Pages of 16: requests snapshot their state into track slots at page boundaries; pages of 1:
    the state after a request's last token is cached. Every fork is checked against the recurrence,
    and state snapshots are evicted for room as KV is."""
    res, stats, summary = run_chats(replace(HYBRID_CHATS, page_size=page_size, validate=True))
    assert stats.forks > 0 and stats.matched_tokens > 0 and stats.evicted_states > 0, summary
    assert res.state_checked == res.served + stats.forks and res.state_mismatches == 0
    assert "MambaRadixCache" in summary and "forked into requests' slots (each checked)" in summary


def test_hybrid_a_match_without_its_state_fails_the_state_check(monkeypatch):
    monkeypatch.setattr(prefix_sim.MambaRadixCache, "_fork_into", lambda self, node, req, dst=None: True)  # no copy
    res = serve_sim.run(HYBRID_CHATS)
    assert not res.ok and res.state_mismatches > 0 and res.mismatched_tokens == 0


@pytest.mark.parametrize(
    "how", [dict(page_size=16), dict(page_size=1), dict(host_write_policy="write_back", host_io_backend="direct")],
    ids=["track-slots", "token", "write-back-direct"],
)
def test_hybrid_host_tier_loads_kv_and_states_back_checked(how):
    """HiMambaRadixCache: evicted nodes park their KV pages and state snapshots on the host; a match
    that reaches them loads both back, forks the loaded state into the request's slot, and both are
    checked (the rows byte for byte, the state against its recurrence); nothing stays held."""
    cfg = replace(HYBRID_CHATS, host_tier=True, validate=True, **how)
    res, stats, summary = run_chats(cfg)
    assert stats.loaded_tokens > 0 and stats.loaded_states > 0 and res.reloaded_tokens == stats.loaded_tokens, summary
    assert res.reload_mismatches == 0 and res.state_mismatches == 0 and res.state_checked == res.served + stats.forks
    assert stats.integrity_checks == res.steps + 1 and res.leaked_slots == 0
    assert "HiMambaRadixCache" in summary and f"{stats.loaded_states} loaded back from the host" in summary
    plain = serve_sim.run(replace(cfg, host_tier=False))
    assert stats.hit_rate > plain.prefix.hit_rate and res.prefill_tokens < plain.prefill_tokens


def test_hybrid_a_load_without_forking_its_state_fails_the_state_check(monkeypatch):
    """Control: the loads start but the loaded state is not forked into the request's slot."""
    monkeypatch.setattr(prefix_sim.hybrid, "fork_loaded", lambda cache, params, node, prefix: cache.ready_to_load_host_cache())
    res = serve_sim.run(replace(HYBRID_CHATS, host_tier=True))
    assert res.prefix.loaded_tokens > 0 and not res.ok and res.state_mismatches > 0 and res.reload_mismatches == 0


def test_prefix_cache_command_line(capsys):
    args = [*SMALL_SIM_ARGS, "--prefix-cache", "--few-shot-len", "40", "--turns", "1", "3", "--prompt-len", "4", "24",
            "--output-len", "2", "16", "--kv-budget-mib", "0.06", "--requests", "16"]  # fmt: skip
    assert serve_sim.main(args) == 0
    out = capsys.readouterr().out
    assert "prefix cache    RadixCache(page_size=16, lru): " in out and out.rstrip().endswith("PASS")
    assert serve_sim.main([*args, "--host-tier", "--host-write-policy", "write_back"]) == 0
    assert "HiRadixCache" in capsys.readouterr().out
    assert serve_sim.main([*args, "--model", "qwen3.5", "--layers", "4", "--kv-budget-mib", "0.3", "--host-tier"]) == 0
    assert "prefix cache    HiMambaRadixCache(page_size=16, lru): " in capsys.readouterr().out
    for bad, message in (
        (["--cpu-park"], "--prefix-cache runs without --cpu-park"),
        (["--spec-decode", "2"], "--prefix-cache runs without --spec-decode"),
        (["--turns", "3", "1"], "--turns must be a range MIN MAX with 1 <= MIN <= MAX, got 3 1"),
    ):
        assert serve_sim.main([*args, *bad]) == 2
        assert re.search(message, capsys.readouterr().err)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "how", [dict(), dict(host_tier=True), dict(host_tier=True, host_write_policy="write_back", host_io_backend="direct"),
            dict(model="qwen3.5", layers=4, kv_budget_mib=0.3), dict(model="qwen3.5", layers=4, kv_budget_mib=0.3, host_tier=True)],  # fmt: skip
    ids=["radix", "hiradix-write-through", "hiradix-write-back-direct", "hybrid", "himamba"],
)
def test_prefix_cache_on_cuda(how):
    """The fused writes, the host tier's streams and events (backups and layer-by-layer loads in
    flight keep their nodes locked), and the state pool's forks, on a GPU."""
    res, stats, summary = run_chats(replace(CHATS, device="cuda", validate=True, **how))
    assert res.fused_calls > 0 and stats.matched_tokens > 0 and res.leaked_slots == 0, summary
    if how.get("host_tier"):
        assert stats.loaded_tokens > 0 and res.reload_mismatches == 0, summary
    if how.get("host_tier") and how.get("model"):
        assert stats.loaded_states > 0 and res.state_mismatches == 0, summary
