"""MHATokenToKVPool takes SGLang's constructor arguments, positionally in SGLang's order, so SGLang
call sites carry over; kvpool's own options are keyword-only."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvpool import MHATokenToKVPool

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
