"""What the write checks with ``validate`` and what it leaves unchecked without it (docs/contract.md,
"The write" and "Bad input").

With validate (constructor flag, function keyword or ``KVPOOL_VALIDATE=1``), out-of-range slots and
bad scale values are rejected before anything is written, and padding passes. Without it,
out-of-range slots are skipped and nothing outside the buffer is touched; 16-bit caches ignore their
scales; a float scale at the top of the float32 range is taken or cleanly rejected. The targets and
the base call are ``kvassert``'s.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import kvpool
from kvassert import (
    BASE_LOC,
    CACHE_DTYPE,
    D,
    DV,
    FORMAT_OF,
    FUNCTION_TARGETS,
    FunctionTarget,
    GUARD,
    H,
    HV,
    Layer,
    META,
    POOL_TARGETS,
    PoolTarget,
    SLOTS,
    TARGETS,
    assert_codes_equal,
    assert_same_bytes,
    base_args,
    codes_of,
    exact_number,
    expected_cache,
    skip_fused_without_interpreter,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ----------------------------------------------------------------------------------------------
# validate=True (constructor flag, function keyword, or KVPOOL_VALIDATE=1 at construction).

VALIDATING = {
    "reference": lambda: FunctionTarget(kvpool.reference_set_kv_buffer, validate=True),
    "fused_interp": lambda: FunctionTarget(kvpool.fused_fp8_set_kv_buffer, validate=True),
    "pool_never_flag": lambda: PoolTarget("never", validate=True),
    "pool_always_flag": lambda: PoolTarget("always", validate=True),
    "pool_never_env": lambda: PoolTarget("never", env_validate=True),
    "pool_always_env": lambda: PoolTarget("always", env_validate=True),
}

# (id, loc, dtype, bad position, bad value)
OOR_LOCS = [
    ("exactly_slots_at_3", [1, 5, -1, SLOTS, 10], torch.int64, 3, SLOTS),
    ("slots+1_at_0", [SLOTS + 1, 5, -1, 7, 10], torch.int32, 0, SLOTS + 1),
    ("int32_max_at_4", [1, 5, -1, 7, 2**31 - 1], torch.int32, 4, 2**31 - 1),
    ("2^40_at_2", [1, 5, 2**40, 7, -(2**40)], torch.int64, 2, 2**40),
]


def _validating_target(name, monkeypatch):
    skip_fused_without_interpreter(name)
    if name.endswith("_env"):
        monkeypatch.setenv("KVPOOL_VALIDATE", "1")
    return VALIDATING[name]()


@pytest.mark.parametrize("target_name", list(VALIDATING))
@pytest.mark.parametrize("case", OOR_LOCS, ids=[c[0] for c in OOR_LOCS])
def test_validate_rejects_out_of_range_slot(case, target_name, monkeypatch):
    _, loc, dtype, pos, val = case
    target = _validating_target(target_name, monkeypatch)
    monkeypatch.delenv("KVPOOL_VALIDATE", raising=False)  # read at construction only
    a = base_args(target.hv)
    a["cache_loc"] = torch.tensor(loc, dtype=dtype)
    before = target.snapshot()
    with pytest.raises(IndexError) as info:
        target.call(a)
    msg = str(info.value)
    assert re.search(exact_number(val), msg), f"slot value {val} not in message: {msg!r}"
    assert re.search(rf"\[{pos}\]|position {pos}|index {pos}|entry {pos}", msg), f"position {pos} not in: {msg!r}"
    assert re.search(rf"(?<!\w){re.escape(target.name('cache_loc'))}(?!\w)", msg), msg
    for b, n in zip(before, target.current()):
        assert_same_bytes(n, b, f"{target_name}: buffers after rejected loc {loc}")


@pytest.mark.parametrize("target_name", list(VALIDATING))
def test_validate_accepts_padding_and_valid_slots(target_name, monkeypatch):
    """validate is not stricter than the spec: negative slots and slots < size + page_size pass."""
    target = _validating_target(target_name, monkeypatch)
    a = base_args(target.hv)
    a["cache_loc"] = torch.tensor([0, SLOTS - 1, -1, -(2**31), 6], dtype=torch.int32)
    a["k_scale"] = torch.tensor([2.0**-126, 3.0e38])  # the extreme normal float32 values are fine
    assert target.call(a) is None


# (id, which scale, tensor, text of the bad value)
BAD_SCALE_VALUES = [
    ("k_zero", "k_scale", torch.tensor(0.0), r"0"),
    ("k_negative", "k_scale", torch.tensor([-1.0]), r"-1"),
    ("k_nan_per_head", "k_scale", torch.tensor([1.0, float("nan")]), r"nan"),
    ("k_inf", "k_scale", torch.tensor([[float("inf")]]), r"inf"),
    ("k_f32_subnormal", "k_scale", torch.tensor([1e-40]), r"1e-40|1\.0*e-40|9\.99\d*e-41"),
    ("v_neg_inf_per_head", "v_scale", lambda hv: torch.tensor([1.0] * (hv - 1) + [float("-inf")]), r"-inf"),
    ("v_zero_per_head_Hx1", "v_scale", lambda hv: torch.tensor([[1.0], [0.0]] + [[1.0]] * (hv - 2)), r"0"),
    ("v_bf16_negative", "v_scale", torch.tensor([-0.5], dtype=torch.bfloat16), r"-0\.5"),
]


@pytest.mark.parametrize("target_name", list(VALIDATING))
@pytest.mark.parametrize("case", BAD_SCALE_VALUES, ids=[c[0] for c in BAD_SCALE_VALUES])
def test_validate_rejects_bad_scale_values(case, target_name, monkeypatch):
    _, which, scale, text = case
    if target_name.startswith(("fused", "pool_always")) and case[0] == "v_bf16_negative":
        pytest.skip("the fused kernel reads float32 scale tensors only")
    target = _validating_target(target_name, monkeypatch)
    scale = scale(target.hv) if callable(scale) else scale
    a = base_args(target.hv)
    a[which] = scale
    before = target.snapshot()
    scale_before = scale.clone()
    with pytest.raises(ValueError) as info:
        target.call(a)
    msg = str(info.value)
    assert re.search(rf"(?<!\w){which}(?!\w)", msg), msg
    assert re.search(text, msg), f"bad value /{text}/ not in message: {msg!r}"
    assert re.search(r"positive|finite|normal", msg), f"no expectation in message: {msg!r}"
    for b, n in zip(before, target.current()):
        assert_same_bytes(n, b, f"{target_name}: buffers after rejected scale")
    assert_same_bytes(scale, scale_before, "scale tensor")


# ----------------------------------------------------------------------------------------------
# Without validate: out-of-range entries are skipped and nothing outside the buffer is touched.

OOR_SKIP_LOC = [SLOTS, 3, SLOTS + 1, SLOTS + GUARD, 2**31 - 1, -1, -(2**31), 11]


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("target_name", FUNCTION_TARGETS)
def test_out_of_range_slots_skipped_guard_rows_untouched(target_name, loc_dtype):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    k_before, v_before = target.snapshot()
    g = torch.Generator().manual_seed(3)
    n = len(OOR_SKIP_LOC)
    k = (torch.randn(n, H, D, generator=g) * 100).to(torch.float16)
    v = torch.randn(n, HV, DV, generator=g)
    loc = torch.tensor(OOR_SKIP_LOC, dtype=loc_dtype)
    target.fn(k, v, target.k_cache, target.v_cache, loc, 0.37, torch.tensor([3.3, 0.1, 1e-3]))
    for outer, before in ((target.k_outer, k_before), (target.v_outer, v_before)):
        for gr in list(range(GUARD)) + list(range(GUARD + SLOTS, SLOTS + 2 * GUARD)):
            assert_same_bytes(outer[gr], before[gr], f"{target_name}: guard row {gr}")
    fmt = FORMAT_OF[CACHE_DTYPE]
    exp_k = expected_cache(codes_of(k_before[GUARD:GUARD + SLOTS]), k, OOR_SKIP_LOC, CACHE_DTYPE, 0.37)
    exp_v = expected_cache(codes_of(v_before[GUARD:GUARD + SLOTS]), v, OOR_SKIP_LOC, CACHE_DTYPE,
                           torch.tensor([3.3, 0.1, 1e-3]))
    assert_codes_equal(target.k_cache, exp_k, fmt, f"{target_name} k_cache with out-of-range slots")
    assert_codes_equal(target.v_cache, exp_v, fmt, f"{target_name} v_cache with out-of-range slots")


@pytest.mark.parametrize("target_name", POOL_TARGETS)
def test_pool_out_of_range_slots_skipped_other_layers_untouched(target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    before = target.snapshot()
    n = len(OOR_SKIP_LOC)
    k = torch.full((n, H, D), 3.0)
    v = torch.full((n, H, DV), -5.0, dtype=torch.bfloat16)
    a = dict(base_args(H), k=k, v=v, cache_loc=torch.tensor(OOR_SKIP_LOC), layer=Layer(4), k_scale=None, v_scale=None)
    target.call(a)
    after = target.current()
    fmt = FORMAT_OF[CACHE_DTYPE]
    assert_codes_equal(after[0], expected_cache(codes_of(before[0]), k, OOR_SKIP_LOC, CACHE_DTYPE), fmt, "layer 4 K")
    assert_codes_equal(after[1], expected_cache(codes_of(before[1]), v, OOR_SKIP_LOC, CACHE_DTYPE), fmt, "layer 4 V")
    for i in range(2, 6):
        assert_same_bytes(after[i], before[i], f"{target_name}: buffer {i} of layers 5..6")


# ----------------------------------------------------------------------------------------------
# 16-bit caches ignore scales, unchecked (docs/contract.md, "The write"). The test also accepts the
# stricter reading, a clear error naming the scale with nothing written; anything else fails.

IGNORED_SCALES = [("neg_float", -1.0), ("nan_float", math.nan), ("int_tensor", torch.tensor([1])),
                  ("wrong_shape", torch.ones(7)), ("meta_tensor", torch.ones(1, device=META))]


@pytest.mark.parametrize("target_name", FUNCTION_TARGETS)
@pytest.mark.parametrize("case", IGNORED_SCALES, ids=[c[0] for c in IGNORED_SCALES])
def test_16bit_cache_with_bad_scale_errors_cleanly_or_casts(case, target_name):
    _, scale = case
    skip_fused_without_interpreter(target_name)
    target = FunctionTarget(kvpool.reference_set_kv_buffer if target_name == "reference"
                            else kvpool.fused_fp8_set_kv_buffer, cache_dtype=torch.bfloat16)
    before = target.snapshot()
    a = base_args()
    a["k_scale"] = scale
    try:
        target.call(a)
    except (ValueError, TypeError) as err:
        assert "k_scale" in str(err), str(err)
        for b, n in zip(before, target.current()):
            assert_same_bytes(n, b, "buffers after a rejected scale")
        return
    exp = expected_cache(codes_of(before[0][GUARD:GUARD + SLOTS]), a["k"], BASE_LOC, torch.bfloat16)
    assert_codes_equal(target.k_cache, exp, FORMAT_OF[torch.bfloat16], "bf16 cache, scale ignored")


# ----------------------------------------------------------------------------------------------
# Float scales at the top of the float32 range. float32(s) is what divides (docs/contract.md, "The
# write"), so a Python
# float between FLT_MAX and FLT_MAX + half an ulp (3.4028235e38, the usual spelling of FLT_MAX) is
# a finite, normal float32 scale. Accepted: it must write q(x, FLT_MAX). Rejected: a ValueError that
# names the argument, before anything is written. Either reading passes; a crash half-way does not.

FLT_MAX = float(np.finfo(np.float32).max)  # 3.4028234663852886e38
FLT_MAX_SPELLED = 3.4028235e38  # > FLT_MAX as a double, == FLT_MAX once rounded to float32
assert FLT_MAX_SPELLED > FLT_MAX and float(np.float32(FLT_MAX_SPELLED)) == FLT_MAX

def _boundary_params():
    out = []
    for value, vid in ((FLT_MAX, "flt_max_exact"), (FLT_MAX_SPELLED, "3.4028235e38")):
        for which in ("k_scale", "v_scale"):
            for t in TARGETS:
                out.append(pytest.param(value, which, t, id=f"{vid}-{which}-{t}"))
    return out


@pytest.mark.parametrize("value, which, target_name", _boundary_params())
def test_float_scale_at_float32_max_is_taken_or_cleanly_rejected(value, which, target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = base_args(target.hv)
    a["k_scale"], a["v_scale"] = None, None
    a[which] = value
    before = target.snapshot()
    try:
        target.call(a)
    except ValueError as err:
        assert re.search(rf"(?<!\w){which}(?!\w)", str(err)), str(err)
        for b, n in zip(before, target.current()):
            assert_same_bytes(n, b, f"{target_name}: buffers after rejected {which}={value!r}")
        return
    fmt = FORMAT_OF[CACHE_DTYPE]
    k_now, v_now = target.current()[:2] if isinstance(target, FunctionTarget) else target.current()[2:4]
    k_before, v_before = before[:2] if isinstance(target, FunctionTarget) else before[2:4]
    if isinstance(target, FunctionTarget):
        k_now, v_now = k_now[GUARD:GUARD + SLOTS], v_now[GUARD:GUARD + SLOTS]
        k_before, v_before = k_before[GUARD:GUARD + SLOTS], v_before[GUARD:GUARD + SLOTS]
    exp_k = expected_cache(codes_of(k_before), a["k"], BASE_LOC, CACHE_DTYPE, a["k_scale"])
    exp_v = expected_cache(codes_of(v_before), a["v"], BASE_LOC, CACHE_DTYPE, a["v_scale"])
    assert_codes_equal(k_now, exp_k, fmt, f"{target_name} K with {which}={value!r}")
    assert_codes_equal(v_now, exp_v, fmt, f"{target_name} V with {which}={value!r}")
