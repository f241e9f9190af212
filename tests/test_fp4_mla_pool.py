"""``MLATokenToKVPoolFP4`` (docs/contract.md, "FP4 pools"): SGLang's latent FP4 buffers, whole-row
and two-part writes against an oracle and SGLang's quantizer, fused against reference, the readers,
moves and CPU copies with their scales, bad input and the sizing."""

from __future__ import annotations

import types

import pytest
import torch

from kvassert import DEVICE, assert_same_bytes, fill_random_, fp4_oracle, fused_runs, id_of, sglang_kvfp4
from kvpool import FusedPathUnavailable, KVGeometry, MLATokenToKVPoolFP4, dequantize_fp4

FP4 = torch.float4_e2m1fn_x2
R, ROPE, SIZE = 32, 16, 12
ROWS = SIZE + 1
LAYER = types.SimpleNamespace(layer_id=0)


def make_pool(fused: str = "never", **kw) -> MLATokenToKVPoolFP4:
    p = MLATokenToKVPoolFP4(SIZE, 1, FP4, R, ROPE, 1, DEVICE, fused=fused, **kw)
    for b in (p.kv_buffer[0], p.kv_scale_buffer[0]):
        b.fill_(0xA5)
    return p


def latent_rows(t: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 1, R + ROPE, generator=g) * torch.exp2(torch.randint(-8, 8, (t, 1, 3), generator=g).float()).repeat_interleave(16, -1)
    x[0, 0, :16] = 0
    x[1, 0, R + 3] = float("nan")
    x[2, 0, 5] = float("-inf")
    return x.to(dtype).to(DEVICE)


def stored(p: MLATokenToKVPoolFP4) -> list[torch.Tensor]:
    return [p.kv_buffer[0], p.kv_scale_buffer[0]]


def test_buffers_are_sglangs():
    p = MLATokenToKVPoolFP4(SIZE, 1, FP4, 512, 64, 2, DEVICE)
    assert [tuple(b.shape) for b in p.kv_buffer] == [(ROWS, 1, 288)] * 2
    assert [tuple(b.shape) for b in p.kv_scale_buffer] == [(ROWS, 36)] * 2
    assert all(b.dtype == torch.uint8 and not b.any() for b in p.kv_buffer + p.kv_scale_buffer)
    assert p.get_kv_size_bytes() == KVGeometry.mla(512, 64, 2, FP4).pool_bytes(SIZE) == 2 * ROWS * (288 + 36)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
def test_whole_row_and_two_part_writes_store_the_format(dtype):
    x = latent_rows(5, dtype, 1)
    loc = torch.tensor([3, -1, 7, ROWS + 2, 1], device=DEVICE)
    whole, parts = make_pool(), make_pool()
    before = [b.clone() for b in stored(whole)]
    whole.set_kv_buffer(LAYER, loc, x, None)
    parts.set_mla_kv_buffer(LAYER, loc, x[..., :R], x[..., R:])
    codes, scales = fp4_oracle(x[[0, 2, 4]])
    want_kv, want_scale = before[0].clone(), before[1].clone()
    want_kv[[3, 7, 1]] = torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4)).to(DEVICE)
    want_scale[[3, 7, 1]] = torch.from_numpy(scales).to(DEVICE)
    for p in (whole, parts):
        assert_same_bytes(p.kv_buffer[0], want_kv, "kv_buffer")
        assert_same_bytes(p.kv_scale_buffer[0], want_scale, "kv_scale_buffer")


def test_two_part_write_is_sglangs_separate_quantization():
    util = sglang_kvfp4()
    x = latent_rows(4, torch.bfloat16, 2).cpu()
    p = MLATokenToKVPoolFP4(SIZE, 1, FP4, R, ROPE, 1, "cpu")
    p.set_mla_kv_buffer(LAYER, torch.arange(1, 5), x[..., :R], x[..., R:])
    (nope, nope_sf), (rope, rope_sf) = util.batched_quantize(x[..., :R].contiguous()), util.batched_quantize(x[..., R:].contiguous())
    assert_same_bytes(p.kv_buffer[0][1:5], torch.cat([nope, rope], dim=-1), "kv_buffer")
    assert_same_bytes(p.kv_scale_buffer[0][1:5], torch.cat([nope_sf, rope_sf], dim=-1), "kv_scale_buffer")


@fused_runs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=id_of)
def test_fused_writes_are_the_reference_writes(dtype):
    x = latent_rows(5, dtype, 3)
    loc = torch.tensor([3, -1, 7, ROWS + 2, 1], device=DEVICE)
    fused, reference = make_pool("always"), make_pool("never")
    for p in (fused, reference):
        p.set_kv_buffer(LAYER, loc[:3], x[:3])
        p.set_mla_kv_buffer(LAYER, loc[3:], x[3:, :, :R], x[3:, :, R:])
    assert fused.stats.fused_calls == 2 and reference.stats.reference_calls == 2
    for a, b in zip(stored(fused), stored(reference)):
        assert_same_bytes(a, b, "buffer")
    with pytest.raises(FusedPathUnavailable, match="k_scale/v_scale given"):
        fused.set_kv_buffer(LAYER, loc[:3], x[:3], k_scale=2.0)


def test_readers():
    p = make_pool(start_layer=3)
    fill_random_(stored(p), seed=4)
    whole = p.get_key_buffer(3)
    assert_same_bytes(whole, dequantize_fp4(p.kv_buffer[0], p.kv_scale_buffer[0]), "get_key_buffer")
    assert_same_bytes(p.get_value_buffer(3), whole[..., :R], "get_value_buffer")
    assert p.get_fp4_buffers(3).kv is p.kv_buffer[0]
    nope, rope = p.get_mla_kv_buffer(types.SimpleNamespace(layer_id=3), torch.tensor([2, -1, 5], device=DEVICE), torch.float32)
    full = dequantize_fp4(p.kv_buffer[0], p.kv_scale_buffer[0], torch.float32)
    assert_same_bytes(nope[[0, 2]], full[[2, 5], :, :R], "k_nope")
    assert_same_bytes(rope[[0, 2]], full[[2, 5], :, R:], "k_rope")
    assert not nope[1].any() and not rope[1].any()  # a padding slot reads as zeros


def test_moves_and_cpu_copies_carry_the_scales(copy_path):
    p = make_pool()
    fill_random_(stored(p), seed=5)
    before = [b.clone() for b in stored(p)]
    p.move_kv_cache(torch.tensor([8, 9], device=DEVICE), torch.tensor([9, 2], device=DEVICE))
    copy = p.get_cpu_copy(torch.tensor([8, 9], device=DEVICE))
    p.load_cpu_copy(copy, torch.tensor([10, 11], device=DEVICE))
    for a, b in zip(stored(p), before):
        want = b.clone()
        want[[8, 9]] = b[[9, 2]]
        want[[10, 11]] = b[[9, 2]]
        assert_same_bytes(a, want, "buffer")


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda p, x: p.set_kv_buffer(LAYER, torch.tensor([1, 2], device=DEVICE), x[..., :R]), ValueError, "cache_k must have head dim 48"),
        (lambda p, x: p.set_mla_kv_buffer(LAYER, torch.tensor([1, 2], device=DEVICE), x[..., :R], x[:1, :, R:]), ValueError, "cache_k_rope must have T=2"),
        (lambda p, x: p.set_kv_buffer(LAYER, torch.tensor([1], device=DEVICE), x), ValueError, "loc must have T=2"),
        (lambda p, x: p.set_kv_buffer(LAYER, torch.tensor([1, 2], device=DEVICE), x, k_scale=0.0), ValueError, "k_scale must be a positive"),
        (lambda p, x: p.set_kv_buffer(types.SimpleNamespace(layer_id=1), torch.tensor([1, 2], device=DEVICE), x), IndexError, "layer_id 1 is outside"),
    ],
    ids=["row width", "rope tokens", "loc length", "scale", "layer"],
)
def test_bad_input_raises_and_writes_nothing(call, error, message):
    p = make_pool()
    before = [b.clone() for b in stored(p)]
    with pytest.raises(error, match=message):
        call(p, latent_rows(3, torch.bfloat16, 6)[:2])
    for a, b in zip(stored(p), before):
        assert_same_bytes(a, b, "buffer")


def test_constructor_refusals():
    with pytest.raises(ValueError, match="kv_lora_rank must be a multiple of 16.*got 40"):
        MLATokenToKVPoolFP4(SIZE, 1, FP4, 40, 16, 1, DEVICE)
    with pytest.raises(ValueError, match="use_nsa must be False"):
        MLATokenToKVPoolFP4(SIZE, 1, FP4, R, ROPE, 1, DEVICE, use_nsa=True)
    with pytest.raises(ValueError, match="override_kv_cache_dim must be None or kv_lora_rank"):
        MLATokenToKVPoolFP4(SIZE, 1, FP4, R, ROPE, 1, DEVICE, False, None, None, False, 64)
