"""Bad input to the write (docs/contract.md, "Bad input"): a clear error naming the argument, the
expected and the actual value, and nothing written.

Every case runs against ``reference_set_kv_buffer``, ``fused_fp8_set_kv_buffer`` (Triton's
interpreter on CPU) and ``MHATokenToKVPool.set_kv_buffer`` (``kvassert``'s write targets and base
call): shapes, dtypes, devices and scales, layer ids outside the pool, bad input with zero tokens, and
the fused path refusing what its gate refuses.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

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
    INTERPRETER,
    LAYER,
    Layer,
    META,
    POOL_TARGETS,
    PoolTarget,
    SLOTS,
    START,
    T,
    TARGETS,
    assert_codes_equal,
    assert_same_bytes,
    base_args,
    codes_of,
    expected_cache,
    skip_fused_without_interpreter,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ==============================================================================================
# Bad input.
# Every case runs against the two functions and the pool. The base call is valid and names real
# slots, so a write that happens before the error shows up in the byte snapshots of the caches or
# pool buffers. A tensor on ``torch.device("meta")`` is "a tensor on another device".

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


def exact_number(n) -> str:
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
    Bad("k_heads_7", _set(k=torch.ones(T, 7, D, dtype=torch.bfloat16)), SHAPE, ("k",), exact_number(H), exact_number(7)),
    Bad("k_head_dim_9", _set(k=torch.ones(T, H, 9, dtype=torch.bfloat16)), SHAPE, ("k",), exact_number(D), exact_number(9)),
    Bad("v_heads_7", _set(v=torch.ones(T, 7, DV, dtype=torch.bfloat16)), SHAPE, ("v",), lambda t: exact_number(t.hv), exact_number(7)),
    Bad("v_head_dim_9", _set(v=lambda a: torch.ones(T, a["v"].shape[1], 9, dtype=torch.bfloat16)), SHAPE, ("v",),
        exact_number(DV), exact_number(9)),
    Bad("v_with_k_heads", _set(v=torch.ones(T, H, DV, dtype=torch.bfloat16)), SHAPE, ("v",), exact_number(HV), exact_number(H),
        targets=tuple(FUNCTION_TARGETS)),
    # T differing between k, v and loc
    Bad("v_T_4", _set(v=lambda a: a["v"][:4]), SHAPE, ("v", "k"), exact_number(5), exact_number(4)),
    Bad("k_T_4", _set(k=lambda a: a["k"][:4]), SHAPE, ("k", "v", "cache_loc"), exact_number(4), exact_number(5)),
    Bad("loc_T_6", _set(cache_loc=torch.tensor(BASE_LOC + [2])), SHAPE, ("cache_loc",), exact_number(5), exact_number(6)),
    Bad("loc_T_4", _set(cache_loc=torch.tensor(BASE_LOC[:4])), SHAPE, ("cache_loc",), exact_number(5), exact_number(4)),
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
    Bad("k_scale_shape_H+1", _set(k_scale=torch.ones(H + 1)), VE, ("k_scale",), exact_number(H), r"\(3,\)"),
    Bad("k_scale_shape_2x2", _set(k_scale=torch.ones(2, 2)), VE, ("k_scale",), exact_number(H), r"\(2, 2\)"),
    Bad("k_scale_shape_1xH", _set(k_scale=torch.ones(1, H)), VE, ("k_scale",), exact_number(H), r"\(1, 2\)"),
    Bad("k_scale_shape_Hx1x1", _set(k_scale=torch.ones(H, 1, 1)), VE, ("k_scale",), exact_number(H), r"\(2, 1, 1\)"),
    Bad("k_scale_empty", _set(k_scale=torch.ones(0)), VE, ("k_scale",), r"one|1|" + exact_number(H), r"\(0,\)"),
    Bad("v_scale_k_heads", _set(v_scale=torch.ones(H)), VE, ("v_scale",), exact_number(HV), r"\(2,\)",
        targets=tuple(FUNCTION_TARGETS)),
    Bad("v_scale_shape_Hvx2", _set(v_scale=lambda a: torch.ones(a["v"].shape[1], 2)), VE, ("v_scale",),
        lambda t: exact_number(t.hv), lambda t: rf"\({t.hv}, 2\)"),
]

LAYER_CASES = [
    *[Bad(f"layer_id_{lid}", _set(layer=Layer(lid)), (IndexError,), ("layer_id", "layer"), r"4\D{1,6}6", exact_number(lid),
          targets=tuple(POOL_TARGETS))
      for lid in (0, 3, 7, 100, -1, -3)],
    *[Bad(f"override_{lid}", _set(layer=None, layer_id_override=lid), (IndexError,), ("layer_id", "layer_id_override"),
          r"4\D{1,6}6", exact_number(lid), targets=tuple(POOL_TARGETS))
      for lid in (0, -2, 7)],
    Bad("override_out_of_range_wins_over_valid_layer", _set(layer=Layer(LAYER), layer_id_override=2), (IndexError,),
        ("layer_id", "layer_id_override"), r"4\D{1,6}6", exact_number(2), targets=tuple(POOL_TARGETS)),
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
    a = base_args(target.hv)
    case.change(a)
    inputs = {k: v for k, v in a.items() if isinstance(v, torch.Tensor) and v.device != META}
    inputs_before = {k: v.clone() for k, v in inputs.items()}
    before = target.snapshot()
    with pytest.raises(case.exc) as info:
        target.call(a)
    _message_checks(info.value, case, target)
    for b, now in zip(before, target.current()):
        assert_same_bytes(now, b, f"{target_name}: cache/buffer after rejected call {case.id}")
    for k, v in inputs.items():
        assert_same_bytes(v, inputs_before[k], f"input {k} after rejected call {case.id}")


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
        a = base_args(target.hv)
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
    assert re.search(exact_number(lid), str(info.value)) and re.search(r"4\D{1,6}6", str(info.value)), str(info.value)


@pytest.mark.parametrize("target_name", POOL_TARGETS)
def test_layer_id_override_takes_precedence(target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    before = target.snapshot()
    a = base_args(target.hv)
    a["layer"], a["layer_id_override"] = Layer(4), 6
    target.call(a)
    after = target.current()
    # buffers are listed per layer: 4 (K, V), 5 (K, V), 6 (K, V)
    for i in range(4):
        assert_same_bytes(after[i], before[i], f"layer {START + i // 2} (not the override)")
    exp = expected_cache(codes_of(before[4]), a["k"], BASE_LOC, CACHE_DTYPE, 0.5)
    assert_codes_equal(after[4], exp, FORMAT_OF[CACHE_DTYPE], "override layer 6 K")

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
    a = dict(base_args(target.hv), k=torch.zeros(0, H, D), v=torch.zeros(0, target.hv, DV),
             cache_loc=torch.zeros(0, dtype=torch.int64))
    for key, val in change.items():
        a[key] = val(target.hv) if callable(val) else val
    before = target.snapshot()
    with pytest.raises(exc) as info:
        target.call(a)
    assert re.search(rf"(?<![\w.]){re.escape(target.name(name))}(?!\w)", str(info.value)), str(info.value)
    for b, n in zip(before, target.current()):
        assert_same_bytes(n, b, f"{target_name}: buffers after rejected empty call")


# ----------------------------------------------------------------------------------------------
# The fused path refuses what its gate refuses (docs/contract.md, "The gate"), before writing.


@pytest.mark.parametrize("target_name", ["fused_interp", "pool_always"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_fused_refuses_non_float32_scale_tensor_without_writing(scale_dtype, target_name):
    skip_fused_without_interpreter(target_name)
    target = TARGETS[target_name]()
    a = base_args(target.hv)
    a["v_scale"] = torch.tensor([0.25], dtype=scale_dtype)
    before = target.snapshot()
    with pytest.raises(kvpool.FusedPathUnavailable) as info:
        target.call(a)
    assert "v_scale" in str(info.value) and str(scale_dtype).split(".")[-1] in str(info.value), str(info.value)
    for b, n in zip(before, target.current()):
        assert_same_bytes(n, b, f"{target_name}: buffers after the gate refused")
