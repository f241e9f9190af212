"""FP8 (and 16-bit) encodings derived by hand, as literal bytes: ``kvassert``'s oracle q(x, s)
(docs/contract.md, "The write") must agree with them, and so must ``quantize``,
``reference_set_kv_buffer`` and ``fused_fp8_set_kv_buffer`` (through the Triton interpreter on CPU),
byte for byte; non-power-of-two scales divide as IEEE float32 division; 16-bit and float32 caches
take the plain cast and ignore scales.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch

import kvpool
from kvassert import (
    BF16,
    E4M3FN,
    E5M2,
    FORMAT_OF,
    FP16,
    INPUT_DTYPES,
    INTERPRETER,
    assert_codes_equal,
    assert_same_bytes,
    codes_of,
    encode_exact,
    encode_f32,
    needs_interpreter,
    q_codes,
    q_exact,
    skip_fused_without_interpreter,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ==============================================================================================
# Encodings derived by hand.
#
# Every expected byte below was worked out on paper from the format definitions (comments show the
# working).
#
# e4m3fn: value = 2**(e-7) * 1.mmm (e = 1..15), 2**-6 * 0.mmm (e = 0); S.1111.111 is NaN, no inf;
#         fmax = 1.75 * 2**8 = 448 = 0x7E; smallest subnormal 2**-9.
# e5m2:   value = 2**(e-15) * 1.mm (e = 1..30), 2**-14 * 0.mm (e = 0); e = 31 is inf/NaN;
#         fmax = 1.75 * 2**15 = 57344 = 0x7B; smallest subnormal 2**-16.

NAN = float("nan")
INF = float("inf")
E4M3 = torch.float8_e4m3fn
E5M2_T = torch.float8_e5m2


class Known(NamedTuple):
    id: str
    x: float
    code: int  # expected byte; -1 means "a NaN code"
    approx: bool = False  # True: the byte holds for x rounded to any input dtype (x itself need not be exact)


# fmt: off
E4M3FN_KNOWN = [
    Known("zero", 0.0, 0x00),
    Known("neg_zero", -0.0, 0x80),
    Known("one", 1.0, 0x38),                       # e=7, m=000
    Known("tie_1.0625_down_to_even", 1.0625, 0x38),  # halfway 1.0 (m=000) / 1.125 (m=001) -> even 000
    Known("tie_1.1875_up_to_even", 1.1875, 0x3A),    # halfway 1.125 (001) / 1.25 (010) -> even 010
    Known("1.97_rounds_up_to_2", 1.97, 0x40, approx=True),  # above midpoint 1.9375 of 1.875 / 2.0
    Known("tie_1.9375_carries_to_2", 1.9375, 0x40),  # halfway 1.875 (111) / 2.0 (e=8, 000) -> even 000
    Known("0.1", 0.1, 0x1D, approx=True),          # 1.6 * 2**-4: e=3, m=4.8 -> 5 (101)
    Known("neg_3.5", -3.5, 0xC6),                  # 1.75 * 2**1: S=1, e=8, m=110
    Known("240", 240.0, 0x77),                     # 1.875 * 2**7: e=14, m=111
    Known("416", 416.0, 0x7D),                     # 1.625 * 2**8: e=15, m=101
    Known("424", 424.0, 0x7D),                     # m = 5.25 -> 5
    Known("tie_432_up_to_even_448", 432.0, 0x7E),  # halfway 416 (101) / 448 (110) -> 110
    Known("440", 440.0, 0x7E),                     # m = 5.75 -> 6
    Known("fmax_448", 448.0, 0x7E),
    Known("neg_fmax", -448.0, 0xFE),
    Known("449_saturates", 449.0, 0x7E, approx=True),
    Known("464_saturates", 464.0, 0x7E),           # midpoint of 448 and (non-existent) 480: clamp first
    Known("465_saturates", 465.0, 0x7E, approx=True),
    Known("480_saturates", 480.0, 0x7E),
    Known("1e6_saturates", 1e6, 0x7E, approx=True),
    Known("neg_1e6_saturates", -1e6, 0xFE, approx=True),
    Known("inf_saturates", INF, 0x7E),
    Known("neg_inf_saturates", -INF, 0xFE),
    Known("nan", NAN, -1),
    Known("min_normal_2^-6", 2.0 ** -6, 0x08),
    Known("min_subnormal_2^-9", 2.0 ** -9, 0x01),
    Known("7*2^-9", 7 * 2.0 ** -9, 0x07),          # largest subnormal
    Known("tie_2^-10_to_zero", 2.0 ** -10, 0x00),  # halfway 0 / 2**-9 -> even 0
    Known("neg_tie_2^-10_to_neg_zero", -(2.0 ** -10), 0x80),
    Known("just_above_2^-10", 2.0 ** -10 + 2.0 ** -17, 0x01),
    Known("2^-11_to_zero", 2.0 ** -11, 0x00),
    Known("tie_3*2^-10_to_2", 3 * 2.0 ** -10, 0x02),   # 1.5 quanta -> 2
    Known("tie_5*2^-10_to_2", 5 * 2.0 ** -10, 0x02),   # 2.5 quanta -> 2
    Known("tie_7*2^-10_to_4", 7 * 2.0 ** -10, 0x04),   # 3.5 quanta -> 4
    Known("tie_15*2^-10_to_min_normal", 15 * 2.0 ** -10, 0x08),  # 7.5 quanta -> 8 = 2**-6
    Known("1e-30_to_zero", 1e-30, 0x00, approx=True),
    Known("neg_1e-30_to_neg_zero", -1e-30, 0x80, approx=True),
    Known("f32_subnormal_to_zero", 2.0 ** -140, 0x00, approx=True),
    Known("neg_f32_subnormal_to_neg_zero", -(2.0 ** -140), 0x80, approx=True),
]

E5M2_KNOWN = [
    Known("zero", 0.0, 0x00),
    Known("neg_zero", -0.0, 0x80),
    Known("one", 1.0, 0x3C),                       # e=15, m=00
    Known("tie_1.125_down_to_even", 1.125, 0x3C),  # halfway 1.0 (00) / 1.25 (01)
    Known("tie_1.375_up_to_even", 1.375, 0x3E),    # halfway 1.25 (01) / 1.5 (10)
    Known("1.97_rounds_up_to_2", 1.97, 0x40, approx=True),  # above midpoint 1.875 of 1.75 / 2.0
    Known("tie_1.875_carries_to_2", 1.875, 0x40),  # halfway 1.75 (11) / 2.0 (e=16, 00)
    Known("0.1", 0.1, 0x2E, approx=True),          # 1.6 * 2**-4: e=11, m=2.4 -> 2 (10)
    Known("neg_3.5", -3.5, 0xC3),                  # 1.75 * 2: S=1, e=16, m=11
    Known("49152", 49152.0, 0x7A),                 # 1.5 * 2**15: e=30, m=10
    Known("tie_53248_down_to_even", 53248.0, 0x7A),  # halfway 49152 (10) / 57344 (11)
    Known("fmax_57344", 57344.0, 0x7B),
    Known("neg_fmax", -57344.0, 0xFB),
    Known("57345_saturates", 57345.0, 0x7B, approx=True),
    Known("61440_saturates", 61440.0, 0x7B),       # midpoint of 57344 and 65536 (would be inf)
    Known("65504_saturates", 65504.0, 0x7B),
    Known("1e5_saturates", 1e5, 0x7B, approx=True),
    Known("1e30_saturates", 1e30, 0x7B, approx=True),
    Known("inf_saturates", INF, 0x7B),
    Known("neg_inf_saturates", -INF, 0xFB),
    Known("nan", NAN, -1),
    Known("min_normal_2^-14", 2.0 ** -14, 0x04),
    Known("min_subnormal_2^-16", 2.0 ** -16, 0x01),
    Known("3*2^-16", 3 * 2.0 ** -16, 0x03),        # largest subnormal
    Known("tie_2^-17_to_zero", 2.0 ** -17, 0x00),
    Known("neg_tie_2^-17_to_neg_zero", -(2.0 ** -17), 0x80),
    Known("just_above_2^-17", 2.0 ** -17 + 2.0 ** -24, 0x01),
    Known("tie_3*2^-17_to_2", 3 * 2.0 ** -17, 0x02),
    Known("tie_5*2^-17_to_2", 5 * 2.0 ** -17, 0x02),
    Known("tie_7*2^-17_to_min_normal", 7 * 2.0 ** -17, 0x04),  # 3.5 quanta -> 4 = 2**-14
    Known("neg_1e-30_to_neg_zero", -1e-30, 0x80, approx=True),
]
# fmt: on

KNOWN = {E4M3: E4M3FN_KNOWN, E5M2_T: E5M2_KNOWN}
FMT_ID = {E4M3: "e4m3fn", E5M2_T: "e5m2"}


def _representable(x: float, dtype: torch.dtype) -> bool:
    if math.isnan(x) or math.isinf(x):
        return True
    back = torch.tensor([x], dtype=torch.float64).to(dtype).double().item()
    return back == x and math.copysign(1.0, back) == math.copysign(1.0, x)


def _literal_rows(cache_dtype, in_dtype, mult: float = 1.0):
    """The literal rows usable with this input dtype, with inputs x * mult."""
    out = []
    for k in KNOWN[cache_dtype]:
        xm = k.x * mult
        if k.approx or _representable(xm, in_dtype):
            out.append(k._replace(x=xm))
    return out


# ----------------------------------------------------------------------------------------------
# The oracle against the literals.


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_oracle_agrees_with_literals(cache_dtype):
    fmt = FORMAT_OF[cache_dtype]
    for k in KNOWN[cache_dtype]:
        y = np.array([k.x], dtype=np.float32)
        vec = int(encode_f32(y, fmt)[0])
        exact = encode_exact(float(y[0]), fmt)
        for name, got in (("vectorised", vec), ("exact", exact)):
            if k.code < 0:
                assert fmt.is_nan_code(np.array([got]))[0], f"{name} oracle: {k.id} gave 0x{got:02x}"
            else:
                assert got == k.code, f"{name} oracle: {k.id} ({k.x!r}) gave 0x{got:02x}, literal 0x{k.code:02x}"


def test_oracle_encoders_agree_on_every_bf16_and_fp16_pattern():
    """The vectorised (bit-pattern) and exact (rational) encoders agree on 131072 inputs."""
    bf = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    fp = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    sample = np.concatenate([bf[::7], fp[::7]])  # every 7th keeps this quick; ties stay dense
    for fmt in (E4M3FN, E5M2, BF16, FP16):
        vec = encode_f32(sample, fmt)
        exact = np.array([encode_exact(float(y), fmt) for y in sample])
        assert_codes_equal(vec, exact, fmt, "vectorised vs exact encoder")


def test_oracle_fp16_encoder_agrees_with_numpy_ieee_cast():
    """NumPy's float32 -> float16 is an independent IEEE RNE implementation (overflow to inf)."""
    rng = np.random.default_rng(1234)
    y = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    y = np.concatenate([y, (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)])
    with np.errstate(all="ignore"):
        np_codes = y.astype(np.float16).view(np.uint16).astype(np.int64)
    assert_codes_equal(encode_f32(y, FP16), np_codes, FP16, "oracle vs numpy float16")


# ----------------------------------------------------------------------------------------------
# kvpool against the literals: quantize, both write functions, three input dtypes, several scales.

# (id, scale as passed, multiplier applied to the inputs so that x * mult / scale == x), per head
SCALES = [
    ("none", lambda H: None, [1.0, 1.0]),
    ("float_1", lambda H: 1.0, [1.0, 1.0]),
    ("float_2", lambda H: 2.0, [2.0, 2.0]),
    ("float_0.25", lambda H: 0.25, [0.25, 0.25]),
    ("t0d_0.5", lambda H: torch.tensor(0.5), [0.5, 0.5]),
    ("t1_4", lambda H: torch.tensor([4.0]), [4.0, 4.0]),
    ("t111_0.5", lambda H: torch.full((1, 1, 1), 0.5), [0.5, 0.5]),
    ("head_H_2_0.5", lambda H: torch.tensor([2.0, 0.5]), [2.0, 0.5]),
    ("head_H1_0.5_4", lambda H: torch.tensor([[0.5], [4.0]]), [0.5, 4.0]),
]
SCALE_IDS = [s[0] for s in SCALES]


def _literal_input(cache_dtype, in_dtype, mults):
    """x [2, 2, N]: token 0 = literals, token 1 = their negations; head h scaled by mults[h].

    Only rows usable for both heads' multipliers are kept."""
    usable = None
    per_head = []
    for m in mults:
        rows = _literal_rows(cache_dtype, in_dtype, m)
        per_head.append(rows)
        ids = {r.id for r in rows}
        usable = ids if usable is None else usable & ids
    per_head = [[r for r in rows if r.id in usable] for rows in per_head]
    vals = torch.tensor([[r.x for r in rows] for rows in per_head], dtype=torch.float64)
    x = torch.stack([vals, -vals]).to(in_dtype)  # [2, H=2, N]
    base = [r for r in KNOWN[cache_dtype] if r.id in usable]
    fmt = FORMAT_OF[cache_dtype]
    pos = np.array([r.code if r.code >= 0 else fmt.nan_code for r in base])
    neg = np.where(fmt.is_nan_code(pos), pos, pos ^ 0x80)
    expected = np.stack([np.stack([pos, pos]), np.stack([neg, neg])])  # [2, 2, N]
    return x, expected, base


@pytest.mark.parametrize("scale_case", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_quantize_and_oracle_match_literals(cache_dtype, in_dtype, scale_case):
    _, make_scale, mults = scale_case
    x, expected, base = _literal_input(cache_dtype, in_dtype, mults)
    scale = make_scale(2)
    fmt = FORMAT_OF[cache_dtype]
    x_before = x.clone()
    got = kvpool.quantize(x, cache_dtype, scale)
    assert got.dtype == cache_dtype
    assert_codes_equal(q_codes(x, cache_dtype, scale), expected, fmt, "oracle on literals")
    assert_codes_equal(got, expected, fmt, "quantize on literals")
    for i, r in enumerate(base):  # NaN literals must come out as NaN (not merely equal-as-NaN)
        if r.code < 0:
            assert fmt.is_nan_code(codes_of(got)[:, :, i]).all(), f"{r.id} did not stay NaN"
    assert_same_bytes(x, x_before, "quantize input")


def _poisoned_caches(slots, H, D, dtype, poison=0xFF):
    kc = torch.empty(slots, H, D, dtype=dtype)
    kc.view(torch.uint8).fill_(poison)
    vc = torch.empty(slots, H, D, dtype=dtype)
    vc.view(torch.uint8).fill_(poison ^ 0x5A)
    return kc, vc


WRITERS = {
    "reference": kvpool.reference_set_kv_buffer,
    "fused_interp": kvpool.fused_fp8_set_kv_buffer,
}


@pytest.mark.parametrize("writer", list(WRITERS), ids=str)
@pytest.mark.parametrize("scale_case", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_write_functions_match_literals(cache_dtype, in_dtype, scale_case, writer):
    """Both tokens land in their rows with the literal bytes; K and V both; other rows untouched."""
    skip_fused_without_interpreter(writer)
    _, make_scale, mults = scale_case
    x, expected, _ = _literal_input(cache_dtype, in_dtype, mults)
    fmt = FORMAT_OF[cache_dtype]
    N = x.shape[2]
    kc, vc = _poisoned_caches(6, 2, N, cache_dtype)
    kc0, vc0 = kc.clone(), vc.clone()
    v = x.flip(0).clone()  # V gets the tokens the other way round
    loc = torch.tensor([4, 1], dtype=torch.int64)
    ks, vs = make_scale(2), make_scale(2)
    WRITERS[writer](x, v, kc, vc, loc, ks, vs)
    exp_k = codes_of(kc0).astype(np.int64)
    exp_v = codes_of(vc0).astype(np.int64)
    exp_k[4], exp_k[1] = expected[0], expected[1]
    exp_v[4], exp_v[1] = expected[1], expected[0]
    assert_codes_equal(kc, exp_k, fmt, f"{writer} k_cache")
    assert_codes_equal(vc, exp_v, fmt, f"{writer} v_cache")
    for slot in (0, 2, 3, 5):
        assert_same_bytes(kc[slot], kc0[slot], f"{writer} k_cache untouched row {slot}")
        assert_same_bytes(vc[slot], vc0[slot], f"{writer} v_cache untouched row {slot}")


# ----------------------------------------------------------------------------------------------
# Non-power-of-two scales: the division is IEEE float32 division, rounded once to float32 and then
# rounded again to FP8 (docs/contract.md, "The write"). These inputs sit where that matters:
# multiplying by a float32 reciprocal, or rounding the exact quotient directly to FP8, gives a
# different byte.
# float32(0.1) = 13421773 * 2**-27, float32(0.37) = 12415139 * 2**-25, float32(3.3) = 13841203 * 2**-22.

# (id, float32 input, scale, cache dtype, expected byte, what goes wrong otherwise)
# fmt: off
DIVISION_CASES = [
    ("e4m3_s0.1_quotient_is_tie_1.0625", 0.10625000298023224, 0.1, E4M3, 0x38, "exact quotient is above the tie -> 0x39"),
    ("e4m3_s0.1_quotient_is_tie_1.1875", 0.11874999850988388, 0.1, E4M3, 0x3A, "exact quotient is below the tie -> 0x39"),
    ("e4m3_s0.1_quotient_below_1.9375", 0.19374999403953552, 0.1, E4M3, 0x3F, "x * (1/s) rounds to the tie 1.9375 -> 0x40"),
    ("e4m3_s0.37_quotient_below_1.1875", 0.43937498331069946, 0.37, E4M3, 0x39, "x * (1/s) rounds to the tie -> 0x3A"),
    ("e4m3_s0.37_quotient_below_1.6875", 0.6243749856948853, 0.37, E4M3, 0x3D, "x * (1/s) rounds to the tie -> 0x3E"),
    ("e4m3_s3.3_quotient_is_tie_1.0625", 3.5062501430511475, 3.3, E4M3, 0x38, "x * (1/s) and the exact quotient -> 0x39"),
    ("e4m3_s3.3_quotient_is_tie_1.9375", 6.393749713897705, 3.3, E4M3, 0x40, "exact quotient is below the tie -> 0x3F"),
    ("e5m2_s0.1_quotient_is_tie_1.125", 0.11250000447034836, 0.1, E5M2_T, 0x3C, "exact quotient is above the tie -> 0x3D"),
    ("e5m2_s0.37_quotient_is_tie_1.125", 0.4162500202655792, 0.37, E5M2_T, 0x3C, "x * (1/s) and the exact quotient -> 0x3D"),
    ("e5m2_s3.3_quotient_is_tie_1.125", 3.7125000953674316, 3.3, E5M2_T, 0x3C, "x * (1/s) and the exact quotient -> 0x3D"),
    # float32-subnormal inputs divided by the smallest accepted scale 2**-126: no flush to zero allowed
    ("e5m2_f32_subnormal_x_2^-140_over_2^-126", 2.0 ** -140, 2.0 ** -126, E5M2_T, 0x04, "flushing x to 0 -> 0x00"),
    ("e5m2_f32_subnormal_x_3*2^-143_over_2^-126", 3 * 2.0 ** -143, 2.0 ** -126, E5M2_T, 0x02, "tie 1.5 quanta -> 2"),
    ("e4m3_f32_subnormal_x_7*2^-136_over_2^-126", 7 * 2.0 ** -136, 2.0 ** -126, E4M3, 0x04, "tie 3.5 quanta -> 4"),
]
# fmt: on


@pytest.mark.parametrize("case", DIVISION_CASES, ids=[c[0] for c in DIVISION_CASES])
def test_division_literals(case):
    name, x, s, cache_dtype, code, _why = case
    fmt = FORMAT_OF[cache_dtype]
    assert q_exact(x, s, fmt) == code, f"oracle disagrees with the literal for {name}"
    for scale in (s, torch.tensor(s, dtype=torch.float32), torch.tensor([s, s], dtype=torch.float32)):
        xt = torch.tensor([x, -x], dtype=torch.float32).reshape(1, 2, 1).expand(1, 2, 3).contiguous()
        expected = np.array([[code] * 3, [code ^ 0x80] * 3]).reshape(1, 2, 3)
        assert_codes_equal(kvpool.quantize(xt, cache_dtype, scale), expected, fmt, f"quantize {name}")
        for writer, fn in WRITERS.items():
            if writer == "fused_interp" and not INTERPRETER:
                continue
            kc, vc = _poisoned_caches(2, 2, 3, cache_dtype)
            fn(xt, xt, kc, vc, torch.tensor([1], dtype=torch.int32), scale, scale)
            assert_codes_equal(kc[1:], expected, fmt, f"{writer} k {name} scale={scale!r}")
            assert_codes_equal(vc[1:], expected, fmt, f"{writer} v {name} scale={scale!r}")


_ALL16 = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16).copy())
ALL_BF16 = _ALL16.view(torch.bfloat16).reshape(256, 1, 256)
ALL_FP16 = _ALL16.view(torch.float16).reshape(256, 1, 256)


@pytest.mark.parametrize("scale", [None, 0.1, 0.37, 3.3, 1e-3, 1e3], ids=lambda s: f"s={s}")
@pytest.mark.parametrize("in_name", ["all_bf16", "all_fp16"])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_quantize_every_16bit_pattern_matches_oracle(cache_dtype, in_name, scale):
    """Every bf16 / fp16 bit pattern (NaNs and infs included) through quantize and the reference write."""
    x = ALL_BF16 if in_name == "all_bf16" else ALL_FP16
    fmt = FORMAT_OF[cache_dtype]
    expected = q_codes(x, cache_dtype, scale)
    assert_codes_equal(kvpool.quantize(x, cache_dtype, scale), expected, fmt, f"quantize {in_name}")
    kc, vc = _poisoned_caches(256, 1, 256, cache_dtype)
    loc = torch.arange(255, -1, -1)
    kvpool.reference_set_kv_buffer(x, x, kc, vc, loc, scale, scale)
    assert_codes_equal(kc.flip(0), expected, fmt, f"reference write {in_name}")


@needs_interpreter
@pytest.mark.parametrize("scale", [0.1, 0.37, 3.3], ids=lambda s: f"s={s}")
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2_T], ids=FMT_ID.get)
def test_fused_interpreter_every_bf16_pattern_matches_oracle(cache_dtype, scale):
    x = ALL_BF16
    fmt = FORMAT_OF[cache_dtype]
    expected = q_codes(x, cache_dtype, scale)
    kc, vc = _poisoned_caches(257, 1, 256, cache_dtype)
    loc = torch.arange(1, 257, dtype=torch.int32)
    kvpool.fused_fp8_set_kv_buffer(x, x, kc, vc, loc, scale, torch.tensor([scale]))
    assert_codes_equal(kc[1:], expected, fmt, "fused k, every bf16 pattern")
    assert_codes_equal(vc[1:], expected, fmt, "fused v, every bf16 pattern")
    assert (codes_of(kc[0]) == 0xFF).all()


def _random_fp32(shape, seed, exp_lo=110, exp_hi=146):
    """float32 values with random signs and mantissas and exponent fields in [exp_lo, exp_hi)
    (2**-17 .. 2**18 by default: FP8 subnormals, normals and overflow), plus a few inf/NaN/zeros."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    sign = rng.integers(0, 2, n, dtype=np.uint32) << 31
    exp = rng.integers(exp_lo, exp_hi, n, dtype=np.uint32) << 23
    man = rng.integers(0, 1 << 23, n, dtype=np.uint32)
    bits = sign | exp | man
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x00000000, 0x80000000,
                        0x00000001, 0x80400000], dtype=np.uint32)
    bits[rng.choice(n, size=len(special), replace=False)] = special
    return torch.from_numpy(bits.view(np.float32).reshape(shape).copy())


@needs_interpreter
def test_fused_interpreter_random_fp32_matches_oracle():
    """float32 inputs spanning the FP8 ranges, per-tensor scale 0.37 and per-head 3.3/1e-3, both formats."""
    x = _random_fp32((64, 2, 128), seed=7)
    for cache_dtype in (E4M3, E5M2_T):
        fmt = FORMAT_OF[cache_dtype]
        for writer, fn in WRITERS.items():
            kc, vc = _poisoned_caches(64, 2, 128, cache_dtype)
            vs = torch.tensor([3.3, 1e-3])
            fn(x, x, kc, vc, torch.arange(64), 0.37, vs)
            assert_codes_equal(kc, q_codes(x, cache_dtype, 0.37), fmt, f"{writer} k, random fp32")
            assert_codes_equal(vc, q_codes(x, cache_dtype, vs), fmt, f"{writer} v, random fp32")


# ----------------------------------------------------------------------------------------------
# 16-bit and float32 caches: the plain cast; scales are ignored.

# (id, input dtype, x, cache dtype, expected 16-bit code)
# fmt: off
CAST_CASES = [
    ("f32->bf16_tie_1+2^-8_down", torch.float32, 1 + 2.0 ** -8, torch.bfloat16, 0x3F80),
    ("f32->bf16_tie_1+3*2^-8_up", torch.float32, 1 + 3 * 2.0 ** -8, torch.bfloat16, 0x3F82),
    ("f32->bf16_above_tie", torch.float32, 1 + 2.0 ** -8 + 2.0 ** -20, torch.bfloat16, 0x3F81),
    ("f32->bf16_max_f32_overflows", torch.float32, 3.4028234663852886e38, torch.bfloat16, 0x7F80),
    ("f32->bf16_neg_zero", torch.float32, -0.0, torch.bfloat16, 0x8000),
    ("f32->bf16_min_normal", torch.float32, 2.0 ** -126, torch.bfloat16, 0x0080),
    ("f32->bf16_f32_subnormal_to_zero", torch.float32, 2.0 ** -149, torch.bfloat16, 0x0000),
    ("f32->bf16_subnormal", torch.float32, 2.0 ** -133, torch.bfloat16, 0x0001),
    ("f32->fp16_max", torch.float32, 65504.0, torch.float16, 0x7BFF),
    ("f32->fp16_below_overflow_tie", torch.float32, 65519.0, torch.float16, 0x7BFF),
    ("f32->fp16_overflow_tie_to_inf", torch.float32, 65520.0, torch.float16, 0x7C00),
    ("f32->fp16_1e6_inf", torch.float32, 1e6, torch.float16, 0x7C00),
    ("f32->fp16_neg_inf", torch.float32, -INF, torch.float16, 0xFC00),
    ("f32->fp16_min_subnormal", torch.float32, 2.0 ** -24, torch.float16, 0x0001),
    ("f32->fp16_tie_2^-25_to_zero", torch.float32, 2.0 ** -25, torch.float16, 0x0000),
    ("f32->fp16_neg_tie_to_neg_zero", torch.float32, -(2.0 ** -25), torch.float16, 0x8000),
    ("f32->fp16_tie_3*2^-25_to_2", torch.float32, 3 * 2.0 ** -25, torch.float16, 0x0002),
    ("f32->fp16_tie_1+2^-11_down", torch.float32, 1 + 2.0 ** -11, torch.float16, 0x3C00),
    ("f32->fp16_tie_1+3*2^-11_up", torch.float32, 1 + 3 * 2.0 ** -11, torch.float16, 0x3C02),
    ("bf16->fp16_1+2^-7", torch.bfloat16, 1 + 2.0 ** -7, torch.float16, 0x3C08),
    ("bf16->fp16_65536_inf", torch.bfloat16, 65536.0, torch.float16, 0x7C00),
    ("bf16->fp16_2^-30_to_zero", torch.bfloat16, 2.0 ** -30, torch.float16, 0x0000),
    ("fp16->bf16_1+2^-10_down", torch.float16, 1 + 2.0 ** -10, torch.bfloat16, 0x3F80),
    ("fp16->bf16_tie_1+2^-8_down", torch.float16, 1 + 2.0 ** -8, torch.bfloat16, 0x3F80),
    ("fp16->bf16_tie_1+3*2^-8_up", torch.float16, 1 + 3 * 2.0 ** -8, torch.bfloat16, 0x3F82),
    ("fp16->bf16_65504", torch.float16, 65504.0, torch.bfloat16, 0x4780),  # 1.999 * 2**15 -> 2**16
]
# fmt: on


@pytest.mark.parametrize("writer", ["quantize", *WRITERS], ids=str)
@pytest.mark.parametrize("case", CAST_CASES, ids=[c[0] for c in CAST_CASES])
def test_16bit_cache_cast_literals(case, writer):
    name, in_dtype, x, cache_dtype, code = case
    skip_fused_without_interpreter(writer)
    fmt = FORMAT_OF[cache_dtype]
    xt = torch.tensor([x], dtype=torch.float64).to(in_dtype).reshape(1, 1, 1)
    assert xt.double().item() == x or math.isinf(x), "input not exactly representable"
    assert int(q_codes(xt, cache_dtype, 0.5)[0, 0, 0]) == code, f"oracle disagrees with literal {name}"
    expected = np.array([[[code]]])
    if writer == "quantize":
        got = kvpool.quantize(xt, cache_dtype, 0.5)  # the scale must be ignored
        assert_codes_equal(got, expected, fmt, name)
        return
    kc = torch.full((3, 1, 1), float("nan"), dtype=cache_dtype)
    vc = kc.clone()
    WRITERS[writer](xt, xt, kc, vc, torch.tensor([2]), 0.5, torch.tensor([0.25]))
    assert_codes_equal(kc[2:], expected, fmt, f"{writer} k {name}")
    assert_codes_equal(vc[2:], expected, fmt, f"{writer} v {name}")
