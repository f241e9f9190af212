"""Row copies on a GPU (skipped without a CUDA device): ``copy_rows``, ``move_kv_cache`` and the CPU
copies on real sizes, the compiled kernel against the reference path (run on CPU copies of the same
bytes), pinned host tables in both directions, unaligned tables, CUDA graphs and no synchronisation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st

from kvassert import assert_same_bytes, gpu, no_sync, random_cuda_pool
from kvpool import MHATokenToKVPool
from kvpool.kernels.copy_rows import launcher as C
from kvpool.kernels.copy_rows import RowTable, copy_rows


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
