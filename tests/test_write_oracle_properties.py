"""Properties of the write against the oracle (``kvassert``'s q(x, s)), for random shapes, input and
cache dtypes, scales, magnitudes (subnormal to overflow, inf and NaN), strided inputs and slot lists:
the written rows equal the oracle byte for byte (NaN as "some NaN code"), every other row and the
memory around the cache keep their poisoned bytes, and the inputs keep theirs. On both write
functions, on the pool's two paths, and on a deliberate grid of shapes.
"""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpool
from kvassert import (
    CACHE_DTYPES,
    FORMAT_OF,
    INPUT_DTYPES,
    INTERPRETER,
    Layer,
    assert_codes_equal,
    assert_same_bytes,
    codes_of,
    expected_cache,
    needs_interpreter,
    q_codes,
    skip_fused_without_interpreter,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ==============================================================================================
# Properties of the write against the oracle. The reference function runs on every example; the
# Triton kernel (interpreter) and the pool on fewer.

LAYOUTS = ["contiguous", "qkv_slice", "tokens_last", "d_strided", "heads_transposed"]
GUARD = 2  # guard rows on each side of a caller-owned cache


def _examples(n_at_ci: int) -> int:
    """Examples for an interpreter-heavy test: n_at_ci under the "ci" profile (60), scaled with the profile."""
    return max(5, n_at_ci * settings().max_examples // 60)


# ----------------------------------------------------------------------------------------------
# Building one example.


def _make_input(rng: np.random.Generator, T: int, H: int, D: int, dtype, layout: str, regime: str,
                centre: float, specials: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] of ``dtype`` laid out as ``layout``; returns (x, base) where base owns the memory."""
    lo, hi = {"tiny": (-22, -6), "normal": (-8, 9), "huge": (8, 22), "wide": (-30, 22)}[regime]
    n = T * H * D
    e = rng.integers(lo, hi, n) + centre
    vals = (rng.uniform(1.0, 2.0, n) * np.exp2(e) * rng.choice([-1.0, 1.0], n))
    if regime == "tiny":  # also exact multiples of tiny powers of two: ties in the subnormal range
        k = rng.integers(0, 16, n) * np.exp2(np.floor(centre) - rng.integers(8, 19, n))
        vals = np.where(rng.random(n) < 0.5, vals, k * rng.choice([-1.0, 1.0], n))
    if specials and n:
        m = max(1, n // 30)
        idx = rng.choice(n, size=m, replace=True)
        vals[idx] = rng.choice([np.inf, -np.inf, np.nan, 0.0, -0.0], size=m)
    vals = torch.from_numpy(vals.reshape(T, H, D)).to(dtype)
    if layout == "contiguous":
        base = vals.clone()
        return base, base
    if layout == "qkv_slice":  # k or v sliced out of a fused projection [T, Hq + H + pad, D + 3]
        base = torch.full((T, H + 3, D + 3), 7.0, dtype=dtype)
        x = base[:, 2:2 + H, 1:1 + D]
        x.copy_(vals)
        return x, base
    if layout == "tokens_last":  # stored [H, D, T]: every stride differs from the contiguous one
        base = vals.permute(1, 2, 0).contiguous()
        return base.permute(2, 0, 1), base
    if layout == "d_strided":  # head_dim not contiguous
        base = torch.full((T, H, 2 * D), -3.0, dtype=dtype)
        x = base[:, :, ::2]
        x.copy_(vals)
        return x, base
    if layout == "heads_transposed":  # stored [T, D, H]
        base = vals.transpose(1, 2).contiguous()
        return base.transpose(1, 2), base
    raise AssertionError(layout)


@dataclasses.dataclass
class Example:
    T: int
    H: int
    D: int
    Hv: int
    Dv: int
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    cache_dtype: torch.dtype
    slots: int
    loc: torch.Tensor
    loc_base: torch.Tensor
    k_scale: object
    v_scale: object
    k: torch.Tensor
    v: torch.Tensor
    k_base: torch.Tensor
    v_base: torch.Tensor
    poison: int

    def __repr__(self) -> str:
        def sc(s):
            if isinstance(s, torch.Tensor):
                return f"tensor{tuple(s.shape)}:{s.dtype}={s.reshape(-1).tolist()}"
            return repr(s)

        return (f"Example(T={self.T}, H={self.H}, D={self.D}, Hv={self.Hv}, Dv={self.Dv}, "
                f"k={self.k_dtype} strides {self.k.stride()}, v={self.v_dtype} strides {self.v.stride()}, "
                f"cache={self.cache_dtype}, slots={self.slots}, loc={self.loc.tolist()} ({self.loc.dtype}), "
                f"k_scale={sc(self.k_scale)}, v_scale={sc(self.v_scale)}, poison=0x{self.poison:02x})")


def _draw_scale(draw, H: int, kind: str, tensor_dtypes) -> object:
    value = st.one_of(
        st.sampled_from([1.0, 0.5, 2.0, 0.1, 0.37, 3.3, 1e-3, 1e3, 0.0123, 448.0 / 3]),
        st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
    )
    if kind == "none":
        return None
    if kind == "float":
        return draw(value)
    dtype = draw(st.sampled_from(tensor_dtypes))
    if kind == "per_tensor":
        shape = draw(st.sampled_from([(), (1,), (1, 1)]))
        return torch.tensor(draw(value), dtype=torch.float64).to(dtype).reshape(shape)
    vals = [draw(value) for _ in range(H)]
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    form = draw(st.sampled_from(["H", "H1", "H_strided", "H1_strided"]))
    if form.endswith("strided"):  # a column of a wider table: per-head values at stride 2
        wide = torch.full((H, 2), 1e30, dtype=torch.float64).to(dtype)
        wide[:, 0] = t
        t = wide[:, 0] if form == "H_strided" else wide[:, :1]
        return t
    return t if form == "H" else t.reshape(H, 1)


@st.composite
def examples(draw, *, max_T=8, dims=(1, 5, 8, 16, 96), cache_dtypes=CACHE_DTYPES,
             scale_tensor_dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
             same_heads=False, layouts=LAYOUTS, strided_loc=True):
    T = draw(st.sampled_from([t for t in (0, 1, 2, 3, 7, 8) if t <= max_T]))
    H = draw(st.integers(1, 4))
    Hv = H if same_heads else draw(st.integers(1, 4))
    D = draw(st.sampled_from(dims))
    Dv = draw(st.sampled_from(dims))
    cache_dtype = draw(st.sampled_from(cache_dtypes))
    k_dtype = draw(st.sampled_from(INPUT_DTYPES))
    v_dtype = draw(st.sampled_from(INPUT_DTYPES))
    scale_kinds = ["none", "float", "per_tensor", "per_head"]
    k_scale = _draw_scale(draw, H, draw(st.sampled_from(scale_kinds)), scale_tensor_dtypes)
    v_scale = _draw_scale(draw, Hv, draw(st.sampled_from(scale_kinds)), scale_tensor_dtypes)

    # slots: each token is padding (< 0), a distinct valid slot, or out of range (>= slots)
    slots = T + draw(st.integers(2, 5))  # >= 2: a pool needs size = slots - 1 >= 1
    loc_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    big = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    small = -(2**31) if loc_dtype == torch.int32 else -(2**40)
    free = list(draw(st.permutations(range(slots))))
    loc = []
    for _ in range(T):
        kind = draw(st.sampled_from(["valid", "valid", "valid", "negative", "out_of_range"]))
        if kind == "valid":
            loc.append(free.pop())
        elif kind == "negative":
            loc.append(draw(st.sampled_from([-1, -2, -slots, small])))
        else:
            loc.append(draw(st.sampled_from([slots, slots + 1, slots + GUARD, big])))
    loc_t = torch.tensor(loc, dtype=loc_dtype)
    if strided_loc and draw(st.booleans()):  # a strided loc (every other entry of a longer buffer)
        loc_base = torch.full((2 * T,), 12345, dtype=loc_dtype)
        loc_base[::2] = loc_t
        loc_t = loc_base[::2]
    else:
        loc_base = loc_t

    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    def centre(s):
        if isinstance(s, torch.Tensor):
            return float(np.log2(float(s.double().reshape(-1)[0])))
        return float(np.log2(s)) if s is not None else 0.0

    # values are placed relative to the scale so the quotient covers the FP8 ranges
    specials = draw(st.booleans())
    k, k_base = _make_input(rng, T, H, D, k_dtype, draw(st.sampled_from(layouts)),
                            draw(st.sampled_from(["tiny", "normal", "huge", "wide"])),
                            round(centre(k_scale)), specials)
    v, v_base = _make_input(rng, T, Hv, Dv, v_dtype, draw(st.sampled_from(layouts)),
                            draw(st.sampled_from(["tiny", "normal", "huge", "wide"])),
                            round(centre(v_scale)), specials)
    poison = draw(st.sampled_from([0xFF, 0xA5]))
    return Example(T, H, D, Hv, Dv, k_dtype, v_dtype, cache_dtype, slots, loc_t, loc_base,
                   k_scale, v_scale, k, v, k_base, v_base, poison)


# ----------------------------------------------------------------------------------------------
# Running one example through a write function and checking everything.


CACHE_LAYOUTS = {
    # name: (outer shape from (slots, H, D), the cache as a view of the outer tensor)
    "contiguous": (lambda s, h, d: (s + 2 * GUARD, h, d), lambda o, s, h, d: o[GUARD:GUARD + s]),
    "padded_head_dim": (lambda s, h, d: (s + 2 * GUARD, h, d + 3), lambda o, s, h, d: o[GUARD:GUARD + s, :, 1:1 + d]),
    "heads_of_wider": (lambda s, h, d: (s + 2 * GUARD, h + 2, d), lambda o, s, h, d: o[GUARD:GUARD + s, 1:1 + h]),
    "every_other_slot": (lambda s, h, d: (2 * s + 2 * GUARD, h, d), lambda o, s, h, d: o[GUARD:GUARD + 2 * s:2]),
}


def _guarded_cache(slots, H, D, dtype, poison, layout="contiguous"):
    """A [slots, H, D] cache viewed inside a larger poisoned tensor (guard rows before and after).

    Returns (cache, outer, inside) where ``inside`` marks the elements of ``outer`` that are the cache."""
    shape_of, view_of = CACHE_LAYOUTS[layout]
    outer = torch.empty(shape_of(slots, H, D), dtype=dtype)
    outer.view(torch.uint8).fill_(poison)
    inside = torch.zeros(outer.shape, dtype=torch.bool)
    view_of(inside, slots, H, D).fill_(True)
    return view_of(outer, slots, H, D), outer, inside


def _snapshot(ex: Example):
    return [t.clone() if isinstance(t, torch.Tensor) else t
            for t in (ex.k_base, ex.v_base, ex.loc_base, ex.k_scale, ex.v_scale)]


def _check_inputs_unchanged(ex: Example, snap) -> None:
    names = ("k (and the tensor it views)", "v (and the tensor it views)", "loc", "k_scale", "v_scale")
    now = (ex.k_base, ex.v_base, ex.loc_base, ex.k_scale, ex.v_scale)
    for name, before, after in zip(names, snap, now):
        if isinstance(before, torch.Tensor):
            assert_same_bytes(after, before, f"input {name}")


def _check_written(ex: Example, cache: torch.Tensor, outer: torch.Tensor, inside: torch.Tensor, x: torch.Tensor,
                   scale, what: str):
    fmt = FORMAT_OF[ex.cache_dtype]
    poisoned = torch.empty(cache.shape, dtype=cache.dtype)
    poisoned.view(torch.uint8).fill_(ex.poison)
    before = codes_of(poisoned)
    expected = expected_cache(before, x, ex.loc.tolist(), ex.cache_dtype, scale)
    assert_codes_equal(cache, expected, fmt, f"{what}; {ex!r}")
    # rows not named: the exact poison bytes (NaN-leniency would hide a stray NaN write)
    named = {int(l) for l in ex.loc.tolist() if 0 <= int(l) < ex.slots}
    for slot in range(ex.slots):
        if slot not in named:
            assert_same_bytes(cache[slot], poisoned[slot], f"{what}: untouched row {slot}; {ex!r}")
    outside = outer.view(torch.uint8)[~inside.unsqueeze(-1).expand(*outer.shape, outer.element_size())
                                      .reshape(*outer.shape[:-1], -1)]
    bad = torch.nonzero(outside != ex.poison)
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} bytes outside the cache view changed "
                              f"(first: flat {bad[0].tolist()}, now 0x{int(outside[bad[0, 0]]):02x}); {ex!r}")


def _run_function(fn, ex: Example, what: str, k_layout="contiguous", v_layout="contiguous") -> None:
    kc, k_outer, k_in = _guarded_cache(ex.slots, ex.H, ex.D, ex.cache_dtype, ex.poison, k_layout)
    vc, v_outer, v_in = _guarded_cache(ex.slots, ex.Hv, ex.Dv, ex.cache_dtype, ex.poison ^ 0x5A, v_layout)
    what = f"{what} [caches {k_layout}/{v_layout}]"
    snap = _snapshot(ex)
    ret = fn(ex.k, ex.v, kc, vc, ex.loc, ex.k_scale, ex.v_scale)
    assert ret is None, f"{what} returned {ret!r}"
    _check_inputs_unchanged(ex, snap)
    _check_written(ex, kc, k_outer, k_in, ex.k, ex.k_scale, f"{what} k_cache")
    ex_v = dataclasses.replace(ex, poison=ex.poison ^ 0x5A)
    _check_written(ex_v, vc, v_outer, v_in, ex.v, ex.v_scale, f"{what} v_cache")


@given(ex=examples(), k_layout=st.sampled_from(list(CACHE_LAYOUTS)), v_layout=st.sampled_from(list(CACHE_LAYOUTS)))
def test_reference_write_equals_oracle(ex, k_layout, v_layout):
    _run_function(kvpool.reference_set_kv_buffer, ex, "reference_set_kv_buffer", k_layout, v_layout)


@settings(max_examples=_examples(40))
@given(ex=examples(max_T=7, dims=(1, 5, 16, 96), scale_tensor_dtypes=(torch.float32,), strided_loc=False),
       k_layout=st.sampled_from(list(CACHE_LAYOUTS)), v_layout=st.sampled_from(list(CACHE_LAYOUTS)))
@needs_interpreter
def test_fused_interpreter_write_equals_oracle(ex, k_layout, v_layout):
    _run_function(kvpool.fused_fp8_set_kv_buffer, ex, "fused_fp8_set_kv_buffer (interpreter)", k_layout, v_layout)


@given(ex=examples(max_T=8))
def test_quantize_equals_oracle(ex):
    snap = ex.k_base.clone()
    got = kvpool.quantize(ex.k, ex.cache_dtype, ex.k_scale)
    assert got.dtype == ex.cache_dtype and tuple(got.shape) == tuple(ex.k.shape)
    assert_codes_equal(got, q_codes(ex.k, ex.cache_dtype, ex.k_scale), FORMAT_OF[ex.cache_dtype],
                       f"quantize; {ex!r}")
    assert_same_bytes(ex.k_base, snap, "quantize input")


@pytest.mark.parametrize("writer", [
    pytest.param("reference", id="reference"),
    pytest.param("fused_interp", id="fused_interp"),
])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=str)
def test_strided_loc_is_read_with_its_stride(writer, loc_dtype):
    """loc as a view with stride 2 (e.g. a column of a [T, 2] index table): tokens go to loc[t]."""
    skip_fused_without_interpreter(writer)
    fn = {"reference": kvpool.reference_set_kv_buffer, "fused_interp": kvpool.fused_fp8_set_kv_buffer}[writer]
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    loc_base = torch.tensor([[5, 0], [1, 2], [-1, 3]], dtype=loc_dtype)
    loc = loc_base[:, 0]  # [5, 1, -1], stride 2
    kc = torch.full((6, 1, 2), float("nan"), dtype=torch.float8_e4m3fn)
    vc = kc.clone()
    before = codes_of(kc)
    fn(k, k, kc, vc, loc)
    expected = expected_cache(before, k, [5, 1, -1], torch.float8_e4m3fn)
    assert_codes_equal(kc, expected, FORMAT_OF[torch.float8_e4m3fn], f"{writer} with loc strides {loc.stride()}")
    assert_same_bytes(kc[[0, 2, 3, 4]], torch.from_numpy(before[[0, 2, 3, 4]].astype(np.uint8)).view(torch.float8_e4m3fn),
                      "rows not named")


@pytest.mark.parametrize("mode", [
    pytest.param("never", id="never"),
    pytest.param("always", id="always"),
])
def test_pool_strided_loc_is_read_with_its_stride(mode):
    skip_fused_without_interpreter(mode)
    with mock.patch.dict(os.environ):
        os.environ.pop("KVPOOL_FUSED", None)
        pool = kvpool.MHATokenToKVPool(5, 1, torch.float8_e5m2, 1, 2, 1, "cpu", fused=mode)
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]], dtype=torch.bfloat16)
    loc = torch.tensor([[4, 0], [2, 1]])[:, 0]  # [4, 2], stride 2
    kb, vb = pool.get_kv_buffer(0)
    kb.view(torch.uint8).fill_(0xA5)
    before = codes_of(kb)
    pool.set_kv_buffer(Layer(0), loc, k, k)
    expected = expected_cache(before, k, [4, 2], torch.float8_e5m2)
    assert_codes_equal(kb, expected, FORMAT_OF[torch.float8_e5m2], f"pool[{mode}] with loc strides {loc.stride()}")


def test_duplicate_slots_write_one_of_the_tokens():
    """Which token wins a duplicated slot is unspecified (docs/contract.md, "The write"); with one head
    and one block per row, as here, the row is one of them, whole."""
    k = torch.tensor([[[1.0, 2.0, 3.0]], [[-5.0, 0.25, 100.0]], [[7.0, 7.0, 7.0]]])
    loc = torch.tensor([2, 2, 0])
    writers = [kvpool.reference_set_kv_buffer] + ([kvpool.fused_fp8_set_kv_buffer] if INTERPRETER else [])
    for fn in writers:
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            kc = torch.full((4, 1, 3), float("nan"), dtype=dtype)
            vc = kc.clone()
            fn(k, k, kc, vc, loc, 0.5, 0.5)
            rows = q_codes(k, dtype, 0.5)
            got = codes_of(kc)
            assert any((got[2] == rows[t]).all() for t in (0, 1)), f"{fn.__name__} {dtype}: slot 2 = {got[2]}"
            assert (got[0] == rows[2]).all()
            assert (codes_of(kc[1]) == codes_of(torch.full((1, 3), float("nan"), dtype=dtype))).all()


# ----------------------------------------------------------------------------------------------
# The pool: fused="never" (reference path) and fused="always" (interpreter) against the oracle.


def _pool_example(ex: Example, start_layer: int, mode: str):
    size = ex.slots - 1  # buffers have size + page_size = slots rows with page_size 1
    pool = kvpool.MHATokenToKVPool(size, 1, ex.cache_dtype, ex.H, ex.D, 2, "cpu", v_head_dim=ex.Dv,
                                   start_layer=start_layer, fused=mode)
    return pool


@settings(max_examples=_examples(30), suppress_health_check=[HealthCheck.too_slow])
@given(ex=examples(max_T=7, dims=(1, 5, 16, 96), scale_tensor_dtypes=(torch.float32,), same_heads=True,
                   strided_loc=False),
       mode=st.sampled_from(["never", "always"] if INTERPRETER else ["never"]), start_layer=st.sampled_from([0, 3]),
       which=st.sampled_from([0, 1]), via_override=st.booleans())
def test_pool_write_equals_oracle(ex, mode, start_layer, which, via_override):
    with mock.patch.dict(os.environ):
        os.environ.pop("KVPOOL_FUSED", None)
        os.environ.pop("KVPOOL_VALIDATE", None)
        pool = _pool_example(ex, start_layer, mode)
    layer_id = start_layer + which
    other = start_layer + 1 - which
    bufs = {}
    for lid in (layer_id, other):
        kb, vb = pool.get_kv_buffer(lid)
        assert kb.dtype == ex.cache_dtype and tuple(kb.shape) == (ex.slots, ex.H, ex.D)
        assert tuple(vb.shape) == (ex.slots, ex.H, ex.Dv)
        kb.view(torch.uint8).fill_(ex.poison)
        vb.view(torch.uint8).fill_(ex.poison ^ 0x5A)
        bufs[lid] = (kb.clone(), vb.clone())
    snap = _snapshot(ex)
    before = dataclasses.replace(pool.stats, reasons=dict(pool.stats.reasons))
    if via_override:
        ret = pool.set_kv_buffer(None, ex.loc, ex.k, ex.v, ex.k_scale, ex.v_scale, layer_id_override=layer_id)
    else:
        ret = pool.set_kv_buffer(Layer(layer_id), ex.loc, ex.k, ex.v, ex.k_scale, ex.v_scale)
    assert ret is None
    _check_inputs_unchanged(ex, snap)
    fmt = FORMAT_OF[ex.cache_dtype]
    kb, vb = pool.get_kv_buffer(layer_id)
    exp_k = expected_cache(codes_of(bufs[layer_id][0]), ex.k, ex.loc.tolist(), ex.cache_dtype, ex.k_scale)
    exp_v = expected_cache(codes_of(bufs[layer_id][1]), ex.v, ex.loc.tolist(), ex.cache_dtype, ex.v_scale)
    assert_codes_equal(kb, exp_k, fmt, f"pool[{mode}] layer {layer_id} K; {ex!r}")
    assert_codes_equal(vb, exp_v, fmt, f"pool[{mode}] layer {layer_id} V; {ex!r}")
    named = {int(l) for l in ex.loc.tolist() if 0 <= int(l) < ex.slots}
    for slot in range(ex.slots):
        if slot not in named:
            assert_same_bytes(kb[slot], bufs[layer_id][0][slot], f"pool K untouched row {slot}")
            assert_same_bytes(vb[slot], bufs[layer_id][1][slot], f"pool V untouched row {slot}")
    ok, ov = pool.get_kv_buffer(other)
    assert_same_bytes(ok, bufs[other][0], f"pool K of the other layer {other}")
    assert_same_bytes(ov, bufs[other][1], f"pool V of the other layer {other}")
    # the path taken is the one asked for (T == 0 is a no-op that may take no path at all)
    stats = pool.stats
    if ex.T == 0:
        assert stats.fused_calls + stats.reference_calls <= before.fused_calls + before.reference_calls + 1
    elif mode == "always":
        assert stats.fused_calls == before.fused_calls + 1, stats
        assert stats.reference_calls == before.reference_calls, stats
    else:
        assert stats.reference_calls == before.reference_calls + 1, stats
        assert stats.fused_calls == before.fused_calls, stats


# ----------------------------------------------------------------------------------------------
# A deliberate grid of shapes (head dims around block sizes, many heads, many tokens), both paths.

# (id, T, H, D, Hv, Dv)
SHAPES = [
    ("T7-H3-D96", 7, 3, 96, 3, 96),
    ("T1-H1-D1", 1, 1, 1, 1, 1),
    ("T3-H2-D576-Dv512", 3, 2, 576, 2, 512),
    ("T2-H8-D128-Hv1", 2, 8, 128, 1, 128),
    ("T5-H4-D160-Hv2-Dv192", 5, 4, 160, 2, 192),
    ("T300-H1-D8", 300, 1, 8, 1, 8),
    ("T1-H32-D64", 1, 32, 64, 32, 64),
    ("T4-H2-D129-Dv127", 4, 2, 129, 2, 127),
]


@pytest.mark.parametrize("writer", ["reference", "fused_interp"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_shape_grid_equals_oracle(shape, cache_dtype, writer):
    skip_fused_without_interpreter(writer)
    _, T, H, D, Hv, Dv = shape
    rng = np.random.default_rng(T * 1000 + H * 10 + D)
    slots = T + 3
    perm = rng.permutation(slots)[:T]
    loc = [int(s) if rng.random() > 0.15 else int(rng.choice([-1, slots, slots + 7])) for s in perm]
    k, k_base = _make_input(rng, T, H, D, torch.bfloat16, "qkv_slice", "wide", -1, True)
    v, v_base = _make_input(rng, T, Hv, Dv, torch.float32, "tokens_last", "normal", 3, True)
    k_scale = 0.37
    v_scale = torch.tensor(rng.uniform(1.0, 16.0, Hv), dtype=torch.float32)
    ex = Example(T, H, D, Hv, Dv, torch.bfloat16, torch.float32, cache_dtype, slots,
                 torch.tensor(loc, dtype=torch.int32), torch.tensor(loc, dtype=torch.int32), k_scale, v_scale,
                 k, v, k_base, v_base, 0xFF)
    fn = {"reference": kvpool.reference_set_kv_buffer, "fused_interp": kvpool.fused_fp8_set_kv_buffer}[writer]
    _run_function(fn, ex, writer, "padded_head_dim", "every_other_slot")


@pytest.mark.parametrize("writer", ["reference", "fused_interp"])
def test_integer_python_scales_are_floats(writer):
    """A Python int scale is a number like any other: 3 divides like 3.0."""
    skip_fused_without_interpreter(writer)
    fn = {"reference": kvpool.reference_set_kv_buffer, "fused_interp": kvpool.fused_fp8_set_kv_buffer}[writer]
    x = torch.tensor([[[1.0, 3.0, 5.0, 1000.0, -7.0]]])
    kc = torch.zeros(2, 1, 5, dtype=torch.float8_e4m3fn)
    vc = torch.zeros(2, 1, 5, dtype=torch.float8_e4m3fn)
    fn(x, x, kc, vc, torch.tensor([1]), 3, 2)
    assert_codes_equal(kc[1:], q_codes(x, torch.float8_e4m3fn, 3.0), FORMAT_OF[torch.float8_e4m3fn], "k, scale 3")
    assert_codes_equal(vc[1:], q_codes(x, torch.float8_e4m3fn, 2.0), FORMAT_OF[torch.float8_e4m3fn], "v, scale 2")
