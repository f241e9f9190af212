"""HybridLinearKVPool, the KV pool over a hybrid model's full-attention layers: global layer ids,
both write paths, the verify write, moves, CPU copies and calibration, MLA inside, and its MambaPool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvassert import DEVICE, E4M3FN, Layer, assert_codes_equal, assert_same_bytes, bits, poison_pool_, q_codes
from kvpool import HybridLinearKVPool, MambaCacheParams, MambaPool, MambaStateShape, MLATokenToKVPool
from kvpool.kernels.store_kv import writer as store_kv

FULL = [3, 7, 11]  # every 4th layer, as Qwen3.5's


def hybrid_pool(dtype=torch.bfloat16, head_dim=16, **kwargs):
    return HybridLinearKVPool(40, dtype, 2, 2, head_dim, FULL, False, DEVICE, None, warmup=False, **kwargs)


def test_hybrid_pool_maps_global_ids_to_dense_layers():
    pool = hybrid_pool(v_head_dim=8)
    assert pool.full_attention_layer_id_mapping == {3: 0, 7: 1, 11: 2} and pool.full_kv_pool.layer_num == 3
    assert (pool.size, pool.page_size, pool.head_num, pool.head_dim, pool.v_head_dim) == (40, 2, 2, 16, 8)
    for layer_id, dense in zip(FULL, range(3)):
        k, v = pool.get_kv_buffer(layer_id)
        assert k.data_ptr() == pool.full_kv_pool.k_buffer[dense].data_ptr() and v.shape == (42, 2, 8)
        assert pool.get_key_buffer(layer_id) is k and pool.get_value_buffer(layer_id) is v
        assert pool.dense_layer_id(layer_id) == dense
    assert pool.get_kv_size_bytes() == pool.full_kv_pool.get_kv_size_bytes() and pool.get_v_head_dim() == 8


@pytest.mark.parametrize("layer_id", [0, 4, 10, 12, -1])
def test_hybrid_pool_refuses_linear_layer_ids_naming_the_full_layers(layer_id):
    pool = hybrid_pool()
    message = rf"layer_id {layer_id} is not a full-attention layer of this pool: its full-attention layers are \[3, 7, 11\]"
    x = torch.ones(1, 2, 16, device=DEVICE)
    before = [b.clone() for b in pool.full_kv_pool.k_buffer]
    for call in (lambda: pool.get_key_buffer(layer_id), lambda: pool.get_kv_buffer(layer_id),
                 lambda: pool.set_kv_buffer(Layer(layer_id), torch.tensor([1], device=DEVICE), x, x),
                 lambda: pool.set_kv_buffer(None, torch.tensor([1], device=DEVICE), x, x, layer_id_override=layer_id)):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, pool.full_kv_pool.k_buffer)), "nothing written"
    with pytest.raises(TypeError, match="layer_id must be an int, got str"):
        pool.get_value_buffer("3")
    with pytest.raises(TypeError, match="layer_id_override"):
        pool.set_kv_buffer(None, torch.tensor([1], device=DEVICE), x, x)


@pytest.mark.parametrize("head_dim", [256, 96], ids=["d256", "d96"])
def test_hybrid_pool_fp8_fused_write_equals_the_reference(head_dim):
    """Qwen3.5's full attention: FP8 cache, head_dim 256, through the fused kernel (the interpreter on
    CPU) against the reference path on the same global layer, bit for bit."""
    if DEVICE == "cpu" and not store_kv.INTERPRETER:
        pytest.skip("the kernel cannot run here")
    fused = hybrid_pool(torch.float8_e4m3fn, head_dim, fused="always")
    ref = hybrid_pool(torch.float8_e4m3fn, head_dim, fused="never")
    for pool in (fused, ref):
        poison_pool_(pool.full_kv_pool)
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(5, 2, head_dim, generator=g) * 300).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(5, 2, head_dim, generator=g).to(DEVICE)
    loc = torch.tensor([2, 9, -1, 41, 17], device=DEVICE)
    scale = torch.tensor([0.37], device=DEVICE)
    for pool in (fused, ref):
        pool.set_kv_buffer(Layer(7), loc, k, v, scale, 0.5)
    assert fused.stats.fused_calls == 1 and ref.stats.reference_calls == 1
    for layer_id in FULL:
        for a, b in zip(fused.get_kv_buffer(layer_id), ref.get_kv_buffer(layer_id)):
            assert_same_bytes(a, b, f"layer {layer_id}")
    assert_codes_equal(ref.get_key_buffer(7)[9:10], q_codes(k[1:2], torch.float8_e4m3fn, 0.37), E4M3FN, "slot 9")
    assert (bits(ref.get_key_buffer(3)) == 0xFF).all(), "other layers untouched"


def test_hybrid_pool_verify_write_moves_cpu_copies_and_calibration():
    pool = hybrid_pool(torch.float8_e4m3fn, fused="never")
    k = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    loc_2d = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    pool.observe_amax(True)
    pool.set_kv_buffer_prefix_valid(Layer(11), loc_2d, torch.tensor([1, 2], device=DEVICE), k, k)
    kbuf = pool.get_key_buffer(11)
    assert_codes_equal(kbuf[[1, 3, 4]], q_codes(k[[0, 2, 3]], torch.float8_e4m3fn), E4M3FN, "committed")
    assert not bits(kbuf[2]).any(), "uncommitted token (0, 1) writes nothing"
    pool.move_kv_cache(torch.tensor([5], device=DEVICE), torch.tensor([3], device=DEVICE))
    assert_same_bytes(kbuf[5], kbuf[3], "moved")
    copy = pool.get_cpu_copy(torch.tensor([1, 5], device=DEVICE))
    pool.load_cpu_copy(copy, torch.tensor([20, 21], device=DEVICE))
    assert_same_bytes(kbuf[[20, 21]], kbuf[[1, 5]], "cpu copy")
    scales = pool.calibrated_scales()
    amax = float(k[[0, 2, 3]].abs().max())  # a float32 value, exactly
    assert list(scales) == FULL and float(scales[11][0]) == float(np.float32(amax * (1.0 / 448))), "amax / fmax, rounded once"
    assert pool.kv_amax.shape == (3, 2, 2)


def test_hybrid_pool_with_mla_inside():
    pool = HybridLinearKVPool(16, torch.bfloat16, 1, 0, 0, [1, 5], False, DEVICE, None, False, True, 8, 4, warmup=False)
    assert isinstance(pool.full_kv_pool, MLATokenToKVPool) and (pool.kv_lora_rank, pool.qk_rope_head_dim) == (8, 4)
    nope, rope = torch.randn(2, 1, 8, device=DEVICE), torch.randn(2, 1, 4, device=DEVICE)
    loc = torch.tensor([3, 6], device=DEVICE)
    pool.set_mla_kv_buffer(Layer(5), loc, nope, rope)
    got_nope, got_rope = pool.get_mla_kv_buffer(Layer(5), loc)
    assert torch.equal(got_nope, nope.to(torch.bfloat16)) and torch.equal(got_rope, rope.to(torch.bfloat16))
    assert not pool.get_key_buffer(1).any()
    with pytest.raises(ValueError, match="not a full-attention layer"):
        pool.get_mla_kv_buffer(Layer(2), loc)
    with pytest.raises(ValueError, match="set_kv_buffer_prefix_valid needs an MHA pool inside"):
        pool.set_kv_buffer_prefix_valid(Layer(1), loc[None], loc[:1], nope, nope)
    with pytest.raises(ValueError, match="set_mla_kv_buffer needs use_mla=True"):
        hybrid_pool().set_mla_kv_buffer(Layer(3), loc, nope, rope)


def test_hybrid_pool_keeps_its_mamba_pool_and_checks_the_layers():
    mamba = MambaPool(size=4, cache_params=MambaCacheParams(MambaStateShape((6, 3), (1, 2, 2)), [0, 1, 2, 4]), device=DEVICE)
    pool = HybridLinearKVPool(16, torch.bfloat16, 1, 1, 8, [3, 7], False, DEVICE, mamba, warmup=False)
    assert pool.mamba_pool is mamba and pool.get_state_buf_infos() == mamba.get_contiguous_buf_infos()
    args = (16, torch.bfloat16, 1, 1, 8)
    for full, transpose, m, exc, match in [
        ([3, 4], False, mamba, ValueError, r"must not include the mamba_pool's linear layers, got \[4\] in both"),
        ([3, 3], False, None, ValueError, r"full_attention_layer_ids must be distinct, got \[3, 3\]"),
        ([], False, None, ValueError, "must name at least one layer"),
        ([-1], False, None, ValueError, r"full_attention_layer_ids\[0\] must be a non-negative int"),
        (3, False, None, TypeError, "full_attention_layer_ids must be a sequence of ints, got int"),
        ([3], True, None, ValueError, "enable_kvcache_transpose must be False"),
        ([3], False, object(), TypeError, "mamba_pool must be a MambaPool or None, got object"),
    ]:
        with pytest.raises(exc, match=match):
            HybridLinearKVPool(*args, full, transpose, DEVICE, m, warmup=False)
    with pytest.raises(ValueError, match="get_state_buf_infos needs a mamba_pool"):
        hybrid_pool().get_state_buf_infos()
