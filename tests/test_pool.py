"""MHATokenToKVPool: construction, getters, layer ids, and both write paths through the pool; the
same for HybridLinearKVPool, which holds one over a hybrid model's full-attention layers."""

from __future__ import annotations

import pytest
import torch

from kvassert import assert_same_bytes, bits, poison_
from kvpool import HybridLinearKVPool, MHATokenToKVPool, MLATokenToKVPool, quantize
from kvpool.kernels import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32]


class Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_buffers_shapes_dtypes_and_views(dtype):
    pool = MHATokenToKVPool(100, 4, dtype, 3, 16, 2, DEVICE, v_head_dim=8, start_layer=5, warmup=False)
    assert (pool.start_layer, pool.end_layer, pool.layer_num) == (5, 6, 2)
    assert pool.store_dtype == (torch.uint8 if dtype.itemsize == 1 else dtype)
    for layer_id in (5, 6):
        k, v = pool.get_kv_buffer(layer_id)
        assert k.shape == (104, 3, 16) and v.shape == (104, 3, 8)
        assert k.dtype == dtype and v.dtype == dtype
        assert not k.any() if dtype.itemsize > 1 else not k.view(torch.uint8).any()
        # a view of the storage, never a copy: the same object every time, same memory as k_buffer
        assert pool.get_key_buffer(layer_id) is k and pool.get_value_buffer(layer_id) is v
        assert k.data_ptr() == pool.k_buffer[layer_id - 5].data_ptr()
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes == 2 * 104 * 3 * 16 * dtype.itemsize and v_bytes == 2 * 104 * 3 * 8 * dtype.itemsize


@pytest.mark.parametrize("layer_id", [-1, 0, 3, 7, 100])
def test_layer_ids_outside_the_rank_raise_and_never_wrap(layer_id):
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 1, 8, 3, DEVICE, start_layer=4, warmup=False)
    with pytest.raises(IndexError, match=rf"layer_id {layer_id} is outside this pool's layers \[4, 6\]"):
        pool.get_key_buffer(layer_id)
    k = torch.ones(1, 1, 8, device=DEVICE)
    with pytest.raises(IndexError, match=rf"layer_id {layer_id} is outside"):
        pool.set_kv_buffer(Layer(layer_id), torch.tensor([1], device=DEVICE), k, k)


def test_layer_object_and_override():
    pool = MHATokenToKVPool(16, 1, torch.bfloat16, 1, 8, 2, DEVICE, warmup=False)
    k = torch.full((1, 1, 8), 2.0, device=DEVICE)
    pool.set_kv_buffer(Layer(1), torch.tensor([3], device=DEVICE), k, k)
    assert pool.get_key_buffer(1)[3].eq(2).all() and not pool.get_key_buffer(0).any()
    pool.set_kv_buffer(Layer(1), torch.tensor([4], device=DEVICE), k, k, layer_id_override=0)
    assert pool.get_key_buffer(0)[4].eq(2).all(), "layer_id_override wins over layer.layer_id"
    with pytest.raises(TypeError, match="layer_id_override"):
        pool.set_kv_buffer(None, torch.tensor([4], device=DEVICE), k, k)
    with pytest.raises(TypeError, match="layer_id"):
        pool.set_kv_buffer(object(), torch.tensor([4], device=DEVICE), k, k)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(size=0), "size must be a positive int, got 0"),
        (dict(page_size=-1), "page_size must be a positive int, got -1"),
        (dict(dtype=torch.int8), "dtype must be one of"),
        (dict(head_num=0), "head_num must be a positive int, got 0"),
        (dict(head_dim=2.5), "head_dim must be a positive int, got 2.5"),
        (dict(layer_num=True), "layer_num must be a positive int, got True"),
        (dict(end_layer=9), r"end_layer must be start_layer \+ layer_num - 1 = 1"),
        (dict(start_layer=-2), "start_layer must be a non-negative int, got -2"),
        (dict(v_head_dim=0), "v_head_dim must be a positive int, got 0"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    args = dict(size=8, page_size=1, dtype=torch.float8_e4m3fn, head_num=1, head_dim=8, layer_num=2, device=DEVICE)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        MHATokenToKVPool(**args, warmup=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_and_reference_pools_agree_and_leave_other_rows_alone(dtype):
    if DEVICE == "cpu" and not store_kv.INTERPRETER:
        pytest.skip("the kernel cannot run here")
    geometry = (50, 2, dtype, 3, 24, 2, DEVICE)
    fused = MHATokenToKVPool(*geometry, v_head_dim=40, fused="always", warmup=False)
    ref = MHATokenToKVPool(*geometry, v_head_dim=40, fused="never")
    for pool in (fused, ref):
        for buf in pool.k_buffer + pool.v_buffer:
            poison_(buf)
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(6, 9, 40, generator=g) * 100).to(torch.bfloat16).to(DEVICE)
    k, v = qkv[:, :3, :24], qkv[:, 6:9]
    loc = torch.tensor([1, 7, -1, 51, 52, 30], device=DEVICE, dtype=torch.int32)
    for pool in (fused, ref):
        pool.set_kv_buffer(Layer(1), loc, k, v, 0.61, torch.tensor([1.7, 0.2, 9.0], device=DEVICE))
    assert fused.stats.fused_calls == 1 and ref.stats.reference_calls == 1
    for layer_id in (0, 1):
        for a, b in zip(fused.get_kv_buffer(layer_id), ref.get_kv_buffer(layer_id)):
            assert_same_bytes(a, b, f"layer {layer_id}")
    # written rows hold q(x); slots 51 (the last row) was written, 52 is out of range
    expect_k = quantize(k, dtype, 0.61)
    kbuf = ref.get_key_buffer(1)
    for t, slot in enumerate([1, 7, None, 51, None, 30]):
        if slot is not None:
            assert_same_bytes(kbuf[slot], expect_k[t], f"slot {slot}")
    untouched = [s for s in range(52) if s not in (1, 7, 51, 30)]
    assert (bits(kbuf)[untouched] == -1 if dtype.itemsize > 1 else bits(kbuf)[untouched] == 0xFF).all()


def test_scales_are_ignored_by_16_bit_pools():
    pool = MHATokenToKVPool(8, 1, torch.bfloat16, 1, 4, 1, DEVICE, warmup=False)
    x = torch.tensor([[[1.5, -2.0, 3.0, 0.25]]], device=DEVICE)
    pool.set_kv_buffer(None, torch.tensor([2], device=DEVICE), x, x, -5.0, "ignored", layer_id_override=0)
    assert torch.equal(pool.get_key_buffer(0)[2], x[0].to(torch.bfloat16))


def test_validate_checks_slots_on_request(monkeypatch):
    monkeypatch.setenv("KVPOOL_VALIDATE", "1")
    pool = MHATokenToKVPool(8, 2, torch.float8_e4m3fn, 1, 4, 1, DEVICE, warmup=False)
    assert pool.validate
    x = torch.ones(3, 1, 4, device=DEVICE)
    with pytest.raises(IndexError, match=r"loc\[2\] = 10 is out of range: slots are 0..9"):
        pool.set_kv_buffer(None, torch.tensor([1, -1, 10], device=DEVICE), x, x, layer_id_override=0)
    assert not pool.get_key_buffer(0).view(torch.uint8).any()


# --- HybridLinearKVPool: the full-attention layers of a hybrid model, by global layer id ---------

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
        for buf in pool.full_kv_pool.k_buffer + pool.full_kv_pool.v_buffer:
            poison_(buf)
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
    assert_same_bytes(ref.get_key_buffer(7)[9:10], quantize(k[1:2], torch.float8_e4m3fn, 0.37), "slot 9")
    assert (bits(ref.get_key_buffer(3)) == 0xFF).all(), "other layers untouched"


def test_hybrid_pool_verify_write_moves_cpu_copies_and_calibration():
    pool = hybrid_pool(torch.float8_e4m3fn, fused="never")
    k = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    loc_2d = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    pool.observe_amax(True)
    pool.set_kv_buffer_prefix_valid(Layer(11), loc_2d, torch.tensor([1, 2], device=DEVICE), k, k)
    kbuf = pool.get_key_buffer(11)
    assert_same_bytes(kbuf[[1, 3, 4]], quantize(k[[0, 2, 3]], torch.float8_e4m3fn), "committed")
    assert not bits(kbuf[2]).any(), "uncommitted token (0, 1) writes nothing"
    pool.move_kv_cache(torch.tensor([5], device=DEVICE), torch.tensor([3], device=DEVICE))
    assert_same_bytes(kbuf[5], kbuf[3], "moved")
    copy = pool.get_cpu_copy(torch.tensor([1, 5], device=DEVICE))
    pool.load_cpu_copy(copy, torch.tensor([20, 21], device=DEVICE))
    assert_same_bytes(kbuf[[20, 21]], kbuf[[1, 5]], "cpu copy")
    scales = pool.calibrated_scales()
    assert list(scales) == FULL and float(scales[11][0]) == pytest.approx(float(k[[0, 2, 3]].abs().max()) / 448, rel=1e-6)
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
    from kvpool import MambaCacheParams, MambaPool, MambaStateShape

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
