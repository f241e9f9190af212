"""Per-token-head FP8's definition (docs/contract.md, "Per-token-head FP8"): the reference quantizer
against an oracle built from the format definitions in NumPy, the scale rule at its edges (all-zero
rows, infinities, NaN, subnormals, the largest finite inputs), and the read-back rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvassert import DEVICE, FP8, INPUT_DTYPES, assert_same_bytes, id_of, spread_rows, token_head_oracle
from kvpool.kernels.store_fp8_token import (
    MIN_TOKEN_SCALE,
    dequantize_token_head,
    quantize_token_head,
    token_head_scales,
)

FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def assert_matches_oracle(x: torch.Tensor, dtype: torch.dtype) -> None:
    codes, scales = quantize_token_head(x, dtype)
    want_codes, want_scales = token_head_oracle(x, dtype)
    assert_same_bytes(scales, torch.from_numpy(want_scales), "scales")
    assert_same_bytes(codes, torch.from_numpy(want_codes.astype(np.uint8)), "codes")


@pytest.mark.parametrize("dtype", FP8, ids=id_of)
@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=id_of)
def test_the_reference_stores_what_the_format_definitions_give(dtype, in_dtype):
    x = spread_rows(7, 3, 96, in_dtype, seed=11)  # wide magnitudes, NaN, +-inf, zeros, 448, 464
    x[1, 2] = 0.0  # an all-zero head
    x[2, 0] = -0.0
    x[3, 1] = float("nan")  # a head with no finite element
    x[4, 2, ::2] = float("inf")
    assert_matches_oracle(x, dtype)


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(FP8),
    in_dtype=st.sampled_from(INPUT_DTYPES),
    shape=st.tuples(st.integers(0, 4), st.integers(1, 3), st.integers(1, 20)),
    exponent=st.integers(-140, 120),
    seed=st.integers(0, 2**16),
)
def test_the_reference_matches_the_oracle_at_any_magnitude(dtype, in_dtype, shape, exponent, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2.0**exponent
    x = x.to(in_dtype).to(DEVICE)  # out-of-range magnitudes become inf or zero in the narrower types
    assert_matches_oracle(x, dtype)


@pytest.mark.parametrize("dtype", FP8, ids=id_of)
def test_the_scale_maps_the_largest_finite_magnitude_to_fmax(dtype):
    fmax = FMAX[dtype]
    x = torch.tensor([[[3.0, -12.0, 0.5], [fmax, 1.0, -1.0], [0.0, -0.0, 0.0]]], device=DEVICE)
    codes, scales = quantize_token_head(x, dtype)
    assert scales.tolist() == [[np.float32(12.0) / np.float32(fmax), 1.0, MIN_TOKEN_SCALE]]
    values = dequantize_token_head(codes, scales, dtype, torch.float32)
    assert values[0, 0, 1].item() == pytest.approx(-12.0, rel=2**-20)  # the amax comes back (almost) exactly
    assert values[0, 1].tolist() == [fmax, 1.0, -1.0]


@pytest.mark.parametrize("dtype", FP8, ids=id_of)
def test_zero_rows_store_the_smallest_scale_and_signed_zeros(dtype):
    x = torch.tensor([[[0.0, -0.0, 0.0, -0.0]]], device=DEVICE)
    codes, scales = quantize_token_head(x, dtype)
    assert scales.item() == 2.0**-126
    assert codes.tolist() == [[[0x00, 0x80, 0x00, 0x80]]]


@pytest.mark.parametrize("dtype", FP8, ids=id_of)
def test_inf_saturates_and_nan_stores_0x7f_without_moving_the_scale(dtype):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[[2.0, inf, -inf, nan, -nan, 1.0]]], device=DEVICE)
    codes, scales = quantize_token_head(x, dtype)
    assert scales.item() == np.float32(2.0) / np.float32(FMAX[dtype])  # the finite elements decide
    fmax_code = token_head_oracle(torch.tensor([[[FMAX[dtype]]]]), dtype)[0].item()
    assert codes[0, 0, :5].tolist() == [fmax_code, fmax_code, fmax_code | 0x80, 0x7F, 0x7F]
    only_nan = torch.full((1, 1, 3), nan, device=DEVICE)
    codes, scales = quantize_token_head(only_nan, dtype)
    assert scales.item() == 2.0**-126 and codes.tolist() == [[[0x7F] * 3]]


def test_subnormal_inputs_keep_their_value_through_the_smallest_scale():
    # amax / 448 is a float32 subnormal: the scale stays 2**-126 and x / s = x * 2**126 is exact.
    x = torch.tensor([[[2.0**-127, -(2.0**-130), 2.0**-140]]], dtype=torch.float32, device=DEVICE)
    codes, scales = quantize_token_head(x, torch.float8_e4m3fn)
    assert scales.item() == 2.0**-126
    assert dequantize_token_head(codes, scales, torch.float8_e4m3fn, torch.float32).tolist() == [
        [[2.0**-127, -(2.0**-130), 0.0]]  # 2**-14 in units of the scale is below e4m3's smallest 2**-9
    ]


def test_inputs_are_never_modified_and_scales_are_float32_on_the_inputs_device():
    x = spread_rows(3, 2, 8, torch.bfloat16, seed=3)
    before = x.clone()
    codes, scales = quantize_token_head(x, torch.float8_e5m2)
    assert_same_bytes(x, before, "input")
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    assert codes.device == x.device == scales.device and tuple(scales.shape) == (3, 2)
    assert_same_bytes(token_head_scales(x, torch.float8_e5m2), scales, "token_head_scales")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_token_head(torch.zeros(2, 3), torch.float8_e4m3fn), r"x must be 3-D \[T, H, D\], got shape \(2, 3\)"),
        (lambda: quantize_token_head(torch.zeros(1, 1, 2), torch.bfloat16), "dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.bfloat16"),
        (lambda: dequantize_token_head(torch.zeros(2, 1, 4, dtype=torch.uint8), torch.zeros(2, 2), torch.float8_e4m3fn), r"scales must have shape \(2, 1\)"),
        (lambda: dequantize_token_head(torch.zeros(2, 1, 4, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.float64), torch.float8_e4m3fn), "scales must be a float32 tensor, got torch.float64"),
        (lambda: dequantize_token_head(torch.zeros(2, 1, 4), torch.zeros(2, 1), torch.float8_e4m3fn), "codes must be torch.uint8 or torch.float8_e4m3fn, got torch.float32"),
    ],
    ids=["rows_2d", "not_fp8", "scale_shape", "scale_dtype", "codes_dtype"],
)
def test_malformed_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_docstring_examples_hold():
    import doctest

    import kvpool.kernels.store_fp8_token.naive as naive
    import kvpool.pools.mha_fp8_token_pool as pool_module

    for module in (naive, pool_module):
        result = doctest.testmod(module, extraglobs={"torch": torch})
        assert result.attempted > 0 and result.failed == 0, module.__name__
