"""The write kernel compiled for real GPU targets (NVIDIA sm_80/90/100, AMD gfx942) on a machine
without one, with the Hopper build keeping the instructions its speed depends on (wide accesses,
hardware FP8), for every plan and variant, and the fnuz formats built with the integer encoder.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import (
    assert_same_bytes,
    cross_compile,
    cuda_values,
    gpu,
    poison_,
)
from kvpool import reference_set_kv_buffer
from kvpool.kernels.store_kv.layout import storage_view
from kvpool.kernels.store_kv.writer import KVWriter
from kvpool.write_types import FUNCTION_NAMES, Geometry


# --- the write kernel compiled for real GPU targets -----------------------------------------------


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return cross_compile()


@pytest.fixture(scope="module")
def plain(compiled) -> list[dict]:
    """The variants that write to the slots as given (no slot map)."""
    return [v for v in compiled if not v["mapped"]]


def test_the_write_kernel_compiles_for_every_target(compiled):
    assert {v["target"] for v in compiled} == {"sm90", "sm100", "sm80", "gfx942"}
    assert len(compiled) == 24


def test_hopper_build_uses_wide_accesses_and_hardware_fp8(plain):
    [fp8] = [
        v for v in plain
        if v["target"] == "sm90" and v["D"] == 128 and v["out_kind"] == 0
        and not (v["prefix"] or v["observe"]) and v["i64"]
    ]  # fmt: skip
    # 16-byte loads of bf16 rows and 16-byte stores of FP8 rows; cvt.rn.satfinite for the cast;
    # the reciprocal-and-FMA division per element, with div.rn left for the reciprocal itself and
    # for scales outside the range where the FMA correction is exact.
    assert fp8["ld_v4"] > 0 and fp8["st_v4"] > 0
    assert fp8["cvt_satfinite"] > 0 and fp8["fma_rn"] > fp8["div_rn"] > 0
    # The cast saturates by itself (no clamp); the division clamps its input with NaN-keeping min/max.
    assert fp8["max_nan"] > 0
    [e5m2] = [v for v in plain if v["target"] == "sm90" and v["out_kind"] == 1]
    assert e5m2["cvt_satfinite"] > 0
    [soft] = [v for v in plain if v["target"] == "sm80" and v["out_kind"] == 0]
    assert soft["soft"] and soft["cvt_satfinite"] == 0, "no FP8 conversion instruction before sm_89"


def test_prefix_and_observe_variants_keep_the_fast_write(plain):
    """The verify write (PREFIX) and the calibrating write (OBSERVE) are the same vectorised write;
    only the observing one carries an atomic max, and the plain one has none."""
    by = {
        (v["prefix"], v["observe"]): v
        for v in plain if v["target"] == "sm90" and v["H"] == 8 and v["out_kind"] == 0 and v["i64"]
    }  # fmt: skip
    for v in by.values():
        assert v["ld_v4"] > 0 and v["st_v4"] > 0 and v["cvt_satfinite"] > 0
    assert by[(False, True)]["atom_max"] > 0
    assert by[(False, False)]["atom_max"] == 0 and by[(True, False)]["atom_max"] == 0


def test_32_bit_offsets_and_two_piece_rows_compile_to_the_fast_write(plain):
    """The 32-bit-offset variant does less 64-bit address arithmetic than the 64-bit one; the odd
    shape's flat plan (288 = 256 + 32 per row, 32-bit offsets) keeps 16-byte loads and the
    hardware cast."""
    [wide] = [v for v in plain if v["target"] == "sm90" and v["H"] == 8 and v["i64"] and not (v["prefix"] or v["observe"]) and v["out_kind"] == 0]
    [narrow] = [v for v in plain if v["target"] == "sm90" and (v["H"], v["D"]) == (8, 128) and not v["i64"]]
    assert narrow["mul_wide"] < wide["mul_wide"], (narrow, wide)
    assert narrow["ld_v4"] > 0 and narrow["st_v4"] > 0 and narrow["cvt_satfinite"] > 0
    [odd] = [v for v in plain if v["target"] == "sm90" and v["flat"] and v["H"] == 3]
    assert odd["ld_v4"] > 0 and odd["cvt_satfinite"] > 0


def test_the_row_plan_of_heads_cut_in_two_pieces_compiles_to_wider_accesses(plain):
    """H=8, D=96: a large write's row plan (each row one run, 512 + 256) issues 16-byte stores and
    more 16-byte loads than the per-head plan (every head 64 + 32), which has no 16-byte store."""
    by = {v["flat"]: v for v in plain if v["target"] == "sm90" and (v["H"], v["D"]) == (8, 96)}
    assert by[True]["st_v4"] > by[False]["st_v4"] and by[True]["ld_v4"] > by[False]["ld_v4"], by
    assert by[True]["cvt_satfinite"] > 0 and not by[True]["i64"]


def test_joined_plan_compiles_to_the_fast_write(compiled):
    """The MLA pool's joined plan (one program writes the 512 latent and 64 rotary values of its
    tokens) keeps 16-byte loads and stores, the hardware cast and the FMA division for both parts."""
    [mla] = [v for v in compiled if v["joined"] and v["target"] == "sm90"]
    assert (mla["H"], mla["D"], mla["DV"]) == (1, 512, 64)
    assert mla["ld_v4"] > 0 and mla["st_v4"] > 0 and mla["cvt_satfinite"] > 0 and mla["fma_rn"] > mla["div_rn"] > 0


def test_the_write_through_a_slot_map_keeps_the_fast_write(compiled):
    """A sliding-window layer's write reads the full-to-SWA mapping in the same launch: the plain
    and verify writes through the map keep 16-byte loads and stores and the hardware cast, and
    compile for AMD too."""
    mapped = [v for v in compiled if v["mapped"]]
    assert {(v["target"], v["prefix"]) for v in mapped} == {("sm90", False), ("sm90", True), ("gfx942", False)}
    for v in mapped:
        if v["target"] == "sm90":
            assert v["ld_v4"] > 0 and v["st_v4"] > 0 and v["cvt_satfinite"] > 0, v


def test_fnuz_formats_compile_for_gfx942_and_hopper_with_the_integer_encoder(compiled):
    """e4m3fnuz and e5m2fnuz (out kinds 5 and 6) compile for gfx942, the MLA pool's joined plan
    included, with no hardware FP8 conversion (``v_cvt_pk_fp8_f32`` / ``v_cvt_pk_bf8_f32``, which
    Triton emits for a native cast to float8e4b8 / float8e5b16); on Hopper the fnuz writes keep the
    16-byte accesses and the FMA division but have no cvt.rn.satfinite (no fnuz conversion there)."""
    fnuz = [v for v in compiled if v["out_kind"] in (5, 6)]
    amd = [v for v in fnuz if v["target"] == "gfx942"]
    assert {v["out_kind"] for v in amd} == {5, 6} and any(v["joined"] for v in amd)
    for v in amd:
        assert v["soft"] and v["cvt_fp8"] == 0 and v["stores"] > 0, v
    hopper = [v for v in fnuz if v["target"] == "sm90"]
    assert {v["out_kind"] for v in hopper} == {5, 6}
    for v in hopper:
        assert not v["soft"] and v["cvt_satfinite"] == 0 and v["fma_rn"] > v["div_rn"] > 0, v
    [wide] = [v for v in hopper if (v["H"], v["D"]) == (8, 128)]
    assert wide["ld_v4"] > 0 and wide["st_v4"] > 0


@gpu
def test_a_writer_on_a_bare_cuda_device_takes_the_current_device_tensors():
    """``KVWriter`` given ``torch.device("cuda")`` takes it as the current device: it writes K and V
    of tensors on ``cuda:<current>`` exactly as the reference does."""
    kc = poison_(torch.empty(8, 2, 16, dtype=torch.float8_e4m3fn, device="cuda"))
    vc = poison_(torch.empty(8, 2, 16, dtype=torch.float8_e4m3fn, device="cuda"))
    writer = KVWriter(Geometry(kc.dtype, 2, 16, 2, 16, torch.device("cuda")), kc.stride(), vc.stride(), 8, "always")
    assert writer.geometry.device == kc.device
    k, v = cuda_values((3, 2, 16), torch.bfloat16, seed=5), cuda_values((3, 2, 16), torch.bfloat16, seed=6)
    loc = torch.tensor([1, 4, 6], device="cuda")
    writer.write(storage_view(kc), storage_view(vc), loc, k, v, None, None, FUNCTION_NAMES)
    k_ref, v_ref = poison_(torch.empty_like(kc)), poison_(torch.empty_like(vc))
    reference_set_kv_buffer(k, v, k_ref, v_ref, loc)
    assert_same_bytes(kc.view(torch.uint8), k_ref.view(torch.uint8), "K written through a bare-cuda writer")
    assert_same_bytes(vc.view(torch.uint8), v_ref.view(torch.uint8), "V written through a bare-cuda writer")
