"""``MHATokenToKVPoolFP4`` with ``fp4_format="nvfp4"`` (docs/contract.md, "NVFP4"): how the format
is chosen, its buffers and per-layer global scales, the write against the oracle, bad input, the
getters and the reader, moves and CPU copies carrying block and global scales."""

from __future__ import annotations

import types

import pytest
import torch

from kvassert import DEVICE, assert_rows_copied, assert_same_bytes, assert_tensors_unchanged
from kvassert import fill_random_, id_of, nvfp4_oracle, poisoned_parts, scaled_parts
from kvpool import Fp4CpuCopy, MHATokenToKVPoolFP4
from kvpool.kernels.store_nvfp4 import dequantize_nvfp4

FP4 = torch.float4_e2m1fn_x2
H, D, DV, SIZE = 3, 48, 32, 20  # 3 block scales per K head, 2 per V head
ROWS = SIZE + 1
K_G, V_G = [0.5, 3.0], [1.25, 0.01]


def make_pool(validate: bool = False, **kw) -> MHATokenToKVPoolFP4:
    args = dict(size=SIZE, page_size=1, dtype=FP4, head_num=H, head_dim=D, layer_num=2, device=DEVICE, v_head_dim=DV,
                fp4_format="nvfp4", k_global_scales=K_G, v_global_scales=V_G)  # fmt: skip
    args.update(kw)
    return MHATokenToKVPoolFP4(**args, validate=validate)


def buffers(pool: MHATokenToKVPoolFP4) -> list[torch.Tensor]:
    return [b for name in pool.part_names for b in getattr(pool, name)] + [pool.k_global_scales, pool.v_global_scales]


poisoned = poisoned_parts


def snapshot(pool: MHATokenToKVPoolFP4) -> list[torch.Tensor]:
    return [b.clone() for b in buffers(pool)]


def rows(t: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads, dim, generator=g) * torch.exp2(torch.randint(-8, 8, (t, heads, 1), generator=g).float())
    x[0, 0, :16] = 0
    return x.to(dtype).to(DEVICE)


def expected_rows(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed bytes [T, H, D // 2], block scale bytes [T, H, D // 16]) from the independent oracle."""
    codes, scales = nvfp4_oracle(x, g)
    return torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4)).to(DEVICE), torch.from_numpy(scales).to(DEVICE)


def test_buffers_and_global_scales_are_sglangs_layout():
    pool = make_pool()
    assert pool.fp4_format == "nvfp4" and pool.dtype is FP4 and pool.store_dtype == torch.uint8
    for name, shape in (("k_buffer", (ROWS, H, D // 2)), ("v_buffer", (ROWS, H, DV // 2)),
                        ("k_scale_buffer", (ROWS, H, D // 16)), ("v_scale_buffer", (ROWS, H, DV // 16))):  # fmt: skip
        for b in getattr(pool, name):
            assert tuple(b.shape) == shape and b.dtype == torch.uint8 and not b.any(), name
    assert pool.k_global_scales.dtype == torch.float32 and pool.k_global_scales.device == pool.device
    assert pool.k_global_scales.tolist() == K_G and pool.v_global_scales.tolist() == [1.25, float(torch.tensor(0.01))]
    assert pool.global_scale_values == ((0.5, 1.25), (3.0, float(torch.tensor(0.01))))
    default = make_pool(k_global_scales=None, v_global_scales=2.0)
    assert default.k_global_scales.tolist() == [1.0, 1.0] and default.v_global_scales.tolist() == [2.0, 2.0]
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes == 2 * ROWS * H * (D // 2 + D // 16) and v_bytes == 2 * ROWS * H * (DV // 2 + DV // 16)


def test_the_format_is_chosen_by_fp4_format_or_sglangs_dtype_name():
    assert make_pool(dtype="nvfp4", fp4_format=None).fp4_format == "nvfp4"
    plain = make_pool(fp4_format=None, k_global_scales=None, v_global_scales=None)
    assert plain.fp4_format == "fp4_mx_block16" and plain.k_global_scales is None and plain.global_scale_values == ()
    assert tuple(plain.k_scale_buffer[0].shape) == (ROWS, H * D // 16)
    with pytest.raises(ValueError, match="fp4_format must be 'fp4_mx_block16' or 'nvfp4', got 'mxfp4'"):
        make_pool(fp4_format="mxfp4")
    with pytest.raises(ValueError, match="fp4_format must be 'nvfp4' .or None. with dtype='nvfp4', got 'fp4_mx_block16'"):
        make_pool(dtype="nvfp4", fp4_format="fp4_mx_block16")
    with pytest.raises(ValueError, match="k_global_scales/v_global_scales are for fp4_format='nvfp4'"):
        make_pool(fp4_format="fp4_mx_block16")


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(k_global_scales=[1.0]), "k_global_scales must have one scale per layer .2., got 1"),
        (dict(v_global_scales=[1.0, 0.0]), r"v_global_scales\[1\] must be a positive finite float"),
        (dict(k_global_scales=float("inf")), "k_global_scales must be a positive finite float"),
        (dict(v_global_scales=1e-40), "v_global_scales must be a positive finite float that is a normal float32"),
    ],
)
def test_bad_global_scales_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        make_pool(**kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
def test_write_stores_the_format_at_loc_and_nothing_else(dtype):
    pool = poisoned(make_pool())
    before = snapshot(pool)
    k, v = rows(7, H, D, dtype, 1), rows(7, H, DV, dtype, 2)
    k_in, v_in = k.clone(), v.clone()
    loc = torch.tensor([4, -1, 9, 2, 30, 17, 0], device=DEVICE)  # -1 padding, 30 beyond the buffers
    pool.set_kv_buffer(types.SimpleNamespace(layer_id=1), loc, k, v)
    written, slots = [0, 2, 3, 5, 6], [4, 9, 2, 17, 0]
    # buffers(): K0 K1 V0 V1 KS0 KS1 VS0 VS1 KG VG
    for x, g, codes, scales, was_codes, was_scales in (
        (k, K_G[1], pool.k_buffer[1], pool.k_scale_buffer[1], before[1], before[5]),
        (v, pool.global_scale_values[1][1], pool.v_buffer[1], pool.v_scale_buffer[1], before[3], before[7]),
    ):
        packed, scale_bytes = expected_rows(x[written], g)
        want_codes, want_scales = was_codes.clone(), was_scales.clone()
        want_codes[slots], want_scales[slots] = packed, scale_bytes
        assert_same_bytes(codes, want_codes, "codes")
        assert_same_bytes(scales, want_scales, "block scales")
    for i in (0, 2, 4, 6, 8, 9):  # layer 0 and the global scales untouched
        assert_same_bytes(buffers(pool)[i], before[i], f"buffer {i}")
    assert_same_bytes(k, k_in, "cache_k")
    assert_same_bytes(v, v_in, "cache_v")


def test_the_layers_global_scale_may_be_passed_as_k_scale():
    a, b = make_pool(), make_pool(validate=True)
    k, v, loc = rows(3, H, D, torch.bfloat16, 3), rows(3, H, DV, torch.bfloat16, 4), torch.tensor([1, 2, 3], device=DEVICE)
    a.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    b.set_kv_buffer(None, loc, k, v, 0.5, torch.tensor([1.25], device=DEVICE), layer_id_override=0)
    for x, y in zip(buffers(a), buffers(b)):
        assert_same_bytes(x, y, "buffer")


def test_set_global_scales_changes_later_writes_and_reads():
    pool = make_pool()
    k, v, loc = rows(2, H, D, torch.float32, 5), rows(2, H, DV, torch.float32, 6), torch.tensor([5, 6], device=DEVICE)
    pool.set_global_scales(1, 0.125, 64.0)
    assert pool.global_scale_values[1] == (0.125, 64.0) and pool.k_global_scales.tolist() == [0.5, 0.125]
    pool.set_kv_buffer(None, loc, k, v, layer_id_override=1)
    packed, scale_bytes = expected_rows(k, 0.125)
    assert_same_bytes(pool.k_buffer[1][5:7], packed, "codes")
    assert_same_bytes(pool.k_scale_buffer[1][5:7], scale_bytes, "block scales")
    want = dequantize_nvfp4(pool.v_buffer[1], pool.v_scale_buffer[1], torch.tensor([64.0], device=DEVICE))
    assert_same_bytes(pool.get_value_buffer(1), want, "V read with the new scale")
    before = snapshot(pool)
    for call, error, message in (
        ((7, 1.0, 1.0), IndexError, "layer_id 7 is outside"),
        ((0, -1.0, 1.0), ValueError, "k_scale must be a positive"),
        ((0, 1.0, float("nan")), ValueError, "v_scale must be a positive"),
    ):
        with pytest.raises(error, match=message):
            pool.set_global_scales(*call)
    assert_tensors_unchanged(buffers(pool), before, "buffer after a refused set_global_scales")
    assert pool.global_scale_values[0] == (0.5, 1.25)
    with pytest.raises(ValueError, match="set_global_scales is for fp4_format='nvfp4'"):
        make_pool(fp4_format=None, k_global_scales=None, v_global_scales=None).set_global_scales(0, 1.0, 1.0)


def _bad_calls():
    k, v, loc = rows(2, H, D, torch.bfloat16, 6), rows(2, H, DV, torch.bfloat16, 7), torch.tensor([1, 2], device=DEVICE)
    o = {"layer_id_override": 0}
    return {
        "k heads": ((None, loc, k[:, :2], v), o, ValueError, "cache_k must have 3 heads"),
        "v dim": ((None, loc, k, k), o, ValueError, "cache_v must have head dim 32"),
        "v tokens": ((None, loc, k, v[:1]), o, ValueError, "cache_v must have T=2"),
        "loc dtype": ((None, loc.float(), k, v), o, ValueError, "loc must be int32 or int64"),
        "input dtype": ((None, loc, k.to(torch.int32), v), o, ValueError, "cache_k must be bfloat16"),
        "another k_scale": ((None, loc, k, v, 2.0), o, ValueError, "k_scale must be None or the layer's NVFP4 global scale 0.5"),
        "bad k_scale": ((None, loc, k, v, -1.0), o, ValueError, "k_scale must be a positive"),
        "per-head v_scale": ((None, loc, k, v, None, torch.ones(H, device=DEVICE)), o, ValueError, "v_scale must have one element"),
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


def test_validate_refuses_a_slot_beyond_the_buffers_or_another_scale_tensor_before_writing():
    pool = poisoned(make_pool(validate=True))
    before = snapshot(pool)
    k, v = rows(2, H, D, torch.bfloat16, 8), rows(2, H, DV, torch.bfloat16, 9)
    with pytest.raises(IndexError, match="loc"):
        pool.set_kv_buffer(None, torch.tensor([3, ROWS], device=DEVICE), k, v, layer_id_override=0)
    with pytest.raises(ValueError, match="v_scale must equal the layer's NVFP4 global scale 1.25"):
        pool.set_kv_buffer(None, torch.tensor([3, 4], device=DEVICE), k, v, None, torch.tensor([1.0], device=DEVICE), layer_id_override=0)
    assert_tensors_unchanged(buffers(pool), before, "buffer")


def test_the_reader_and_the_getters():
    pool = make_pool(start_layer=4)
    fill_random_(buffers(pool)[:-2], seed=10)
    pool.v_scale_buffer[1][pool.v_scale_buffer[1] == 0x7F] = 0x7E  # e4m3fn's NaN byte aside: a write never stores it
    stored = pool.get_fp4_buffers(5)
    assert stored.k.data_ptr() == pool.k_buffer[1].data_ptr() and stored.v_scale is pool.v_scale_buffer[1]
    assert stored.k_global_scale.shape == (1,) and stored.k_global_scale.data_ptr() == pool.k_global_scales.data_ptr() + 4
    assert stored.v_global_scale.tolist() == [pool.global_scale_values[1][1]]
    k, v = pool.get_kv_buffer(5)
    assert k.shape == (ROWS, H, D) and k.dtype == torch.bfloat16 and v.shape == (ROWS, H, DV)
    assert_same_bytes(k, dequantize_nvfp4(stored.k, stored.k_scale, torch.tensor([3.0], device=DEVICE)), "K", any_nan=True)
    assert_same_bytes(pool.get_value_buffer(5), v, "get_value_buffer", any_nan=True)
    assert_same_bytes(pool.get_key_buffer(5), k, "get_key_buffer", any_nan=True)
    out = make_pool(out_dtype=torch.float32)
    assert out.get_key_buffer(1).dtype == torch.float32
    with pytest.raises(IndexError, match="layer_id 3 is outside"):
        pool.get_key_buffer(3)


def test_move_carries_codes_and_block_scales(copy_path):
    pool = make_pool()
    fill_random_(buffers(pool)[:-2], seed=12)
    before = snapshot(pool)
    tgt, src = torch.tensor([5, 6, 7, -1], device=DEVICE), torch.tensor([6, 7, 5, 3], device=DEVICE)  # a cycle, padding
    pool.move_kv_cache(tgt, src)
    assert_rows_copied(scaled_parts(pool), before[:-2], [5, 6, 7], [6, 7, 5], "buffer after the move")


def test_cpu_copy_round_trip_carries_block_and_global_scales(copy_path):
    pool = make_pool()
    fill_random_(buffers(pool)[:-2], seed=13)
    before = snapshot(pool)
    copy = pool.get_cpu_copy(torch.tensor([3, 8], device=DEVICE))
    assert isinstance(copy, Fp4CpuCopy) and len(copy) == 2 and copy.global_scales == pool.global_scale_values
    assert tuple(copy.parts[2].shape) == (2, 2, H, D // 16)
    pool.load_cpu_copy(copy, torch.tensor([11, 12], device=DEVICE))
    assert_rows_copied(scaled_parts(pool), before[:-2], [11, 12], [3, 8], "buffer after the load")


def test_a_cpu_copy_made_with_other_global_scales_is_refused_and_nothing_written():
    pool, other = make_pool(), make_pool(k_global_scales=[0.5, 4.0])
    plain = make_pool(fp4_format=None, k_global_scales=None, v_global_scales=None)
    fill_random_(buffers(pool)[:-2], seed=14)
    before = snapshot(pool)
    with pytest.raises(ValueError, match="kv_cache_cpu.global_scales must be this pool's"):
        pool.load_cpu_copy(other.get_cpu_copy(torch.tensor([1], device=DEVICE)), torch.tensor([2], device=DEVICE))
    with pytest.raises(ValueError, match="kv_cache_cpu.global_scales must be this pool's"):
        pool.load_cpu_copy(plain.get_cpu_copy(torch.tensor([1], device=DEVICE)), torch.tensor([2], device=DEVICE))
    assert_tensors_unchanged(buffers(pool), before, "buffer")
