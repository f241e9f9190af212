"""examples/serve_sim.py with --model gemma3 and --model gpt-oss at a small size: the K/V of the
sliding-window layers in the SWA part of an ``SWAKVPool``, the full layers' in its full part, a
``SWATokenToKVPoolAllocator`` under serve_sim's scheduler giving each request's SWA slots back as its
tokens leave the window. Every full layer's row of every token and every sliding layer's row of the
tokens it holds must check out byte for byte, no window may lose a token, both parts must hold
exactly what the running requests keep after every step, and every slot must come back."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvassert import SMALL_SIM_ARGS, load_example, small_sim_config

serve_sim = load_example("serve_sim")  # puts examples/ on sys.path, where its parts are (support.sim)
from support.sim import sliding  # noqa: E402

# serve_sim's small run (kvassert) with a window of 16 tokens: prompts of up to 80 tokens slide it.
# gpt-oss at 2 layers (one sliding, one full: 128 + 128 B/token) and Gemma 3 at 6 (five local, one
# global: 640 + 128 B/token), budgets that give a few hundred full slots, so requests retract.
SMALL = {
    "gpt-oss": replace(small_sim_config(), model="gpt-oss", sliding_window=16),
    "gemma3": replace(small_sim_config(), model="gemma3", layers=6, sliding_window=16, kv_budget_mib=0.15),
}
MODELS = sorted(SMALL)
# Chats of 1-3 turns after a 40-token few-shot prompt on the prefix cache (an SWARadixCache), budgets
# in which the tree competes with the running requests for both parts, so it is evicted from both
# and its SWA eviction makes tombstones.
CHATS = {
    model: replace(
        cfg, requests=16, prompt_len=(4, 24), output_len=(2, 16), arrival_every=1.0, prefix_cache=True,
        few_shot_len=40, turns=(1, 3), kv_budget_mib={"gpt-oss": 0.06, "gemma3": 0.15}[model],
    )
    for model, cfg in SMALL.items()
}  # fmt: skip


def held_exactly_what_the_windows_keep(monkeypatch) -> list[int]:
    """Make every ``release_windows`` check, after its frees, that the full part holds each running
    request's pages, the SWA part exactly its pages from the oldest one inside the window, the
    mapping every token in the window and none of the pages given back; returns the list of running
    counts seen (one per call)."""
    release = sliding.SchedulerWithWindows.release_windows
    seen: list[int] = []

    def checked(self) -> None:
        release(self)
        a, p, w = self.allocator, self.page_size, self.window
        pages = sum(-(-r.kv_len // p) * p for r in self.running)
        first_kept = sum(max(0, r.kv_len - w + 1) // p * p for r in self.running)
        assert a.size_full - a.full_available_size() == pages
        assert a.size_swa - a.swa_available_size() == pages - first_kept
        for r in self.running:
            swa = a.translate_loc_from_full_to_swa(self.table.req_to_token[r.row, : r.kv_len].to(torch.int64))
            assert bool((swa[max(0, r.kv_len - w + 1) :] > 0).all())  # every token a later query reads
            assert bool((swa[: max(0, r.kv_len - w + 1) // p * p] == 0).all())  # every page that left the window
        a.check_integrity()
        seen.append(len(self.running))

    monkeypatch.setattr(sliding.SchedulerWithWindows, "release_windows", checked)
    return seen


@pytest.mark.parametrize("page_size", [16, 1], ids=["paged16", "token"])
@pytest.mark.parametrize("model", MODELS)
def test_sliding_window_runs_verify_every_byte_and_give_windows_back(monkeypatch, model, page_size):
    cfg = replace(SMALL[model], page_size=page_size, validate=True)
    seen = held_exactly_what_the_windows_keep(monkeypatch)
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    s = res.swa
    assert res.ok and res.served == res.verified_requests == cfg.requests, summary
    assert len(seen) >= res.forward_steps and max(seen) > 1, summary
    assert res.retractions > 0 or page_size == 1, summary  # the paged runs retract: release frees both parts
    assert res.fused_calls + res.reference_calls == res.forward_steps * cfg.layers
    assert s.given_back > 0 and s.lost_window == 0, summary
    assert 0 < s.checked_tokens < res.verified_tokens  # the sliding layers hold only the windows
    assert 0 < s.swa_peak <= s.size_swa and 0 < s.full_peak <= s.size and res.leaked_slots == 0
    assert res.pool_size == s.size + s.size_swa and s.size_swa <= cfg.swa_full_tokens_ratio * s.size


@pytest.mark.parametrize("page_size", [16, 1], ids=["paged16", "token"])
@pytest.mark.parametrize("model", MODELS)
def test_sliding_window_spec_decode_writes_both_parts(monkeypatch, model, page_size):
    """Drafts written into both parts with set_kv_buffer_prefix_valid (a sliding layer's at the
    translated SWA slots), compacted with move_kv_cache, rejected slots of both parts freed: every
    accepted token checks out, the windows stay whole and exact, every slot comes back."""
    cfg = replace(SMALL[model], spec_k=4, page_size=page_size, validate=True)
    seen = held_exactly_what_the_windows_keep(monkeypatch)
    res = serve_sim.run(cfg)
    assert res.ok, serve_sim.format_summary(res)
    assert res.spec_steps > 0 and 0 < res.accepted_tokens < res.drafted_tokens and res.moved_slots == res.accepted_tokens
    assert res.swa.given_back > 0 and res.swa.lost_window == 0 and seen
    assert res.retractions > 0 or page_size == 1, serve_sim.format_summary(res)


def test_sliding_window_spec_decode_at_page_64():
    cfg = replace(SMALL["gpt-oss"], spec_k=3, page_size=64, kv_budget_mib=0.2, prompt_len=(60, 140))
    res = serve_sim.run(cfg)
    assert res.ok and res.swa.given_back > 0 and res.accepted_tokens > 0, serve_sim.format_summary(res)


def test_a_scheduler_that_gives_back_a_page_of_the_window_fails_the_check(monkeypatch):
    """Freeing the SWA part of one page more than left the window (never the last token's): the
    check finds tokens inside the window without an SWA slot."""
    live_from = sliding.live_from
    monkeypatch.setattr(
        sliding, "live_from", lambda n, w, p: min(live_from(n, w, p) + p, (n - 1) // p * p) if n > w else live_from(n, w, p)
    )  # fmt: skip
    res = serve_sim.run(SMALL["gpt-oss"])
    assert not res.ok and res.swa.lost_window > 0 and res.mismatched_tokens >= res.swa.lost_window
    assert res.first_mismatch.which == "SWA slot"
    assert "FAILED" in serve_sim.format_summary(res)


@pytest.mark.parametrize("model", MODELS)
def test_a_corrupted_byte_fails_the_sliding_window_check(model):
    res = serve_sim.run(replace(SMALL[model], corrupt=True, layers=SMALL[model].layers + 1))  # the last layer slides
    assert not res.ok and res.mismatched_tokens == 1 and res.first_mismatch.layer == SMALL[model].layers


def test_kv_bytes_per_request_at_a_long_context():
    """gpt-oss at 4 layers of 4 KV heads x 64, FP8, pages of 16, a window of 128, at 131,072 tokens:
    the two full layers keep every token (1,024 B each), the two sliding ones the 128 tokens of the
    window's pages; a pool of every layer keeps 2,048 B per token."""
    cfg = serve_sim.SimConfig(model="gpt-oss", layers=4, heads=4, head_dim=64, page_size=16, device="cpu")
    ours, every = sliding.request_bytes(cfg, 131072)
    assert (ours, every) == (131072 * 1024 + 128 * 1024, 131072 * 2048)
    gemma = replace(cfg, model="gemma3", layers=6, sliding_window=1024, page_size=64)  # 1 global, 5 local
    assert sliding.request_bytes(gemma, 131072) == (131072 * 512 + 1024 * 5 * 512, 131072 * 6 * 512)
    assert sliding.request_bytes(gemma, 100) == (128 * 512 + 128 * 5 * 512, 128 * 6 * 512)  # shorter than the window


def test_sliding_window_command_line(capsys):
    assert serve_sim.main([*SMALL_SIM_ARGS, "--model", "gpt-oss", "--sliding-window", "16"]) == 0
    out = capsys.readouterr().out
    assert "SWATokenToKVPoolAllocator(page_size=16)" in out and "SWAKVPool of" in out
    assert "gpt-oss: 1 sliding-window layers of 16 tokens, 1 full-attention" in out
    assert "every window whole" in out and "given back with free_swa" in out
    assert "long context    a request of 131,072 tokens keeps" in out and out.rstrip().endswith("PASS")
    assert serve_sim.parse_args(["--model", "gemma3"]).layers == 6  # five local and one global by default
    for bad, message in (
        (["--model", "gemma3", "--layers", "5"], "--model gemma3 needs --layers 6 or more"),
        (["--model", "gpt-oss", "--sliding-window", "1"], "--sliding-window must be an int >= 2, got 1"),
        (["--model", "gpt-oss", "--swa-full-tokens-ratio", "0"], "--swa-full-tokens-ratio must be a number in (0, 1]"),
        (["--model", "gpt-oss", "--host-tier"], "--model gpt-oss runs without --host-tier"),
        (["--model", "gpt-oss", "--cpu-park"], "--model gpt-oss runs without --cpu-park"),
        (["--model", "gpt-oss", "--kv-budget-mib", "0.01"], "--kv-budget-mib must hold the longest request"),
    ):
        assert serve_sim.main([*SMALL_SIM_ARGS, *bad]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_sim.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model gemma3 or gpt-oss with --host-tier" in text and "--sliding-window SLIDING_WINDOW" in text


def test_sliding_window_on_the_fused_kernel(monkeypatch):
    """Every write on the fused Triton kernel (compiled on a GPU, the interpreter on CPU CI), a
    sliding layer's at the translated slots, verify writes and moves too."""
    monkeypatch.setenv("KVPOOL_FUSED", "always")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = serve_sim.run(replace(SMALL["gpt-oss"], requests=4, output_len=(2, 10), spec_k=3, device=device))
    assert res.ok and res.reference_calls == 0 and res.fused_calls > 0, serve_sim.format_summary(res)


def held_exactly_the_tree_and_the_windows(monkeypatch) -> list[int]:
    """Make every ``release_windows`` of a prefix-cache run check, after its frees, that each part
    holds exactly the tree's tokens (the SWA part: of its live nodes) plus each running request's own
    pages from ``cache_protected_len`` (the SWA part: from what it gave back), that live nodes map to
    SWA slots and tombstones do not, and that every token in a running request's window has its SWA
    slot; returns the tombstones seen at each call."""
    release = sliding.SchedulerWithWindows.release_windows
    seen: list[int] = []

    def checked(self) -> None:
        release(self)
        a, p, w = self.allocator, self.page_size, self.window
        tree_full = tree_swa = tombs = 0
        stack = list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            mapped = a.full_to_swa_index_mapping[node.value]
            tree_full += len(node.value)
            if node.swa_tombstone:
                tombs += 1
                assert bool((mapped == 0).all())
            else:
                tree_swa += len(node.value)
                assert bool((mapped > 0).all())
        own_full = own_swa = 0
        for r in self.running:
            end = -(-r.kv_len // p) * p
            own_full += end - r.cache_protected_len
            own_swa += end - max(r.cache_protected_len, r.swa_evicted_seqlen)
            swa = a.translate_loc_from_full_to_swa(self.table.req_to_token[r.row, : r.kv_len].to(torch.int64))
            assert bool((swa[max(0, r.kv_len - w + 1) :] > 0).all())  # every token a later query reads
        assert a.size_full - a.full_available_size() == tree_full + own_full
        assert a.size_swa - a.swa_available_size() == tree_swa + own_swa
        seen.append(tombs)

    monkeypatch.setattr(sliding.SchedulerWithWindows, "release_windows", checked)
    return seen


@pytest.mark.parametrize("page_size", [16, 4], ids=["paged16", "paged4"])
@pytest.mark.parametrize("model", MODELS)
def test_sliding_window_chats_hit_the_prefix_cache_and_every_row_verifies(monkeypatch, model, page_size):
    """With --validate, check_integrity of tree, allocator, table and running requests before every
    step; every full row and held SWA row, the cached ones included, byte-equal to what was written."""
    cfg = replace(CHATS[model], page_size=page_size, validate=True)
    seen = held_exactly_the_tree_and_the_windows(monkeypatch)
    res = serve_sim.run(cfg)
    summary = serve_sim.format_summary(res)
    stats = res.prefix
    assert res.ok and res.served == res.verified_requests == cfg.requests, summary
    assert stats.matched_tokens > 0 and stats.evicted_swa_tokens > 0, summary
    assert stats.tombstoned_nodes > 0 and max(seen) > 0, summary  # SWA eviction kept full KV of inner nodes
    assert stats.integrity_checks == res.steps + 1 and len(seen) >= res.forward_steps
    assert res.verified_tokens > res.prefill_tokens + res.decode_tokens  # cached rows were checked too
    assert res.swa.lost_window == 0 and res.leaked_slots == 0
    assert f"made {stats.tombstoned_nodes} nodes ({stats.tombstoned_tokens} tokens) tombstones" in summary


def test_sliding_window_prefix_cache_command_line(capsys):
    args = [*SMALL_SIM_ARGS, "--model", "gpt-oss", "--sliding-window", "16", "--prefix-cache", "--few-shot-len", "40",
            "--prompt-len", "4", "24", "--output-len", "2", "16", "--requests", "16", "--kv-budget-mib", "0.06"]  # fmt: skip
    assert serve_sim.main(args) == 0
    out = capsys.readouterr().out
    assert "prefix cache    SWARadixCache(page_size=16, lru)" in out and "tombstones (SWA KV freed" in out
    assert "every window whole" in out and out.rstrip().endswith("PASS")
    assert serve_sim.main([*args, "--corrupt"]) == 1  # one flipped byte: the check fails the run
    assert "FAIL" in capsys.readouterr().out
