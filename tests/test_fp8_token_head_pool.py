"""``MHATokenToKVPoolFP8PerTokenHead`` (docs/contract.md, "Per-token-head FP8"): its buffers, the
write against the oracle at ``loc`` and nowhere else, bad input refused with nothing written, the
dequantizing getters and the stored-bytes reader, moves and CPU copies carrying the scales with the
codes, sizes, and calibration refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvassert import DEVICE, FP8, assert_rows_copied, assert_same_bytes, assert_tensors_unchanged
from kvassert import fill_random_, id_of, poisoned_parts, scaled_parts, token_head_oracle
from kvpool.kernels.store_fp8_token import dequantize_token_head
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead
from kvpool.pools.row_parts import PartsCpuCopy

H, D, DV, SIZE = 3, 24, 10, 20
ROWS = SIZE + 1


def make_pool(validate: bool = False, **kw) -> MHATokenToKVPoolFP8PerTokenHead:
    args = dict(size=SIZE, page_size=1, dtype=torch.float8_e4m3fn, head_num=H, head_dim=D, layer_num=2,
                device=DEVICE, v_head_dim=DV)  # fmt: skip
    args.update(kw)
    return MHATokenToKVPoolFP8PerTokenHead(**args, validate=validate)


buffers, poisoned = scaled_parts, poisoned_parts


def snapshot(pool: MHATokenToKVPoolFP8PerTokenHead) -> list[torch.Tensor]:
    return [b.clone() for b in buffers(pool)]


def assert_unchanged(pool, before, what: str) -> None:
    assert_tensors_unchanged(buffers(pool), before, what)


def rows(t: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, dim, generator=g) * torch.exp2(torch.randint(-12, 12, (t, H, 1), generator=g).float())
    x[0, 0] = 0
    return x.to(dtype).to(DEVICE)


def test_buffers_views_and_attributes():
    pool = make_pool(start_layer=2)
    assert pool.dtype == torch.float8_e4m3fn and pool.store_dtype == torch.uint8 and pool.end_layer == 3
    for name, shape, dtype in (("k_buffer", (ROWS, H, D), torch.uint8), ("v_buffer", (ROWS, H, DV), torch.uint8),
                               ("k_scale_buffer", (ROWS, H), torch.float32),
                               ("v_scale_buffer", (ROWS, H), torch.float32)):  # fmt: skip
        layers = getattr(pool, name)
        assert len(layers) == 2 and all(tuple(b.shape) == shape and b.dtype == dtype for b in layers), name
        assert all(not bool(b.view(torch.uint8).any()) for b in layers), f"{name} starts zeroed"
    stored = pool.get_fp8_buffers(3)
    assert stored.k.dtype == torch.float8_e4m3fn and stored.k.data_ptr() == pool.k_buffer[1].data_ptr()
    assert stored.v_scale is pool.v_scale_buffer[1]


@pytest.mark.parametrize("dtype", FP8, ids=id_of)
def test_write_stores_the_oracles_codes_and_scales_at_loc_and_nothing_else(dtype):
    pool = poisoned(make_pool(dtype=dtype))
    before = snapshot(pool)
    k, v = rows(4, D, torch.bfloat16, 1), rows(4, DV, torch.bfloat16, 2)
    loc = torch.tensor([7, -1, 3, 19], device=DEVICE)
    pool.set_kv_buffer(None, loc, k, v, layer_id_override=1)
    for x, codes_buf, scale_buf in ((k, pool.k_buffer, pool.k_scale_buffer), (v, pool.v_buffer, pool.v_scale_buffer)):
        codes, scales = token_head_oracle(x, dtype)
        want_codes, want_scales = codes_buf[1].cpu().clone(), scale_buf[1].cpu().clone()
        want_codes[[7, 3, 19]] = torch.from_numpy(codes[[0, 2, 3]].astype(np.uint8))
        want_scales[[7, 3, 19]] = torch.from_numpy(scales[[0, 2, 3]])
        assert_same_bytes(codes_buf[1], want_codes, "codes")
        assert_same_bytes(scale_buf[1], want_scales, "scales")
    for i in (0, 2, 4, 6):  # layer 0 of each buffer
        assert_same_bytes(buffers(pool)[i], before[i], "layer 0, not written")


def test_the_constructor_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="dtype must be torch.float8_e4m3fn or torch.float8_e5m2 for a per-token-head FP8 pool, got torch.bfloat16"):
        make_pool(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be torch.float8_e4m3fn or torch.float8_e5m2 for a per-token-head FP8 pool, got torch.float8_e4m3fnuz"):
        make_pool(dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got torch.int8"):
        make_pool(out_dtype=torch.int8)
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        make_pool(head_dim=0)
    with pytest.raises(ValueError, match="enable_memory_saver must be False"):
        make_pool(enable_memory_saver=True)
    unusable = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=r"^device must be a device this torch can use: .*got '" + unusable):
        make_pool(device=unusable)


def _bad_calls():
    k, v, loc = rows(2, D, torch.bfloat16, 6), rows(2, DV, torch.bfloat16, 7), torch.tensor([1, 2], device=DEVICE)
    over = {"layer_id_override": 0}
    return {
        "k_heads": ((None, loc, k[:, :2], v), over, ValueError, r"cache_k must have 3 heads \(shape\[1\]\), got 2"),
        "v_dim": ((None, loc, k, k), over, ValueError, r"cache_v must have head dim 10 \(shape\[2\]\), got 24"),
        "v_tokens": ((None, loc, k, v[:1]), over, ValueError, "cache_v must have T=2 tokens"),
        "loc_dtype": ((None, loc.float(), k, v), over, ValueError, "loc must be int32 or int64"),
        "loc_length": ((None, loc[:1], k, v), over, ValueError, "loc must have T=2 entries"),
        "input_dtype": ((None, loc, k.to(torch.int32), v), over, ValueError, "cache_k must be bfloat16, float16 or float32, got torch.int32"),
        "scale": ((None, loc, k, v, -1.0), over, ValueError, "k_scale must be a positive finite float"),
        "scale_shape": ((None, loc, k, v, None, torch.ones(2, device=DEVICE)), over, ValueError, "v_scale must have one element"),
        "layer": ((None, loc, k, v), {"layer_id_override": 2}, IndexError, "layer_id 2 is outside"),
        "no_layer": ((None, loc, k, v), {}, TypeError, "layer_id_override"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_naming_the_argument_and_writes_nothing(case):
    args, kw, error, message = _bad_calls()[case]
    pool = poisoned(make_pool())
    before = snapshot(pool)
    with pytest.raises(error, match=message):
        pool.set_kv_buffer(*args, **kw)
    assert_unchanged(pool, before, "after a refused write")


def test_bad_verify_writes_and_out_of_range_slots_under_validate_write_nothing():
    pool = poisoned(make_pool(validate=True))
    before = snapshot(pool)
    k, v = rows(4, D, torch.bfloat16, 8), rows(4, DV, torch.bfloat16, 9)
    loc_2d = torch.tensor([[3, 4], [5, 6]], device=DEVICE)
    with pytest.raises(IndexError, match="loc"):
        pool.set_kv_buffer(None, torch.tensor([3, 4, 5, ROWS], device=DEVICE), k, v, layer_id_override=0)
    with pytest.raises(ValueError, match="k_scale must hold positive finite normal float32 values"):
        pool.set_kv_buffer(None, torch.tensor([3, 4, 5, 6], device=DEVICE), k, v, torch.tensor([0.0], device=DEVICE), layer_id_override=0)
    with pytest.raises(ValueError, match=r"commit_lens\[1\] must be in 0..2"):
        pool.set_kv_buffer_prefix_valid(None, loc_2d, torch.tensor([1, 3], device=DEVICE), k, v, layer_id_override=0)
    with pytest.raises(ValueError, match=r"loc_2d must have bs \* width = T = 4 entries"):
        pool.set_kv_buffer_prefix_valid(None, loc_2d[:1], torch.tensor([1], device=DEVICE), k, v, layer_id_override=0)
    with pytest.raises(ValueError, match="commit_lens must be 1-D"):
        pool.set_kv_buffer_prefix_valid(None, loc_2d, torch.tensor([1], device=DEVICE), k, v, layer_id_override=0)
    assert_unchanged(pool, before, "after refused writes")


def test_a_slot_past_the_buffers_is_skipped_without_validate():
    pool = poisoned(make_pool())
    before = snapshot(pool)
    k, v = rows(2, D, torch.bfloat16, 10), rows(2, DV, torch.bfloat16, 11)
    pool.set_kv_buffer(None, torch.tensor([ROWS, -3], device=DEVICE), k, v, layer_id_override=0)
    assert_unchanged(pool, before, "after a write to no valid slot")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=id_of)
def test_getters_dequantize_code_times_scale(out_dtype):
    pool = make_pool(dtype=torch.float8_e5m2, out_dtype=out_dtype, start_layer=4)
    fill_random_(pool.k_buffer + pool.v_buffer, seed=12)
    for b in pool.k_scale_buffer + pool.v_scale_buffer:
        b.copy_(torch.rand(b.shape, generator=torch.Generator().manual_seed(13)).to(b.device) * 3)
    k, v = pool.get_kv_buffer(5)
    stored = pool.get_fp8_buffers(5)
    want_k = (stored.k.cpu().double() * stored.k_scale.cpu().double()[..., None]).float().to(out_dtype)
    assert k.shape == (ROWS, H, D) and k.dtype == out_dtype
    # float32(code) * float32(scale) is exact in float64 and rounds once to float32, as the getter's product
    assert_same_bytes(k, want_k, "K", any_nan=True)
    assert_same_bytes(v, dequantize_token_head(pool.v_buffer[1], pool.v_scale_buffer[1], torch.float8_e5m2, out_dtype), "V")
    assert_same_bytes(pool.get_key_buffer(5), k, "get_key_buffer")
    assert_same_bytes(pool.get_value_buffer(5), v, "get_value_buffer")
    with pytest.raises(IndexError, match="layer_id 3 is outside"):
        pool.get_key_buffer(3)


def test_move_carries_codes_and_scales(copy_path):
    pool = make_pool()
    fill_random_(buffers(pool), seed=14)
    before = snapshot(pool)
    tgt, src = torch.tensor([5, 6, 7, -1], device=DEVICE), torch.tensor([6, 7, 5, 3], device=DEVICE)  # a cycle, padding
    pool.move_kv_cache(tgt, src)
    assert_rows_copied(buffers(pool), before, [5, 6, 7], [6, 7, 5], "buffer after the move")


def test_cpu_copy_round_trip_carries_codes_and_scales(copy_path):
    pool = make_pool()
    fill_random_(buffers(pool), seed=15)
    before = snapshot(pool)
    copy = pool.get_cpu_copy(torch.tensor([3, 8], device=DEVICE))
    assert isinstance(copy, PartsCpuCopy) and len(copy) == 2 and copy.part_names == pool.part_names
    assert tuple(copy.parts[2].shape) == (2, 2, H) and copy.parts[2].dtype == torch.float32
    pool.load_cpu_copy(copy, torch.tensor([11, 12], device=DEVICE))
    assert_rows_copied(buffers(pool), before, [11, 12], [3, 8], "buffer after the load")


def test_a_cpu_copy_of_another_pool_is_refused_and_nothing_written():
    pool, other = make_pool(), make_pool(v_head_dim=24)
    fill_random_(buffers(pool), seed=16)
    before = snapshot(pool)
    copy = other.get_cpu_copy(torch.tensor([1], device=DEVICE))
    with pytest.raises(ValueError, match=r"kv_cache_cpu.v_buffer must have shape \(2, 1, 3, 10\)"):
        pool.load_cpu_copy(copy, torch.tensor([2], device=DEVICE))
    bad = PartsCpuCopy(copy.parts[:2] + (copy.parts[2].double(), copy.parts[3]), copy.part_names, 0)
    with pytest.raises(ValueError, match="kv_cache_cpu.k_scale_buffer must be torch.float32, got torch.float64"):
        make_pool(v_head_dim=24).load_cpu_copy(bad, torch.tensor([2], device=DEVICE))
    with pytest.raises(TypeError, match="kv_cache_cpu must be a PartsCpuCopy"):
        pool.load_cpu_copy((copy.parts[0], copy.parts[1]), torch.tensor([2], device=DEVICE))
    assert_unchanged(pool, before, "after refused loads")


def test_a_cpu_copy_missing_a_buffer_is_refused_by_name_and_nothing_written():
    pool = make_pool()
    fill_random_(buffers(pool), seed=17)
    before = snapshot(pool)
    copy = pool.get_cpu_copy(torch.tensor([1], device=DEVICE))
    short = PartsCpuCopy(copy.parts[:3], copy.part_names, 0)  # the V scales left out
    with pytest.raises(ValueError, match=r"kv_cache_cpu must hold 4 buffers \(one per name\), got 3"):
        pool.load_cpu_copy(short, torch.tensor([2], device=DEVICE))
    assert_unchanged(pool, before, "after a refused load")

def test_sizes_count_the_scales():
    k_bytes, v_bytes = make_pool().get_kv_size_bytes()
    assert k_bytes == 2 * ROWS * H * (D + 4) and v_bytes == 2 * ROWS * H * (DV + 4)


def test_calibration_is_refused_since_every_row_carries_its_scale():
    pool = make_pool()
    with pytest.raises(ValueError, match="enabled must be False for a per-token-head FP8 pool"):
        pool.observe_amax(True)
    pool.observe_amax(False)
    pool.reset_amax()
    assert pool.kv_amax is None
    with pytest.raises(ValueError, match="calibrated_scales needs a pool with static scales"):
        pool.calibrated_scales()
