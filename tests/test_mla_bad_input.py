"""Bad input to the MLA pool's two write entry points (``set_kv_buffer`` with a latent row,
``set_mla_kv_buffer`` with its two parts) and to validate: a clear error, and nothing written.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvassert import (
    DEVICE,
    Layer,
    MODES,
    R,
    ROPE,
    assert_same_bytes,
    make_mla_pool,
    poison_mla_pool,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy inside Triton's interpreter


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error, and nothing written.

T = 5
BASE_LOC = [1, 5, -1, 7, 10]


def _base(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    row = torch.randn(T, 1, R + ROPE, generator=g).to(dtype).to(DEVICE)
    return dict(row=row, nope=row[:, :, :R], rope=row[:, :, R:], loc=torch.tensor(BASE_LOC, device=DEVICE),
                k_scale=0.5, layer=Layer(4), override=None)  # fmt: skip


def _row(a):
    return lambda p: p.set_kv_buffer(a["layer"], a["loc"], a["row"], None, a["k_scale"], None, a["override"])


def _parts(a):
    return lambda p: p.set_mla_kv_buffer(a["layer"], a["loc"], a["nope"], a["rope"], a["k_scale"], a["override"])


META = torch.device("meta")
# (id, entry, changes to the base arguments, exception, message)
BAD = [
    ("row-not-tensor", _row, dict(row=[[1.0]]), TypeError, "cache_k must be a torch.Tensor, got list"),
    ("row-2d", _row, dict(row=torch.ones(T, R + ROPE)), ValueError, r"cache_k must be 3-D \[T, 1, 64\], got shape \(5, 64\)"),
    ("row-heads", _row, dict(row=torch.ones(T, 2, R + ROPE)), ValueError, r"cache_k must have 1 heads \(shape\[1\]\), got 2"),
    ("row-width", _row, dict(row=torch.ones(T, 1, R + ROPE - 1)), ValueError, r"cache_k must have head dim 64 \(shape\[2\]\), got 63"),
    ("row-int", _row, dict(row=torch.ones(T, 1, R + ROPE, dtype=torch.int32)), ValueError,
     "cache_k must be bfloat16, float16 or float32, got torch.int32"),
    ("row-float64", _row, dict(row=torch.ones(T, 1, R + ROPE, dtype=torch.float64)), ValueError,
     "cache_k must be bfloat16, float16 or float32, got torch.float64"),
    ("row-meta", _row, dict(row=torch.ones(T, 1, R + ROPE, device=META)), ValueError, "cache_k must be on .*, got meta"),
    ("row-loc-float", _row, dict(loc=torch.ones(T)), ValueError, "loc must be int32 or int64, got torch.float32"),
    ("row-loc-2d", _row, dict(loc=torch.ones(T, 1, dtype=torch.int64)), ValueError, r"loc must be 1-D \[T\], got shape \(5, 1\)"),
    ("row-loc-short", _row, dict(loc=torch.ones(4, dtype=torch.int64)), ValueError,
     r"loc must have T=5 entries \(one per token\), got 4"),
    ("row-loc-meta", _row, dict(loc=torch.ones(T, dtype=torch.int64, device=META)), ValueError, "loc must be on .*, got meta"),
    ("row-loc-list", _row, dict(loc=BASE_LOC), TypeError, "loc must be a torch.Tensor, got list"),
    ("row-scale-zero", _row, dict(k_scale=0.0), ValueError, "k_scale must be a positive finite float .*got 0.0"),
    ("row-scale-inf", _row, dict(k_scale=float("inf")), ValueError, "k_scale must be a positive finite float .*got inf"),
    ("row-scale-subnormal", _row, dict(k_scale=1e-40), ValueError, "k_scale must be a positive finite float .*got 1e-40"),
    ("row-scale-str", _row, dict(k_scale="0.5"), TypeError, "k_scale must be None, a positive float or a floating-point tensor, got str"),
    ("row-scale-bool", _row, dict(k_scale=True), TypeError, "k_scale must be None, a positive float .*got bool"),
    ("row-scale-int-tensor", _row, dict(k_scale=torch.ones(1, dtype=torch.int32)), ValueError,
     "k_scale must be a floating-point tensor, got torch.int32"),
    ("row-scale-shape", _row, dict(k_scale=torch.ones(2)), ValueError,
     r"k_scale must have one element \(per tensor\) or shape \[1\] or \[1, 1\] \(per head\), got shape \(2,\)"),
    ("row-scale-meta", _row, dict(k_scale=torch.ones(1, device=META)), ValueError, "k_scale must be on .*, got meta"),
    ("row-layer-range", _row, dict(layer=Layer(5)), IndexError, r"layer_id 5 is outside this pool's layers \[3, 4\]"),
    ("row-layer-none", _row, dict(layer=None), TypeError, "a write needs a layer with .layer_id or layer_id_override"),
    ("row-layer-str", _row, dict(layer=Layer("4")), TypeError, "layer_id must be an int, got str"),
    ("parts-nope-not-tensor", _parts, dict(nope=None), TypeError, "cache_k_nope must be a torch.Tensor, got NoneType"),
    ("parts-nope-width", _parts, dict(nope=torch.ones(T, 1, R + 1)), ValueError,
     r"cache_k_nope must have head dim 40 \(shape\[2\]\), got 41"),
    ("parts-rope-width", _parts, dict(rope=torch.ones(T, 1, R + ROPE)), ValueError,
     r"cache_k_rope must have head dim 24 \(shape\[2\]\), got 64"),
    ("parts-rope-heads", _parts, dict(rope=torch.ones(T, 2, ROPE)), ValueError, r"cache_k_rope must have 1 heads"),
    ("parts-rope-tokens", _parts, dict(rope=torch.ones(T - 1, 1, ROPE)), ValueError,
     "cache_k_rope must have T=5 tokens like cache_k_nope, got 4"),
    ("parts-rope-int", _parts, dict(rope=torch.ones(T, 1, ROPE, dtype=torch.int16)), ValueError,
     "cache_k_rope must be bfloat16, float16 or float32, got torch.int16"),
    ("parts-rope-meta", _parts, dict(rope=torch.ones(T, 1, ROPE, device=META)), ValueError, "cache_k_rope must be on .*, got meta"),
    ("parts-loc-long", _parts, dict(loc=torch.ones(6, dtype=torch.int32)), ValueError,
     r"loc must have T=5 entries \(one per token\), got 6"),
    ("parts-scale-negative", _parts, dict(k_scale=-2.0), ValueError, "k_scale must be a positive finite float .*got -2.0"),
    ("parts-scale-shape", _parts, dict(k_scale=torch.ones(1, 2)), ValueError, r"k_scale must have one element .*got shape \(1, 2\)"),
]


def _move(changes: dict) -> dict:
    """Put new tensors on the test device, except those meant to be on another device."""
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device != META else v) for k, v in changes.items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_before_anything_is_written(case, mode):
    _, entry, changes, error, message = case
    pool = make_mla_pool(torch.float8_e4m3fn, mode)
    before = poison_mla_pool(pool)
    args = _base()
    if mode == "never":  # the base call is valid and writes (once is enough: the interpreter is slow)
        entry(args)(pool)
        assert any(not torch.equal(a, b) for a, b in zip(pool.kv_buffer, before)), "the base call must write"
        before = [b.clone() for b in pool.kv_buffer]
    with pytest.raises(error, match=message):
        entry({**args, **_move(changes)})(pool)
    for a, b in zip(pool.kv_buffer, before):
        assert_same_bytes(a, b, "pool buffer after a rejected write")


@pytest.mark.parametrize("entry", [_row, _parts], ids=["row", "parts"])
@pytest.mark.parametrize("mode", MODES)
def test_validate_rejects_slots_past_the_end_and_bad_scale_values(mode, entry):
    pool = make_mla_pool(torch.float8_e4m3fn, mode, validate=True)
    before = poison_mla_pool(pool)
    args = _base()
    bad_loc = torch.tensor([1, 5, -1, 12, 10], device=DEVICE)
    with pytest.raises(IndexError, match=re.escape("loc[3] = 12 is out of range: slots are 0..11")):
        entry({**args, "loc": bad_loc})(pool)
    with pytest.raises(ValueError, match="k_scale must hold positive finite normal float32 values, got 0.0 at index 0"):
        entry({**args, "k_scale": torch.zeros(1, device=DEVICE)})(pool)
    for a, b in zip(pool.kv_buffer, before):
        assert_same_bytes(a, b, "pool buffer after a rejected write")
