"""Sizing helper: bytes per token and the largest pool that fits a budget, checked against the
bytes an MHATokenToKVPool and an MLATokenToKVPool actually allocate."""

from __future__ import annotations

import doctest

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import kvpool.pools.sizing as sizing_module
from kvpool.pools.mha_pool import MHATokenToKVPool
from kvpool.pools.mla_pool import MLATokenToKVPool
from kvpool.pools.sizing import KVGeometry, kv_bytes_per_token, max_pool_size, mla_kv_bytes_per_token

DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32]


def test_docstring_examples_run():
    assert doctest.testmod(sizing_module).failed == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
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
