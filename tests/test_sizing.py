"""Sizing helper: bytes per token and the largest pool that fits a budget, checked against the
bytes an MHATokenToKVPool and an MLATokenToKVPool actually allocate; for hybrid models, the split of
one budget between KV slots, state slots and speculative scratch, and for sliding-window models
between the full and SWA parts (and a draft pool), against what the pools allocate."""

from __future__ import annotations

import doctest

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import kvpool.pools.sizing as sizing_module
from kvassert import CACHE_DTYPES
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.mla_pool import MLATokenToKVPool
from kvpool.pools.sizing import (
    KVGeometry,
    kv_bytes_per_token,
    max_pool_size,
    mla_kv_bytes_per_token,
    plan_hybrid_pools,
    plan_swa_pools,
)
from kvpool.pools.swa_pool import SWAKVPool
from kvpool.pools.state_params import MambaCacheParams, MambaStateShape

def test_docstring_examples_run():
    assert doctest.testmod(sizing_module).failed == 0


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_bytes_per_token_by_dtype(dtype):
    # Llama-3-8B on one rank: 8 KV heads x 128, 32 layers
    assert kv_bytes_per_token(8, 128, None, 32, dtype) == 32 * 8 * 256 * dtype.itemsize
    assert kv_bytes_per_token(3, 96, 40, 2, dtype) == 2 * 3 * (96 + 40) * dtype.itemsize


def test_geometry_defaults_v_head_dim_and_is_frozen():
    g = KVGeometry(4, 64, 2, torch.bfloat16)
    assert g.v_head_dim == 64
    with pytest.raises(Exception):
        g.head_num = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"head_num": 0}, "head_num must be a positive int, got 0"),
        ({"head_dim": 2.0}, "head_dim must be a positive int, got 2.0"),
        ({"layer_num": -1}, "layer_num must be a positive int, got -1"),
        ({"v_head_dim": 0}, "v_head_dim must be a positive int, got 0"),
        ({"dtype": torch.int8}, "dtype must be one of .*, got torch.int8"),
    ],
)
def test_geometry_rejects_bad_values(kwargs, message):
    args = {"head_num": 2, "head_dim": 8, "layer_num": 1, "dtype": torch.float16} | kwargs
    with pytest.raises(ValueError, match=message):
        KVGeometry(**args)


@pytest.mark.parametrize(
    "budget, page_size, expected",
    [(10_000, 1, 99), (10_000, 16, 80), (3_200, 16, 16), (100 * 17, 1, 16)],
    ids=["token", "paged", "one-page", "exact-fit"],
)
def test_max_pool_size_counts_the_reserved_rows_and_aligns(budget, page_size, expected):
    assert max_pool_size(budget, 100, page_size) == expected


@pytest.mark.parametrize(
    "args, message",
    [
        ((3_199, 100, 16), "budget_bytes must be at least 3200 .*got 3199"),
        ((-1, 100), "budget_bytes must be a non-negative int, got -1"),
        ((1.5e9, 100), "budget_bytes must be a non-negative int"),
        ((1000, 0), "bytes_per_token must be a positive int, got 0"),
        ((1000, 10, 0), "page_size must be a positive int, got 0"),
    ],
)
def test_max_pool_size_errors(args, message):
    with pytest.raises(ValueError, match=message):
        max_pool_size(*args)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_built_at_the_computed_size_fits_exactly(dtype, page_size):
    g = KVGeometry(head_num=3, head_dim=96, layer_num=2, dtype=dtype, v_head_dim=40)
    budget = 1_000_003
    size = g.max_pool_size(budget, page_size)
    pool = MHATokenToKVPool(size, page_size, dtype, 3, 96, 2, "cpu", v_head_dim=40, warmup=False)
    used = sum(pool.get_kv_size_bytes())
    assert used == g.pool_bytes(size, page_size) <= budget
    assert g.pool_bytes(size + page_size, page_size) > budget  # one more page would not fit
    assert size % page_size == 0


@given(
    budget=st.integers(0, 10**9), bpt=st.integers(1, 10**6), page_size=st.sampled_from([1, 2, 16, 64])
)
def test_max_pool_size_is_the_largest_that_fits(budget, bpt, page_size):
    try:
        size = max_pool_size(budget, bpt, page_size)
    except ValueError:
        assert (2 * page_size) * bpt > budget
        return
    assert size >= page_size and size % page_size == 0
    assert (size + page_size) * bpt <= budget < (size + 2 * page_size) * bpt


# --- MLA: one latent row per token and layer ----------------------------------------------------


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
def test_mla_bytes_per_token(dtype):
    # DeepSeek-V3: 512 latent + 64 rotary values, 61 layers
    g = KVGeometry.mla(512, 64, 61, dtype)
    assert (g.head_num, g.head_dim, g.v_head_dim, g.kv_lora_rank, g.qk_rope_head_dim) == (1, 576, 0, 512, 64)
    assert g.is_mla and not KVGeometry(1, 576, 61, dtype).is_mla
    assert g.bytes_per_token == mla_kv_bytes_per_token(512, 64, 61, dtype) == 61 * 576 * dtype.itemsize
    assert KVGeometry(1, 576, 61, dtype).bytes_per_token == 2 * g.bytes_per_token  # MHA would keep a V too


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_pool_built_at_the_computed_size_fits_exactly(dtype, page_size):
    g = KVGeometry.mla(kv_lora_rank=40, qk_rope_head_dim=24, layer_num=3, dtype=dtype)
    budget = 1_000_003
    size = g.max_pool_size(budget, page_size)
    pool = MLATokenToKVPool(size, page_size, dtype, 40, 24, 3, "cpu", warmup=False)
    assert pool.get_kv_size_bytes() == g.pool_bytes(size, page_size) <= budget
    assert g.pool_bytes(size + page_size, page_size) > budget
    assert size % page_size == 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: KVGeometry.mla(0, 64, 2, torch.bfloat16), "kv_lora_rank must be a positive int, got 0"),
        (lambda: KVGeometry.mla(512, -1, 2, torch.bfloat16), "qk_rope_head_dim must be a positive int, got -1"),
        (lambda: KVGeometry.mla(512, 64, 0, torch.bfloat16), "layer_num must be a positive int, got 0"),
        (lambda: KVGeometry(2, 576, 2, torch.bfloat16, 0, kv_lora_rank=512), "head_num must be 1 for an MLA geometry"),
        (lambda: KVGeometry(1, 576, 2, torch.bfloat16, 0, kv_lora_rank=576), "kv_lora_rank must be less than head_dim"),
        (lambda: KVGeometry(1, 576, 2, torch.bfloat16, 64, kv_lora_rank=512), "v_head_dim must be 0 for an MLA geometry"),
        (lambda: KVGeometry(1, 576, 2, torch.bfloat16, 0), "v_head_dim must be a positive int, got 0"),
    ],
)
def test_mla_geometry_rejects_bad_values(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- hybrid models: KV slots for the full-attention layers, state slots for the linear ones ------


def qwen35_tp8():
    """Qwen3.5-397B-A17B on one of 8 ranks: 15 full-attention layers of one KV head x 256 in FP8, 45
    Gated DeltaNet layers with conv (1536, 3) bf16 and SSM (8, 128, 128) fp32 states."""
    kv = KVGeometry(head_num=1, head_dim=256, layer_num=15, dtype=torch.float8_e4m3fn)
    shape = MambaStateShape.gated_delta_net(
        num_k_heads=16, num_v_heads=64, head_k_dim=128, head_v_dim=128, conv_kernel=4, tp_world_size=8
    )
    return kv, MambaCacheParams(shape, layers=[i for i in range(60) if (i + 1) % 4])


def test_qwen35_tp8_per_rank_budget_split():
    kv, state = qwen35_tp8()
    assert kv.bytes_per_token == 7680
    assert state.bytes_per_slot == 24_007_680  # ~22.9 MiB, as many bytes as 3,126 tokens of FP8 KV
    assert state.bytes_per_slot // kv.bytes_per_token == 3126
    ssm_scratch = 16 * state.temporal_bytes * state.num_layers  # the SSM part of 16 draft steps
    assert ssm_scratch == 360 * 2**20
    assert state.speculative_bytes_per_request(16) == 16 * state.bytes_per_slot  # with the conv windows: ~366 MiB
    budget = 64 * 2**30
    s = plan_hybrid_pools(budget, kv.bytes_per_token, state, page_size=64, max_running_requests=64,
                          speculative_num_draft_tokens=16, track_slots_per_request=1)  # fmt: skip
    assert (s.max_running_requests, s.mamba_size, s.spec_state_size) == (64, 128, 64)
    assert s.state_bytes == 129 * 24_007_680 and s.spec_bytes == 65 * 16 * 24_007_680
    assert s.kv_size == 5_293_440 and s.kv_size % 64 == 0 and s.tokens_per_request == 82_710
    assert s.kv_bytes == (s.kv_size + 64) * 7680 and s.total_bytes <= budget
    assert s.total_bytes + 64 * 7680 > budget  # one more page of KV would not fit
    # Without speculative decoding the scratch's ~25 GB goes to KV (less one more track slot each).
    plain = plan_hybrid_pools(budget, kv.bytes_per_token, state, page_size=64, max_running_requests=64,
                              track_slots_per_request=2)  # fmt: skip
    assert plain.spec_bytes == 0 and plain.spec_state_size == 0 and plain.mamba_size == 192
    assert plain.kv_size == max_pool_size(budget - 193 * 24_007_680, 7680, 64) > s.kv_size + 3 * 10**6


def test_tokens_per_request_finds_the_most_requests_that_fit():
    kv, state = qwen35_tp8()
    budget = 64 * 2**30
    s = plan_hybrid_pools(budget, kv.bytes_per_token, state, page_size=64, tokens_per_request=32_768,
                          speculative_num_draft_tokens=16, track_slots_per_request=1)  # fmt: skip
    per_request = (2 + 16) * state.bytes_per_slot + 32_768 * 7680
    assert s.max_running_requests == (budget - 2 * 64 * 7680 - 17 * state.bytes_per_slot) // per_request
    assert s.tokens_per_request >= 32_768 and s.total_bytes <= budget
    more = plan_hybrid_pools(budget, kv.bytes_per_token, state, page_size=64,
                             max_running_requests=s.max_running_requests + 1,
                             speculative_num_draft_tokens=16, track_slots_per_request=1)  # fmt: skip
    assert more.tokens_per_request < 32_768  # one more request would leave each fewer tokens


@pytest.mark.parametrize("spec", [None, 3], ids=["plain", "speculative"])
def test_hybrid_pools_built_at_the_planned_sizes_fit(spec):
    from kvpool import HybridLinearKVPool, HybridReqToTokenPool

    kv = KVGeometry(head_num=2, head_dim=16, layer_num=2, dtype=torch.bfloat16)
    state = MambaCacheParams(MambaStateShape(conv=(12, 3), temporal=(2, 4, 8)), layers=[0, 2, 3])
    budget = 400_000
    track = 2 if spec is None else 1  # SGLang's extra buffer: two track slots, one with speculative decoding
    s = plan_hybrid_pools(budget, kv.bytes_per_token, state, page_size=4, max_running_requests=5,
                          speculative_num_draft_tokens=spec, track_slots_per_request=track)  # fmt: skip
    table = HybridReqToTokenPool(size=5, mamba_size=s.mamba_size, mamba_spec_state_size=s.spec_state_size or None,
                                 max_context_len=8, device="cpu", cache_params=state, enable_mamba_extra_buffer=True,
                                 speculative_num_draft_tokens=spec)  # fmt: skip
    pool = HybridLinearKVPool(s.kv_size, torch.bfloat16, 4, 2, 16, [1, 4], False, "cpu", table.mamba_pool, warmup=False)
    m = table.mamba_pool
    state_bytes = sum(t.numel() * t.element_size() for t in (*m.conv, m.temporal))
    spec_bytes = 0 if spec is None else sum(t.numel() * t.element_size() for t in (*m.intermediate_conv_window, m.intermediate_ssm))
    assert (sum(pool.get_kv_size_bytes()), state_bytes, spec_bytes) == (s.kv_bytes, s.state_bytes, s.spec_bytes)
    assert s.total_bytes <= budget
    assert table.track_slots_per_request == track
    assert table.alloc(5) is not None and table.mamba_pool.available_size() == 0  # states and track slots for all


@pytest.mark.parametrize(
    "kwargs, exc, message",
    [
        (dict(max_running_requests=None), ValueError, "exactly one of max_running_requests and tokens_per_request"),
        (dict(tokens_per_request=10), ValueError, "exactly one of"),
        (dict(max_running_requests=0), ValueError, "max_running_requests must be a positive int"),
        (dict(budget_bytes=3000), ValueError, r"budget_bytes must be at least \d+ for one page of KV and the states of 4"),
        (dict(budget_bytes=-1), ValueError, "budget_bytes must be a non-negative int"),
        (dict(kv_bytes_per_token=0), ValueError, "kv_bytes_per_token must be a positive int"),
        (dict(track_slots_per_request=-1), ValueError, "track_slots_per_request must be a non-negative int"),
        (dict(speculative_num_draft_tokens=0), ValueError, "speculative_num_draft_tokens must be a positive int"),
        (dict(state=object()), TypeError, "cache_params must be a MambaCacheParams"),
    ],
    ids=["neither", "both", "zero-requests", "too-small", "negative", "kv-bytes", "track", "draft", "state"],
)
def test_plan_hybrid_pools_errors(kwargs, exc, message):
    args = dict(budget_bytes=10**9, kv_bytes_per_token=1000,
                state=MambaCacheParams(MambaStateShape(conv=(12, 3), temporal=(2, 4, 8)), layers=[0]),
                max_running_requests=4) | kwargs  # fmt: skip
    budget, kvb, state = args.pop("budget_bytes"), args.pop("kv_bytes_per_token"), args.pop("state")
    with pytest.raises(exc, match=message):
        plan_hybrid_pools(budget, kvb, state, **args)


def test_too_small_for_tokens_per_request_names_the_bytes():
    state = MambaCacheParams(MambaStateShape(conv=(12, 3), temporal=(2, 4, 8)), layers=[0])
    with pytest.raises(ValueError, match=r"budget_bytes must be at least \d+ .* of 1 request"):
        plan_hybrid_pools(10_000, 1000, state, tokens_per_request=100)


# --- sliding-window models: plan_swa_pools -----------------------------------------------------------


def _pool_bytes(pool) -> int:
    return sum(t.numel() * t.element_size() for t in pool.k_buffer + pool.v_buffer)


@pytest.mark.parametrize("ratio,page", [(0.5, 4), (1.0, 1), (0.125, 16), (0.3, 8)])
def test_swa_split_builds_pools_of_exactly_its_bytes_and_is_the_largest_that_fits(ratio, page):
    """The sizes build an ``SWAKVPool`` whose two parts allocate exactly ``full_bytes`` and
    ``swa_bytes`` (reserved pages included), within the budget; the SWA part holds the ratio's share
    rounded down to pages; one page more of the full part would not fit."""
    full = KVGeometry(2, 8, 2, torch.bfloat16)
    swa = KVGeometry(1, 16, 3, torch.bfloat16)  # its own head count and dim
    budget = 300_000
    s = plan_swa_pools(budget, full, swa, ratio, page_size=page)
    assert s.size % page == 0 and s.size_swa % page == 0 and s.size_swa >= page
    assert s.size_swa == max(int(s.size * ratio) // page * page, page)
    assert s.total_bytes <= budget and s.draft_size == 0 and s.draft_bytes == 0
    bigger = s.size + page
    bigger_swa = max(int(bigger * ratio) // page * page, page)
    assert (bigger + page) * full.bytes_per_token + (bigger_swa + page) * swa.bytes_per_token > budget
    pool = SWAKVPool(
        s.size, s.size_swa, page, torch.bfloat16, 2, 8, [1, 3, 4], [0, 2], False, "cpu",
        swa_head_num=1, swa_head_dim=16, warmup=False,
    )  # fmt: skip
    assert _pool_bytes(pool.full_kv_pool) == s.full_bytes
    assert _pool_bytes(pool.swa_kv_pool) == s.swa_bytes


def test_a_draft_pool_gets_the_full_parts_size_after_the_split():
    """A draft model's pool holds every token its target's full part holds: ``draft_size == size``,
    its bytes counted in the budget, so the split is made with it."""
    full, swa = KVGeometry(8, 64, 18, torch.bfloat16), KVGeometry(8, 64, 18, torch.bfloat16)
    draft = KVGeometry(8, 64, 1, torch.bfloat16)
    alone = plan_swa_pools(2**28, full, swa, 0.5, page_size=64)
    with_draft = plan_swa_pools(2**28, full, swa, 0.5, page_size=64, draft=draft)
    assert with_draft.draft_size == with_draft.size < alone.size
    assert with_draft.draft_bytes == (with_draft.size + 64) * draft.bytes_per_token
    assert with_draft.total_bytes <= 2**28


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(swa_full_tokens_ratio=0), "swa_full_tokens_ratio"),
        (dict(swa_full_tokens_ratio=1.5), "swa_full_tokens_ratio"),
        (dict(swa_full_tokens_ratio=True), "swa_full_tokens_ratio"),
        (dict(budget_bytes=-1), "budget_bytes"),
        (dict(budget_bytes=1000), "budget_bytes must be at least"),
        (dict(full="8 heads"), "full must be a KVGeometry"),
        (dict(draft=3), "draft must be a KVGeometry"),
        (dict(page_size=0), "page_size"),
    ],
)
def test_a_bad_swa_split_names_its_argument(kwargs, match):
    args = dict(budget_bytes=2**20, full=KVGeometry(2, 8, 2, torch.bfloat16), swa=KVGeometry(2, 8, 2, torch.bfloat16),
                swa_full_tokens_ratio=0.5)  # fmt: skip
    args.update(kwargs)
    page = args.pop("page_size", 4)
    draft = args.pop("draft", None)
    with pytest.raises(ValueError, match=match):
        plan_swa_pools(**args, page_size=page, draft=draft)
