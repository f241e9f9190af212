"""``copy_rows``: the reference path against a plain-Python model of the bytes (with hypothesis), the
Triton kernel through the interpreter against the reference on small deliberate shapes, the row
tables it copies between, its plans and launch keys.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvassert import assert_same_bytes, needs_interpreter, poison_
from kvpool.kernels.copy_rows import kernel as copy_rows_kernel
from kvpool.kernels.copy_rows import launcher as C
from kvpool.kernels.copy_rows import RowTable, copy_rows, copy_rows_reference, plan_copy
from kvpool.kernels.launch import kernel_params, launch_key


# --- a model of the bytes ---------------------------------------------------------------------------


def _rows_bytes(table: RowTable) -> list[list[bytes]]:
    return [[bytes(C.byte_rows(buf, rb)[r].tolist()) for r in range(table.rows)] for buf, rb in zip(table.buffers, table.row_bytes)]


def expected_rows(dst: RowTable, src: RowTable, di: list[int], si: list[int]) -> list[list[set[bytes]]]:
    """For each dst buffer and row, the byte strings it may hold after the copy: all sources read
    first; a row named by several valid pairs may hold any of their sources."""
    before_d, before_s = _rows_bytes(dst), _rows_bytes(src)
    out = [[{row} for row in buf] for buf in before_d]
    named: dict[int, list[int]] = {}
    for d, s in zip(di, si):
        if 0 <= d < dst.rows and 0 <= s < src.rows:
            named.setdefault(d, []).append(s)
    for b in range(len(dst)):
        for d, sources in named.items():
            out[b][d] = {before_s[b][s] for s in sources}
    return out


def assert_rows(table: RowTable, expected: list[list[set[bytes]]]) -> None:
    after = _rows_bytes(table)
    for b, (rows, allowed) in enumerate(zip(after, expected)):
        bad = [r for r, (row, ok) in enumerate(zip(rows, allowed)) if row not in ok]
        if bad:
            r = bad[0]
            raise AssertionError(
                f"buffer {b}: {len(bad)} rows differ from the model; first row {r}: {rows[r].hex()} "
                f"not in {[x.hex() for x in allowed[r]]}"
            )


def random_buffers(rows: int, shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        t = torch.empty((rows, *shape), dtype=dtype)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
        out.append(t)
    return out


# --- RowTable ---------------------------------------------------------------------------------------


def test_table_records_geometry_and_alignment():
    k = torch.zeros(10, 3, 32, dtype=torch.float8_e4m3fn)
    v = torch.zeros(10, 3, 16, dtype=torch.bfloat16)
    t = RowTable.of([k, v])
    assert (t.rows, t.row_bytes, t.device, len(t)) == (10, (96, 96), torch.device("cpu"), 2)
    assert t.table.dtype == torch.int64 and t.table.shape == (3, 2)
    assert t.table[0].tolist() == [k.data_ptr(), v.data_ptr()]
    assert t.table[1].tolist() == [96, 96] and t.table[2].tolist() == [96, 96]
    assert t.align == 16 and t.buffers[0] is k


def test_table_of_strided_views_and_odd_rows():
    host = torch.zeros(8, 4, 2, 6, dtype=torch.uint8)  # [slots, layers, H, D]: page-first layout
    t = RowTable.of([host[:, layer] for layer in range(4)])
    assert t.row_bytes == (12,) * 4 and t.table[1].tolist() == [48] * 4
    assert t.align == 4  # 12-byte rows
    odd = RowTable.of([torch.zeros(5, 3, dtype=torch.uint8)])
    assert odd.align == 1


def test_select_is_a_view_of_the_table():
    bufs = [torch.zeros(4, 16, dtype=torch.uint8) for _ in range(6)]
    t = RowTable.of(bufs)
    s = t.select(2, 4)
    assert s.buffers == tuple(bufs[2:4]) and s.table.data_ptr() == t.table[:, 2].data_ptr()
    assert s.table[0].tolist() == [bufs[2].data_ptr(), bufs[3].data_ptr()]
    with pytest.raises(IndexError, match=r"select\(4, 7\)"):
        t.select(4, 7)


@pytest.mark.parametrize(
    "buffers, exc, match",
    [
        ([], ValueError, "at least one tensor"),
        (torch.zeros(3, 4), TypeError, "sequence of tensors"),
        ([torch.zeros(3, 4), "x"], TypeError, r"buffers\[1\] must be a torch.Tensor, got str"),
        ([torch.zeros(())], ValueError, r"buffers\[0\] must have a row dimension"),
        ([torch.zeros(3, 4), torch.zeros(4, 4)], ValueError, r"buffers\[1\] must have 3 rows like buffers\[0\], got 4"),
        ([torch.zeros(3, 4, 2).transpose(1, 2)], ValueError, r"buffers\[0\] must have contiguous rows"),
        ([torch.zeros(3, 0)], ValueError, "at least one byte"),
    ],
    ids=["empty", "tensor-not-list", "not-tensor", "0-d", "rows-differ", "row-not-contiguous", "empty-rows"],
)
def test_table_rejects_bad_buffers(buffers, exc, match):
    with pytest.raises(exc, match=match):
        RowTable.of(buffers)


def test_table_device_must_be_reachable():
    with pytest.raises(ValueError, match="table_device must be the buffers' device cpu"):
        RowTable.of([torch.zeros(3, 4)], table_device="meta")


# --- the reference path against the model -----------------------------------------------------------


@st.composite
def copies(draw):
    rows_d = draw(st.integers(1, 12))
    same = draw(st.booleans())
    rows_s = rows_d if same else draw(st.integers(1, 12))
    n_buffers = draw(st.integers(1, 3))
    shapes = [draw(st.sampled_from([(3,), (2, 4), (1, 8), (5, 2)])) for _ in range(n_buffers)]
    dtype = draw(st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.float8_e5m2]))
    n = draw(st.integers(0, 16))
    di = draw(st.lists(st.integers(-2, rows_d + 1), min_size=n, max_size=n))
    si = draw(st.lists(st.integers(-2, rows_s + 1), min_size=n, max_size=n))
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    seed = draw(st.integers(0, 2**16))
    return rows_d, rows_s, same, shapes, dtype, di, si, index_dtype, seed


@given(copies())
def test_reference_matches_the_model(case):
    rows_d, rows_s, same, shapes, dtype, di, si, index_dtype, seed = case
    dst = RowTable.of(random_buffers(rows_d, shapes, dtype, seed))
    src = dst if same else RowTable.of(random_buffers(rows_s, shapes, dtype, seed + 1))
    expected = expected_rows(dst, src, di, si)
    copy_rows(dst, torch.tensor(di, dtype=index_dtype), src, torch.tensor(si, dtype=index_dtype))
    assert_rows(dst, expected)


@pytest.mark.parametrize(
    "di, si",
    [
        ([1, 2, 3], [2, 3, 1]),  # a cycle
        ([0, 1, 2, 3], [1, 2, 3, 4]),  # a chain: dst[i] == src[i + 1]
        ([4, 3, 2, 1], [3, 2, 1, 0]),  # the chain the other way
        ([1, 2, 3], [1, 2, 3]),  # dst == src
        ([5, 6, 5], [0, 1, 2]),  # a destination named twice
    ],
    ids=["cycle", "chain-down", "chain-up", "identity", "duplicate-dst"],
)
def test_reference_overlapping_moves(di, si):
    t = RowTable.of(random_buffers(8, [(4, 4), (2, 8)], torch.uint8, 7))
    expected = expected_rows(t, t, di, si)
    copy_rows(t, torch.tensor(di), t, torch.tensor(si))
    assert_rows(t, expected)


def test_nothing_valid_writes_nothing():
    t = RowTable.of(random_buffers(4, [(8,)], torch.uint8, 3))
    before = t.buffers[0].clone()
    copy_rows(t, torch.tensor([-1, 9, 2]), t, torch.tensor([0, 0, -5]))
    assert torch.equal(t.buffers[0], before)


def test_fp8_bit_patterns_are_copied_exactly():
    # Every FP8 byte (NaNs, negative zero, subnormals) lands bit for bit: bytes are copied, not values.
    src = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(256, 1).view(torch.float8_e4m3fn)
    dst = poison_(torch.empty(256, 1, dtype=torch.float8_e4m3fn))
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    copy_rows(RowTable.of([dst]), perm, RowTable.of([src]), torch.arange(256))
    assert torch.equal(dst.view(torch.uint8)[perm], src.view(torch.uint8))


# --- the kernel (interpreter) against the reference -------------------------------------------------


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    monkeypatch.setattr(C, "kernel_on_cpu", True)


KERNEL_CASES = {
    # name: (rows, shapes per buffer, dtype, dst index, src index, same table)
    "aligned-2buf": (16, [(2, 16), (2, 16)], torch.uint8, [3, 9, 0, 15], [1, 2, 14, 7], False),
    "k-v-row-lengths-differ": (12, [(3, 32), (3, 16)], torch.uint8, [1, 5, 11], [0, 6, 2], False),
    "odd-rows-align-1": (10, [(7,), (7,)], torch.uint8, [2, 3, 4], [5, 6, 7], False),
    "align-2": (10, [(3,)], torch.float16, [1, 2], [3, 4], False),
    "align-8": (10, [(3, 2)], torch.float32, [0, 9], [9, 0], False),
    "skips": (8, [(16,)], torch.uint8, [-1, 8, 3, 2, 100], [0, 1, 9, -3, 4], False),
    "cycle": (8, [(2, 16), (2, 16)], torch.uint8, [1, 2, 3], [2, 3, 1], True),
    "chain": (8, [(32,)], torch.uint8, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5], True),
    "identity": (8, [(32,)], torch.uint8, [1, 2, 3], [1, 2, 3], True),
    "move-with-skips": (8, [(64,)], torch.uint8, [2, -1, 3, 9], [3, 2, 8, 1], True),
}


@needs_interpreter
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_reference(kernel_on_cpu, name, index_dtype):
    rows, shapes, dtype, di, si, same = KERNEL_CASES[name]
    k_bufs = random_buffers(rows, shapes, dtype, 11)
    r_bufs = [b.clone() for b in k_bufs]
    k_src = None if same else random_buffers(rows, shapes, dtype, 12)
    kd = RowTable.of(k_bufs)
    ks = kd if same else RowTable.of(k_src)
    rd = RowTable.of(r_bufs)
    rs = rd if same else RowTable.of([b.clone() for b in k_src])
    d, s = torch.tensor(di, dtype=index_dtype), torch.tensor(si, dtype=index_dtype)
    expected = expected_rows(rd, rs, di, si)
    copy_rows_reference(rd, d, rs, s)
    copy_rows(kd, d, ks, s)
    assert_rows(rd, expected)
    for b, (x, y) in enumerate(zip(k_bufs, r_bufs)):
        assert_same_bytes(x.view(torch.uint8), y.view(torch.uint8), f"{name} buffer {b}")


@needs_interpreter
def test_kernel_loops_when_the_grid_is_capped(kernel_on_cpu):
    # One program walks every task: 3 buffers x 2 column chunks x 9 pair blocks with an 8-element
    # tile; the 48-byte rows end mid-chunk (column mask), the 32-byte rows have an empty chunk.
    shapes = [(64,), (48,), (32,)]
    bufs = random_buffers(20, shapes, torch.uint8, 5)
    src = random_buffers(20, shapes, torch.uint8, 6)
    d = torch.tensor([0, 4, 8, 12, 16, 19, 1, 2, 3])
    s = torch.tensor([19, 15, 11, 7, 3, 0, 5, 6, 7])
    dst, srct = RowTable.of(bufs), RowTable.of(src)
    expected = expected_rows(dst, srct, d.tolist(), s.tolist())
    tile = C.Tile(elems=8, num_warps=1)
    plan = plan_copy(9, 3, (32, 48, 64), 16, False, 1, tile)
    assert (plan.programs, plan.tasks, plan.chunks, plan.even) == (1, 3 * 2 * 9, 2, False)
    C.launch_copy_rows(dst, d, srct, s, max_programs=1, tile=tile)
    assert_rows(dst, expected)


@needs_interpreter
def test_kernel_strided_index_tensors(kernel_on_cpu):
    bufs = random_buffers(10, [(16,)], torch.uint8, 1)
    src = random_buffers(10, [(16,)], torch.uint8, 2)
    both = torch.tensor([[1, 8], [2, 7], [3, 6]])
    dst, srct = RowTable.of(bufs), RowTable.of(src)
    expected = expected_rows(dst, srct, [1, 2, 3], [8, 7, 6])
    copy_rows(dst, both[:, 0], srct, both[:, 1])  # stride 2
    assert_rows(dst, expected)


@needs_interpreter
def test_large_moves_go_through_staging(kernel_on_cpu, monkeypatch):
    # Above ONE_PASS_MAX_PAIRS pairs an aliasing copy stages through a device buffer, one group of
    # buffers at a time (STAGING_BYTES shrunk to force three groups).
    monkeypatch.setattr(C, "ONE_PASS_MAX_PAIRS", 4)
    monkeypatch.setattr(C, "STAGING_BYTES", 7 * 32)
    t = RowTable.of(random_buffers(12, [(32,), (16,), (32,)], torch.uint8, 9))
    di = [0, 1, 2, 3, 4, 5, 6, 11, -1]
    si = [1, 2, 3, 4, 5, 0, 20, 6, 3]  # a cycle of 6, a skipped source, a chain into 6 -> 11
    expected = expected_rows(t, t, di, si)
    copy_rows(t, torch.tensor(di), t, torch.tensor(si))
    assert_rows(t, expected)


# --- plans ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 255, 256, 1000, 1024])
def test_one_pass_plan_holds_every_pair(n):
    plan = plan_copy(n, 64, (1024,), 16, True, 1056, C.SM_TILE)
    assert plan.block_p >= n and plan.block_p * plan.block_w <= C.ONE_PASS_TILE.elems
    assert plan.block_w * 4 % 16 == 0  # whole 16-byte vectors
    assert plan.tasks == 64 * plan.chunks and plan.one_pass


def test_streaming_plan_caps_the_grid():
    plan = plan_copy(100_000, 64, (1024,), 16, False, 1056, C.SM_TILE)
    assert plan.programs == 1056 and plan.block_p * plan.block_w == 4096 and plan.even
    few = plan_copy(8192, 2, (1024,), 16, False, 8, C.FEW_PROGRAMS_TILE)
    assert few.programs == 8 and few.num_warps == 16
    one = plan_copy(1, 64, (1024,), 16, False, 1056, C.SM_TILE)
    assert one.programs == one.tasks == 64 and one.num_warps == 1


def test_launch_key_separates_what_triton_specialises_on():
    """Launches that share a compiled kernel (cached launcher) must agree on what Triton compiled it
    for: index dtypes, 16-byte alignment of every tensor, and per int whether it is 1, a multiple of
    16, and its integer type (i32 / i64 / u64 by range)."""
    plan = plan_copy(16, 2, (1024,), 16, False, 8, C.FEW_PROGRAMS_TILE)
    buf = torch.zeros(64, dtype=torch.int64)
    args = (buf, buf[2:], 16, 100)

    def key(*a, dev=0, p=plan, nreg=None):
        return launch_key(dev, p.constexprs, (p.num_warps, nreg), a[:2], a[2:])

    base = key(*args)
    assert key(buf[4:], buf[6:], 32, 101) == base  # other values, same classes: one kernel
    assert key(buf[1:], buf[2:], 16, 100) != base  # an address 8 bytes off 16
    assert key(buf.int(), buf[2:], 16, 100) != base  # int32 indices
    assert key(buf, buf[2:], 1, 100) != base  # 1
    assert key(buf, buf[2:], 17, 100) != base  # not a multiple of 16
    assert key(buf, buf[2:], 16, 2**31) != base  # past int32
    assert key(buf, buf[2:], 16, 2**31) != key(buf, buf[2:], 16, 2**63)  # i64 against u64
    assert key(buf, buf[2:], 16, -(2**31)) != key(buf, buf[2:], 16, -(2**31) - 16)  # i32 against i64
    assert key(*args, dev=1) != base
    assert key(*args, nreg=32) != base
    assert key(*args, p=plan_copy(16, 2, (1024,), 16, False, 4, C.FEW_PROGRAMS_TILE)) == base  # same plan
    assert key(*args, p=plan_copy(16, 2, (1024,), 8, False, 8, C.FEW_PROGRAMS_TILE)) != base  # other constexprs
    # The grid is not part of the key: pair counts with the same blocks share a compiled kernel.
    many, more = (plan_copy(n, 2, (1024,), 16, False, 8, C.FEW_PROGRAMS_TILE) for n in (4096, 8192))
    assert many.tasks != more.tasks and key(*args, p=many) == key(*args, p=more)


def test_cached_launches_pass_the_kernel_signature_in_order():
    """The compiled kernel's launcher takes every parameter positionally without checking their
    number: launch_copy_rows passes PARAMS' order, which must be the kernel's."""
    assert kernel_params(copy_rows_kernel.copy_rows) == C.PARAMS


def test_launch_key_agrees_with_triton_specialisation():
    """Arguments with equal key parts get equal specialisations from Triton itself (where this
    Triton exposes its specialiser)."""
    jit = pytest.importorskip("triton.runtime.jit")
    spec = getattr(jit, "native_specialize_impl", None)
    backend = getattr(getattr(jit, "BaseBackend", None), "__name__", None) and jit.BaseBackend
    if spec is None or not backend:
        pytest.skip("this Triton does not expose native_specialize_impl")
    buf = torch.zeros(64, dtype=torch.int64)
    tensors = [buf, buf[1:], buf[2:], buf[3:], buf.int(), buf.int()[1:], buf.int()[4:]]
    ints = [0, 1, 2, 15, 16, 17, 32, 2**31 - 16, 2**31 - 1, 2**31, 2**32, 2**63 - 16, 2**63, -16, -(2**31) - 16]
    plan = plan_copy(16, 2, (1024,), 16, False, 8, C.FEW_PROGRAMS_TILE)
    for group, part in ((tensors, lambda t: launch_key(0, plan.constexprs, (), (t,), ())[-1]),
                        (ints, lambda v: launch_key(0, plan.constexprs, (), (), (v,))[-1])):  # fmt: skip
        for a in group:
            for b in group:
                if part(a) == part(b):
                    assert spec(jit.BaseBackend, a, False, True, True)[:2] == spec(jit.BaseBackend, b, False, True, True)[:2], (a, b)


def test_one_pass_refuses_too_many_pairs():
    with pytest.raises(ValueError, match="at most 1024 pairs"):
        plan_copy(1025, 2, (16,), 16, True, 8, C.SM_TILE)
