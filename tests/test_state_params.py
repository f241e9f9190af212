"""State pools: the state's shapes and dtypes (MambaStateShape, MambaStateDType, MambaCacheParams,
SGLang's params read by attribute), a MambaPool's buffers and views, its constructor's checks, and the
docstring examples of the state modules."""

from __future__ import annotations

import doctest

import pytest
import torch

import kvpool.pools.cpu_copy as cpu_copy_module
import kvpool.pools.mamba_pool as mamba_pool_module
import kvpool.pools.state_params as state_params_module
import kvpool.pools.state_slots as state_slots_module
from kvassert import STATE_K as K
from kvassert import STATE_LAYERS as LAYERS
from kvassert import make_state_pool as make_pool
from kvassert import slots_of as T
from kvassert import state_device  # noqa: F401 (a fixture)
from kvassert import state_params
from kvpool import MambaCacheParams, MambaPool, MambaStateDType, MambaStateShape

SHAPE = MambaStateShape(conv=(7, 3), temporal=(2, 3, 5))
PARAMS = state_params()


@pytest.fixture
def device(state_device):
    return state_device


def test_docstring_examples_run():
    for module in (mamba_pool_module, state_params_module, state_slots_module, cpu_copy_module):
        assert doctest.testmod(module).failed == 0


# --- params -----------------------------------------------------------------------------------------


def test_qwen35_tp8_per_rank_shapes_and_bytes():
    shape = MambaStateShape.gated_delta_net(
        num_k_heads=16, num_v_heads=64, head_k_dim=128, head_v_dim=128, conv_kernel=4, tp_world_size=8
    )
    assert shape.conv == ((1536, 3),) and shape.temporal == (8, 128, 128)
    params = MambaCacheParams(shape, layers=[i for i in range(60) if (i + 1) % 4])
    assert params.num_layers == 45
    assert params.conv_bytes == 1536 * 3 * 2 and params.temporal_bytes == 8 * 128 * 128 * 4
    assert params.bytes_per_slot == params.mamba_cache_per_req == 24_007_680  # ~22.9 MiB
    assert params.speculative_bytes_per_request(16) == 16 * 24_007_680
    # SGLang's Mamba2 formulas: channels = intermediate + 2 * groups * state, split over ranks
    same = MambaStateShape.create(
        tp_world_size=8, intermediate_size=8192, n_groups=16, num_heads=64, head_dim=128, state_size=128, conv_kernel=4
    )
    assert same == shape


def test_groups_replicate_up_to_the_ranks():
    shape = MambaStateShape.create(
        tp_world_size=4, intermediate_size=256, n_groups=1, num_heads=8, head_dim=32, state_size=16, conv_kernel=4
    )
    assert shape.conv == (((256 + 2 * 4 * 16) // 4, 3),) and shape.temporal == (2, 32, 16)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: MambaStateShape(conv=(7,), temporal=(2, 3, 5)), ValueError, r"conv\[0\] must be a tuple of 2"),
        (lambda: MambaStateShape(conv=(7, 0), temporal=(2, 3, 5)), ValueError, r"conv\[0\]\[1\] must be a positive int, got 0"),
        (lambda: MambaStateShape(conv=[], temporal=(2, 3, 5)), ValueError, "non-empty list"),
        (lambda: MambaStateShape(conv=(7, 3), temporal=(2, 3)), ValueError, "temporal must be a tuple of 3"),
        (lambda: MambaStateDType(conv=torch.int8), ValueError, "conv must be a floating torch.dtype"),
        (lambda: MambaCacheParams(SHAPE, layers=[]), ValueError, "non-empty sequence"),
        (lambda: MambaCacheParams(SHAPE, layers=[2, 1]), ValueError, r"distinct and ascending, got \[2, 1\]"),
        (lambda: MambaCacheParams(SHAPE, layers=[-1]), ValueError, r"layers\[0\] must be a non-negative int"),
        (lambda: MambaCacheParams((7, 3), layers=[0]), TypeError, "shape must be a MambaStateShape"),
        (lambda: MambaStateShape.create(tp_world_size=3, intermediate_size=8, n_groups=2, num_heads=3, head_dim=2,
                                        state_size=2, conv_kernel=4), ValueError, r"n_groups \(2\)"),  # fmt: skip
        (lambda: MambaStateShape.create(tp_world_size=2, intermediate_size=8, n_groups=2, num_heads=3, head_dim=2,
                                        state_size=2, conv_kernel=4), ValueError, r"num_heads \(3\) must split"),  # fmt: skip
        (lambda: MambaStateShape.create(tp_world_size=1, intermediate_size=8, n_groups=2, num_heads=3, head_dim=2,
                                        state_size=2, conv_kernel=1), ValueError, "conv_kernel must be at least 2"),  # fmt: skip
        (lambda: MambaCacheParams.of(object()), TypeError, "SGLang's Mamba2CacheParams"),
    ],
    ids=["conv-ndim", "conv-zero", "conv-empty", "temporal-ndim", "dtype", "no-layers", "layers-order",
         "negative-layer", "shape-type", "groups", "heads", "kernel", "foreign"],  # fmt: skip
)
def test_params_reject_bad_values(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_sglang_style_params_are_read_by_attribute():
    class Shape:
        conv = [(7, 3)]
        temporal = (2, 3, 5)

    class DType:
        conv = torch.float16
        temporal = torch.bfloat16

    class Sglang:
        shape, dtype, layers = Shape(), DType(), [1, 2, 5]

    pool = MambaPool(size=4, spec_state_size=4, cache_params=Sglang(), device="cpu")
    assert pool.cache_params == MambaCacheParams(SHAPE, LAYERS, MambaStateDType(torch.float16, torch.bfloat16))
    assert pool.conv[0].dtype == torch.float16 and pool.temporal.dtype == torch.bfloat16


# --- buffers and views ------------------------------------------------------------------------------


def test_buffers_are_one_allocation_per_kind_with_per_layer_views(device):
    pool = MambaPool(size=9, spec_state_size=4, cache_params=PARAMS, device=device, speculative_num_draft_tokens=K)
    assert pool.conv[0].shape == (3, 10, 7, 3) and pool.conv[0].dtype == torch.bfloat16
    assert pool.temporal.shape == (3, 10, 2, 3, 5) and pool.temporal.dtype == torch.float32
    assert pool.intermediate_conv_window[0].shape == (3, 5, K, 7, 3)
    assert pool.intermediate_ssm.shape == (3, 5, K, 2, 3, 5)
    assert not any(t.any() for t in [*pool.conv, pool.temporal, pool.intermediate_ssm])  # zeroed
    for i, layer in enumerate(LAYERS):
        conv, ssm = pool.get_conv_state(layer), pool.get_ssm_state(layer)
        assert conv.shape == (10, 7, 3) and ssm.shape == (10, 2, 3, 5)
        assert conv.data_ptr() == pool.conv[0].data_ptr() + i * pool.conv[0].stride(0) * 2
        assert ssm.data_ptr() == pool.temporal.data_ptr() + i * pool.temporal.stride(0) * 4
        assert pool.get_intermediate_ssm_state(layer).data_ptr() == pool.intermediate_ssm[i].data_ptr()
        assert pool.get_intermediate_conv_window(layer).shape == (5, K, 7, 3)
        assert pool.layer_index(layer) == i
    assert pool.row_table.row_bytes == (42, 120) * 3 and pool.row_table.rows == 10
    assert pool.spec_row_table.row_bytes == (42, 120) * 3 and pool.spec_row_table.rows == 5 * K
    assert pool.row_table.buffers[2].data_ptr() == pool.get_conv_state(2).data_ptr()
    assert pool.available_size() == 9 and pool.num_mamba_layers == 3 and pool.layers == LAYERS


def test_sglang_views_of_the_same_tensors():
    pool = make_pool()
    assert pool.mamba_cache.conv[0] is pool.conv[0] and pool.mamba_cache.temporal is pool.temporal
    layer = pool.mamba2_layer_cache(1)  # dense index: the second linear layer, global id 2
    assert layer.temporal.data_ptr() == pool.get_ssm_state(2).data_ptr()
    assert layer.conv[0].data_ptr() == pool.get_conv_state(2).data_ptr()
    assert layer.intermediate_ssm.data_ptr() == pool.get_intermediate_ssm_state(2).data_ptr()
    spec = pool.get_speculative_mamba2_params_all_layers()
    assert spec.intermediate_ssm is pool.intermediate_ssm
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs[0] == pool.get_conv_state(1).data_ptr() and ptrs[3] == pool.get_ssm_state(1).data_ptr()
    assert lens[3] == 10 * 120 and items == [42] * 3 + [120] * 3
    assert pool.mem_usage * 2**30 == pool.mamba_cache.mem_usage_bytes()


def test_layer_ids_and_missing_scratch_raise():
    pool = MambaPool(size=4, cache_params=PARAMS, device="cpu")
    with pytest.raises(ValueError, match=r"layer_id 3 is not a linear-attention layer of this pool: its layers are \[1, 2, 5\]"):
        pool.get_ssm_state(3)
    with pytest.raises(TypeError, match="layer_id must be an int, got str"):
        pool.get_conv_state("1")
    with pytest.raises(IndexError, match="dense index in 0..2"):
        pool.mamba2_layer_cache(3)
    for call in (lambda: pool.get_intermediate_ssm_state(1), lambda: pool.get_speculative_mamba2_params_all_layers(),
                 lambda: pool.commit(T([1]), T([1]))):  # fmt: skip
        with pytest.raises(ValueError, match="needs speculative state"):
            call()
    assert pool.intermediate_ssm is None and pool.spec_row_table is None


def test_constructor_rejects_bad_arguments():
    for kwargs, match in [
        (dict(size=0), "size must be a positive int"),
        (dict(speculative_num_draft_tokens=0), "speculative_num_draft_tokens must be a positive int"),
        (dict(speculative_num_draft_tokens=2, spec_state_size=0), "spec_state_size must be a positive int"),
        (dict(enable_memory_saver=True), "enable_memory_saver must be False"),
    ]:
        with pytest.raises(ValueError, match=match):
            MambaPool(**{"size": 4, "cache_params": PARAMS, "device": "cpu", **kwargs})
