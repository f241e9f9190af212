"""The NVFP4 quantizer and dequantizer (docs/contract.md, "NVFP4"): hand-computed bytes, an
independent oracle of the rule, and SGLang's own ``NVFP4KVQuantizeUtil`` from its wheel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvassert import DEVICE, E4M3_VALUES, assert_same_bytes, fp4_unpacked, id_of, nvfp4_oracle, sglang_nvfp4
from kvpool.kernels.store_nvfp4 import dequantize_nvfp4, quantize_nvfp4

INF, NAN = float("inf"), float("nan")
T8 = 2.0**-8

# Each row: 16 float32 inputs (one block), the global scale, the block scale byte and the 16 codes,
# worked out by hand.
HAND_ROWS = [
    # amax 6: 6 / 6 = 1.0, byte 0x38; every bound is a tie and goes to the even code (0.25 -> 0,
    # 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); the sign bit is the input's:
    # -0.25, -0.0 and -0.1 store 0x8.
    ([0, 0.25, -0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -6, -0.0, 0.1, -0.1, 4, 3], 1.0, 0x38,
     [0, 0, 8, 2, 2, 4, 4, 6, 6, 7, 15, 8, 0, 8, 6, 5]),
    # amax 6.5: 6.5 / 6 = 1.0833 is nearer 1.125 (0x39) than 1.0; 6.5 / 1.125 = 5.78 -> 6,
    # 1 / 1.125 = 0.89 -> 1, -1 -> 0xA.
    ([6.5, 1, -1] + [0] * 13, 1.0, 0x39, [7, 2, 10] + [0] * 13),
    # amax 6000: 1000 saturates at 448 (0x7E); 6000 / 448 = 13.4 saturates at 6, 2000 / 448 = 4.46 -> 4.
    ([6000, 2000, -448] + [0] * 13, 1.0, 0x7E, [7, 6, 10] + [0] * 13),
    # an all-zero block: byte 0, codes 0 but for -0.0's sign.
    ([0, -0.0] + [0] * 14, 1.0, 0x00, [0, 8] + [0] * 14),
    # a subnormal block scale: 6 * 2**-8 / 6 = 2**-8 = 2 * 2**-9, byte 0x02; 1.5 * 2**-8 -> 1.5.
    ([6 * T8, 1.5 * T8, -3 * T8] + [0] * 13, 1.0, 0x02, [7, 3, 13] + [0] * 13),
    # amax / 6 = 2**-10, half the smallest subnormal: a tie to the even byte 0, so signs only.
    ([6 * 2.0**-10, -1e-5, 1e-5] + [0] * 13, 1.0, 0x00, [0, 8, 0] + [0] * 13),
    # amax / 6 = 1.5 * 2**-10 rounds up to 2**-9 (0x01); 9 * 2**-10 / 2**-9 = 4.5 -> 4.
    ([9 * 2.0**-10, -2.0**-9] + [0] * 14, 1.0, 0x01, [6, 10] + [0] * 14),
    # the global scale divides first: 3 / 0.5 = 6 and -1.5 / 0.5 = -3, so byte 0x38 as above.
    ([3, -1.5] + [0] * 14, 0.5, 0x38, [7, 13] + [0] * 14),
    # +-inf or NaN in the block, or a finite value that the global scale takes past FLT_MAX: byte 0,
    # every code 0x0.
    ([INF, 1, -2] + [0] * 13, 1.0, 0x00, [0] * 16),
    ([1, NAN] + [5] * 14, 1.0, 0x00, [0] * 16),
    ([3e38, 1] + [0] * 14, 0.5, 0x00, [0] * 16),
]


def _packed(codes: list[int]) -> list[int]:
    return [codes[j] | (codes[j + 1] << 4) for j in range(0, 16, 2)]


def _g(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize("row", range(len(HAND_ROWS)))
def test_hand_computed_rows(row):
    values, g, scale, codes = HAND_ROWS[row]
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE).reshape(1, 1, 16)
    packed, scales = quantize_nvfp4(x, _g(g))
    assert_same_bytes(scales, torch.tensor([[[scale]]], dtype=torch.uint8, device=DEVICE), "block scale byte")
    assert_same_bytes(packed, torch.tensor([[_packed(codes)]], dtype=torch.uint8, device=DEVICE), "packed codes")


def test_blocks_are_per_head_and_nibbles_pair_neighbours():
    # H=2, D=32: two blocks a head, scales [T, H, D // 16]; element 2j is the low nibble of byte j.
    x = torch.zeros(1, 2, 32, device=DEVICE)
    x[0, 0, :2] = torch.tensor([6.0, 0.5])
    x[0, 1, 16 + 14 :] = torch.tensor([-1.5, 12.0])
    packed, scales = quantize_nvfp4(x, _g(1.0))
    assert scales.tolist() == [[[0x38, 0x00], [0x00, 0x40]]]  # 12 / 6 = 2.0 is byte 0x40
    assert packed[0, 0, 0].item() == 0x17 and packed[0, 1, 15].item() == 0x7A  # -1.5 / 2 = -0.75 -> -1


def _rows(t: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Blocks at their own magnitudes (subnormal and saturated block scales among them), zero and
    non-finite blocks, and the e2m1 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h * d // 16, 16, generator=g) * torch.exp2(torch.randint(-24, 14, (t, h * d // 16, 1), generator=g).float())
    x[:, 0] = 0
    x[0, 0, 5] = -0.0
    x[:, 1, :4] = torch.tensor([1e-40, -3e-39, 6e-8, -1e-45])
    x[1, 2, 5], x[2, 2, 0], x[3, 3, 7] = INF, -INF, NAN
    x[4, 2] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    return x.reshape(t, h, d).to(dtype).to(DEVICE)


@pytest.mark.parametrize("g", [1.0, 0.37, 2.0**-20, 3000.5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=id_of)
def test_matches_the_oracle_of_the_rule(dtype, g):
    x = _rows(6, 3, 32, dtype, seed=1)
    before = x.clone()
    packed, scales = quantize_nvfp4(x, _g(g))
    codes, expected_scales = nvfp4_oracle(x, g)
    differ = scales.cpu().numpy() != expected_scales
    assert not differ.any(), f"{int(differ.sum())} scale bytes differ, first at {tuple(np.argwhere(differ)[0])}"
    differ = fp4_unpacked(packed) != codes
    assert not differ.any(), f"{int(differ.sum())} codes differ, first at {tuple(np.argwhere(differ)[0])}"
    assert_same_bytes(x, before, "input")  # never modified


def test_every_block_scale_byte_is_reached():
    # amax = 6 * S for each of the 127 finite e4m3 values S: the scale byte is S's own code.
    amax = torch.tensor([6 * float(v) for v in E4M3_VALUES[1:]], dtype=torch.float32, device=DEVICE)
    x = torch.zeros(1, 126, 16, device=DEVICE)
    x[0, :, 3] = amax
    _, scales = quantize_nvfp4(x, _g(1.0))
    assert scales.reshape(-1).tolist() == list(range(1, 127))


@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=32, max_size=32),
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.sampled_from([1.0, 0.01, 2.0**-30, 17.0]),
)
def test_any_two_blocks_match_the_oracle(values, dtype, g):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 2, 16).to(dtype).to(DEVICE)
    packed, scales = quantize_nvfp4(x, _g(g))
    codes, expected_scales = nvfp4_oracle(x, g)
    np.testing.assert_array_equal(scales.cpu().numpy(), expected_scales)
    np.testing.assert_array_equal(fp4_unpacked(packed), codes)


def test_dequantize_is_exact_products_then_the_global_scale():
    codes = torch.tensor([[[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]], dtype=torch.uint8, device=DEVICE)
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for byte, g in ((0x38, 1.0), (0x01, 0.3), (0x7E, 1e-3), (0x4D, 7.0)):
        got = dequantize_nvfp4(codes, torch.tensor([[[byte]]], dtype=torch.uint8, device=DEVICE), _g(g), torch.float32)
        block = float(E4M3_VALUES[byte])
        want = (torch.tensor(magnitudes + [-m for m in magnitudes], dtype=torch.float64) * block).to(torch.float32)
        want = (want * torch.tensor(g, dtype=torch.float32)).to(DEVICE)  # one float32 rounding, by g
        assert_same_bytes(got.reshape(16), want, f"byte {byte:#x}, g {g}")


def test_dequantized_values_are_sglangs():
    util = sglang_nvfp4(sm=90)  # SGLang's pure-PyTorch dequantizer (its path on SM90)
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (6, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 127, (6, 3, 2), dtype=torch.uint8, generator=g)  # every finite e4m3 byte
    for gs, out in ((1.0, torch.bfloat16), (0.37, torch.bfloat16), (3.5, torch.float16)):
        global_scale = torch.tensor([gs])
        # SGLang's fallback broadcasts block scales of shape [T, H * D // 16] (the same bytes).
        theirs = util.dequantize(packed, scales.reshape(6, -1).view(torch.float8_e4m3fn), global_scale, out)
        assert_same_bytes(dequantize_nvfp4(packed, scales, global_scale, out), theirs, f"dequantized, g {gs}")


def test_stored_bytes_are_sglangs_where_its_kernel_runs():
    """SGLang quantizes with flashinfer's kernel (compute capability 10.0+), whose reciprocals are
    approximate: on blocks with amax = 6 * 2**k and g = 1 every quotient is exact there too, so the
    bytes must agree, rounding, ties, saturation and signs included."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("SGLang's NVFP4 quantizer runs flashinfer's kernel, on compute capability 10.0+ only")
    pytest.importorskip("flashinfer", reason="SGLang's NVFP4 quantizer needs flashinfer")
    util = sglang_nvfp4(sm=100)
    k = torch.arange(-6, 9, dtype=torch.float32).repeat(4)[:48].reshape(3, 16, 1)  # block scales 2**k, normal
    grid = torch.tensor([0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -0.0, -6])
    x = (grid.roll(1)[None, None, :].repeat(3, 16, 1) * torch.exp2(k)).reshape(3, 8, 32).to(torch.bfloat16).cuda()
    x[..., 13::16] *= -1
    packed, scales = quantize_nvfp4(x, torch.tensor([1.0], device="cuda"))
    theirs_packed, theirs_scales, _ = util.quantize(x, torch.tensor([1.0], device="cuda"))
    assert_same_bytes(scales, theirs_scales.view(torch.uint8).reshape(scales.shape), "block scales")
    assert_same_bytes(packed, theirs_packed.view(torch.uint8).reshape(packed.shape), "packed codes")


@pytest.mark.parametrize(
    "args, error, message",
    [
        (((2, 16), 1.0), ValueError, "3-D"),
        (((1, 1, 24), 1.0), ValueError, "multiple of 16"),
        (((1, 1, 16), None), ValueError, "global_scale must be a float32 tensor of one element"),
        (((1, 1, 16), "two"), ValueError, "global_scale must be a float32 tensor of one element, got torch.float32 with 2 elements"),
    ],
)
def test_bad_arguments_name_the_argument(args, error, message):
    shape, g = args
    scale = {None: None, 1.0: _g(1.0), "two": torch.ones(2, device=DEVICE)}[g]
    with pytest.raises(error, match=message):
        quantize_nvfp4(torch.zeros(shape, device=DEVICE), scale)


def test_dequantize_refuses_mismatched_buffers_naming_them():
    packed = torch.zeros(2, 3, 16, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 3, 2\) for packed \(2, 3, 16\), got \(2, 6\)"):
        dequantize_nvfp4(packed, torch.zeros(2, 6, dtype=torch.uint8, device=DEVICE), _g(1.0))
    with pytest.raises(ValueError, match="packed and scales must be uint8"):
        dequantize_nvfp4(packed.float(), torch.zeros(2, 3, 2, dtype=torch.uint8, device=DEVICE), _g(1.0))
    with pytest.raises(ValueError, match="global_scale must be a float32 tensor of one element, got float"):
        dequantize_nvfp4(packed, torch.zeros(2, 3, 2, dtype=torch.uint8, device=DEVICE), 1.0)
