"""The FP8 formats of MI300-class GPUs, ``float8_e4m3fnuz`` and ``float8_e5m2fnuz``, as cache dtypes
(docs/contract.md, "The write", the fnuz formats).

* Encodings derived by hand, as literal bytes: -0.0, NaN, infinities, overflow, ties, subnormals and
  negative values that round to zero; the oracle, ``quantize``, and both write functions agree.
* The kernel (interpreter on CPU, compiled on CUDA) and the reference path byte for byte, and both
  against the oracle, over every bf16 bit pattern, random float32 bit patterns and every rounding
  boundary of both formats.
* The pools: MHA and MLA writes on both paths, the gate, bad input, sizing, calibration, and the
  transfer header's dtype codes.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import numpy as np
import pytest
import torch

from kvassert import (
    DEVICE,
    E4M3FNUZ,
    E5M2FNUZ,
    FNUZ,
    FORMAT_OF,
    INPUT_DTYPES,
    KERNEL_HERE,
    MODES,
    Layer,
    assert_codes_equal,
    assert_same_bytes,
    both_paths,
    codes_of,
    decode_exact,
    encode_exact,
    encode_f32,
    expected_cache,
    expected_latent_cache,
    fused_runs,
    id_of,
    make_mla_pool,
    poison_,
    poison_mla_pool,
    poison_pool_,
    q_codes_stored,
)
from kvpool import MHATokenToKVPool, fused_fp8_set_kv_buffer, quantize, reference_set_kv_buffer
from kvpool.kernels.gate import ELIGIBLE, cache_verdict, fused_eligibility
from kvpool.pools.sizing import KVGeometry, kv_bytes_per_token
from kvpool.transfer.handshake import dtype_code

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter

E4 = torch.float8_e4m3fnuz
E5 = torch.float8_e5m2fnuz
NAN = float("nan")
INF = float("inf")


# ==============================================================================================
# Encodings derived by hand.
#
# e4m3fnuz: value = 2**(e-8) * 1.mmm (e = 1..15), 2**-7 * 0.mmm (e = 0); no infinities; 0x80 is
#           the one NaN, so there is no -0; fmax = 1.875 * 2**7 = 240 = 0x7F; smallest subnormal 2**-10.
# e5m2fnuz: value = 2**(e-16) * 1.mm (e = 1..31), 2**-15 * 0.mm (e = 0); same NaN and zero rules;
#           fmax = 1.75 * 2**15 = 57344 = 0x7F; smallest subnormal 2**-17.


class Known(NamedTuple):
    id: str
    x: float
    code: int
    approx: bool = False  # the byte holds for x rounded to any input dtype (x itself need not be exact)


# fmt: off
E4M3FNUZ_KNOWN = [
    Known("zero", 0.0, 0x00),
    Known("neg_zero_is_zero", -0.0, 0x00),          # no -0 in the format: 0x80 is NaN
    Known("nan", NAN, 0x80),
    Known("neg_nan", -NAN, 0x80),
    Known("inf_saturates", INF, 0x7F),
    Known("neg_inf_saturates", -INF, 0xFF),
    Known("one", 1.0, 0x40),                        # e=8, m=000
    Known("neg_3.5", -3.5, 0xCE),                   # 1.75 * 2**1: S=1, e=9, m=110
    Known("tie_1.0625_down_to_even", 1.0625, 0x40),  # halfway 1.0 (000) / 1.125 (001) -> 000
    Known("tie_1.1875_up_to_even", 1.1875, 0x42),    # halfway 1.125 (001) / 1.25 (010) -> 010
    Known("tie_1.9375_carries_to_2", 1.9375, 0x48),  # halfway 1.875 (e=8, 111) / 2.0 (e=9, 000) -> 000
    Known("224", 224.0, 0x7E),                      # 1.75 * 2**7: e=15, m=110
    Known("tie_232_to_even_224", 232.0, 0x7E),      # halfway 224 (110) / 240 (111) -> 110
    Known("236_rounds_to_fmax", 236.0, 0x7F),
    Known("fmax_240", 240.0, 0x7F),
    Known("248_saturates", 248.0, 0x7F),            # halfway to 256, which the format lacks
    Known("1e6_saturates", 1e6, 0x7F, approx=True),
    Known("neg_1e6_saturates", -1e6, 0xFF, approx=True),
    Known("min_normal", 2.0**-7, 0x08),             # e=1, m=000
    Known("largest_subnormal", 7 * 2.0**-10, 0x07),
    Known("smallest_subnormal", 2.0**-10, 0x01),
    Known("neg_smallest_subnormal", -(2.0**-10), 0x81),
    Known("tie_half_ulp_to_zero", 2.0**-11, 0x00),
    Known("neg_tie_half_ulp_to_zero_not_nan", -(2.0**-11), 0x00),  # rounds to zero: 0x00, never 0x80
    Known("neg_0.75_ulp_to_smallest", -1.5 * 2.0**-11, 0x81),
    Known("tie_1.5_ulp_to_even_2", 3 * 2.0**-11, 0x02),
    Known("neg_tiny_to_zero", -1e-30, 0x00, approx=True),
]

E5M2FNUZ_KNOWN = [
    Known("zero", 0.0, 0x00),
    Known("neg_zero_is_zero", -0.0, 0x00),
    Known("nan", NAN, 0x80),
    Known("neg_nan", -NAN, 0x80),
    Known("inf_saturates", INF, 0x7F),
    Known("neg_inf_saturates", -INF, 0xFF),
    Known("one", 1.0, 0x40),                        # e=16, m=00
    Known("neg_1.5", -1.5, 0xC2),                   # S=1, e=16, m=10
    Known("tie_1.125_down_to_even", 1.125, 0x40),    # halfway 1.0 (00) / 1.25 (01) -> 00
    Known("tie_1.375_up_to_even", 1.375, 0x42),      # halfway 1.25 (01) / 1.5 (10) -> 10
    Known("49152", 49152.0, 0x7E),                  # 1.5 * 2**15: e=31, m=10
    Known("fmax_57344", 57344.0, 0x7F),
    Known("61440_saturates", 61440.0, 0x7F),        # halfway to 65536, which the format lacks
    Known("fp16_max_saturates", 65504.0, 0x7F),
    Known("1e9_saturates", 1e9, 0x7F, approx=True),
    Known("min_normal", 2.0**-15, 0x04),            # e=1, m=00
    Known("smallest_subnormal", 2.0**-17, 0x01),
    Known("neg_smallest_subnormal", -(2.0**-17), 0x81),
    Known("neg_tie_half_ulp_to_zero_not_nan", -(2.0**-18), 0x00),
    Known("tie_1.5_ulp_to_even_2", 3 * 2.0**-18, 0x02),
    Known("neg_tiny_to_zero", -1e-30, 0x00, approx=True),
]
# fmt: on

KNOWN = {E4: (E4M3FNUZ_KNOWN, E4M3FNUZ), E5: (E5M2FNUZ_KNOWN, E5M2FNUZ)}


def _known_cases():
    for dtype, (table, _) in KNOWN.items():
        for k in table:
            yield pytest.param(dtype, k, id=f"{id_of(dtype)}-{k.id}")


@pytest.mark.parametrize("dtype, k", list(_known_cases()))
def test_oracle_encoders_give_the_literal(dtype, k):
    fmt = KNOWN[dtype][1]
    vec = int(encode_f32(np.array([k.x], dtype=np.float32), fmt)[0])
    exact = encode_exact(float(np.float32(k.x)), fmt)
    assert vec == k.code and exact == k.code, (
        f"{k.id}: vectorised 0x{vec:02x}, exact 0x{exact:02x}, literal 0x{k.code:02x}"
    )


@pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=id_of)
@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_quantize_and_both_writes_store_the_literals(dtype, in_dtype):
    """Every literal of the format in one row, through ``quantize``, the reference function and the
    fused function (interpreter on CPU), byte for byte; inputs that the input dtype cannot hold
    exactly are kept only where the byte does not depend on their rounding."""
    def held(x: float) -> bool:
        return x != x or float(torch.tensor(x).to(in_dtype).float()) == x

    table = [k for k in KNOWN[dtype][0] if k.approx or held(k.x)]
    x = torch.tensor([k.x for k in table], dtype=torch.float32).to(in_dtype).reshape(1, 1, -1).to(DEVICE)
    expected = torch.tensor([k.code for k in table], dtype=torch.uint8).reshape(1, 1, -1)
    assert_same_bytes(quantize(x, dtype).view(torch.uint8).cpu(), expected, "quantize")
    writes = [reference_set_kv_buffer] + ([fused_fp8_set_kv_buffer] if KERNEL_HERE else [])
    for write in writes:
        k_cache = poison_(torch.empty(3, 1, len(table), dtype=dtype, device=DEVICE))
        v_cache = poison_(torch.empty(3, 1, len(table), dtype=dtype, device=DEVICE))
        write(x, x, k_cache, v_cache, torch.tensor([1], device=DEVICE))
        assert_same_bytes(k_cache[1:2].view(torch.uint8).cpu(), expected, f"{write.__name__} K row")
        assert_same_bytes(v_cache[1:2].view(torch.uint8).cpu(), expected, f"{write.__name__} V row")
        assert (k_cache.view(torch.uint8)[[0, 2]] == 0xFF).all(), "rows not named by loc are untouched"


def test_oracle_encoders_agree_on_bf16_and_fp16_patterns():
    """The vectorised (bit-pattern) and exact (rational) fnuz encoders agree on every 5th bf16 and
    fp16 pattern, and every code decodes and re-encodes to itself (0x80 to NaN and back)."""
    bf = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    fp = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    sample = np.concatenate([bf[::5], fp[::5]])
    for fmt in (E4M3FNUZ, E5M2FNUZ):
        exact = np.array([encode_exact(float(y), fmt) for y in sample])
        assert_codes_equal(encode_f32(sample, fmt), exact, fmt, "vectorised vs exact encoder", nan_equal=False)
        for code in range(256):
            value = decode_exact(code, fmt)
            again = encode_exact(float(value), fmt)
            assert again == code, f"{fmt.name}: 0x{code:02x} decodes to {value} and encodes to 0x{again:02x}"


# ==============================================================================================
# The kernel and the reference path, byte for byte, and both against the oracle.


def _all_bf16() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _random_float32(n: int, seed: int) -> torch.Tensor:
    """``n`` uniformly random float32 bit patterns (every class: NaN payloads of both signs,
    infinities, float32 subnormals, both zeros, the whole exponent range)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    bits[:8] = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x00000001, 0x80000001]
    return torch.from_numpy(bits.view(np.float32).copy())


def _rounding_boundaries(fmt) -> torch.Tensor:
    """For every pair of neighbouring codes of ``fmt`` (and zero and the saturation point), the
    midpoint between their values and the float32 values on either side of it, both signs."""
    values = sorted({decode_exact(c, fmt) for c in range(256) if isinstance(decode_exact(c, fmt), Fraction)})
    positive = [v for v in values if v >= 0]
    ulp_at_max = positive[-1] - positive[-2]
    points = positive + [positive[-1] + ulp_at_max]  # the next value the format would have
    mids = np.array([float((a + b) / 2) for a, b in zip(points, points[1:])], dtype=np.float32)
    around = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    around = np.concatenate([around, np.array([float(v) for v in positive], dtype=np.float32)])
    return torch.from_numpy(np.concatenate([around, -around]).astype(np.float32))


def _rows(flat: torch.Tensor, width: int = 128) -> torch.Tensor:
    """A flat tensor as [T, 1, width] rows (padded with the first element)."""
    pad = (-flat.numel()) % width
    flat = torch.cat([flat, flat[:1].expand(pad)]) if pad else flat
    return flat.reshape(-1, 1, width)


def _check_write(x: torch.Tensor, dtype: torch.dtype, scale, what: str) -> None:
    """The reference write against the oracle; the fused write (where it runs) against the reference."""
    x = x.to(DEVICE)
    loc = torch.arange(x.shape[0], device=DEVICE)
    k_ref = poison_(torch.empty(x.shape, dtype=dtype, device=DEVICE))
    v_ref = poison_(torch.empty(x.shape, dtype=dtype, device=DEVICE))
    reference_set_kv_buffer(x, x, k_ref, v_ref, loc, scale, scale)
    assert_codes_equal(k_ref, q_codes_stored(x, dtype, scale), FORMAT_OF[dtype], f"{what}: reference", nan_equal=False)
    if not KERNEL_HERE:
        return
    (kf, vf), (kr, vr) = both_paths(x, x, loc, scale, scale, x.shape[0], dtype)
    assert_same_bytes(kf, kr, f"{what}: K fused vs reference")
    assert_same_bytes(vf, vr, f"{what}: V fused vs reference")
    assert_same_bytes(kr, k_ref, f"{what}: reference is deterministic")


@pytest.mark.parametrize("scale", [None, 0.37, "tensor_2**-7"], ids=["none", "0.37", "tensor_pow2"])
@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_every_bf16_bit_pattern(dtype, scale):
    """All 65,536 bf16 values: every exponent, both zeros, subnormals, infinities, NaNs."""
    if scale == "tensor_2**-7":
        scale = torch.tensor([2.0**-7], device=DEVICE)
    _check_write(_rows(_all_bf16()), dtype, scale, f"every bf16 pattern, scale {scale}")


@pytest.mark.parametrize("scale", [None, 3.3], ids=["none", "3.3"])
@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_random_float32_bit_patterns(dtype, scale):
    seed = 2 * FNUZ.index(dtype) + (scale is None)
    _check_write(_rows(_random_float32(32768, seed)), dtype, scale, "random float32")


@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_every_rounding_boundary_of_the_format(dtype):
    """Each midpoint between neighbouring values (ties to even), the float32 values just inside and
    outside it, the midpoint above fmax (saturation), and the values themselves, both signs."""
    _check_write(_rows(_rounding_boundaries(FORMAT_OF[dtype]), 64), dtype, None, "rounding boundaries")


# ==============================================================================================
# The pools.


def _specials(t: int, h: int, d: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[t, h, d] of wide-range values with the zero, NaN and saturation cases at the front."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * torch.exp2(torch.randint(-22, 17, (t, h, d), generator=g).float())
    specials = torch.tensor([-0.0, 0.0, NAN, -NAN, INF, -INF, 1e6, -1e6, -(2.0**-19), 240.0, 248.0, -61440.0])
    x.view(-1)[: specials.numel()] = specials
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_mha_pool_write_stores_the_oracle_bytes(dtype, mode):
    pool = MHATokenToKVPool(8, 1, dtype, 2, 16, 2, DEVICE, v_head_dim=8, fused=mode, warmup=False)
    assert pool.store_dtype == torch.uint8 and pool.get_key_buffer(0).dtype == dtype
    poison_pool_(pool)
    k, v = _specials(5, 2, 16, 1, torch.bfloat16), _specials(5, 2, 8, 2, torch.float32)
    loc = torch.tensor([3, -1, 8, 1, 12], device=DEVICE)
    k_scale, v_scale = 0.5, torch.tensor([3.0, 0.25], device=DEVICE)
    before = [codes_of(b) for b in pool.get_kv_buffer(1)]
    pool.set_kv_buffer(Layer(1), loc, k, v, k_scale, v_scale)
    stats = pool.stats
    assert (stats.fused_calls, stats.reference_calls) == ((1, 0) if mode == "always" else (0, 1))
    fmt = FORMAT_OF[dtype]
    k_buf, v_buf = pool.get_kv_buffer(1)
    expect_k = expected_cache(before[0], k, loc.tolist(), dtype, k_scale)
    expect_v = expected_cache(before[1], v, loc.tolist(), dtype, v_scale)
    assert_codes_equal(k_buf, expect_k, fmt, f"{mode} K", nan_equal=False)
    assert_codes_equal(v_buf, expect_v, fmt, f"{mode} V", nan_equal=False)
    assert (pool.get_key_buffer(0).view(torch.uint8) == 0xFF).all(), "another layer was written"


@fused_runs
@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_mha_pools_fused_and_reference_are_bit_identical(dtype):
    pools = [MHATokenToKVPool(12, 4, dtype, 3, 24, 1, DEVICE, fused=m, warmup=False) for m in ("always", "never")]
    k, v = _specials(7, 3, 24, 3, torch.float16), _specials(7, 3, 24, 4, torch.bfloat16)
    loc = torch.tensor([1, 15, 2, 0, -4, 9, 16], device=DEVICE, dtype=torch.int32)
    for pool in pools:
        poison_pool_(pool)
        pool.set_kv_buffer(None, loc, k, v, torch.tensor([0.61], device=DEVICE), None, layer_id_override=0)
    for a, b in zip(pools[0].get_kv_buffer(0), pools[1].get_kv_buffer(0)):
        assert_same_bytes(a.view(torch.uint8), b.view(torch.uint8), f"{dtype} fused vs reference pool")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_mla_pool_writes_store_the_oracle_bytes(dtype, mode):
    """Both MLA entry points (the whole latent row; the nope and rope parts) on both paths."""
    pool = make_mla_pool(dtype, mode)
    assert pool.get_key_buffer(3).dtype == dtype and pool.get_value_buffer(4).dtype == dtype
    poison_mla_pool(pool, 0xFF)
    row = _specials(4, 1, pool.kv_cache_dim, 5, torch.bfloat16)
    nope = _specials(4, 1, pool.kv_lora_rank, 6, torch.float32)
    rope = _specials(4, 1, pool.qk_rope_head_dim, 7, torch.float16)
    loc = torch.tensor([2, 11, -1, 5], device=DEVICE)
    before = [codes_of(pool.get_key_buffer(layer_id)) for layer_id in (3, 4)]
    pool.set_kv_buffer(Layer(3), loc, row, None, 0.61)
    pool.set_mla_kv_buffer(Layer(4), loc.flip(0), nope, rope, torch.tensor([2.5], device=DEVICE))
    fmt = FORMAT_OF[dtype]
    expect3 = expected_latent_cache(before[0], [row], loc.tolist(), dtype, 0.61)
    expect4 = expected_latent_cache(before[1], [nope, rope], loc.flip(0).tolist(), dtype, 2.5)
    assert_codes_equal(pool.get_key_buffer(3), expect3, fmt, f"{mode} layer 3", nan_equal=False)
    assert_codes_equal(pool.get_key_buffer(4), expect4, fmt, f"{mode} layer 4", nan_equal=False)


@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_moves_and_cpu_copies_keep_the_bytes(dtype):
    """Row copies move stored bytes: 0x80 (NaN) and every other code come back as they were."""
    pool = MHATokenToKVPool(10, 2, dtype, 2, 8, 2, DEVICE, warmup=False)
    for i, b in enumerate(pool.k_buffer + pool.v_buffer):
        b.view(torch.uint8).copy_(torch.arange(b.numel(), dtype=torch.int64).add(i * 37).remainder(256).view(b.shape))
    before = [b.view(torch.uint8).clone() for b in pool.k_buffer + pool.v_buffer]
    pool.move_kv_cache(torch.tensor([7, 8], device=DEVICE), torch.tensor([1, 2], device=DEVICE))
    copy = pool.get_cpu_copy(torch.tensor([7, 8], device=DEVICE))
    pool.load_cpu_copy(copy, torch.tensor([3, 4], device=DEVICE))
    for b, old in zip(pool.k_buffer + pool.v_buffer, before):
        got = b.view(torch.uint8)
        for dst, src in ((7, 1), (8, 2), (3, 1), (4, 2)):
            assert_same_bytes(got[dst], old[src], f"row {dst} as a copy of row {src}")
        untouched = [r for r in range(b.shape[0]) if r not in (3, 4, 7, 8)]
        assert_same_bytes(got[untouched], old[untouched], "rows not copied to")


# ==============================================================================================
# The gate, bad input, sizing, calibration and transfer headers.


@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_the_gate_lets_fnuz_caches_take_the_fused_kernel(dtype):
    cuda = torch.device("cuda")
    assert cache_verdict(cuda, dtype, 128, 128, 1, 1, triton_available=True, interpreter=False) == (True, ELIGIBLE)
    cpu_verdict = cache_verdict(torch.device("cpu"), dtype, 96, 64, 1, 1, triton_available=True, interpreter=True)
    assert cpu_verdict == (True, ELIGIBLE)
    ok, reason = fused_eligibility(
        device=cuda, cache_dtype=dtype, k_dtype=torch.bfloat16, v_dtype=torch.bfloat16, head_dim=128, v_head_dim=128,
        k_cache_stride_d=1, v_cache_stride_d=1, k_scale=torch.ones(1, dtype=torch.float16), v_scale=None,
        triton_available=True, interpreter=False,
    )  # fmt: skip
    assert not ok and reason == "k_scale is a torch.float16 tensor; the fused kernel reads float32 scale tensors"


@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_bad_input_is_refused_and_nothing_written(dtype):
    """As for the other FP8 formats: scales are checked (and applied), errors name the argument."""
    pool = MHATokenToKVPool(8, 1, dtype, 1, 4, 1, DEVICE, warmup=False)
    poison_pool_(pool)
    before = [b.clone() for b in pool.get_kv_buffer(0)]
    x = torch.ones(1, 1, 4, device=DEVICE)
    loc = torch.tensor([2], device=DEVICE)
    cases = [
        (dict(k_scale=-5.0), ValueError, "k_scale must be a positive finite"),
        (dict(v_scale=torch.ones(3, device=DEVICE)), ValueError, "v_scale"),
        (dict(loc=loc.float()), ValueError, "loc must be int32 or int64, got torch.float32"),
        (dict(k=torch.ones(1, 2, 4, device=DEVICE)), ValueError, "cache_k"),
    ]
    for over, error, message in cases:
        a = dict(k=x, v=x, loc=loc, k_scale=None, v_scale=None) | over
        with pytest.raises(error, match=message):
            pool.set_kv_buffer(None, a["loc"], a["k"], a["v"], a["k_scale"], a["v_scale"], layer_id_override=0)
        for b, old in zip(pool.get_kv_buffer(0), before):
            assert_same_bytes(b.view(torch.uint8), old.view(torch.uint8), f"after a refused call ({message})")
    pool.set_kv_buffer(None, loc, x * 6, x, 2.0, None, layer_id_override=0)
    assert pool.get_key_buffer(0)[2].float().eq(3.0).all(), "the scale divides fnuz writes"
    storage = torch.zeros(4, 1, 4, dtype=torch.uint8, device=DEVICE)
    message = r"k_cache must be one of .*float8_e4m3fnuz, float8_e5m2fnuz, got torch.uint8 \(pass the FP8 view"
    with pytest.raises(ValueError, match=message):
        reference_set_kv_buffer(x, x, storage, storage.clone(), loc)


@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_sizing_counts_one_byte_per_element_as_the_pools_allocate(dtype):
    assert kv_bytes_per_token(8, 128, None, 32, dtype) == 32 * 8 * 256
    g = KVGeometry(3, 24, 2, dtype, v_head_dim=8)
    pool = MHATokenToKVPool(20, 4, dtype, 3, 24, 2, DEVICE, v_head_dim=8, warmup=False)
    assert g.pool_bytes(20, 4) == sum(pool.get_kv_size_bytes())
    mla = make_mla_pool(dtype, size=20, page_size=4)
    assert KVGeometry.mla(mla.kv_lora_rank, mla.qk_rope_head_dim, 2, dtype).pool_bytes(20, 4) == mla.get_kv_size_bytes()


@pytest.mark.parametrize("dtype", FNUZ, ids=id_of)
def test_calibrated_scales_map_the_largest_value_to_the_format_max(dtype):
    fmax = torch.finfo(dtype).max
    pool = MHATokenToKVPool(8, 1, dtype, 1, 4, 1, DEVICE, warmup=False)
    pool.observe_amax(True)
    x = torch.tensor([[[1.0, -3.0 * fmax, 2.0, NAN]]], device=DEVICE)
    pool.set_kv_buffer(None, torch.tensor([1], device=DEVICE), x, x / 4, layer_id_override=0)
    [(k_scale, v_scale)] = pool.calibrated_scales()
    assert k_scale.item() == 3.0 and v_scale.item() == 0.75


def test_transfer_headers_keep_the_earlier_dtype_codes():
    """A header names a dtype by its position in the list of cache dtypes: the fnuz formats come
    after the five earlier ones, so ranks that differ only in knowing them agree on those codes."""
    earlier = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float32]
    assert [dtype_code(d) for d in earlier + FNUZ] == [1, 2, 3, 4, 5, 6, 7]
