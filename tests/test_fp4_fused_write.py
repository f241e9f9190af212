"""The fused FP4 write (docs/contract.md, "FP4 pools"): K and V in one launch, bit-identical to the
reference path for every input, NaN and infinities included; the gate and the modes as the FP8
write's. On a CPU the kernel runs through Triton's interpreter (``fused="always"``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvassert import (
    DEVICE,
    assert_same_parts,
    assert_tensors_unchanged,
    cross_compile,
    every_16_bit_value,
    fused_runs,
    id_of,
    poisoned_parts,
    qkv_slices,
)
from kvpool import FusedPathUnavailable, MHATokenToKVPoolFP4

FP4 = torch.float4_e2m1fn_x2
H, D, DV, SIZE = 3, 48, 32, 20


def pool(fused: str, **kw) -> MHATokenToKVPoolFP4:
    return poisoned_parts(MHATokenToKVPoolFP4(SIZE, 1, FP4, H, D, 1, DEVICE, v_head_dim=DV, fused=fused, **kw))


def stored(p: MHATokenToKVPoolFP4) -> list[torch.Tensor]:
    return [getattr(p, name)[0] for name in p.part_names]


def special_rows(t: int, heads: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Blocks at many magnitudes, with zeros, subnormals, infinities, NaN and amaxes of 6 * 2**k."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads * dim // 16, 16, generator=g)
    x *= torch.exp2(torch.randint(-40, 40, (t, heads * dim // 16, 1), generator=g).float())
    x[0, 0] = 0
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
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert fused.stats.fused_calls == 1 and reference.stats.reference_calls == 1
    assert_same_parts(fused, reference)


@fused_runs
def test_int32_slots_and_an_empty_write():
    k, v = special_rows(5, H, D, torch.bfloat16, 3), special_rows(5, H, DV, torch.bfloat16, 4)
    fused, reference = pool("always"), pool("never")
    for p in (fused, reference):
        p.set_kv_buffer(None, torch.tensor([5, 6, 7, 1, 3], dtype=torch.int32, device=DEVICE), k, v, layer_id_override=0)
        p.set_kv_buffer(None, torch.zeros(0, dtype=torch.int64, device=DEVICE), k[:0], v[:0], layer_id_override=0)
    assert_same_parts(fused, reference)


@fused_runs
def test_a_scaled_write_is_refused_by_the_gate_before_anything_is_written():
    p = pool("always")
    before = [b.clone() for b in stored(p)]
    k, v = special_rows(5, H, D, torch.bfloat16, 5)[:2], special_rows(5, H, DV, torch.bfloat16, 6)[:2]
    with pytest.raises(FusedPathUnavailable, match="k_scale/v_scale given"):
        p.set_kv_buffer(None, torch.tensor([1, 2], device=DEVICE), k, v, k_scale=0.5, layer_id_override=0)
    assert_tensors_unchanged(stored(p), before, "buffer")


def test_auto_takes_the_reference_path_where_the_gate_refuses_and_says_why():
    p = pool("auto")
    k, v = special_rows(5, H, D, torch.bfloat16, 7)[:2], special_rows(5, H, DV, torch.bfloat16, 8)[:2]
    p.set_kv_buffer(None, torch.tensor([1, 2], device=DEVICE), k, v, k_scale=0.5, layer_id_override=0)
    p.set_kv_buffer(None, torch.tensor([3, 4], device=DEVICE), k, v, layer_id_override=0)
    if DEVICE == "cpu":  # the interpreter runs only with fused="always"
        assert not p.fused_verdict[0] and "device is cpu" in p.fused_verdict[1]
        assert p.stats.reference_calls == 2 and p.stats.reasons == {p.fused_verdict[1]: 2}
    else:
        assert p.stats.fused_calls == 1 and list(p.stats.reasons) == ["k_scale/v_scale given: the fused FP4 kernel writes unscaled inputs"]


@fused_runs
@settings(max_examples=20)  # each example is two interpreted launches on a CPU
@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=64, max_size=64),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_any_rows_fused_are_the_reference_rows(values, dtype):
    k = torch.tensor(values, dtype=torch.float32).reshape(2, 1, 32).to(dtype).to(DEVICE)  # 2 tokens, 2 blocks each
    v = k[..., 16:]
    loc = torch.tensor([3, 8], device=DEVICE)
    fused, reference = (MHATokenToKVPoolFP4(10, 1, FP4, 1, 32, 1, DEVICE, v_head_dim=16, fused=f) for f in ("always", "never"))
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert_same_parts(fused, reference)


@fused_runs
@pytest.mark.parametrize("layout", ["every_other", "broadcast"])
@pytest.mark.parametrize("scales", [{}, dict(fp4_format="nvfp4", k_global_scales=[1.0], v_global_scales=[2.0**-12])],
                         ids=["fp4_mx_block16", "nvfp4"])  # fmt: skip
def test_strided_slots_fused_are_the_reference_rows(layout, scales):
    """``loc`` with any stride (every other entry of a longer tensor, one slot broadcast to every
    token) names the same rows on both paths, in either FP4 format."""
    k, v = special_rows(5, H, D, torch.bfloat16, 12)[1:], special_rows(5, H, DV, torch.bfloat16, 13)[1:]
    if layout == "every_other":
        loc = torch.tensor([6, 1, -1, 2, 11, 3, 0, 4], device=DEVICE)[::2]
    else:
        loc = torch.tensor([8], device=DEVICE).expand(4)
        # Which of several writes to one slot lands is unspecified on a GPU: every token has one row.
        k, v = k[:1].repeat(4, 1, 1), v[:1].repeat(4, 1, 1)
    fused, reference = pool("always", **scales), pool("never", **scales)
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert_same_parts(fused, reference)


@fused_runs
@pytest.mark.parametrize("heads,dim", [(H, D), (1, 32)], ids=["3x48", "1x32"])
@pytest.mark.parametrize("scales", [{}, dict(fp4_format="nvfp4", k_global_scales=[0.5], v_global_scales=[3.0])],
                         ids=["fp4_mx_block16", "nvfp4"])  # fmt: skip
@pytest.mark.parametrize("layout", ["contiguous", "odd_offset"])
def test_writes_of_many_programs_are_the_reference_rows(heads, dim, scales, layout):
    """Enough tokens for several programs of several tokens each, the last one part-full, with
    padding and out-of-range slots among them, in either FP4 format: the same rows on both paths,
    whether the kernel reads pairs as 32-bit words (contiguous rows) or element by element (rows
    that start one element into their buffer, as no word read can take)."""
    t, size = 150, 200
    k, v = special_rows(t, heads, dim, torch.bfloat16, 21), special_rows(t, heads, dim, torch.bfloat16, 22)
    if layout == "odd_offset":
        k, v = (torch.cat((x[..., :1], x), -1)[..., 1:] for x in (k, v))
        assert k.stride(1) % 2 == 1 and k.data_ptr() % 4 == 2
    g = torch.Generator().manual_seed(3)
    loc = torch.randperm(size, generator=g)[:t]
    loc[[5, 17, 40]] = torch.tensor([-1, size, size + 7])
    loc = loc.to(DEVICE)
    pools = [poisoned_parts(MHATokenToKVPoolFP4(size, 1, FP4, heads, dim, 1, DEVICE, fused=f, **scales)) for f in ("always", "never")]
    for p in pools:
        p.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert pools[0].stats.fused_calls == 1
    assert_same_parts(*pools)


def test_the_fp4_writes_compile_to_vector_accesses_without_spills():
    """Both FP4 writes, compiled for Hopper and Blackwell as their launcher launches contiguous rows,
    read each 16-element block with 16-byte loads and store its 8 code bytes at once; on Hopper they
    keep their values in registers (the interpreter would notice none of this)."""
    compiled = cross_compile("--fp4")
    assert {(v["kernel"], v["target"]) for v in compiled} == {(f, t) for f in ("fp4", "nvfp4") for t in ("sm90", "sm100")}
    for v in compiled:
        assert v["ld_v4"] > 0 and v["st_vector"] > 0, v
        if v["target"] == "sm90":
            assert v["spill_bytes"] == 0, v


@fused_runs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=id_of)
def test_every_16_bit_value_fused_is_the_reference(dtype):
    """16-bit inputs take the kernel's own code and exponent arithmetic (no division by 6): every
    value of the type, under every scale it can meet, stores the reference path's bytes."""
    k = every_16_bit_value(dtype).to(DEVICE)
    t = k.shape[0]
    v = k[..., :16]
    loc = torch.randperm(t + 4, generator=torch.Generator().manual_seed(5))[:t].to(DEVICE)
    fused, reference = (MHATokenToKVPoolFP4(t + 4, 1, FP4, 1, 1024, 1, DEVICE, v_head_dim=16, fused=f) for f in ("always", "never"))
    fused.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    reference.set_kv_buffer(None, loc, k, v, layer_id_override=0)
    assert fused.stats.fused_calls == 1
    assert_same_parts(fused, reference)
