"""Bad input raises a clear error (argument, expected value, actual value) and writes nothing
(docs/contract.md, "Bad input").

Every case runs against ``reference_set_kv_buffer``, ``fused_fp8_set_kv_buffer`` (Triton interpreter on
CPU) and ``MHATokenToKVPool.set_kv_buffer``. The base call is valid and names real slots, so a write
that happens before the error shows up in the byte snapshots of the caches / pool buffers. A tensor
on ``torch.device("meta")`` stands in for "a tensor on another device".
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable
from unittest import mock

import numpy as np
import pytest
import torch

import kvpool
from kvassert import INTERPRETER, skip_fused_without_interpreter
from oracle import FORMAT_OF, assert_bytes_unchanged, assert_codes_equal, codes_of, expected_cache

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# The base call: T=5 tokens, K [5, 2, 8], V [5, 3, 6] (H != Hv, D != Dv so every number is distinct).
T, H, D, HV, DV = 5, 2, 8, 3, 6
PAGE = 4
SIZE = 8
SLOTS = SIZE + PAGE  # 12 rows per buffer
START, LAYERS = 4, 3  # the pool holds global layers 4, 5, 6
LAYER = 5
CACHE_DTYPE = torch.float8_e4m3fn
BASE_LOC = [1, 5, -1, 7, 10]
GUARD = 2
META = torch.device("meta")
POOL_NAMES = {"k": "cache_k", "v": "cache_v", "cache_loc": "loc"}


@dataclasses.dataclass
class Layer:
    layer_id: Any


def _base_args(hv: int = HV) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(
        k=torch.randn(T, H, D, generator=g).to(torch.bfloat16),
        v=torch.randn(T, hv, DV, generator=g).to(torch.bfloat16),
        cache_loc=torch.tensor(BASE_LOC, dtype=torch.int64),
        k_scale=0.5,
        v_scale=torch.tensor([0.25]),
        layer=Layer(LAYER),
        layer_id_override=None,
    )


# ----------------------------------------------------------------------------------------------
# Targets: the two functions (caller-owned, guarded caches) and the pool.


class FunctionTarget:
    hv = HV  # caller-owned caches may have H != Hv

    def __init__(self, fn: Callable, validate: bool = False, cache_dtype=CACHE_DTYPE):
        self.fn, self.validate = fn, validate
        self.k_outer = torch.empty(SLOTS + 2 * GUARD, H, D, dtype=cache_dtype)
        self.v_outer = torch.empty(SLOTS + 2 * GUARD, HV, DV, dtype=cache_dtype)
        self.k_outer.view(torch.uint8).fill_(0xA5)
        self.v_outer.view(torch.uint8).fill_(0x5A)
        self.k_cache = self.k_outer[GUARD:GUARD + SLOTS]
        self.v_cache = self.v_outer[GUARD:GUARD + SLOTS]

    def name(self, arg: str) -> str:
        return arg

    def snapshot(self):
        return [self.k_outer.clone(), self.v_outer.clone()]

    def current(self):
        return [self.k_outer, self.v_outer]

    def call(self, a: dict) -> None:
        kc = a.get("k_cache", self.k_cache)
        vc = a.get("v_cache", self.v_cache)
        return self.fn(a["k"], a["v"], kc, vc, a["cache_loc"], a["k_scale"], a["v_scale"], validate=self.validate)


class PoolTarget:
    hv = H  # the pool has head_num heads for K and V

    def __init__(self, mode: str, validate: bool = False, env_validate: bool = False, cache_dtype=CACHE_DTYPE):
        env = {"KVPOOL_VALIDATE": "1"} if env_validate else {}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("KVPOOL_FUSED", None)
            if not env_validate:
                os.environ.pop("KVPOOL_VALIDATE", None)
            self.pool = kvpool.MHATokenToKVPool(SIZE, PAGE, cache_dtype, H, D, LAYERS, "cpu", v_head_dim=DV,
                                                start_layer=START, fused=mode, validate=validate)
        for lid in range(START, START + LAYERS):
            kb, vb = self.pool.get_kv_buffer(lid)
            kb.view(torch.uint8).fill_(0xA5 ^ lid)
            vb.view(torch.uint8).fill_(0x5A ^ lid)

    def name(self, arg: str) -> str:
        return POOL_NAMES.get(arg, arg)

    def buffers(self):
        out = []
        for lid in range(START, START + LAYERS):
            out.extend(self.pool.get_kv_buffer(lid))
        return out

    def snapshot(self):
        return [b.clone() for b in self.buffers()]

    def current(self):
        return self.buffers()

    def call(self, a: dict) -> None:
        return self.pool.set_kv_buffer(a["layer"], a["cache_loc"], a["k"], a["v"], a["k_scale"], a["v_scale"],
                                       layer_id_override=a["layer_id_override"])


TARGETS = {
    "reference": lambda: FunctionTarget(kvpool.reference_set_kv_buffer),
    "fused_interp": lambda: FunctionTarget(kvpool.fused_fp8_set_kv_buffer),
    "pool_never": lambda: PoolTarget("never"),
    "pool_always": lambda: PoolTarget("always"),
}
FUNCTION_TARGETS = ["reference", "fused_interp"]
POOL_TARGETS = ["pool_never", "pool_always"]


# ----------------------------------------------------------------------------------------------
# The cases.


@dataclasses.dataclass
class Bad:
    id: str
    change: Callable[[dict], None]
    exc: tuple
    names: tuple  # the error must name one of these arguments (function spelling; mapped for the pool)
    expected: Any  # regex of the expected value (or a function of the target giving it)
    actual: Any  # regex of the actual value (or a function of the target)
    targets: tuple = tuple(TARGETS)


def _set(**kw) -> Callable[[dict], None]:
    def change(a: dict) -> None:
        for key, val in kw.items():
            a[key] = val(a) if callable(val) and not isinstance(val, torch.Tensor) else val
    return change


def _num(n) -> str:
    return rf"(?<![\d.]){re.escape(str(n))}(?![\d.])"


VE = (ValueError,)
VTE = (ValueError, TypeError)
SHAPE, NDIM_3 = VE, r"3-?D|3 dim|ndim\D{0,4}3|\[T, ?\w+, ?\w+\]"

# fmt: off
CASES = [
    # wrong ndim
    Bad("k_2d", _set(k=lambda a: a["k"][:, 0]), SHAPE, ("k",), NDIM_3, r"\(5, 8\)|2-?D"),
    Bad("k_4d", _set(k=lambda a: a["k"][None]), SHAPE, ("k",), NDIM_3, r"\(1, 5, 2, 8\)|4-?D"),
    Bad("v_2d", _set(v=lambda a: a["v"][:, :, 0]), SHAPE, ("v",), NDIM_3, lambda t: rf"\(5, {t.hv}\)|2-?D"),
    # wrong head count / head dim
    Bad("k_heads_7", _set(k=torch.ones(T, 7, D, dtype=torch.bfloat16)), SHAPE, ("k",), _num(H), _num(7)),
    Bad("k_head_dim_9", _set(k=torch.ones(T, H, 9, dtype=torch.bfloat16)), SHAPE, ("k",), _num(D), _num(9)),
    Bad("v_heads_7", _set(v=torch.ones(T, 7, DV, dtype=torch.bfloat16)), SHAPE, ("v",), lambda t: _num(t.hv), _num(7)),
    Bad("v_head_dim_9", _set(v=lambda a: torch.ones(T, a["v"].shape[1], 9, dtype=torch.bfloat16)), SHAPE, ("v",),
        _num(DV), _num(9)),
    Bad("v_with_k_heads", _set(v=torch.ones(T, H, DV, dtype=torch.bfloat16)), SHAPE, ("v",), _num(HV), _num(H),
        targets=tuple(FUNCTION_TARGETS)),
    # T differing between k, v and loc
    Bad("v_T_4", _set(v=lambda a: a["v"][:4]), SHAPE, ("v", "k"), _num(5), _num(4)),
    Bad("k_T_4", _set(k=lambda a: a["k"][:4]), SHAPE, ("k", "v", "cache_loc"), _num(4), _num(5)),
    Bad("loc_T_6", _set(cache_loc=torch.tensor(BASE_LOC + [2])), SHAPE, ("cache_loc",), _num(5), _num(6)),
    Bad("loc_T_4", _set(cache_loc=torch.tensor(BASE_LOC[:4])), SHAPE, ("cache_loc",), _num(5), _num(4)),
    # loc dtype / ndim
    Bad("loc_float32", _set(cache_loc=torch.tensor(BASE_LOC, dtype=torch.float32)), VTE, ("cache_loc",), r"int32|int64|integer", r"float32"),
    Bad("loc_float64", _set(cache_loc=torch.tensor(BASE_LOC, dtype=torch.float64)), VTE, ("cache_loc",), r"int32|int64|integer", r"float64"),
    Bad("loc_bool", _set(cache_loc=torch.tensor([True, False, True, True, False])), VTE, ("cache_loc",), r"int32|int64|integer", r"bool"),
    Bad("loc_int16", _set(cache_loc=torch.tensor(BASE_LOC, dtype=torch.int16)), VTE, ("cache_loc",), r"int32|int64", r"int16"),
    Bad("loc_2d", _set(cache_loc=torch.tensor([BASE_LOC])), SHAPE, ("cache_loc",), r"1-?D|\[T\]|ndim\D{0,4}1", r"\(1, 5\)|2-?D"),
    Bad("loc_2d_column", _set(cache_loc=torch.tensor(BASE_LOC)[:, None]), SHAPE, ("cache_loc",), r"1-?D|\[T\]|ndim\D{0,4}1", r"\(5, 1\)|2-?D"),
    # non-float input dtypes
    Bad("k_int32", _set(k=torch.ones(T, H, D, dtype=torch.int32)), VTE, ("k",), r"bfloat16|float16|float32|floating", r"int32"),
    Bad("k_bool", _set(k=torch.ones(T, H, D, dtype=torch.bool)), VTE, ("k",), r"bfloat16|float16|float32|floating", r"bool"),
    Bad("k_fp8_e4m3", _set(k=torch.zeros(T, H, D, dtype=torch.float8_e4m3fn)), VTE, ("k",), r"bfloat16|float16|float32", r"float8_e4m3fn"),
    Bad("v_fp8_e5m2", _set(v=lambda a: torch.zeros(a["v"].shape, dtype=torch.float8_e5m2)), VTE, ("v",), r"bfloat16|float16|float32", r"float8_e5m2"),
    Bad("v_int64", _set(v=lambda a: torch.ones(a["v"].shape, dtype=torch.int64)), VTE, ("v",), r"bfloat16|float16|float32|floating", r"int64"),
    Bad("v_uint8", _set(v=lambda a: torch.ones(a["v"].shape, dtype=torch.uint8)), VTE, ("v",), r"bfloat16|float16|float32|floating", r"uint8"),
    # another device
    Bad("k_meta", _set(k=torch.empty(T, H, D, dtype=torch.bfloat16, device=META)), VE, ("k",), r"cpu", r"meta"),
    Bad("v_meta", _set(v=lambda a: torch.empty(a["v"].shape, dtype=torch.bfloat16, device=META)), VE, ("v",), r"cpu", r"meta"),
    Bad("loc_meta", _set(cache_loc=torch.empty(T, dtype=torch.int64, device=META)), VE, ("cache_loc",), r"cpu", r"meta"),
    Bad("k_scale_meta", _set(k_scale=torch.empty(1, device=META)), VE, ("k_scale",), r"cpu", r"meta"),
    Bad("v_scale_meta_per_head", _set(v_scale=lambda a: torch.empty(a["v"].shape[1], device=META)), VE, ("v_scale",), r"cpu", r"meta"),
    Bad("k_cache_meta", _set(k_cache=torch.empty(SLOTS, H, D, dtype=CACHE_DTYPE, device=META)), VE,
        ("k_cache", "v_cache", "k", "v", "cache_loc"), r"cpu|meta", r"cpu|meta", targets=tuple(FUNCTION_TARGETS)),
    # python float scales (also ints): <= 0, non-finite, not a normal float32
    *[Bad(f"{which}_float_{name}", _set(**{which: val}), VE, (which,), r"positive", re.escape(repr(val)))
      for which in ("k_scale", "v_scale")
      for name, val in [("0.0", 0.0), ("-0.0", -0.0), ("-1.0", -1.0), ("nan", math.nan), ("inf", math.inf),
                        ("-inf", -math.inf), ("1e39_f32_inf", 1e39), ("1e-45_f32_subnormal", 1e-45),
                        ("1e-40_f32_subnormal", 1e-40), ("int_0", 0), ("int_-2", -2)]],
    Bad("k_scale_bool", _set(k_scale=True), (TypeError,), ("k_scale",), r"float|tensor", r"bool"),
    Bad("v_scale_str", _set(v_scale="0.5"), (TypeError,), ("v_scale",), r"float|tensor", r"str"),
    # tensor scales: not floating, or neither per-tensor nor per-head
    Bad("k_scale_int64_tensor", _set(k_scale=torch.tensor(1)), VTE, ("k_scale",), r"float", r"int64"),
    Bad("v_scale_int32_per_head", _set(v_scale=lambda a: torch.ones(a["v"].shape[1], dtype=torch.int32)), VTE, ("v_scale",), r"float", r"int32"),
    Bad("k_scale_bool_tensor", _set(k_scale=torch.tensor([True])), VTE, ("k_scale",), r"float", r"bool"),
    Bad("k_scale_complex", _set(k_scale=torch.ones(1, dtype=torch.complex64)), VTE, ("k_scale",), r"float", r"complex64"),
    Bad("k_scale_shape_H+1", _set(k_scale=torch.ones(H + 1)), VE, ("k_scale",), _num(H), r"\(3,\)"),
    Bad("k_scale_shape_2x2", _set(k_scale=torch.ones(2, 2)), VE, ("k_scale",), _num(H), r"\(2, 2\)"),
    Bad("k_scale_shape_1xH", _set(k_scale=torch.ones(1, H)), VE, ("k_scale",), _num(H), r"\(1, 2\)"),
    Bad("k_scale_shape_Hx1x1", _set(k_scale=torch.ones(H, 1, 1)), VE, ("k_scale",), _num(H), r"\(2, 1, 1\)"),
    Bad("k_scale_empty", _set(k_scale=torch.ones(0)), VE, ("k_scale",), r"one|1|" + _num(H), r"\(0,\)"),
    Bad("v_scale_k_heads", _set(v_scale=torch.ones(H)), VE, ("v_scale",), _num(HV), r"\(2,\)",
        targets=tuple(FUNCTION_TARGETS)),
    Bad("v_scale_shape_Hvx2", _set(v_scale=lambda a: torch.ones(a["v"].shape[1], 2)), VE, ("v_scale",),
        lambda t: _num(t.hv), lambda t: rf"\({t.hv}, 2\)"),
]

LAYER_CASES = [
    *[Bad(f"layer_id_{lid}", _set(layer=Layer(lid)), (IndexError,), ("layer_id", "layer"), r"4\D{1,6}6", _num(lid),
          targets=tuple(POOL_TARGETS))
      for lid in (0, 3, 7, 100, -1, -3)],
    *[Bad(f"override_{lid}", _set(layer=None, layer_id_override=lid), (IndexError,), ("layer_id", "layer_id_override"),
          r"4\D{1,6}6", _num(lid), targets=tuple(POOL_TARGETS))
      for lid in (0, -2, 7)],
    Bad("override_out_of_range_wins_over_valid_layer", _set(layer=Layer(LAYER), layer_id_override=2), (IndexError,),
        ("layer_id", "layer_id_override"), r"4\D{1,6}6", _num(2), targets=tuple(POOL_TARGETS)),
    Bad("layer_none_without_override", _set(layer=None), (TypeError,), ("layer", "layer_id_override", "layer_id"),
        r"layer_id|override", r"None|neither", targets=tuple(POOL_TARGETS)),
]
# fmt: on


def _message_checks(err: BaseException, case: Bad, target) -> None:
    msg = str(err)
    names = [target.name(n) for n in case.names]
    assert any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", msg) for n in names), (
        f"message does not name any of {names}: {msg!r}")
    expected = case.expected(target) if callable(case.expected) else case.expected
    actual = case.actual(target) if callable(case.actual) else case.actual
    assert re.search(expected, msg), f"message lacks the expected value /{expected}/: {msg!r}"
    assert re.search(actual, msg), f"message lacks the actual value /{actual}/: {msg!r}"


def _run_bad(case: Bad, target_name: str) -> None:
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = _base_args(target.hv)
    case.change(a)
    inputs = {k: v for k, v in a.items() if isinstance(v, torch.Tensor) and v.device != META}
    inputs_before = {k: v.clone() for k, v in inputs.items()}
    before = target.snapshot()
    with pytest.raises(case.exc) as info:
        target.call(a)
    _message_checks(info.value, case, target)
    for b, now in zip(before, target.current()):
        assert_bytes_unchanged(b, now, f"{target_name}: cache/buffer after rejected call {case.id}")
    for k, v in inputs.items():
        assert_bytes_unchanged(inputs_before[k], v, f"input {k} after rejected call {case.id}")


def _pairs(cases):
    return [pytest.param(c, t, id=f"{c.id}-{t}") for c in cases for t in c.targets]


@pytest.mark.parametrize("case, target_name", _pairs(CASES))
def test_bad_input_rejected_named_and_nothing_written(case, target_name):
    _run_bad(case, target_name)


@pytest.mark.parametrize("case, target_name", _pairs(LAYER_CASES))
def test_bad_layer_rejected_named_and_nothing_written(case, target_name):
    _run_bad(case, target_name)


def test_base_call_is_valid_and_writes():
    """The base call of every bad case is good: it writes rows 1, 5, 7 and 10 (so a partial write
    before an error would show up in the snapshots above)."""
    for name in TARGETS:
        if not INTERPRETER and ("fused" in name or "always" in name):
            continue
        target = TARGETS[name]()
        before = target.snapshot()
        a = _base_args(target.hv)
        assert target.call(a) is None
        changed = [not torch.equal(b.view(torch.uint8), n.view(torch.uint8)) for b, n in zip(before, target.current())]
        assert any(changed), f"{name}: the base call wrote nothing"
        if isinstance(target, FunctionTarget):
            exp = expected_cache(codes_of(before[0][GUARD:GUARD + SLOTS]), a["k"], BASE_LOC, CACHE_DTYPE, 0.5)
            assert_codes_equal(target.k_cache, exp, FORMAT_OF[CACHE_DTYPE], f"{name} base call")


@pytest.mark.parametrize("getter", ["get_key_buffer", "get_value_buffer", "get_kv_buffer"])
@pytest.mark.parametrize("lid", [0, 3, 7, -1, -3, 100])
def test_getters_reject_layer_ids_outside_the_pool(getter, lid):
    """A layer id outside [start_layer, end_layer] is an error, never a wrapped list index
    (docs/contract.md, "Pools")."""
    pool = PoolTarget("never").pool
    with pytest.raises(IndexError) as info:
        getattr(pool, getter)(lid)
    assert re.search(_num(lid), str(info.value)) and re.search(r"4\D{1,6}6", str(info.value)), str(info.value)


@pytest.mark.parametrize("target_name", POOL_TARGETS)
def test_layer_id_override_takes_precedence(target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    before = target.snapshot()
    a = _base_args(target.hv)
    a["layer"], a["layer_id_override"] = Layer(4), 6
    target.call(a)
    after = target.current()
    # buffers are listed per layer: 4 (K, V), 5 (K, V), 6 (K, V)
    for i in range(4):
        assert_bytes_unchanged(before[i], after[i], f"layer {START + i // 2} (not the override)")
    exp = expected_cache(codes_of(before[4]), a["k"], BASE_LOC, CACHE_DTYPE, 0.5)
    assert_codes_equal(after[4], exp, FORMAT_OF[CACHE_DTYPE], "override layer 6 K")


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
    a = _base_args(target.hv)
    a["cache_loc"] = torch.tensor(loc, dtype=dtype)
    before = target.snapshot()
    with pytest.raises(IndexError) as info:
        target.call(a)
    msg = str(info.value)
    assert re.search(_num(val), msg), f"slot value {val} not in message: {msg!r}"
    assert re.search(rf"\[{pos}\]|position {pos}|index {pos}|entry {pos}", msg), f"position {pos} not in: {msg!r}"
    assert re.search(rf"(?<!\w){re.escape(target.name('cache_loc'))}(?!\w)", msg), msg
    for b, n in zip(before, target.current()):
        assert_bytes_unchanged(b, n, f"{target_name}: buffers after rejected loc {loc}")


@pytest.mark.parametrize("target_name", list(VALIDATING))
def test_validate_accepts_padding_and_valid_slots(target_name, monkeypatch):
    """validate is not stricter than the spec: negative slots and slots < size + page_size pass."""
    target = _validating_target(target_name, monkeypatch)
    a = _base_args(target.hv)
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
    a = _base_args(target.hv)
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
        assert_bytes_unchanged(b, n, f"{target_name}: buffers after rejected scale")
    assert_bytes_unchanged(scale_before, scale, "scale tensor")


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
            assert_bytes_unchanged(before[gr], outer[gr], f"{target_name}: guard row {gr}")
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
    a = dict(_base_args(H), k=k, v=v, cache_loc=torch.tensor(OOR_SKIP_LOC), layer=Layer(4), k_scale=None, v_scale=None)
    target.call(a)
    after = target.current()
    fmt = FORMAT_OF[CACHE_DTYPE]
    assert_codes_equal(after[0], expected_cache(codes_of(before[0]), k, OOR_SKIP_LOC, CACHE_DTYPE), fmt, "layer 4 K")
    assert_codes_equal(after[1], expected_cache(codes_of(before[1]), v, OOR_SKIP_LOC, CACHE_DTYPE), fmt, "layer 4 V")
    for i in range(2, 6):
        assert_bytes_unchanged(before[i], after[i], f"{target_name}: buffer {i} of layers 5..6")


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
    a = _base_args()
    a["k_scale"] = scale
    try:
        target.call(a)
    except (ValueError, TypeError) as err:
        assert "k_scale" in str(err), str(err)
        for b, n in zip(before, target.current()):
            assert_bytes_unchanged(b, n, "buffers after a rejected scale")
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
    a = _base_args(target.hv)
    a["k_scale"], a["v_scale"] = None, None
    a[which] = value
    before = target.snapshot()
    try:
        target.call(a)
    except ValueError as err:
        assert re.search(rf"(?<!\w){which}(?!\w)", str(err)), str(err)
        for b, n in zip(before, target.current()):
            assert_bytes_unchanged(b, n, f"{target_name}: buffers after rejected {which}={value!r}")
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


# ----------------------------------------------------------------------------------------------
# T == 0 is a no-op only for good input: bad input is still rejected.

# fmt: off
EMPTY_CASES = [
    ("loc_float", dict(cache_loc=torch.zeros(0)), VTE, "cache_loc"),
    ("k_heads", dict(k=torch.zeros(0, 7, D)), VE, "k"),
    ("v_head_dim", dict(v=lambda hv: torch.zeros(0, hv, 9)), VE, "v"),
    ("k_int", dict(k=torch.zeros(0, H, D, dtype=torch.int32)), VTE, "k"),
    ("v_meta", dict(v=lambda hv: torch.zeros(0, hv, DV, device=META)), VE, "v"),
    ("k_scale_negative", dict(k_scale=-1.0), VE, "k_scale"),
    ("v_scale_shape", dict(v_scale=torch.ones(5)), VE, "v_scale"),
    ("loc_T_1", dict(cache_loc=torch.tensor([1])), VE, "cache_loc"),
]
# fmt: on


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("case", EMPTY_CASES, ids=[c[0] for c in EMPTY_CASES])
def test_bad_input_rejected_when_T_is_0(case, target_name):
    _, change, exc, name = case
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = dict(_base_args(target.hv), k=torch.zeros(0, H, D), v=torch.zeros(0, target.hv, DV),
             cache_loc=torch.zeros(0, dtype=torch.int64))
    for key, val in change.items():
        a[key] = val(target.hv) if callable(val) else val
    before = target.snapshot()
    with pytest.raises(exc) as info:
        target.call(a)
    assert re.search(rf"(?<![\w.]){re.escape(target.name(name))}(?!\w)", str(info.value)), str(info.value)
    for b, n in zip(before, target.current()):
        assert_bytes_unchanged(b, n, f"{target_name}: buffers after rejected empty call")


# ----------------------------------------------------------------------------------------------
# The fused path refuses what its gate refuses (docs/contract.md, "The gate"), before writing.


@pytest.mark.parametrize("target_name", ["fused_interp", "pool_always"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_fused_refuses_non_float32_scale_tensor_without_writing(scale_dtype, target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = _base_args(target.hv)
    a["v_scale"] = torch.tensor([0.25], dtype=scale_dtype)
    before = target.snapshot()
    with pytest.raises(kvpool.FusedPathUnavailable) as info:
        target.call(a)
    assert "v_scale" in str(info.value) and str(scale_dtype).split(".")[-1] in str(info.value), str(info.value)
    for b, n in zip(before, target.current()):
        assert_bytes_unchanged(b, n, f"{target_name}: buffers after the gate refused")
