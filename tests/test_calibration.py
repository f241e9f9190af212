"""KV-scale calibration: ``observe_amax``, ``kv_amax``, ``reset_amax``, ``calibrated_scales``.

A pool that observes folds, per layer and head, the largest finite |k| and |v| of the tokens a write
stores into ``kv_amax``. A max involves no rounding, so the maxima are compared bit for bit with an
independent computation (NumPy over the tokens this test knows are written), on the fused path (the
kernel; under Triton's interpreter without CUDA) and on the reference path. Observation must not
change the bytes written, and a pool that does not observe must launch the kernel variant without
observation code. Also here: ``calibrated_scales`` against the contract's formula, and the observing
write inside ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvassert import (
    DEVICE,
    FORMAT_OF,
    Layer,
    assert_codes_equal,
    assert_same_bytes,
    bits,
    fused_runs,
    id_of,
    needs_interpreter,
    poison_pool_,
    q_codes_stored,
)
from kvpool import MHATokenToKVPool
from kvpool.kernels.store_kv import kernel as store_kv_kernel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


H, D, DV = 2, 8, 4
SIZE, PAGE = 20, 1
ROWS = SIZE + PAGE
START, LAYERS = 2, 3  # global layers 2, 3, 4
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
F32_MIN_NORMAL = 2.0**-126


def _pool(fused, dtype=torch.float8_e4m3fn, **kw) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(
        SIZE, PAGE, dtype, H, D, LAYERS, DEVICE, v_head_dim=DV, start_layer=START, fused=fused, warmup=False, **kw
    )
    return poison_pool_(pool)


class Expected:
    """The maxima kept here independently: [layers, 2, H] float32, folded with NumPy."""

    def __init__(self, heads: int = H, layers: int = LAYERS, start: int = START) -> None:
        self.amax = np.zeros((layers, 2, heads), dtype=np.float32)
        self.start = start

    def fold(self, layer_id: int, written: list[bool], k: torch.Tensor, v: torch.Tensor) -> None:
        for kv, x in ((0, k), (1, v)):
            a = np.abs(x.detach().float().cpu().numpy())  # [T, H, D], exact widening
            for t, w in enumerate(written):
                if not w:
                    continue
                for h in range(a.shape[1]):
                    finite = a[t, h][np.isfinite(a[t, h])]
                    if finite.size:
                        i = layer_id - self.start
                        self.amax[i, kv, h] = max(self.amax[i, kv, h], finite.max())

    def check(self, pool, what: str) -> None:
        assert pool.kv_amax is not None, what
        assert_same_bytes(pool.kv_amax.cpu(), torch.from_numpy(self.amax), f"{what}: kv_amax")


def _written(loc: list[int]) -> list[bool]:
    return [0 <= s < ROWS for s in loc]


def _values(t, heads, dim, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads, dim, generator=g) * scale
    return x.to(dtype).to(DEVICE)


def _both(**kw):
    return {fused: _pool(fused, **kw) for fused in ("always", "never")}


# --- a deliberate sequence of writes -------------------------------------------------------------


@fused_runs
@pytest.mark.parametrize("how", ["constructor", "method"])
def test_maxima_equal_an_independent_max_over_many_writes(how):
    pools = _both(observe_amax=True) if how == "constructor" else _both()
    if how == "method":
        for pool in pools.values():
            assert pool.kv_amax is None
            pool.observe_amax(True)
    exp = Expected()

    def write_all(layer_id, loc, k, v, ks=None, vs=None):
        for pool in pools.values():
            pool.set_kv_buffer(Layer(layer_id), torch.tensor(loc, device=DEVICE), k, v, ks, vs)
        exp.fold(layer_id, _written(loc), k, v)

    def check(what):
        for fused, pool in pools.items():
            exp.check(pool, f"{what} fused={fused}")
        for layer_id in range(START, START + LAYERS):
            for a, b in zip(pools["always"].get_kv_buffer(layer_id), pools["never"].get_kv_buffer(layer_id)):
                assert_same_bytes(a, b, f"{what}: layer {layer_id}")

    # 1. Padding and out-of-range slots carry the largest values: they must not count.
    loc = [3, -1, ROWS, 7, 2**40, 0]
    k = _values(6, H, D, torch.bfloat16, 1)
    v = _values(6, H, DV, torch.bfloat16, 2)
    for t in (1, 2, 4):
        k[t] = 3e4
        v[t] = -5e4
    k[0, 0, 0], k[3, 1, 2], v[5, 1, 0] = float("nan"), float("inf"), -float("inf")
    write_all(2, loc, k, v, 0.5, torch.tensor([2.0], device=DEVICE))
    check("padding and out-of-range")
    assert float(pools["never"].kv_amax[0].max()) < 3e4

    # 2. fp16 inputs with per-head scales into another layer (maxima are of the inputs, unscaled).
    k = _values(5, H, D, torch.float16, 3, scale=40.0)
    v = _values(5, H, DV, torch.float16, 4, scale=0.01)
    write_all(4, [1, 2, 3, 4, 5], k, v, torch.tensor([0.1, 9.0], device=DEVICE), None)
    check("fp16 with per-head scales")

    # 3. Head 0 only NaN and infinities (stays 0), head 1 only float32 subnormals and -0.
    k = torch.full((3, H, D), float("nan"), device=DEVICE)
    k[:, 0, ::2] = float("inf")
    k[:, 1] = torch.tensor([2.0**-149, -(2.0**-140), -0.0, 2.0**-130] * 2, device=DEVICE)
    write_all(3, [8, 9, 10], k, k[:, :, :DV].clone())
    check("specials and subnormals")
    assert float(pools["never"].kv_amax[1, 0, 0]) == 0.0
    assert float(pools["never"].kv_amax[1, 0, 1]) == 2.0**-130

    # 4. A verify write: uncommitted tokens hold huge values and must not count.
    loc_2d = torch.tensor([[11, 12, 13], [14, 15, -1]], device=DEVICE)
    commit = torch.tensor([1, 3], device=DEVICE, dtype=torch.int32)
    k = _values(6, H, D, torch.float32, 5)
    v = _values(6, H, DV, torch.float32, 6)
    for t in (1, 2):  # (0, 1), (0, 2): not committed
        k[t], v[t] = -1e6, 1e6
    v[5] = 7e5  # committed, but slot -1
    for pool in pools.values():
        pool.set_kv_buffer_prefix_valid(None, loc_2d, commit, k, v, layer_id_override=2)
    exp.fold(2, [True, False, False, True, True, False], k, v)
    check("verify write")
    assert float(pools["never"].kv_amax[0].max()) < 1e5

    # 5. More tokens than one program's block (several programs fold into the same heads), and
    # values smaller than the maxima so far in layer 4 K: the maxima must not drop.
    k = _values(300, H, D, torch.bfloat16, 7, scale=0.5)
    v = _values(300, H, DV, torch.bfloat16, 8, scale=100.0)
    # 20 distinct in-range slots spread over the token blocks; the rest padding or out of range.
    loc = [1 + i // 15 if i % 15 == 0 else (-1 - i if i % 2 else ROWS + i) for i in range(300)]
    write_all(4, loc, k, v, 1.5, 0.75)
    check("300 tokens")


# --- properties ----------------------------------------------------------------------------------


@st.composite
def write_sequences(draw):
    writes = []
    for _ in range(draw(st.integers(1, 3))):
        t = draw(st.integers(1, 6))
        loc = draw(st.lists(st.sampled_from([-3, -1, 0, 1, 5, 9, ROWS - 1, ROWS, ROWS + 4]), min_size=t, max_size=t))
        prefix = draw(st.booleans()) and t % 2 == 0
        commit = [draw(st.integers(-1, 3)) for _ in range(2)] if prefix else None
        writes.append(dict(
            layer_id=draw(st.integers(START, START + LAYERS - 1)), loc=loc, commit=commit,
            in_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
            magnitude=draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 6e4])),
            specials=draw(st.lists(st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0]), max_size=3)),
            seed=draw(st.integers(0, 1000)),
        ))  # fmt: skip
    return writes


@fused_runs
@settings(max_examples=25)
@given(write_sequences())
def test_maxima_property(writes):
    pools = _both(observe_amax=True)
    exp = Expected()
    for w in writes:
        t = len(w["loc"])
        k = _values(t, H, D, w["in_dtype"], w["seed"], w["magnitude"])
        v = _values(t, H, DV, w["in_dtype"], w["seed"] + 1, w["magnitude"] * 3)
        for i, s in enumerate(w["specials"]):
            k.view(-1)[(5 * i) % k.numel()] = s
            v.view(-1)[(3 * i) % v.numel()] = s
        if w["commit"] is None:
            for pool in pools.values():
                pool.set_kv_buffer(Layer(w["layer_id"]), torch.tensor(w["loc"], device=DEVICE), k, v)
            written = _written(w["loc"])
        else:
            width = t // 2
            loc_2d = torch.tensor(w["loc"], device=DEVICE).reshape(2, width)
            commit = torch.tensor(w["commit"], device=DEVICE)
            for pool in pools.values():
                pool.set_kv_buffer_prefix_valid(Layer(w["layer_id"]), loc_2d, commit, k, v)
            written = [_written(w["loc"])[i] and (i % width) < w["commit"][i // width] for i in range(t)]
        exp.fold(w["layer_id"], written, k, v)
    for fused, pool in pools.items():
        exp.check(pool, f"fused={fused}")


@fused_runs
def test_flat_plan_geometry_still_observes_per_head():
    """H=3, D=96 has a flat plan (a row as one "head"); observing writes must take the per-head
    plan, or every head's maximum would land in head 0."""
    h, d = 3, 96
    pools = {f: MHATokenToKVPool(8, 1, torch.float8_e4m3fn, h, d, 1, DEVICE, fused=f, observe_amax=True) for f in ("always", "never")}
    assert pools["always"]._writer.plan((h * d, d, 1), (h * d, d, 1), (0, 0), False, 4).row_view  # a row plan exists
    x = _values(4, h, d, torch.bfloat16, 9)
    x[:, 0] *= 100
    x[:, 2] *= 0.01
    exp = Expected(heads=h, layers=1, start=0)
    loc = [1, 2, -1, 4]
    for pool in pools.values():
        pool.set_kv_buffer(None, torch.tensor(loc, device=DEVICE), x, x * 2, layer_id_override=0)
    exp.fold(0, _written(loc), x, x * 2)
    for fused, pool in pools.items():
        exp.check(pool, f"flat geometry fused={fused}")


# --- observation off -----------------------------------------------------------------------------


class KernelSpy:
    """Wraps the Triton kernel object: records each launch's PREFIX/OBSERVE constants and launches
    the real kernel."""

    def __init__(self, real) -> None:
        self.real = real
        self.launches: list[tuple[bool, bool]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((bool(kwargs["PREFIX"]), bool(kwargs["OBSERVE"])))
            return self.real[grid](*args, **kwargs)

        return launch


@pytest.fixture
def spy(monkeypatch):
    spy = KernelSpy(store_kv_kernel.store_kv)
    monkeypatch.setattr(store_kv_kernel, "store_kv", spy)
    return spy


@needs_interpreter  # the spy sees JIT launches only; on a GPU most launches are direct
def test_observation_off_writes_identical_bytes_with_the_plain_variant(spy):
    never = _pool("always")
    toggled = _pool("always")
    from_ctor = _pool("always", observe_amax=True)
    x = _values(4, H, D, torch.bfloat16, 11, 10.0)
    y = _values(4, H, DV, torch.bfloat16, 12, 10.0)
    loc = torch.tensor([1, 5, -1, 9], device=DEVICE)
    loc_2d, commit = loc.reshape(2, 2), torch.tensor([1, 2], device=DEVICE)

    def writes(pool):
        pool.set_kv_buffer(Layer(3), loc, x, y, 0.25, None)
        pool.set_kv_buffer_prefix_valid(Layer(4), loc_2d, commit, x, y, None, 0.5)

    writes(never)
    assert spy.launches == [(False, False), (True, False)], "a pool that never observed launched an observing variant"
    toggled.observe_amax(True)
    writes(toggled)
    writes(from_ctor)
    assert spy.launches[2:] == [(False, True), (True, True)] * 2
    for pool in (toggled, from_ctor):
        seen = pool.kv_amax.clone()
        assert seen.any()
        pool.observe_amax(False)
        del spy.launches[:]
        writes(pool)
        assert spy.launches == [(False, False), (True, False)]
        assert torch.equal(bits(pool.kv_amax), bits(seen)), "maxima changed while not observing"
        for layer_id in range(START, START + LAYERS):
            for a, b in zip(pool.get_kv_buffer(layer_id), never.get_kv_buffer(layer_id)):
                assert_same_bytes(a, b, f"layer {layer_id}")


@fused_runs
def test_observing_writes_the_same_bytes_as_not_observing():
    plain, observing = _pool("always"), _pool("always", observe_amax=True)
    ref = _pool("never", observe_amax=True)
    x = _values(6, H, D, torch.float32, 13, 300.0)
    loc = torch.tensor([2, 3, 4, 5, ROWS, -2], device=DEVICE)
    for pool in (plain, observing, ref):
        pool.set_kv_buffer(None, loc, x, x[:, :, :DV], torch.tensor([0.7], device=DEVICE), 1.3, layer_id_override=START)
    for pool in (observing, ref):
        for a, b in zip(pool.get_kv_buffer(START), plain.get_kv_buffer(START)):
            assert_same_bytes(a, b, "observing vs plain")


def test_kv_amax_reset_and_arguments():
    pool = _pool("never")
    assert pool.kv_amax is None
    pool.reset_amax()  # never observed: nothing to reset, no error
    with pytest.raises(ValueError, match=r"enabled must be a bool, got 1"):
        pool.observe_amax(1)
    pool.observe_amax(True)
    amax = pool.kv_amax
    assert amax.shape == (LAYERS, 2, H) and amax.dtype == torch.float32 and amax.device == pool.device
    assert not amax.any()
    x = torch.full((2, H, D), -3.5, device=DEVICE)
    pool.set_kv_buffer(None, torch.tensor([1, 2], device=DEVICE), x, x[:, :, :DV] * 2, layer_id_override=3)
    assert amax[1].tolist() == [[3.5, 3.5], [7.0, 7.0]] and not amax[0].any() and not amax[2].any()
    ptr = amax.data_ptr()
    pool.reset_amax()
    assert pool.kv_amax is amax and amax.data_ptr() == ptr and not amax.any(), "reset is in place"
    pool.set_kv_buffer(None, torch.tensor([1], device=DEVICE), x[:1] / 7, x[:1, :, :DV], layer_id_override=3)
    assert amax[1].tolist() == [[0.5, 0.5], [3.5, 3.5]]
    pool.observe_amax(True)  # already on: keeps the maxima
    assert amax[1, 0, 0] == 0.5


# --- calibrated_scales ---------------------------------------------------------------------------


def _formula(amax: float, margin: float, fmax: float) -> float:
    """float32(amax * (margin / fmax)) computed in float64, floored at 2**-126."""
    return max(float(np.float32(np.float64(amax) * (np.float64(margin) / np.float64(fmax)))), F32_MIN_NORMAL)


AMAX_VALUES = [
    [[0.0, 1e-45], [448.0, 3.3]],  # layer 2: a never-observed head, a subnormal
    [[1e30, 3.4028234663852886e38], [0.1, 0.2]],  # layer 3: huge values
    [[57344.0, 1.0], [2.0**-126, 7.0]],  # layer 4
]


@pytest.mark.parametrize("margin", [1.0, 1.25, 0.5, 3])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=id_of)
def test_calibrated_scales_formula_shapes_and_layer_order(dtype, margin):
    pool = _pool("never", dtype=dtype, observe_amax=True)
    pool.kv_amax.copy_(torch.tensor(AMAX_VALUES, dtype=torch.float32))
    stored = pool.kv_amax.double().tolist()  # the float32 values actually held
    for per_head in (False, True):
        scales = pool.calibrated_scales(margin=margin, per_head=per_head)
        assert len(scales) == LAYERS
        for i, (ks, vs) in enumerate(scales):  # i = layer_id - START
            for kv, s in ((0, ks), (1, vs)):
                assert s.dtype == torch.float32 and s.device == pool.device
                heads = stored[i][kv]
                if per_head:
                    assert s.shape == (H,)
                    expected = [_formula(a, margin, FMAX[dtype]) for a in heads]
                else:
                    assert s.shape == (1,)
                    expected = [_formula(max(heads), margin, FMAX[dtype])]
                assert s.tolist() == expected, (i, kv, per_head)
    assert pool.calibrated_scales()[0][0].item() == _formula(1e-45, 1.0, FMAX[dtype])


def test_calibrated_scales_of_a_16_bit_pool_need_an_fp8_dtype():
    pool = _pool("never", dtype=torch.bfloat16, observe_amax=True)
    x = torch.full((1, H, D), 44.8, device=DEVICE)
    pool.set_kv_buffer(None, torch.tensor([1], device=DEVICE), x, x[:, :, :DV], layer_id_override=START)
    with pytest.raises(ValueError, match=r"dtype must be an FP8 format .*got torch.bfloat16 \(the pool's own dtype; pass dtype=\.\.\.\)"):
        pool.calibrated_scales()
    with pytest.raises(ValueError, match=r"dtype must be an FP8 format .*got torch.float16$"):
        pool.calibrated_scales(dtype=torch.float16)
    ks, vs = pool.calibrated_scales(dtype=torch.float8_e5m2)[0]
    amax = float(np.float32(44.8))  # the input's maximum (float32), not the stored bf16 value
    assert ks.item() == vs.item() == _formula(amax, 1.0, 57344.0)


@pytest.mark.parametrize("margin", [0, 0.0, -1.0, math.inf, math.nan, True, "1", None])
def test_calibrated_scales_reject_bad_margins(margin):
    pool = _pool("never", observe_amax=True)
    with pytest.raises(ValueError, match=rf"margin must be a positive finite number, got {margin!r}"):
        pool.calibrated_scales(margin=margin)


def test_calibrated_scales_reject_bad_per_head_and_unobserved_pools():
    with pytest.raises(ValueError, match=r"calibrated_scales needs observed maxima"):
        _pool("never").calibrated_scales()
    with pytest.raises(ValueError, match=r"per_head must be a bool, got 1"):
        _pool("never", observe_amax=True).calibrated_scales(per_head=1)


@fused_runs
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=id_of)
def test_calibrated_scales_work_when_passed_back(dtype, per_head):
    """Calibrate on data, then write the same data with the scales: both paths agree, the bytes
    are q(x, scale), and each observed maximum lands exactly on +-fmax (the range is used)."""
    data = {
        START: (_values(5, H, D, torch.bfloat16, 21, 900.0), _values(5, H, DV, torch.bfloat16, 22, 0.02)),
        START + 2: (_values(5, H, D, torch.bfloat16, 23, 3.0), _values(5, H, DV, torch.bfloat16, 24, 1e4)),
    }
    data[START][0][:, 1] *= 50  # heads of different ranges
    loc = torch.tensor([1, 2, 3, 4, 5], device=DEVICE)
    calib = {f: _pool(f, dtype=dtype, observe_amax=True) for f in ("always", "never")}
    for pool in calib.values():
        for layer_id, (k, v) in data.items():
            pool.set_kv_buffer(Layer(layer_id), loc, k, v)
    assert torch.equal(bits(calib["always"].kv_amax), bits(calib["never"].kv_amax))
    scales = calib["never"].calibrated_scales(per_head=per_head)
    pools = _both(dtype=dtype)
    for pool in pools.values():
        for layer_id, (k, v) in data.items():
            ks, vs = scales[layer_id - START]
            pool.set_kv_buffer(Layer(layer_id), loc, k, v, ks, vs)
    for layer_id, (k, v) in data.items():
        ks, vs = scales[layer_id - START]
        for a, b in zip(pools["always"].get_kv_buffer(layer_id), pools["never"].get_kv_buffer(layer_id)):
            assert_same_bytes(a, b, f"layer {layer_id}")
        for x, s, buf in ((k, ks, pools["never"].get_key_buffer(layer_id)), (v, vs, pools["never"].get_value_buffer(layer_id))):
            assert_codes_equal(buf[1:6], q_codes_stored(x, dtype, s), FORMAT_OF[dtype], f"layer {layer_id} vs q(x, s)",
                               nan_equal=False)
            stored = buf[1:6].float().abs()
            peak = stored.amax(dim=(0, 2)) if per_head else stored.max().reshape(1)
            assert peak.tolist() == [FMAX[dtype]] * peak.numel(), "the observed maximum must map to fmax"


# --- compiled callers ----------------------------------------------------------------------------


def _step(pool, layers):
    def step(x, loc, scale):
        total = x.new_zeros(())
        for layer in layers:
            pool.set_kv_buffer(layer, loc, x * (layer.layer_id - 1), x[:, :, :DV] - layer.layer_id, scale, None)
            total = total + pool.get_key_buffer(layer.layer_id)[loc.clamp(0, ROWS - 1)].float().sum()
        return total

    return step


def test_fullgraph_compile_observes_like_eager():
    """torch.compile(fullgraph=True) of a function writing two layers while the pool observes:
    the same bytes and the same maxima as eager, over two calls; then observation turned off and
    on again between calls is honoured by the compiled function."""
    torch._dynamo.reset()
    layers = [Layer(2), Layer(4)]
    compiled_pool, eager_pool = (_pool("auto", observe_amax=True) for _ in range(2))
    scale = torch.tensor([0.37], device=DEVICE)
    step = torch.compile(_step(compiled_pool, layers), fullgraph=True, backend="aot_eager")
    eager = _step(eager_pool, layers)
    loc = torch.tensor([1, 9, -1, 33, 20], device=DEVICE)

    def run(seed, what):
        x = _values(5, H, D, torch.float32, seed, 50.0)
        x[0, 0, 0] = float("nan")
        out, expected = step(x, loc, scale), eager(x, loc, scale)
        assert torch.equal(out, expected) or (out.isnan() and expected.isnan()), what
        assert_same_bytes(compiled_pool.kv_amax, eager_pool.kv_amax, f"{what}: kv_amax")
        for layer in layers:
            for a, b in zip(compiled_pool.get_kv_buffer(layer.layer_id), eager_pool.get_kv_buffer(layer.layer_id)):
                assert_same_bytes(a, b, f"{what}: layer {layer.layer_id}")

    run(1, "first call")
    assert compiled_pool.kv_amax.any() and not compiled_pool.kv_amax[1].any()
    run(2, "second call")
    for pool in (compiled_pool, eager_pool):
        pool.observe_amax(False)
        pool.reset_amax()
    run(3, "observation off")
    assert not compiled_pool.kv_amax.any(), "the compiled function kept observing after observe_amax(False)"
    for pool in (compiled_pool, eager_pool):
        pool.observe_amax(True)
    run(4, "observation on again")
    assert compiled_pool.kv_amax.any(), "the compiled function did not observe after observe_amax(True)"


def test_calibrated_scales_stay_finite_for_an_absurd_margin():
    """A margin that would overflow float32 gives FLT_MAX, a scale set_kv_buffer accepts."""
    pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, 1, 8, 1, "cpu", fused="never", observe_amax=True)
    pool.set_kv_buffer(None, torch.tensor([1]), torch.full((1, 1, 8), 3.0e38), torch.full((1, 1, 8), 3.0e38), layer_id_override=0)
    (k, v), = pool.calibrated_scales(margin=1e300)
    assert float(k) == torch.finfo(torch.float32).max and float(v) == torch.finfo(torch.float32).max
