"""The FP4 quantizer and dequantizer (docs/contract.md, "FP4 pools"): hand-computed bytes, an
independent oracle of the rule, and SGLang's own ``KVFP4QuantizeUtil`` from its wheel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvassert import DEVICE, assert_same_bytes, fp4_oracle, fp4_unpacked, id_of, sglang_kvfp4
from kvpool.kernels.store_fp4 import FP4_DTYPE, dequantize_fp4, quantize_fp4

INF, NAN = float("inf"), float("nan")

# Each row: 16 float32 inputs (one block), the scale byte and the 16 codes, worked out by hand.
HAND_ROWS = [
    # amax 6: 6 / 6 = 1 = 2**0, byte 127; every bound is a tie and rounds away from zero; -0.0 is 0x0,
    # -0.1 (below 0.25) keeps its sign: 0x8.
    ([0, 0.25, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -6, -0.0, 0.1, -0.1, 4, 3], 127,
     [0, 1, 9, 2, 3, 4, 5, 6, 7, 7, 15, 0, 0, 8, 6, 5]),
    # amax 6.5: 6.5 / 6 = 1.083, ceil(log2) = 1, byte 128; 6.5 / 2 = 3.25 -> 3 (code 5), 1 / 2 -> 0.5.
    ([6.5, 1, -1] + [0] * 13, 128, [5, 1, 9] + [0] * 13),
    # amax 12: 12 / 6 = 2 exactly, a power of two keeps its exponent: byte 128, 12 / 2 = 6 (code 7).
    ([12, -12, 2.9] + [0] * 13, 128, [7, 15, 3] + [0] * 13),
    # amax 193: 193 / 6 = 32.17 > 2**5, byte 133 (a log2 rounded to bfloat16 would give 132);
    # 193 / 64 = 3.02 -> 3 (code 5); 16 / 64 = 0.25 and -48 / 64 = -0.75 are ties (codes 1, 0xA).
    ([193, 16, -48] + [0] * 13, 133, [5, 1, 10] + [0] * 13),
    # all zeros: amax / 6 is clamped to 1e-10, ceil(log2(1e-10)) = -33, byte 94.
    ([0] * 16, 94, [0] * 16),
    # float32 subnormals: clamped as zeros, byte 94; 1e-40 * 2**33 is far below 0.25.
    ([1e-40, -1e-40] + [0] * 14, 94, [0, 8] + [0] * 14),
    # amax 1e-9: 1.67e-10 > 1e-10, ceil(log2(1.67e-10)) = -32, byte 95; 1e-9 * 2**32 = 4.29 (code 6),
    # -5e-10 * 2**32 = -2.15 (code 0xC).
    ([1e-9, -5e-10] + [0] * 14, 95, [6, 12] + [0] * 14),
    # +-inf or NaN anywhere in the block: byte 0, every code 0x0.
    ([INF, 1, -2] + [0] * 13, 0, [0] * 16),
    ([-INF] + [3] * 15, 0, [0] * 16),
    ([1, NAN] + [5] * 14, 0, [0] * 16),
]


def _packed(codes: list[int]) -> list[int]:
    return [codes[j] | (codes[j + 1] << 4) for j in range(0, 16, 2)]


def test_torch_has_the_pool_dtype():
    assert FP4_DTYPE is torch.float4_e2m1fn_x2 and FP4_DTYPE.itemsize == 1


@pytest.mark.parametrize("row", range(len(HAND_ROWS)))
def test_hand_computed_rows(row):
    values, scale, codes = HAND_ROWS[row]
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE).reshape(1, 1, 16)
    packed, scales = quantize_fp4(x)
    assert_same_bytes(scales, torch.tensor([[scale]], dtype=torch.uint8, device=DEVICE), "scale byte")
    assert_same_bytes(packed, torch.tensor([[_packed(codes)]], dtype=torch.uint8, device=DEVICE), "packed codes")


def test_blocks_run_over_the_flattened_row_and_nibbles_pair_neighbours():
    # H=2, D=8: one block covers both heads; element 2j is the low nibble of byte j.
    x = torch.tensor([[[6, 0.5, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, -1.5, 4]]], dtype=torch.float32, device=DEVICE)
    packed, scales = quantize_fp4(x)
    assert scales.tolist() == [[127]]
    assert packed.tolist() == [[[0x17, 0x02, 0x00, 0x00], [0x00, 0x00, 0x00, 0x6B]]]


def _rows(t: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with each block at its own magnitude, and zero, subnormal and non-finite blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h * d // 16, 16, generator=g) * torch.exp2(torch.randint(-30, 30, (t, h * d // 16, 1), generator=g).float())
    x[:, 0] = 0
    x[:, 1, :4] = torch.tensor([1e-40, -3e-39, 6e-8, -1e-45])  # subnormal in float32; fp16 keeps 6e-8
    x[1, 2, 5], x[2, 2, 0], x[3, 3, 7] = INF, -INF, NAN
    x[4, 2] = 6 * 2.0 ** torch.arange(-8, 8).float()  # amaxes on powers of two times 6
    return x.reshape(t, h, d).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
def test_matches_the_oracle_of_the_rule(dtype):
    x = _rows(6, 3, 32, dtype, seed=1)
    before = x.clone()
    packed, scales = quantize_fp4(x)
    codes, expected_scales = fp4_oracle(x)
    np.testing.assert_array_equal(scales.cpu().numpy(), expected_scales)
    differ = fp4_unpacked(packed) != codes
    assert not differ.any(), f"{int(differ.sum())} codes differ, first at {tuple(np.argwhere(differ)[0])}"
    assert_same_bytes(x, before, "input")  # never modified


@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=32, max_size=32),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_any_two_blocks_match_the_oracle(values, dtype):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 2, 16).to(dtype).to(DEVICE)
    packed, scales = quantize_fp4(x)
    codes, expected_scales = fp4_oracle(x)
    np.testing.assert_array_equal(scales.cpu().numpy(), expected_scales)
    np.testing.assert_array_equal(fp4_unpacked(packed), codes)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
def test_stored_bytes_are_sglangs(dtype):
    util = sglang_kvfp4()
    x = _rows(16, 4, 64, dtype, seed=2).cpu()
    expected_packed, expected_scales = util.batched_quantize(x)
    packed, scales = quantize_fp4(x)
    assert_same_bytes(scales, expected_scales, "scale bytes")
    assert_same_bytes(packed, expected_packed, "packed codes")


def test_dequantized_values_are_sglangs_for_every_code_and_scale():
    util = sglang_kvfp4()
    codes = torch.arange(256, dtype=torch.uint8).reshape(32, 1, 8)  # every byte: every pair of codes
    scales = torch.tensor([1, 94, 120, 127, 134, 200, 253, 254], dtype=torch.uint8).repeat(32, 1)[:, :1]
    for out in (torch.bfloat16, torch.float32):
        mine = dequantize_fp4(codes, scales, out)
        assert_same_bytes(mine, util.batched_dequantize(codes, scales, out), f"dequantized {out}")


def test_dequantize_is_exact_in_float32():
    codes = torch.tensor([[[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]], dtype=torch.uint8, device=DEVICE)
    for byte in (94, 127, 130):
        got = dequantize_fp4(codes, torch.tensor([[byte]], dtype=torch.uint8, device=DEVICE), torch.float32)
        magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        want = torch.tensor(magnitudes + [-m for m in magnitudes], device=DEVICE) * 2.0 ** (byte - 127)
        assert_same_bytes(got.reshape(16), want, f"byte {byte}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=id_of)
def test_requantizing_decoded_blocks_with_a_six_gives_the_same_bytes_but_negative_zero(dtype):
    x = _rows(5, 2, 32, dtype, seed=3)
    packed, scales = quantize_fp4(x)
    again_packed, again_scales = quantize_fp4(dequantize_fp4(packed, scales, torch.float32))
    codes = torch.from_numpy(fp4_unpacked(packed).reshape(*scales.shape, 16))
    again = torch.from_numpy(fp4_unpacked(again_packed).reshape(*scales.shape, 16))
    # A block holding a code 7 (6.0) decodes to amax = 6 * 2**e exactly, so it keeps its exponent and
    # every code, except 0x8: it decodes to -0.0, which stores 0x0.
    keep = (scales.cpu() != 0) & ((codes & 7).amax(-1) == 7)
    assert bool(keep.any()) and bool((codes[keep] == 8).any())
    assert torch.equal(again_scales.cpu()[keep], scales.cpu()[keep])
    assert torch.equal(again[keep], torch.where(codes[keep] == 8, 0, codes[keep]))


@pytest.mark.parametrize(
    "shape, message",
    [((2, 16), "3-D"), ((1, 1, 7), "even D"), ((1, 1, 10), "multiple of 16")],
)
def test_bad_shapes_name_the_argument(shape, message):
    with pytest.raises(ValueError, match=message):
        quantize_fp4(torch.zeros(shape, device=DEVICE))
