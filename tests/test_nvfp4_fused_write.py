"""The fused NVFP4 write (docs/contract.md, "NVFP4"): K and V in one launch with each layer's global
scales read on the device, bit-identical to the reference path for every input, NaN, infinities,
signed zeros and subnormal block scales included; the gate and the modes as the FP4 write's. On a
CPU the kernel runs through Triton's interpreter (``fused="always"``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvassert import DEVICE, assert_same_parts, every_16_bit_value, fused_runs, id_of, poisoned_parts, qkv_slices
from kvpool import MHATokenToKVPoolFP4

FP4 = torch.float4_e2m1fn_x2
H, D, DV, SIZE = 3, 48, 32, 20
K_G, V_G = [1.0, 0.37], [2.0**-12, 1536.0]


def pool(fused: str, **kw) -> MHATokenToKVPoolFP4:
    args = dict(v_head_dim=DV, fused=fused, fp4_format="nvfp4", k_global_scales=K_G, v_global_scales=V_G)
    args.update(kw)
    p = MHATokenToKVPoolFP4(SIZE, 1, FP4, H, D, 2, DEVICE, **args)
    return poisoned_parts(p)


def special_rows(t: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Blocks at many magnitudes (block scales from subnormal to saturated under the global scales
    above), with zeros, -0.0, float32 subnormals, infinities, NaN and the e2m1 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads * dim // 16, 16, generator=g)
    x *= torch.exp2(torch.randint(-40, 30, (t, heads * dim // 16, 1), generator=g).float())
    x[0, 0] = 0
    x[0, 0, 3] = -0.0
    x[0, 1, :3] = torch.tensor([1e-40, -1e-41, 6e-8])
    x[1, 0, 2], x[1, 1, 0], x[2, 0, 9] = float("inf"), float("-inf"), float("nan")
    x[3, :] = 6 * 2.0 ** torch.randint(-20, 20, (heads * dim // 16, 1), generator=g).float()
    x[4, 0, :] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -0.0])
    return x.reshape(t, heads, dim).to(dtype).to(DEVICE)


@fused_runs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv_slice"])
def test_fused_write_is_the_reference_write_bit_for_bit(dtype, strided):
    k, v = special_rows(7, H, D, dtype, 1), special_rows(7, H, DV, dtype, 2)
    if strided:  # K and V sliced out of one wider projection, as a fused QKV output is
        k, v = qkv_slices(k, v)
    loc = torch.tensor([4, -1, 9, 2, SIZE + 1, 17, 0], device=DEVICE)
    fused, reference = pool("always"), pool("never")
    for layer in (0, 1):  # each layer with its own global scales
        fused.set_kv_buffer(None, loc, k, v, layer_id_override=layer)
        reference.set_kv_buffer(None, loc, k, v, layer_id_override=layer)
    assert fused.stats.fused_calls == 2 and reference.stats.reference_calls == 2
    assert_same_parts(fused, reference)


@fused_runs
def test_int32_slots_an_empty_write_and_a_changed_global_scale():
    k, v = special_rows(5, H, D, torch.bfloat16, 3), special_rows(5, H, DV, torch.bfloat16, 4)
    fused, reference = pool("always"), pool("never")
    for p in (fused, reference):
        p.set_global_scales(1, 0.001, 12.5)  # read on the device at the next write
        p.set_kv_buffer(None, torch.tensor([5, 6, 7, 1, 3], dtype=torch.int32, device=DEVICE), k, v, layer_id_override=1)
        p.set_kv_buffer(None, torch.zeros(0, dtype=torch.int64, device=DEVICE), k[:0], v[:0], layer_id_override=1)
    assert_same_parts(fused, reference)


def test_auto_takes_the_fused_path_on_cuda_and_says_why_not_elsewhere():
    p = pool("auto")
    k, v = special_rows(5, H, D, torch.bfloat16, 7)[:2], special_rows(5, H, DV, torch.bfloat16, 8)[:2]
    p.set_kv_buffer(None, torch.tensor([1, 2], device=DEVICE), k, v, 0.37, layer_id_override=1)  # the layer's scale
    p.set_kv_buffer(None, torch.tensor([3, 4], device=DEVICE), k, v, layer_id_override=0)
    if DEVICE == "cpu":  # the interpreter runs only with fused="always"
        assert not p.fused_verdict[0] and "device is cpu" in p.fused_verdict[1]
        assert p.stats.reference_calls == 2 and p.stats.reasons == {p.fused_verdict[1]: 2}
    else:
        assert p.stats.fused_calls == 2 and p.stats.reference_calls == 0


@fused_runs
@settings(max_examples=20)  # each example is two interpreted launches on a CPU
@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=64, max_size=64),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.sampled_from([1.0, 2.0**-20, 0.7, 4096.0]),
)
def test_any_rows_fused_are_the_reference_rows(values, dtype, g):
    k = torch.tensor(values, dtype=torch.float32).reshape(2, 1, 32).to(dtype).to(DEVICE)  # 2 tokens, 2 blocks each
    v = k[..., 16:]
    loc = torch.tensor([3, 8], device=DEVICE)
    fused, reference = (
        MHATokenToKVPoolFP4(10, 1, "nvfp4", 1, 32, 1, DEVICE, v_head_dim=16, fused=f, k_global_scales=g, v_global_scales=1 / g)
        for f in ("always", "never")
    )
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert_same_parts(fused, reference)


def quotients_at_the_bounds(g: float, dtype: torch.dtype) -> torch.Tensor:
    """For every finite nonzero e4m3 block scale ``S`` (and a saturated one, 448), blocks whose
    elements divided by ``g`` are exactly each e2m1 rounding bound times ``S`` (at most 7
    significant bits: exact in every input type), one step of ``dtype`` either side of it, and
    ``2**-21`` of it either side (steps a division by 3 keeps), with a maximum of ``6 * S``
    (``24 * 448`` for the saturated scale) that gives the block that scale. [T, 1, 48] rows of
    ``dtype``, three blocks a scale."""
    codes = torch.arange(1, 127, dtype=torch.uint8)
    scales = torch.cat((codes.view(torch.float8_e4m3fn).float(), torch.tensor([448.0])))
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    at = scales[:, None] * bounds[None, :]
    if dtype == torch.float32:
        below, above = torch.nextafter(at, torch.zeros(())), torch.nextafter(at, torch.full((), 100.0))
    else:  # the neighbours in the 16-bit type (positive values: the next bit patterns)
        bits = at.to(dtype).view(torch.int16)
        below, above = (bits - 1).view(dtype).float(), (bits + 1).view(dtype).float()
    y = torch.cat((at, below, above, at * (1 - 2.0**-21), at * (1 + 2.0**-21)), dim=1)  # 35 a scale
    lead = torch.where(scales == 448, 24 * 448.0, 6 * scales)[:, None]
    y = torch.cat((y, -at[:, :7], -y[:, :3]), dim=1).reshape(-1, 3, 15)  # 45 a scale: three blocks of 15
    y = torch.cat((lead[:, None, :].expand(-1, 3, 1), y), dim=2)
    return (y.reshape(-1, 1, 48) * g).to(dtype).to(DEVICE)


@fused_runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=id_of)
@pytest.mark.parametrize("g", [1.0, 0.125, 3.0])
def test_quotients_at_and_beside_each_bound_under_each_block_scale(g, dtype):
    """The fused write finds the e2m1 code of ``y / S`` without dividing by ``S``: at each rounding
    bound (ties to even), one step either side of it, for every block scale, under a global scale
    that is a power of two (no division by it either; 16-bit inputs then take the reciprocal of
    ``S``) and one that is not."""
    k = quotients_at_the_bounds(g, dtype)
    t = k.shape[0]
    v = k[..., :16]
    loc = torch.arange(t, device=DEVICE)
    fused, reference = (
        MHATokenToKVPoolFP4(t, 1, FP4, 1, 48, 1, DEVICE, v_head_dim=16, fused=f, fp4_format="nvfp4",
                            k_global_scales=g, v_global_scales=g)
        for f in ("always", "never")
    )  # fmt: skip
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert fused.stats.fused_calls == 1
    assert_same_parts(fused, reference)


@fused_runs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=id_of)
@pytest.mark.parametrize("g", [1.0, 3.0])
def test_every_16_bit_value_fused_is_the_reference(dtype, g):
    k = every_16_bit_value(dtype).to(DEVICE)
    t = k.shape[0]
    v = k[..., :16]
    loc = torch.randperm(t + 4, generator=torch.Generator().manual_seed(6))[:t].to(DEVICE)
    fused, reference = (
        MHATokenToKVPoolFP4(t + 4, 1, FP4, 1, 1024, 1, DEVICE, v_head_dim=16, fused=f, fp4_format="nvfp4",
                            k_global_scales=g, v_global_scales=g)
        for f in ("always", "never")
    )  # fmt: skip
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert_same_parts(fused, reference)
