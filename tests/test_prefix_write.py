"""The speculative-decoding verify write, ``MHATokenToKVPool.set_kv_buffer_prefix_valid``
(docs/contract.md, "The verify write").

Token ``(i, j)`` (input row ``i * width + j``) is written to slot ``loc_2d[i, j]`` exactly as
``set_kv_buffer`` writes a token iff ``j < commit_lens[i]``; the rest write nothing. Every case runs
on a fused pool (the Triton kernel; under the interpreter without CUDA) and a reference pool, with
all buffers poisoned first, and the two must agree byte for byte with each other and with an
expected buffer built here from ``quantize`` row by row.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvassert import INTERPRETER, assert_same_bytes, bits, poison_
from kvpool import MHATokenToKVPool, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

#: The fused path runs on CUDA, or on the CPU under Triton's interpreter.
fused_runs = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETER, reason="the fused kernel needs CUDA or TRITON_INTERPRET=1")
pytestmark = [fused_runs, pytest.mark.filterwarnings("ignore::RuntimeWarning")]
META = torch.device("meta")  # "a tensor on another device"
H, D, DV = 2, 8, 4
SIZE, PAGE = 20, 1
ROWS = SIZE + PAGE  # 21 rows per buffer
LAYERS = 2
LAYER = 1  # the layer written; layer 0 must stay poisoned


def _name(x) -> str:
    return str(x).replace("torch.", "")


def _pool(dtype, fused, **kw) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(SIZE, PAGE, dtype, H, D, LAYERS, DEVICE, v_head_dim=DV, fused=fused, warmup=False, **kw)
    for buf in pool.k_buffer + pool.v_buffer:
        poison_(buf)
    return pool


def _snapshot(pool) -> list[torch.Tensor]:
    return [bits(b).clone() for b in pool.k_buffer + pool.v_buffer]


def _assert_unchanged(pool, snapshot, what) -> None:
    for i, (b, s) in enumerate(zip(pool.k_buffer + pool.v_buffer, snapshot)):
        assert torch.equal(bits(b), s), f"{what}: buffer {i} changed"


def _assert_pools_equal(a, b, what) -> None:
    for layer in range(LAYERS):
        for x, y, kv in zip(a.get_kv_buffer(layer), b.get_kv_buffer(layer), "KV"):
            assert_same_bytes(x, y, f"{what}: layer {layer} {kv}")


def _rows(t, heads, dim, dtype, seed):
    """Values with a wide magnitude range and the specials (NaN, +-inf, +-0, overflow)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, heads, dim, generator=g) * torch.exp2(torch.randint(-12, 12, (t, heads, dim), generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e5, -600.0])
    flat[: min(flat.numel(), 6)] = specials[: min(flat.numel(), 6)]
    return x.to(dtype).to(DEVICE)


def _qkv_slice(t, heads, dim, dtype, seed):
    """[t, heads, dim] as a strided view (the V part of a fused projection)."""
    wide = _rows(t, 3 * heads, dim, dtype, seed)
    return wide[:, heads : 2 * heads]


def _layout(loc: list[list[int]], layout: str, dtype) -> torch.Tensor:
    """``loc`` [bs, width] as a tensor with the given memory layout (same logical values)."""
    t = torch.tensor(loc, dtype=dtype, device=DEVICE).reshape(len(loc), -1)
    bs, width = t.shape
    if layout == "slice":  # rows of a bigger table: stride (width + 5, 1), offset
        big = torch.full((bs + 2, width + 5), -77, dtype=dtype, device=DEVICE)
        big[1 : 1 + bs, 2 : 2 + width] = t
        out = big[1 : 1 + bs, 2 : 2 + width]
    elif layout == "transposed":  # stride (1, bs)
        out = t.t().contiguous().t()
    elif layout == "every_other_column":  # stride (2 * width, 2)
        big = torch.full((bs, 2 * width), -77, dtype=dtype, device=DEVICE)
        big[:, ::2] = t
        out = big[:, ::2]
    else:
        out = t
    assert torch.equal(out, t)
    assert layout == "contiguous" or not out.is_contiguous() or min(out.shape) <= 1
    return out


def _scale(kind, seed=0):
    if kind == "none":
        return None
    if kind == "float":
        return 0.37
    if kind == "tensor":
        return torch.tensor([2.5], device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(H, generator=g) * 4 + 0.05).to(DEVICE)  # per head


def _expected(dtype, loc, commit, k, v, ks, vs):
    """Poisoned buffers of one layer with the committed, in-range tokens written row by row."""
    ek = poison_(torch.empty(ROWS, H, D, dtype=dtype, device=DEVICE))
    ev = poison_(torch.empty(ROWS, H, DV, dtype=dtype, device=DEVICE))
    width = len(loc[0]) if loc else 0
    for i, row in enumerate(loc):
        for j, slot in enumerate(row):
            t = i * width + j
            if j < commit[i] and 0 <= slot < ROWS:
                ek[slot] = quantize(k[t : t + 1], dtype, ks)[0]
                ev[slot] = quantize(v[t : t + 1], dtype, vs)[0]
    return ek, ev


def _check(dtype, loc, commit, loc_t, commit_t, k, v, ks, vs) -> None:
    """Fused pool, reference pool, the explicit expectation, and set_kv_buffer of just the
    committed tokens must all hold the same bytes."""
    pools = {fused: _pool(dtype, fused) for fused in ("always", "never")}
    for pool in pools.values():
        pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, ks, vs, layer_id_override=LAYER)
    _assert_pools_equal(pools["always"], pools["never"], "fused vs reference")
    ek, ev = _expected(dtype, loc, commit, k, v, ks, vs)
    assert_same_bytes(pools["never"].get_key_buffer(LAYER), ek, "K vs expected rows")
    assert_same_bytes(pools["never"].get_value_buffer(LAYER), ev, "V vs expected rows")
    # The same write as a plain set_kv_buffer of the committed tokens only.
    width = len(loc[0]) if loc else 0
    kept = [i * width + j for i, row in enumerate(loc) for j in range(width) if j < commit[i]]
    plain = _pool(dtype, "never")
    idx = torch.tensor(kept, dtype=torch.int64, device=DEVICE)
    flat = torch.tensor([s for row in loc for s in row] or [0], dtype=torch.int64, device=DEVICE)[idx]
    plain.set_kv_buffer(None, flat, k[idx], v[idx], ks, vs, layer_id_override=LAYER)
    _assert_pools_equal(plain, pools["never"], "set_kv_buffer of the committed tokens vs verify write")
    assert pools["always"].stats.fused_calls == 1 and pools["never"].stats.reference_calls == 1


# --- properties ------------------------------------------------------------------------------------


@st.composite
def verify_writes(draw):
    bs = draw(st.integers(0, 4))
    width = draw(st.integers(0, 4))
    loc_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    commit_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    # In-range slots are distinct (which duplicate wins is unspecified); padding and
    # out-of-range slots may repeat.
    in_range = draw(st.permutations(range(ROWS)))
    big = 2**31 - 1 if loc_dtype == torch.int32 else 2**40
    loc = []
    for i in range(bs):
        row = []
        for j in range(width):
            kind = draw(st.sampled_from(["slot", "slot", "slot", "negative", "out_of_range"]))
            if kind == "slot":
                row.append(in_range[i * width + j])
            elif kind == "negative":
                row.append(draw(st.sampled_from([-1, -5, -(2**31)])))
            else:
                row.append(draw(st.sampled_from([ROWS, ROWS + 3, big])))
        loc.append(row)
    commit = [draw(st.integers(-2, width + 2)) for _ in range(bs)]
    return dict(
        bs=bs, width=width, loc=loc, commit=commit, loc_dtype=loc_dtype, commit_dtype=commit_dtype,
        layout=draw(st.sampled_from(["contiguous", "slice", "transposed", "every_other_column"])),
        cache_dtype=draw(st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16])),
        in_dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])),
        k_scale=draw(st.sampled_from(["none", "float", "tensor", "per_head"])),
        v_scale=draw(st.sampled_from(["none", "float", "tensor", "per_head"])),
        seed=draw(st.integers(0, 2**16)),
    )  # fmt: skip


@given(verify_writes())
def test_verify_write_property(case):
    bs, width = case["bs"], case["width"]
    t = bs * width
    loc_t = (
        _layout(case["loc"], case["layout"], case["loc_dtype"])
        if bs and width
        else torch.empty(bs, width, dtype=case["loc_dtype"], device=DEVICE)
    )
    commit_t = torch.tensor(case["commit"], dtype=case["commit_dtype"], device=DEVICE)
    k = _rows(t, H, D, case["in_dtype"], case["seed"])
    v = _qkv_slice(t, H, DV, case["in_dtype"], case["seed"] + 1)
    ks, vs = _scale(case["k_scale"], case["seed"]), _scale(case["v_scale"], case["seed"] + 2)
    if t == 0:
        for fused in ("always", "never"):
            pool = _pool(case["cache_dtype"], fused)
            before = _snapshot(pool)
            pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, ks, vs, layer_id_override=LAYER)
            _assert_unchanged(pool, before, f"empty verify write ({bs}x{width})")
        return
    _check(case["cache_dtype"], case["loc"], case["commit"], loc_t, commit_t, k, v, ks, vs)


# --- deliberate cases ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "slice", "transposed"])
@pytest.mark.parametrize("commit_dtype", [torch.int32, torch.int64], ids=_name)
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=_name)
def test_commit_lengths_at_and_beyond_the_edges(loc_dtype, commit_dtype, layout):
    """commit_lens 0, width, negative, beyond width and in between, in one batch of 5 requests."""
    width = 3
    loc = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, -1, ROWS + 1]]
    commit = [0, width, -1, width + 4, 2]
    k = _rows(15, H, D, torch.bfloat16, 1)
    v = _rows(15, H, DV, torch.bfloat16, 2)
    loc_t = _layout(loc, layout, loc_dtype)
    commit_t = torch.tensor(commit, dtype=commit_dtype, device=DEVICE)
    _check(torch.float8_e4m3fn, loc, commit, loc_t, commit_t, k, v, 0.5, torch.tensor([3.0], device=DEVICE))
    # slots 1-3 (commit 0), 7-9 (negative commit) and all others never named stay poisoned
    pool = _pool(torch.float8_e4m3fn, "always")
    pool.set_kv_buffer_prefix_valid(None, loc_t, commit_t, k, v, 0.5, None, layer_id_override=LAYER)
    untouched = [0, 1, 2, 3, 7, 8, 9, 14, *range(15, ROWS)]
    assert (bits(pool.get_key_buffer(LAYER))[untouched] == 0xFF).all()
    assert not (bits(pool.get_key_buffer(LAYER))[[4, 5, 6, 10, 11, 12, 13]] == 0xFF).all(dim=(1, 2)).any()


def test_flat_plan_geometry_with_qkv_slices():
    """A geometry whose launcher takes the flat plan (H=3, D=96) and inputs sliced out of a fused
    projection: the prefix mask must hold for every block of the row."""
    h, d = 3, 96
    loc = [[3, 9, 4], [7, 1, 12]]
    commit = torch.tensor([2, 1], device=DEVICE)
    loc_t = torch.tensor(loc, device=DEVICE)
    wide = _rows(6, 3 * h, d, torch.bfloat16, 5)
    k, v = wide[:, h : 2 * h], wide[:, 2 * h :]
    pools = {}
    for fused in ("always", "never"):
        pool = MHATokenToKVPool(16, 1, torch.float8_e4m3fn, h, d, 1, DEVICE, fused=fused, warmup=False)
        for buf in pool.k_buffer + pool.v_buffer:
            poison_(buf)
        pool.set_kv_buffer_prefix_valid(None, loc_t, commit, k, v, 0.3, 0.7, layer_id_override=0)
        pools[fused] = pool
    assert pools["always"]._writer.plan((h * d, d, 1), (h * d, d, 1), (1, 1), False, 6).row_view  # a row plan exists
    for a, b in zip(pools["always"].get_kv_buffer(0), pools["never"].get_kv_buffer(0)):
        assert_same_bytes(a, b, "flat plan")
    written = {3, 9, 7}
    k_bits = bits(pools["always"].get_key_buffer(0))
    for slot in range(17):
        assert (k_bits[slot] == 0xFF).all() == (slot not in written), slot


def test_commit_lens_is_read_when_the_write_runs():
    """Changing commit_lens in place between two writes changes what the second one writes (the
    kernel reads it on the device; nothing is cached from the first call)."""
    pool = _pool(torch.bfloat16, "always")
    ref = _pool(torch.bfloat16, "never")
    loc = torch.tensor([[1, 2], [3, 4]], device=DEVICE)
    commit = torch.tensor([0, 0], device=DEVICE)
    k = _rows(4, H, D, torch.float32, 3)
    v = _rows(4, H, DV, torch.float32, 4)
    ever = set()
    for lens, slots in (([0, 0], set()), ([1, 2], {1, 3, 4}), ([2, 0], {1, 2})):
        commit.copy_(torch.tensor(lens))
        for p in (pool, ref):
            p.set_kv_buffer_prefix_valid(None, loc, commit, k * (lens[0] + 1), v, layer_id_override=0)
        _assert_pools_equal(pool, ref, f"commit_lens {lens}")
        ever |= slots
        for slot in (1, 2, 3, 4):
            poisoned = bool((bits(pool.get_key_buffer(0))[slot] == -1).all())
            assert poisoned == (slot not in ever), (lens, slot)


# --- bad input -------------------------------------------------------------------------------------

BS, WIDTH = 2, 3


def _base():
    return dict(
        layer=None,
        loc_2d=torch.tensor([[1, 2, 3], [4, 5, 6]], device=DEVICE),
        commit_lens=torch.tensor([2, 3], device=DEVICE, dtype=torch.int32),
        cache_k=torch.randn(6, H, D, device=DEVICE),
        cache_v=torch.randn(6, H, DV, device=DEVICE),
        k_scale=0.5,
        v_scale=None,
        layer_id_override=LAYER,
    )


BAD = {
    "loc_2d 1-D": (dict(loc_2d=torch.arange(1, 7)), ValueError, r"loc_2d must be 2-D \[bs, width\], got shape \(6,\)"),
    "loc_2d 3-D": (dict(loc_2d=torch.ones(2, 3, 1, dtype=torch.long)), ValueError, r"loc_2d must be 2-D \[bs, width\], got shape \(2, 3, 1\)"),
    "loc_2d bs*width != T": (dict(loc_2d=torch.ones(3, 3, dtype=torch.long)), ValueError, r"loc_2d must have bs \* width = T = 6 entries.*got shape \(3, 3\)"),
    "loc_2d float": (dict(loc_2d=torch.ones(2, 3)), ValueError, r"loc_2d must be int32 or int64, got torch.float32"),
    "loc_2d list": (dict(loc_2d=[[1, 2, 3], [4, 5, 6]]), TypeError, r"loc_2d must be a torch.Tensor, got list"),
    "loc_2d other device": (dict(loc_2d=torch.ones(2, 3, dtype=torch.long, device=META)), ValueError, rf"loc_2d must be on {DEVICE}.*got meta"),
    "commit_lens too long": (dict(commit_lens=torch.tensor([1, 1, 1])), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2 \(one per row of loc_2d\), got shape \(3,\)"),
    "commit_lens 2-D": (dict(commit_lens=torch.tensor([[1], [1]])), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2.*got shape \(2, 1\)"),
    "commit_lens 0-d": (dict(commit_lens=torch.tensor(2)), ValueError, r"commit_lens must be 1-D \[bs\] with bs = 2.*got shape \(\)"),
    "commit_lens float": (dict(commit_lens=torch.tensor([1.0, 2.0])), ValueError, r"commit_lens must be int32 or int64, got torch.float32"),
    "commit_lens bool": (dict(commit_lens=torch.tensor([True, False])), ValueError, r"commit_lens must be int32 or int64, got torch.bool"),
    "commit_lens int16": (dict(commit_lens=torch.tensor([1, 2], dtype=torch.int16)), ValueError, r"commit_lens must be int32 or int64, got torch.int16"),
    "commit_lens other device": (dict(commit_lens=torch.tensor([1, 2], device=META)), ValueError, rf"commit_lens must be on {DEVICE}.*got meta"),
    "commit_lens list": (dict(commit_lens=[2, 3]), TypeError, r"commit_lens must be a torch.Tensor, got list"),
    "commit_lens None": (dict(commit_lens=None), TypeError, r"commit_lens must be a torch.Tensor, got NoneType"),
    "cache_v T differs": (dict(cache_v=torch.randn(5, H, DV)), ValueError, r"cache_v must have T=6 tokens like cache_k, got 5"),
    "cache_k heads": (dict(cache_k=torch.randn(6, H + 1, D)), ValueError, r"cache_k must have 2 heads \(shape\[1\]\), got 3"),
    "cache_v head dim": (dict(cache_v=torch.randn(6, H, D)), ValueError, r"cache_v must have head dim 4 \(shape\[2\]\), got 8"),
    "cache_k int": (dict(cache_k=torch.ones(6, H, D, dtype=torch.int32)), ValueError, r"cache_k must be bfloat16, float16 or float32, got torch.int32"),
    "cache_k 2-D": (dict(cache_k=torch.randn(6, H * D)), ValueError, r"cache_k must be 3-D"),
    "k_scale negative": (dict(k_scale=-1.0), ValueError, r"k_scale must be a positive finite float.*got -1.0"),
    "v_scale shape": (dict(v_scale=torch.ones(3)), ValueError, r"v_scale must have one element \(per tensor\) or shape \[2\].*got shape \(3,\)"),
    "layer outside": (dict(layer_id_override=LAYERS), IndexError, rf"layer_id {LAYERS} is outside this pool's layers"),
    "no layer": (dict(layer_id_override=None), TypeError, r"layer_id_override"),
}  # fmt: skip


def _to_device(value):
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and DEVICE != "cpu":
        return value.to(DEVICE)
    return value


@pytest.mark.parametrize("fused", ["always", "never"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument_and_writes_nothing(case, fused):
    change, exc, message = BAD[case]
    pool = _pool(torch.float8_e4m3fn, fused)
    args = _base()
    args.update({name: _to_device(value) for name, value in change.items()})
    before = _snapshot(pool)
    with pytest.raises(exc, match=message):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_unchanged(pool, before, case)
    assert pool.stats.fused_calls == pool.stats.reference_calls == 0


# --- validate mode ---------------------------------------------------------------------------------

VALIDATE_BAD = {
    "commit_lens negative": ([[1, 2, 3], [4, 5, 6]], [-1, 3], ValueError, r"commit_lens\[0\] must be in 0..3 \(the width of loc_2d\), got -1"),
    "commit_lens beyond width": ([[1, 2, 3], [4, 5, 6]], [2, 4], ValueError, r"commit_lens\[1\] must be in 0..3 .*got 4"),
    "committed slot = rows": ([[1, 2, 3], [4, ROWS, 6]], [3, 2], IndexError, rf"loc_2d\[1, 1\] = {ROWS} is out of range: slots are 0..{ROWS - 1}"),
    "committed slot huge": ([[1, 2, 2**40], [4, 5, 6]], [3, 0], IndexError, rf"loc_2d\[0, 2\] = {2**40} is out of range"),
}  # fmt: skip


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("fused", ["always", "never"])
@pytest.mark.parametrize("case", list(VALIDATE_BAD))
def test_validate_rejects_bad_values_before_writing(case, fused, layout):
    loc, commit, exc, message = VALIDATE_BAD[case]
    pool = _pool(torch.float8_e4m3fn, fused, validate=True)
    args = _base()
    args.update(loc_2d=_layout(loc, layout, torch.int64), commit_lens=torch.tensor(commit, device=DEVICE))
    before = _snapshot(pool)
    with pytest.raises(exc, match=message):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_unchanged(pool, before, case)


@pytest.mark.parametrize("fused", ["always", "never"])
def test_validate_accepts_uncommitted_out_of_range_and_committed_padding(fused):
    """Out-of-range slots that are not committed are never written, so validate lets them be;
    a committed negative slot is padding."""
    loc = [[1, 2, ROWS + 7], [-1, 5, 2**40]]
    commit = [2, 2]
    pool = _pool(torch.float8_e4m3fn, fused, validate=True)
    args = _base()
    args.update(loc_2d=_layout(loc, "slice", torch.int64), commit_lens=torch.tensor(commit, device=DEVICE))
    pool.set_kv_buffer_prefix_valid(**args)
    ek, ev = _expected(torch.float8_e4m3fn, loc, commit, args["cache_k"], args["cache_v"], 0.5, None)
    assert_same_bytes(pool.get_key_buffer(LAYER), ek, "K")
    assert_same_bytes(pool.get_value_buffer(LAYER), ev, "V")


def test_validate_checks_scale_tensor_values():
    pool = _pool(torch.float8_e4m3fn, "never", validate=True)
    args = _base()
    args.update(v_scale=torch.tensor([0.0], device=DEVICE))
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=r"v_scale must hold positive finite normal float32 values, got 0.0"):
        pool.set_kv_buffer_prefix_valid(**args)
    _assert_unchanged(pool, before, "zero v_scale")
