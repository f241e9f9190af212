"""Row copies: copy_rows (the reference path against a plain-Python model of the bytes, with
hypothesis; the Triton kernel through the interpreter against the reference on small deliberate
shapes; its plans, launch keys and errors), MHATokenToKVPool.move_kv_cache and
get_cpu_copy/load_cpu_copy on CPU pools (the reference path against a model of the bytes, and the
row-copy kernel through the interpreter on the same pools); on a GPU, copy_rows, the moves and the CPU
copies on real sizes; and the row-copy kernel compiled for real GPU targets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvassert import assert_same_bytes, cross_compile, fill_random_, gpu, needs_interpreter, no_sync, poison_, random_cuda_pool
from kvpool import MHATokenToKVPool
from kvpool.kernels.copy_rows import launcher as C
from kvpool.kernels.copy_rows import RowTable, copy_rows, copy_rows_reference, plan_copy
from kvpool.kernels.launch import kernel_params, launch_key
from kvpool.pools.cpu_copy import KVCpuCopy


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
    monkeypatch.setattr(C, "_kernel_on_cpu", True)


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
    assert kernel_params(C._k._copy_rows_kernel) == C.PARAMS


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


# --- errors -----------------------------------------------------------------------------------------


def _tables():
    a = RowTable.of([torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 4, dtype=torch.float32)])
    b = RowTable.of([torch.zeros(6, 16, dtype=torch.uint8), torch.zeros(6, 16, dtype=torch.uint8)])
    return a, b


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("dst-not-table", TypeError, "dst must be a RowTable, got list"),
        ("buffer-count", ValueError, r"src must have as many buffers as dst \(2\), got 1"),
        ("row-bytes", ValueError, "src buffer 1 must have rows of 16 bytes like dst buffer 1, got 8"),
        ("float-index", ValueError, "dst_index must be int32 or int64, got torch.float32"),
        ("2d-index", ValueError, r"src_index must be 1-D, got shape \(2, 1\)"),
        ("lengths", ValueError, r"src_index must have as many entries as dst_index \(2\), got 3"),
        ("index-not-tensor", TypeError, "dst_index must be a torch.Tensor, got list"),
        ("max-programs", ValueError, "max_programs must be a positive int, got 0"),
    ],
)
def test_bad_arguments_raise_before_anything_is_written(case, exc, match):
    a, b = _tables()
    before = [t.clone() for t in b.buffers]
    d, s = torch.tensor([1, 2]), torch.tensor([3, 4])
    kwargs = {}
    dst, src = b, a
    if case == "dst-not-table":
        dst = [torch.zeros(1)]
    elif case == "buffer-count":
        src = RowTable.of([torch.zeros(8, 16, dtype=torch.uint8)])
    elif case == "row-bytes":
        src = RowTable.of([torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 8, dtype=torch.uint8)])
    elif case == "float-index":
        d = d.float()
    elif case == "2d-index":
        s = torch.tensor([[3], [4]])
    elif case == "lengths":
        s = torch.tensor([1, 2, 3])
    elif case == "index-not-tensor":
        d = [1, 2]
    elif case == "max-programs":
        kwargs["max_programs"] = 0
    with pytest.raises(exc, match=match):
        copy_rows(dst, d, src, s, **kwargs)
    for t, x in zip(b.buffers, before):
        assert torch.equal(t, x)


def test_validate_names_the_index_value_and_position():
    a, b = _tables()
    before = [t.clone() for t in b.buffers]
    with pytest.raises(IndexError, match=r"src_index\[2\] = 8 is out of range: rows are 0..7"):
        copy_rows(b, torch.tensor([1, 2, 3]), a, torch.tensor([0, -1, 8]), validate=True)
    with pytest.raises(IndexError, match=r"dst_index\[0\] = 6 is out of range: rows are 0..5"):
        copy_rows(b, torch.tensor([6, 2, 3]), a, torch.tensor([0, -1, 1]), validate=True)
    for t, x in zip(b.buffers, before):
        assert torch.equal(t, x)
    copy_rows(b, torch.tensor([-1, 2]), a, torch.tensor([0, 7]), validate=True)  # padding passes


def test_partially_overlapping_tables_are_refused():
    store = torch.zeros(10, 16, dtype=torch.uint8)
    a = RowTable.of([store[:8]])
    shifted = RowTable.of([store[2:]])
    with pytest.raises(ValueError, match="dst buffer 0 shares memory with src buffer 0"):
        copy_rows(a, torch.tensor([0]), shifted, torch.tensor([1]))
    two = RowTable.of([store[:5], store[5:]])
    swapped = RowTable.of([store[5:], store[:5]])
    with pytest.raises(ValueError, match="shares memory"):
        copy_rows(two, torch.tensor([0]), swapped, torch.tensor([1]))
    assert C.aliases(two, RowTable.of([store[:5], store[5:]]))  # same buffers, another table object


def test_empty_copy_is_a_no_op():
    a, b = _tables()
    copy_rows(b, torch.empty(0, dtype=torch.int64), a, torch.empty(0, dtype=torch.int32))


def test_reference_a_row_named_twice_gets_one_source_whole():
    """index_put_ with a duplicated destination interleaved the duplicates' bytes on CPU (about half
    of the runs of this case, before the fix): the row must be one source's bytes, never a mix."""
    for _ in range(50):
        buf = torch.randint(0, 256, (31, 2, 256), dtype=torch.uint8)
        table = RowTable.of([buf])
        sources = (buf[0].clone(), buf[1].clone())
        copy_rows_reference(table, torch.zeros(9, dtype=torch.int64), table, torch.tensor([0, 0, 0, 0, 1, 0, 0, 0, 0]))
        assert any(torch.equal(buf[0], s) for s in sources), "row 0 mixes the bytes of its two sources"


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
