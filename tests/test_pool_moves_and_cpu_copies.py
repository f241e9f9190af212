"""``MHATokenToKVPool.move_kv_cache`` and ``get_cpu_copy``/``load_cpu_copy`` on CPU pools: the reference
path against a model of the bytes, and the row-copy kernel through the interpreter on the same pools;
bad input raising before anything is written.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvassert import assert_same_bytes, fill_random_
from kvpool import MHATokenToKVPool
from kvpool.kernels.copy_rows import launcher as C
from kvpool.pools.cpu_copy import KVCpuCopy


# --- moves and CPU copies of a pool's rows ---------------------------------------------------------


# An odd geometry on purpose: H=3, D=32 for K and Dv=16 for V (rows of 96 and 48 bytes in FP8).
GEOMETRY = dict(head_num=3, head_dim=32, v_head_dim=16)


def make_pool(dtype=torch.float8_e4m3fn, size=30, page_size=2, layers=3, start_layer=0, validate=False, **geometry):
    g = {**GEOMETRY, **geometry}
    pool = MHATokenToKVPool(
        size, page_size, dtype, g["head_num"], g["head_dim"], layers, "cpu",
        v_head_dim=g["v_head_dim"], start_layer=start_layer, validate=validate,
    )  # fmt: skip
    fill_random_(pool.k_buffer + pool.v_buffer, seed=size + layers)
    return pool


def snapshot(pool: MHATokenToKVPool) -> list[torch.Tensor]:
    return [b.view(torch.uint8).clone() for b in pool.k_buffer + pool.v_buffer]


def expected_move(before: list[torch.Tensor], tgt: list[int], src: list[int], rows: int) -> list[list[set[bytes]]]:
    """Per buffer and row, the byte strings the row may hold: sources read before any write."""
    out = [[{bytes(b[r].flatten().tolist())} for r in range(rows)] for b in before]
    named: dict[int, list[int]] = {}
    for t, s in zip(tgt, src):
        if 0 <= t < rows and 0 <= s < rows:
            named.setdefault(t, []).append(s)
    for i, b in enumerate(before):
        for t, sources in named.items():
            out[i][t] = {bytes(b[s].flatten().tolist()) for s in sources}
    return out


def assert_pool(pool: MHATokenToKVPool, expected: list[list[set[bytes]]]) -> None:
    for i, buf in enumerate(pool.k_buffer + pool.v_buffer):
        raw = buf.view(torch.uint8)
        bad = [r for r in range(raw.shape[0]) if bytes(raw[r].flatten().tolist()) not in expected[i][r]]
        assert not bad, f"buffer {i} ({'K' if i < pool.layer_num else 'V'}): rows {bad[:8]} differ from the model"


MOVES = {
    "cycle": ([1, 2, 3], [2, 3, 1]),
    "chain-tgt-is-next-src": ([4, 5, 6, 7], [5, 6, 7, 8]),
    "chain-reversed": ([8, 7, 6, 5], [7, 6, 5, 4]),
    "tgt-equals-src": ([3, 9, 10], [3, 9, 10]),
    "swap": ([1, 2], [2, 1]),
    "duplicate-target": ([12, 12], [1, 2]),
    "skips": ([-1, 40, 5, 6], [3, 4, 99, -2]),
    "compaction": ([10, 11, 12, 13], [10, 13, 15, 17]),  # accepted drafts moved down over themselves
}


@pytest.mark.parametrize("name", list(MOVES))
def test_move_matches_the_model(copy_path, name):
    pool = make_pool()
    tgt, src = MOVES[name]
    rows = pool.size + pool.page_size
    expected = expected_move(snapshot(pool), tgt, src, rows)
    pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src, dtype=torch.int32))
    assert_pool(pool, expected)


def test_large_move_through_staging(copy_path, monkeypatch):
    monkeypatch.setattr(C, "ONE_PASS_MAX_PAIRS", 4)
    pool = make_pool(layers=2)
    tgt = [0, 1, 2, 3, 4, 5, 6, 7]
    src = [1, 2, 3, 4, 5, 6, 7, 0]  # an 8-cycle: more pairs than one pass takes
    expected = expected_move(snapshot(pool), tgt, src, pool.size + pool.page_size)
    pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src))
    assert_pool(pool, expected)


@given(
    pairs=st.lists(st.tuples(st.integers(-1, 33), st.integers(-1, 33)), max_size=12),
    dtype=st.sampled_from([torch.float8_e4m3fn, torch.bfloat16, torch.float32]),
)
def test_move_property(pairs, dtype):
    pool = make_pool(dtype=dtype, size=30, layers=2)
    tgt, src = [p[0] for p in pairs], [p[1] for p in pairs]
    expected = expected_move(snapshot(pool), tgt, src, pool.size + pool.page_size)
    pool.move_kv_cache(torch.tensor(tgt, dtype=torch.int64), torch.tensor(src, dtype=torch.int64))
    assert_pool(pool, expected)


@pytest.mark.parametrize(
    "tgt, src, exc, match",
    [
        (torch.tensor([1.0]), torch.tensor([2]), ValueError, "tgt_loc must be int32 or int64, got torch.float32"),
        (torch.tensor([1]), torch.tensor([[2]]), ValueError, r"src_loc must be 1-D, got shape \(1, 1\)"),
        (torch.tensor([1, 2]), torch.tensor([2]), ValueError, r"src_loc must have as many entries as tgt_loc \(2\), got 1"),
        ([1], torch.tensor([2]), TypeError, "tgt_loc must be a torch.Tensor, got list"),
        (torch.tensor([1], device="meta"), torch.tensor([2]), ValueError, "tgt_loc must be on cpu, got meta"),
    ],
    ids=["float", "2-d", "lengths", "list", "device"],
)
def test_move_rejects_bad_input_before_writing(tgt, src, exc, match):
    pool = make_pool()
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        pool.move_kv_cache(tgt, src)
    for a, b in zip(before, snapshot(pool)):
        assert torch.equal(a, b)


def test_move_validate_names_the_slot():
    pool = make_pool(validate=True)
    before = snapshot(pool)
    with pytest.raises(IndexError, match=r"src_loc\[1\] = 32 is out of range: rows are 0..31"):
        pool.move_kv_cache(torch.tensor([1, 2]), torch.tensor([3, 32]))
    for a, b in zip(before, snapshot(pool)):
        assert torch.equal(a, b)


# --- CPU copies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
def test_cpu_copy_round_trip_is_exact(copy_path, dtype):
    pool = make_pool(dtype=dtype, start_layer=4)
    slots = torch.tensor([7, 3, 8, 31, 0])
    copy = pool.get_cpu_copy(slots)
    assert isinstance(copy, KVCpuCopy) and len(copy) == 5 and copy.start_layer == 4 and copy.dtype == dtype
    assert copy.k.shape == (3, 5, 3, 32) and copy.v.shape == (3, 5, 3, 16) and copy.k.dtype == pool.store_dtype
    for layer in range(3):
        assert_same_bytes(copy.k[layer], pool.k_buffer[layer][slots], f"K layer {layer}")
        assert_same_bytes(copy.v[layer], pool.v_buffer[layer][slots], f"V layer {layer}")
    # Park the rows, let other writes land, bring them back elsewhere.
    originals = [pool.k_buffer[l][slots].clone() for l in range(3)] + [pool.v_buffer[l][slots].clone() for l in range(3)]
    fill_random_(pool.k_buffer + pool.v_buffer, seed=99)
    before = snapshot(pool)
    targets = torch.tensor([20, 21, 22, 23, 24], dtype=torch.int32)
    pool.load_cpu_copy(copy, targets)
    for l in range(3):
        assert_same_bytes(pool.k_buffer[l][targets.long()], originals[l], f"reloaded K {l}")
        assert_same_bytes(pool.v_buffer[l][targets.long()], originals[3 + l], f"reloaded V {l}")
    untouched = torch.ones(pool.size + pool.page_size, dtype=torch.bool)
    untouched[targets.long()] = False
    for a, b in zip(before, snapshot(pool)):
        assert torch.equal(a[untouched], b[untouched])


def test_empty_cpu_copy():
    """An empty CPU copy holds no rows, and taking it or loading it back leaves every byte of the pool
    as it was (random bytes, so a row copied onto another would show)."""
    pool = make_pool()
    before = snapshot(pool)
    copy = pool.get_cpu_copy(torch.empty(0, dtype=torch.int64))
    assert len(copy) == 0
    for i, (now, was) in enumerate(zip(snapshot(pool), before)):
        assert_same_bytes(now, was, f"pool buffer {i} after taking an empty CPU copy")
    pool.load_cpu_copy(copy, torch.empty(0, dtype=torch.int64))
    for i, (now, was) in enumerate(zip(snapshot(pool), before)):
        assert_same_bytes(now, was, f"pool buffer {i} after loading an empty CPU copy")


def test_get_cpu_copy_checks_the_range():
    pool = make_pool()
    with pytest.raises(IndexError, match=r"indices\[1\] = 32 is out of range: slots are 0..31"):
        pool.get_cpu_copy(torch.tensor([1, 32]))
    with pytest.raises(IndexError, match=r"indices\[0\] = -1"):
        pool.get_cpu_copy(torch.tensor([-1]))


def _load_case(case: str):
    pool = make_pool()
    copy = pool.get_cpu_copy(torch.tensor([1, 2, 3]))
    idx = torch.tensor([4, 5, 6])
    if case == "not-a-copy":
        return pool, [copy.k, copy.v], idx, TypeError, "kv_cache_cpu must be a KVCpuCopy"
    if case == "length":
        return pool, copy, idx[:2], ValueError, r"kv_cache_cpu.k must have shape \(3, 2, 3, 32\)"
    if case == "dtype":
        other = make_pool(dtype=torch.bfloat16).get_cpu_copy(torch.tensor([1, 2, 3]))
        return pool, other, idx, ValueError, "kv_cache_cpu must hold torch.float8_e4m3fn rows"
    if case == "layers":
        other = make_pool(layers=2).get_cpu_copy(torch.tensor([1, 2, 3]))
        return pool, other, idx, ValueError, r"kv_cache_cpu.k must have shape \(3, 3, 3, 32\)"
    if case == "start-layer":
        other = make_pool(start_layer=1).get_cpu_copy(torch.tensor([1, 2, 3]))
        return pool, other, idx, ValueError, "kv_cache_cpu must start at layer 0, got 1"
    if case == "head-dim":
        other = make_pool(v_head_dim=32).get_cpu_copy(torch.tensor([1, 2, 3]))
        return pool, other, idx, ValueError, r"kv_cache_cpu.v must have shape \(3, 3, 3, 16\)"
    if case == "store-dtype":
        bad = KVCpuCopy(copy.k.view(torch.float8_e4m3fn), copy.v, copy.dtype, 0)
        return pool, bad, idx, ValueError, "kv_cache_cpu.k must be torch.uint8, got torch.float8_e4m3fn"
    if case == "k-none":
        return pool, KVCpuCopy(None, copy.v, copy.dtype, 0), idx, TypeError, "kv_cache_cpu.k must be a torch.Tensor, got NoneType"
    if case == "strided-rows":
        strided = torch.zeros(3, 3, 6, 32, dtype=torch.uint8)[:, :, ::2]  # the right shape, rows apart
        return pool, KVCpuCopy(strided, copy.v, copy.dtype, 0), idx, ValueError, r"kv_cache_cpu.k must have contiguous \[H, D\] rows"
    if case == "indices-dtype":
        return pool, copy, idx.float(), ValueError, "indices must be int32 or int64, got torch.float32"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    ["not-a-copy", "length", "dtype", "layers", "start-layer", "head-dim", "store-dtype", "k-none", "strided-rows",
     "indices-dtype"],  # fmt: skip
)
def test_load_cpu_copy_rejects_a_mismatched_copy(case):
    pool, copy, idx, exc, match = _load_case(case)
    before = snapshot(pool)
    with pytest.raises(exc, match=match):
        pool.load_cpu_copy(copy, idx)
    for a, b in zip(before, snapshot(pool)):
        assert torch.equal(a, b)


def test_load_cpu_copy_validate_and_skip():
    pool = make_pool(validate=True)
    copy = pool.get_cpu_copy(torch.tensor([1, 2]))
    before = snapshot(pool)
    with pytest.raises(IndexError, match=r"indices\[1\] = 40"):
        pool.load_cpu_copy(copy, torch.tensor([5, 40]))
    for a, b in zip(before, snapshot(pool)):
        assert torch.equal(a, b)
    lax = make_pool()
    copy = lax.get_cpu_copy(torch.tensor([1, 2]))
    lax.load_cpu_copy(copy, torch.tensor([5, 40]))  # the out-of-range row is skipped
    assert torch.equal(lax.k_buffer[0][5], lax.k_buffer[0][1])
