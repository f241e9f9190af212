"""Row copies: MHATokenToKVPool.move_kv_cache and get_cpu_copy/load_cpu_copy on CPU pools (the
reference path against a model of the bytes, and the row-copy kernel through the interpreter on the
same pools); on a GPU, copy_rows, the moves and the CPU copies on real sizes; and the row-copy kernel
compiled for real GPU targets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvassert import assert_same_bytes, cross_compile, fill_random_, gpu, no_sync, random_cuda_pool

from kvpool import MHATokenToKVPool
from kvpool.kernels import copy_rows as C
from kvpool.kernels.copy_rows import RowTable, copy_rows
from kvpool.pools.cpu_copy import KVCpuCopy

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
    pool = make_pool()
    copy = pool.get_cpu_copy(torch.empty(0, dtype=torch.int64))
    assert len(copy) == 0
    pool.load_cpu_copy(copy, torch.empty(0, dtype=torch.int64))


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


# --- on a GPU: copy_rows, move_kv_cache and the CPU copies, the compiled kernel against the reference
# path (run on CPU copies of the same bytes), pinned host tables in both directions, unaligned tables,
# staged moves, CUDA-graph capture and replay, and no host synchronisation where none is promised.


def random_bytes(shape, gen, pin=False) -> torch.Tensor:
    t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if pin:
        return t.pin_memory()
    return t.to("cuda")


def reference(dst_bufs, di, src_bufs, si, same: bool) -> list[torch.Tensor]:
    """The expected destination buffers: the reference path on CPU copies."""
    d = [b.cpu().clone() for b in dst_bufs]
    s = d if same else [b.cpu().clone() for b in src_bufs]
    dt, st = RowTable.of(d), RowTable.of(s)
    C.copy_rows_reference(dt, di.cpu(), st, si.cpu())
    return d


def pairs(n: int, rows: int, gen, *, unique_dst: bool = True, bad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    dst = torch.randperm(rows, generator=gen)[:n] if unique_dst else torch.randint(0, rows, (n,), generator=gen)
    src = torch.randperm(rows, generator=gen)[:n]
    if bad and n >= 4:
        dst[1], src[2], dst[3] = -1, rows + 3, rows  # padding and out-of-range pairs are skipped
    return dst, src


SHAPES = [(8, 128), (8, 64), (1, 576)]  # 1 KiB, 512 B and 576 B rows


@gpu
@pytest.mark.parametrize("n", [1, 7, 256, 1024, 1025, 5000, 100_000])
@pytest.mark.parametrize("same", [False, True], ids=["two-tables", "aliasing"])
def test_compiled_kernel_matches_reference(n, same):
    gen = torch.Generator().manual_seed(n)
    rows = max(2 * n, 64) + 16
    dst_bufs = [random_bytes((rows, *s), gen) for s in SHAPES]
    src_bufs = dst_bufs if same else [random_bytes((rows, *s), gen) for s in SHAPES]
    di, si = pairs(n, rows, gen)
    expected = reference(dst_bufs, di, src_bufs, si, same)
    dt = RowTable.of(dst_bufs)
    st = dt if same else RowTable.of(src_bufs)
    copy_rows(dt, di.to("cuda"), st, si.to("cuda", torch.int32))
    for b, (got, want) in enumerate(zip(dst_bufs, expected)):
        assert_same_bytes(got.cpu(), want, f"buffer {b}")


@gpu
def test_repeated_launches_take_the_compiled_launcher_and_stay_exact(monkeypatch):
    """Copies of every kind Triton specialises on (index slices 16-byte aligned and not, int32 and
    int64 indices, 1, 16 and 17 pairs), on the current stream and on another one: the second round
    launches through the cached compiled kernels only (no JIT call), and every result is the
    reference's."""
    gen = torch.Generator().manual_seed(11)
    rows = 256
    bufs = [random_bytes((rows, 8, 128), gen) for _ in range(2)]
    src = [random_bytes((rows, 8, 128), gen) for _ in range(2)]
    dt, st = RowTable.of(bufs), RowTable.of(src)
    side = torch.cuda.Stream()
    jit = []
    real = C._jit_launch
    monkeypatch.setattr(C, "_jit_launch", lambda *a: jit.append(a) or real(*a))
    for round_ in range(2):
        jit.clear()
        for n, offset, dtype, stream in [
            (16, 0, torch.int64, None), (16, 1, torch.int64, None), (1, 0, torch.int64, None),
            (17, 2, torch.int32, None), (16, 0, torch.int64, side), (17, 1, torch.int32, side),
        ]:  # fmt: skip
            for b in bufs:
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
            di, si = pairs(n + offset, rows, gen, bad=False)
            di, si = di.to("cuda", dtype)[offset:], si.to("cuda", dtype)[offset:]
            expected = reference(bufs, di, src, si, False)
            if stream is not None:
                before = [b.cpu() for b in bufs]
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(1_000_000_000)  # holds `stream` (about 0.5 s): the copy waits behind it
            C.launch_copy_rows(dt, di, st, si, max_programs=8, stream=stream)
            if stream is not None:
                # Queued on `stream` (still asleep), not on the current stream: a stream-ordered read
                # on the current stream (into pinned memory) sees the old bytes.
                # (Other processes sharing the GPU can delay that read past the sleep: the check
                # only holds when `stream` is still asleep after the read.)
                now = [torch.empty(b.shape, dtype=b.dtype, pin_memory=True).copy_(b, non_blocking=True) for b in bufs]
                torch.cuda.current_stream().synchronize()
                if not stream.query():
                    for got, old in zip(now, before):
                        assert_same_bytes(got, old, f"round {round_}: the copy ran on the current stream")
            torch.cuda.synchronize()
            for got, want in zip(bufs, expected):
                assert_same_bytes(got.cpu(), want, f"round {round_}, {n} pairs at offset {offset}, {dtype}")
        if round_ == 1:
            assert C.LAUNCHES.enabled, "this Triton's compiled-kernel launcher was refused"
            assert jit == [], f"{len(jit)} launches went through the JIT in the second round"


@gpu
@pytest.mark.parametrize(
    "shape, dtype", [((3,), torch.float16), ((3, 2), torch.float32), ((7,), torch.uint8)], ids=["align2", "align8", "align1"]
)
def test_unaligned_rows(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    rows, esz = 300, torch.empty(0, dtype=dtype).element_size()
    nbytes = esz * int(torch.tensor(shape).prod())

    def make():
        raw = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=gen).to("cuda")
        return raw.view(dtype).view(rows, *shape)

    bufs, src = [make() for _ in range(2)], [make() for _ in range(2)]
    assert RowTable.of(bufs).align == {2: 2, 4: 8, 1: 1}[esz]
    di, si = pairs(200, rows, gen)
    expected = reference(bufs, di, src, si, False)
    copy_rows(RowTable.of(bufs), di.to("cuda"), RowTable.of(src), si.to("cuda"))
    for got, want in zip(bufs, expected):
        assert_same_bytes(got.cpu().view(torch.uint8), want.view(torch.uint8))


@gpu
@pytest.mark.parametrize("direction", ["device-to-host", "host-to-device"])
def test_pinned_host_tables(direction):
    gen = torch.Generator().manual_seed(2)
    rows, n = 9000, 8192
    host = [random_bytes((rows, *s), gen, pin=True) for s in SHAPES[:2]]
    dev = [random_bytes((rows, *s), gen) for s in SHAPES[:2]]
    ht, dt = RowTable.of(host), RowTable.of(dev)
    assert ht.pinned and ht.table.device.type == "cuda" and ht.device.type == "cpu"
    di, si = pairs(n, rows, gen)
    if direction == "device-to-host":
        expected = reference(host, di, dev, si, False)
        copy_rows(ht, di.to("cuda"), dt, si.to("cuda"), max_programs=8)
        torch.cuda.synchronize()
        got = host
    else:
        expected = reference(dev, di, host, si, False)
        copy_rows(dt, di.to("cuda"), ht, si.to("cuda"), max_programs=8)
        got = dev
    for a, b in zip(got, expected):
        assert_same_bytes(a.cpu(), b)


@gpu
def test_pageable_host_tables_are_refused():
    host = RowTable.of([torch.zeros(4, 16, dtype=torch.uint8)])  # pageable: a CPU table
    dev = RowTable.of([torch.zeros(4, 16, dtype=torch.uint8, device="cuda")])
    with pytest.raises(ValueError, match="pageable host memory"):
        copy_rows(dev, torch.tensor([0], device="cuda"), host, torch.tensor([1], device="cuda"))


@gpu
def test_copies_do_not_synchronise():
    gen = torch.Generator().manual_seed(3)
    bufs = [random_bytes((4096, 8, 128), gen) for _ in range(4)]
    host = [random_bytes((4096, 8, 128), gen, pin=True) for _ in range(4)]
    t, ht = RowTable.of(bufs), RowTable.of(host)
    idx = torch.randperm(4096, device="cuda")[:2000]
    copy_rows(t, idx, t, idx.flip(0))  # compile outside the check
    copy_rows(t, idx[:100], t, idx[100:200])
    copy_rows(ht, idx, t, idx, max_programs=8)
    with no_sync():
        copy_rows(t, idx, t, idx.flip(0))  # staged (aliasing, > 1024 pairs)
        copy_rows(t, idx[:100], t, idx[100:200])  # one pass
        copy_rows(ht, idx, t, idx, max_programs=8)
        RowTable.of(bufs, non_blocking=True)


def _cpu_twin(pool: MHATokenToKVPool) -> MHATokenToKVPool:
    twin = MHATokenToKVPool(pool.size, pool.page_size, pool.dtype, pool.head_num, pool.head_dim, pool.layer_num, "cpu",
                            v_head_dim=pool.v_head_dim)  # fmt: skip
    for a, b in zip(twin.k_buffer + twin.v_buffer, pool.k_buffer + pool.v_buffer):
        a.copy_(b.cpu())
    return twin


def _assert_twins(pool, twin):
    for i, (a, b) in enumerate(zip(pool.k_buffer + pool.v_buffer, twin.k_buffer + twin.v_buffer)):
        assert_same_bytes(a.cpu().view(torch.uint8), b.view(torch.uint8), f"buffer {i}")


@gpu
@pytest.mark.parametrize("n", [1, 64, 256, 3000])
def test_move_kv_cache_matches_cpu(n):
    pool = random_cuda_pool(v_head_dim=64)
    twin = _cpu_twin(pool)
    gen = torch.Generator().manual_seed(n)
    base = torch.randperm(4000, generator=gen)[: n + 1] + 1
    tgt, src = base[:-1], base[1:]  # a chain: each target is the next pair's source
    pool.move_kv_cache(tgt.to("cuda"), src.to("cuda"))
    twin.move_kv_cache(tgt, src)
    _assert_twins(pool, twin)


@gpu
@pytest.mark.parametrize("n", [200, 2000], ids=["one-pass", "staged"])
def test_move_kv_cache_in_a_cuda_graph(n):
    pool = random_cuda_pool()
    twin = _cpu_twin(pool)
    tgt = torch.zeros(n, dtype=torch.int64, device="cuda")
    src = torch.zeros(n, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pool.move_kv_cache(tgt, src)  # compiles; moves slot 0 onto itself
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.move_kv_cache(tgt, src)
    gen = torch.Generator().manual_seed(n)
    for _ in range(3):
        perm = torch.randperm(4000, generator=gen)[:n] + 1
        cycle_src = torch.roll(perm, 1)  # a cycle through every pair
        tgt.copy_(perm.to("cuda"))
        src.copy_(cycle_src.to("cuda"))
        graph.replay()
        twin.move_kv_cache(perm, cycle_src)
        torch.cuda.synchronize()
        _assert_twins(pool, twin)


@gpu
def test_move_kv_cache_does_not_synchronise():
    pool = random_cuda_pool()
    tgt = torch.arange(1, 257, device="cuda")
    pool.move_kv_cache(tgt, tgt + 1)
    with no_sync():
        pool.move_kv_cache(tgt, tgt + 1)


@gpu
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_cpu_copy_round_trip(dtype):
    pool = random_cuda_pool(dtype=dtype, v_head_dim=64)
    slots = torch.randperm(4000, device="cuda")[:777] + 1
    copy = pool.get_cpu_copy(slots)
    assert copy.k.is_pinned() and copy.k.device.type == "cpu"
    for layer in range(pool.layer_num):
        assert_same_bytes(copy.k[layer], pool.k_buffer[layer][slots].cpu(), f"K {layer}")
        assert_same_bytes(copy.v[layer], pool.v_buffer[layer][slots].cpu(), f"V {layer}")
    targets = torch.randperm(4000, device="cuda")[:777] + 1
    with no_sync():
        pool.load_cpu_copy(copy, targets)
    for layer in range(pool.layer_num):
        assert_same_bytes(pool.k_buffer[layer][targets].cpu(), copy.k[layer], f"reloaded K {layer}")
        assert_same_bytes(pool.v_buffer[layer][targets].cpu(), copy.v[layer], f"reloaded V {layer}")


# --- the row-copy kernel compiled for real GPU targets --------------------------------------------
# Its Hopper build moves rows in 16-byte vectors (8-byte ones when that is all the tables' alignment
# allows), with the one-pass plans' barrier between loads and stores.


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return cross_compile("--copy-rows")


def _one(compiled, **match):
    [v] = [v for v in compiled if all(v[k] == x for k, x in match.items())]
    return v


def test_the_row_copy_kernel_compiles_for_every_target(compiled):
    assert {v["target"] for v in compiled} == {"sm90", "sm100", "sm80", "gfx942"}
    assert len(compiled) == 10


def test_aligned_rows_move_in_16_byte_vectors_only(compiled):
    for v in compiled:
        if v["target"] in ("sm90", "sm100", "sm80") and v["align"] == 16:
            # Every data access is a v4: per thread, as many vector loads as stores, and the only
            # scalar loads are the indices and the table entries.
            assert v["ld_v4"] > 0 and v["ld_v4"] == v["st_v4"] == v["st"], v
            assert v["ld_v2"] == v["st_v2"] == 0, v


def test_eight_byte_alignment_gives_8_byte_vectors(compiled):
    v = _one(compiled, target="sm90", align=8)
    assert v["ld_v2"] > 0 and v["ld_v2"] == v["st_v2"] == v["st"] and v["ld_v4"] == 0


def test_one_pass_plans_have_a_barrier_and_streaming_plans_none(compiled):
    for v in compiled:
        if "bar_sync" not in v:
            continue  # AMD: no PTX to inspect
        if v["one_pass"]:
            assert v["bar_sync"] >= 1, v
        else:
            assert v["bar_sync"] == 0, v


def test_host_tier_plan_uses_wide_tasks(compiled):
    v = _one(compiled, target="sm90", few_programs=True)
    assert v["num_warps"] == 16 and v["block_p"] * v["block_w"] == 16384
