"""MHATokenToKVPool (and the hybrid models' pools) take SGLang's constructor arguments, positionally in
SGLang's order, so SGLang call sites carry over; kvpool's own options are keyword-only."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvpool import HybridLinearKVPool, HybridReqToTokenPool, MambaCacheParams, MambaPool, MambaStateShape, MHATokenToKVPool

DEVICE = "cpu"

SGLANG_ORDER = (
    "size", "page_size", "dtype", "head_num", "head_dim", "layer_num", "device", "enable_memory_saver",
    "v_head_dim", "swa_head_num", "swa_head_dim", "swa_v_head_dim", "start_layer", "end_layer",
    "enable_alt_stream", "enable_kv_cache_copy",
)  # fmt: skip


def test_positional_parameters_are_sglangs_and_the_rest_keyword_only():
    params = list(inspect.signature(MHATokenToKVPool).parameters.values())
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == SGLANG_ORDER
    assert {p.name for p in params if p.kind == p.KEYWORD_ONLY} >= {"fused", "warmup", "validate", "observe_amax"}
    with pytest.raises(TypeError):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 8, 1, DEVICE, False, None, None, None, None, None, None, True, False, "never")


def test_all_sixteen_positional_arguments():
    pool = MHATokenToKVPool(16, 2, torch.float8_e4m3fn, 4, 8, 3, DEVICE, False, 6, None, None, None, 2, 4, True, False)
    assert (pool.size, pool.page_size, pool.dtype, pool.store_dtype) == (16, 2, torch.float8_e4m3fn, torch.uint8)
    assert (pool.head_num, pool.head_dim, pool.v_head_dim) == (4, 8, 6)
    assert (pool.layer_num, pool.start_layer, pool.end_layer) == (3, 2, 4)
    assert (pool.row_dim, pool.v_row_dim) == (32, 24)
    k, v = pool.get_kv_buffer(4)
    assert k.shape == (18, 4, 8) and v.shape == (18, 4, 6)
    with pytest.raises(IndexError):
        pool.get_key_buffer(5)


def test_sglang_keywords_and_defaults():
    pool = MHATokenToKVPool(
        size=8, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=2, device=DEVICE,
        enable_memory_saver=False, start_layer=None, end_layer=None, enable_alt_stream=False,
        enable_kv_cache_copy=True,
    )  # fmt: skip
    assert (pool.start_layer, pool.end_layer, pool.v_head_dim) == (0, 1, 16)
    assert (pool.row_dim, pool.v_row_dim) == (32, 32)


@pytest.mark.parametrize(
    "swa, expected",
    [
        (dict(swa_head_num=3, swa_head_dim=16, swa_v_head_dim=12), (3, 16, 12)),
        (dict(swa_head_num=3), (3, 8, 6)),
        (dict(swa_v_head_dim=10), (2, 8, 10)),
        (dict(swa_head_dim=32, swa_v_head_dim=24), (2, 32, 24)),
    ],
    ids=["all", "heads", "v_dim", "dims"],
)
def test_swa_arguments_replace_the_geometry(swa, expected):
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, 2, 8, 1, DEVICE, v_head_dim=6, **swa)
    h, d, dv = expected
    assert (pool.head_num, pool.head_dim, pool.v_head_dim) == expected
    assert (pool.row_dim, pool.v_row_dim) == (h * d, h * dv)
    k, v = pool.get_kv_buffer(0)
    assert k.shape == (9, h, d) and v.shape == (9, h, dv)
    x, y = torch.randn(2, h, d), torch.randn(2, h, dv)
    pool.set_kv_buffer(None, torch.tensor([3, 5]), x, y, layer_id_override=0)
    assert torch.equal(k[[3, 5]], x.to(torch.bfloat16)) and torch.equal(v[[3, 5]], y.to(torch.bfloat16))
    with pytest.raises(ValueError, match=rf"cache_k must have {h} heads"):
        pool.set_kv_buffer(None, torch.tensor([1]), torch.randn(1, h + 1, d), y[:1], layer_id_override=0)


@pytest.mark.parametrize("how", ["positional", "keyword"])
def test_memory_saver_is_refused_naming_the_keyword(how):
    args = (8, 1, torch.bfloat16, 1, 8, 1, DEVICE)
    with pytest.raises(ValueError, match=r"enable_memory_saver must be False.*got True"):
        if how == "positional":
            MHATokenToKVPool(*args, True)
        else:
            MHATokenToKVPool(*args, enable_memory_saver=True)


@pytest.mark.parametrize("name", ["enable_alt_stream", "enable_kv_cache_copy"])
def test_sglang_flags_must_be_bools(name):
    with pytest.raises(ValueError, match=rf"{name} must be a bool, got 'yes'"):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 8, 1, DEVICE, **{name: "yes"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(swa_head_num=0), "head_num must be a positive int, got 0"),
        (dict(swa_head_dim=-8), "head_dim must be a positive int, got -8"),
        (dict(swa_v_head_dim=2.0), "v_head_dim must be a positive int, got 2.0"),
        (dict(start_layer=3, end_layer=3), r"end_layer must be start_layer \+ layer_num - 1 = 4"),
    ],
)
def test_bad_sglang_geometry_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MHATokenToKVPool(8, 1, torch.bfloat16, 1, 8, 2, DEVICE, **kwargs)


# --- hybrid linear-attention models ---------------------------------------------------------------

HYBRID_KV_ORDER = (
    "size", "dtype", "page_size", "head_num", "head_dim", "full_attention_layer_ids", "enable_kvcache_transpose",
    "device", "mamba_pool", "enable_memory_saver", "use_mla", "kv_lora_rank", "qk_rope_head_dim", "start_layer",
)  # fmt: skip


def test_hybrid_kv_pool_takes_sglangs_positional_order():
    params = list(inspect.signature(HybridLinearKVPool).parameters.values())
    assert tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD) == HYBRID_KV_ORDER
    assert {p.name for p in params if p.kind == p.KEYWORD_ONLY} >= {"v_head_dim", "fused", "warmup", "validate"}
    pool = HybridLinearKVPool(
        size=8, dtype=torch.bfloat16, page_size=1, head_num=1, head_dim=8, full_attention_layer_ids=[3],
        enable_kvcache_transpose=False, device=DEVICE, mamba_pool=None, enable_memory_saver=False,
    )  # fmt: skip
    assert pool.full_layer_nums == 1 and pool.start_layer == 0 and not pool.use_mla


def test_state_pools_take_sglangs_keywords():
    """SGLang builds these with keywords only; a Mamba2CacheParams-like object is read by attribute."""
    for cls, names in [
        (MambaPool, {"size", "spec_state_size", "cache_params", "device", "enable_memory_saver",
                     "speculative_num_draft_tokens"}),  # fmt: skip
        (HybridReqToTokenPool, {"size", "mamba_size", "mamba_spec_state_size", "max_context_len", "device",
                                "enable_memory_saver", "cache_params", "enable_mamba_extra_buffer",
                                "speculative_num_draft_tokens", "mamba_layer_ids", "enable_mamba_extra_buffer_lazy",
                                "enable_overlap_schedule", "start_layer"}),  # fmt: skip
    ]:
        params = inspect.signature(cls).parameters.values()
        assert all(p.kind == p.KEYWORD_ONLY for p in params)
        assert names <= {p.name for p in params}
    params = MambaCacheParams(MambaStateShape(conv=[(6, 3)], temporal=(1, 2, 2)), layers=[0, 1])
    table = HybridReqToTokenPool(
        size=2, mamba_size=4, mamba_spec_state_size=2, max_context_len=8, device=DEVICE, enable_memory_saver=False,
        cache_params=params, enable_mamba_extra_buffer=False, speculative_num_draft_tokens=2, mamba_layer_ids=[0, 1],
    )  # fmt: skip
    assert table.mamba_pool.spec_state_size == 2 and table.mamba_pool.mamba_cache.intermediate_ssm.shape[1] == 3
