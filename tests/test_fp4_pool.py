"""``MHATokenToKVPoolFP4`` (docs/contract.md, "FP4 pools"): SGLang's buffers, the write against an
oracle of the format and against SGLang's quantizer, bad input, the getters, moves and CPU copies
carrying the scales, and the sizing."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from kvassert import DEVICE, assert_rows_copied, assert_same_bytes, assert_tensors_unchanged, fill_random_
from kvassert import fp4_oracle, id_of, poisoned_parts, scaled_parts, sglang_kvfp4
from kvpool import Fp4CpuCopy, KVGeometry, MHATokenToKVPoolFP4, dequantize_fp4, kv_bytes_per_token

FP4 = torch.float4_e2m1fn_x2
H, D, DV, SIZE = 3, 48, 32, 20  # H * D // 16 = 9 scale bytes per K row, 6 per V row
ROWS = SIZE + 1


def make_pool(validate: bool = False, **kw) -> MHATokenToKVPoolFP4:
    args = dict(size=SIZE, page_size=1, dtype=FP4, head_num=H, head_dim=D, layer_num=2, device=DEVICE, v_head_dim=DV)
    args.update(kw)
    return MHATokenToKVPoolFP4(**args, validate=validate)


buffers, poisoned = scaled_parts, poisoned_parts


def snapshot(pool: MHATokenToKVPoolFP4) -> list[torch.Tensor]:
    return [b.clone() for b in buffers(pool)]


def rows(t: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads, dim, generator=g) * torch.exp2(torch.randint(-6, 6, (t, heads, 1), generator=g).float())
    x[0, 0, :16] = 0
    return x.to(dtype).to(DEVICE)


def expected_rows(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(packed bytes [T, H, D // 2], scale bytes) from the independent oracle."""
    codes, scales = fp4_oracle(x)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def test_buffers_are_sglangs():
    pool = make_pool(head_num=2, head_dim=64, v_head_dim=None)
    assert pool.dtype is FP4 and pool.store_dtype == torch.uint8
    for name, shape in (("k_buffer", (ROWS, 2, 32)), ("v_buffer", (ROWS, 2, 32)),
                        ("k_scale_buffer", (ROWS, 8)), ("v_scale_buffer", (ROWS, 8))):  # fmt: skip
        layers = getattr(pool, name)
        assert len(layers) == 2
        for b in layers:
            assert tuple(b.shape) == shape and b.dtype == torch.uint8 and not b.any(), name


def test_the_format_name_is_accepted_and_other_dtypes_are_refused():
    assert make_pool(dtype="fp4_e2m1").dtype is FP4
    with pytest.raises(ValueError, match=r"dtype must be torch.float4_e2m1fn_x2 or 'fp4_e2m1'.*float8_e4m3fn"):
        make_pool(dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16.*got 40"):
        make_pool(head_dim=40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
def test_write_stores_the_format_at_loc_and_nothing_else(dtype):
    pool = poisoned(make_pool())
    before = snapshot(pool)
    k, v = rows(7, H, D, dtype, 1), rows(7, H, DV, dtype, 2)
    k_in, v_in = k.clone(), v.clone()
    loc = torch.tensor([4, -1, 9, 2, 30, 17, 0], device=DEVICE)  # -1 padding, 30 beyond the buffers
    pool.set_kv_buffer(types.SimpleNamespace(layer_id=1), loc, k, v)
    written = [0, 2, 3, 5, 6]
    slots = [4, 9, 2, 17, 0]
    for x, codes, scales, was_codes, was_scales in (
        (k, pool.k_buffer[1], pool.k_scale_buffer[1], before[1], before[5]),  # buffers(): K0 K1 V0 V1 KS0 KS1 VS0 VS1
        (v, pool.v_buffer[1], pool.v_scale_buffer[1], before[3], before[7]),
    ):
        packed, scale_bytes = expected_rows(x[written])
        want_codes, want_scales = was_codes.clone(), was_scales.clone()
        want_codes[slots] = torch.from_numpy(packed).to(DEVICE)
        want_scales[slots] = torch.from_numpy(scale_bytes).to(DEVICE)
        assert_same_bytes(codes, want_codes, "codes")
        assert_same_bytes(scales, want_scales, "scales")
    for i in (0, 2, 4, 6):  # layer 0 untouched
        assert_same_bytes(buffers(pool)[i], before[i], f"layer 0 buffer {i}")
    assert_same_bytes(k, k_in, "cache_k")
    assert_same_bytes(v, v_in, "cache_v")


def test_strided_inputs_store_what_contiguous_ones_do():
    qkv = rows(5, 3 * H, D, torch.bfloat16, 3)
    k = qkv[:, H : 2 * H]
    a, b = make_pool(), make_pool()
    loc = torch.tensor([1, 2, 3, 4, 5], device=DEVICE)
    a.set_kv_buffer(None, loc, k, k[..., :DV], layer_id_override=0)
    b.set_kv_buffer(None, loc, k.contiguous(), k[..., :DV].contiguous(), layer_id_override=0)
    for x, y in zip(buffers(a), buffers(b)):
        assert_same_bytes(x, y, "buffer")


@pytest.mark.parametrize("kind", ["float", "tensor", "per_head"])
def test_scaled_write_stores_sglangs_bytes(kind):
    util = sglang_kvfp4()
    pool = make_pool(device="cpu")
    k, v = rows(6, H, D, torch.bfloat16, 4).cpu(), rows(6, H, DV, torch.bfloat16, 5).cpu()
    scale = {"float": 0.37, "tensor": torch.tensor([0.37]), "per_head": torch.tensor([0.37, 2.5, 1.1])}[kind]
    loc = torch.arange(1, 7)
    pool.set_kv_buffer(None, loc, k, v, k_scale=scale, v_scale=scale, layer_id_override=0)
    divisor = scale if kind != "per_head" else scale.reshape(1, H, 1)
    for x, codes, scales in ((k, pool.k_buffer[0], pool.k_scale_buffer[0]), (v, pool.v_buffer[0], pool.v_scale_buffer[0])):
        packed, scale_bytes = util.batched_quantize(x.clone().div_(divisor))  # SGLang divides in place, then quantizes
        assert_same_bytes(codes[1:7], packed, "codes")
        assert_same_bytes(scales[1:7], scale_bytes, "scales")


def _bad_calls():
    k, v, loc = rows(2, H, D, torch.bfloat16, 6), rows(2, H, DV, torch.bfloat16, 7), torch.tensor([1, 2], device=DEVICE)
    return {
        "k heads": ((None, loc, k[:, :2], v), {"layer_id_override": 0}, ValueError, "cache_k must have 3 heads"),
        "v dim": ((None, loc, k, k), {"layer_id_override": 0}, ValueError, "cache_v must have head dim 32"),
        "v tokens": ((None, loc, k, v[:1]), {"layer_id_override": 0}, ValueError, "cache_v must have T=2"),
        "loc dtype": ((None, loc.float(), k, v), {"layer_id_override": 0}, ValueError, "loc must be int32 or int64"),
        "loc length": ((None, loc[:1], k, v), {"layer_id_override": 0}, ValueError, "loc must have T=2"),
        "input dtype": ((None, loc, k.to(torch.int32), v), {"layer_id_override": 0}, ValueError, "cache_k must be bfloat16"),
        "scale": ((None, loc, k, v, -1.0), {"layer_id_override": 0}, ValueError, "k_scale must be a positive"),
        "scale shape": ((None, loc, k, v, None, torch.ones(2, device=DEVICE)), {"layer_id_override": 0}, ValueError, "v_scale must have one element"),
        "layer": ((None, loc, k, v), {"layer_id_override": 2}, IndexError, "layer_id 2 is outside"),
        "no layer": ((None, loc, k, v), {}, TypeError, "layer_id_override"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_naming_the_argument_and_writes_nothing(case):
    args, kw, error, message = _bad_calls()[case]
    pool = poisoned(make_pool())
    before = snapshot(pool)
    with pytest.raises(error, match=message):
        pool.set_kv_buffer(*args, **kw)
    assert_tensors_unchanged(buffers(pool), before, "buffer after a refused write")


def test_validate_refuses_a_slot_beyond_the_buffers_before_writing():
    pool = poisoned(make_pool(validate=True))
    before = snapshot(pool)
    k, v = rows(2, H, D, torch.bfloat16, 8), rows(2, H, DV, torch.bfloat16, 9)
    with pytest.raises(IndexError, match="loc"):
        pool.set_kv_buffer(None, torch.tensor([3, ROWS], device=DEVICE), k, v, layer_id_override=0)
    with pytest.raises(ValueError, match="k_scale"):
        pool.set_kv_buffer(None, torch.tensor([3, 4], device=DEVICE), k, v, torch.tensor([0.0], device=DEVICE), layer_id_override=0)
    assert_tensors_unchanged(buffers(pool), before, "buffer")


def test_getters_dequantize_the_stored_bytes_as_sglang_does():
    util = sglang_kvfp4()
    pool = make_pool(device="cpu", start_layer=4)
    fill_random_(buffers(pool), seed=10)
    stored = pool.get_fp4_buffers(5)
    assert stored.k.data_ptr() == pool.k_buffer[1].data_ptr() and stored.v_scale is pool.v_scale_buffer[1]
    k, v = pool.get_kv_buffer(5)
    assert k.shape == (ROWS, H, D) and k.dtype == torch.bfloat16
    assert_same_bytes(k, util.batched_dequantize(stored.k, stored.k_scale), "K", any_nan=True)
    assert_same_bytes(pool.get_value_buffer(5), util.batched_dequantize(stored.v, stored.v_scale), "V", any_nan=True)
    assert_same_bytes(pool.get_key_buffer(5), k, "get_key_buffer")
    with pytest.raises(IndexError, match="layer_id 3 is outside"):
        pool.get_key_buffer(3)


def test_out_dtype_of_the_getters():
    pool = make_pool(out_dtype=torch.float32)
    fill_random_(buffers(pool), seed=11)
    assert_same_bytes(pool.get_key_buffer(0), dequantize_fp4(pool.k_buffer[0], pool.k_scale_buffer[0], torch.float32), "K")


def test_move_carries_codes_and_scales(copy_path):
    pool = make_pool()
    fill_random_(buffers(pool), seed=12)
    before = snapshot(pool)
    tgt, src = torch.tensor([5, 6, 7, -1], device=DEVICE), torch.tensor([6, 7, 5, 3], device=DEVICE)  # a cycle, padding
    pool.move_kv_cache(tgt, src)
    assert_rows_copied(buffers(pool), before, [5, 6, 7], [6, 7, 5], "buffer after the move")


def test_cpu_copy_round_trip_carries_codes_and_scales(copy_path):
    pool = make_pool()
    fill_random_(buffers(pool), seed=13)
    before = snapshot(pool)
    copy = pool.get_cpu_copy(torch.tensor([3, 8], device=DEVICE))
    assert isinstance(copy, Fp4CpuCopy) and len(copy) == 2 and copy.part_names == pool.part_names
    assert tuple(copy.parts[2].shape) == (2, 2, H * D // 16)
    pool.load_cpu_copy(copy, torch.tensor([11, 12], device=DEVICE))
    assert_rows_copied(buffers(pool), before, [11, 12], [3, 8], "buffer after the load")


def test_a_cpu_copy_of_another_geometry_is_refused_and_nothing_written():
    pool, other = make_pool(), make_pool(v_head_dim=48)
    fill_random_(buffers(pool), seed=14)
    before = snapshot(pool)
    copy = other.get_cpu_copy(torch.tensor([1], device=DEVICE))
    with pytest.raises(ValueError, match=r"kv_cache_cpu.v_buffer must have shape \(2, 1, 3, 16\)"):
        pool.load_cpu_copy(copy, torch.tensor([2], device=DEVICE))
    with pytest.raises(TypeError, match="kv_cache_cpu must be an Fp4CpuCopy"):
        pool.load_cpu_copy((copy.parts[0], copy.parts[1]), torch.tensor([2], device=DEVICE))
    assert_tensors_unchanged(buffers(pool), before, "buffer")


def test_a_cpu_copy_missing_a_buffer_is_refused_by_name_and_nothing_written():
    pool = make_pool()
    fill_random_(buffers(pool), seed=15)
    before = snapshot(pool)
    copy = pool.get_cpu_copy(torch.tensor([1], device=DEVICE))
    short = Fp4CpuCopy(copy.parts[:3], copy.part_names, copy.start_layer)  # the V scales left out
    with pytest.raises(ValueError, match=r"kv_cache_cpu must hold 4 buffers \(one per name\), got 3"):
        pool.load_cpu_copy(short, torch.tensor([2], device=DEVICE))
    assert_tensors_unchanged(buffers(pool), before, "buffer")

def test_sizes_count_the_scale_bytes():
    assert kv_bytes_per_token(1, 128, None, 1, FP4) // 2 == 72  # per head and token, K alone
    assert kv_bytes_per_token(1, 128, None, 1, torch.float8_e4m3fn) // 2 == 128
    pool = make_pool()
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes == 2 * ROWS * H * (D // 2 + D // 16) and v_bytes == 2 * ROWS * H * (DV // 2 + DV // 16)
    assert k_bytes + v_bytes == KVGeometry(H, D, 2, FP4, v_head_dim=DV).pool_bytes(SIZE)
