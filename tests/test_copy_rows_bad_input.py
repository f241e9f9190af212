"""``copy_rows`` on bad input: every bad argument raises before anything is written, validate names the
index value and its position, partially overlapping tables are refused, an empty copy writes nothing,
and a row named twice gets one source whole.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import assert_same_bytes, fill_random_
from kvpool.kernels.copy_rows import launcher as C
from kvpool.kernels.copy_rows import RowTable, copy_rows, copy_rows_reference


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
    """An empty copy leaves every byte of both tables as it was (random bytes, so a row copied onto
    another would show)."""
    a, b = _tables()
    fill_random_(a.buffers, seed=1)
    fill_random_(b.buffers, seed=2)
    before = [t.clone() for t in [*a.buffers, *b.buffers]]
    copy_rows(b, torch.empty(0, dtype=torch.int64), a, torch.empty(0, dtype=torch.int32))
    for i, (now, was) in enumerate(zip([*a.buffers, *b.buffers], before)):
        assert_same_bytes(now, was, f"table buffer {i} after an empty copy")


def test_reference_a_row_named_twice_gets_one_source_whole():
    """index_put_ with a duplicated destination interleaved the duplicates' bytes on CPU (about half
    of the runs of this case, before the fix): the row must be one source's bytes, never a mix."""
    for _ in range(50):
        buf = torch.randint(0, 256, (31, 2, 256), dtype=torch.uint8)
        table = RowTable.of([buf])
        sources = (buf[0].clone(), buf[1].clone())
        copy_rows_reference(table, torch.zeros(9, dtype=torch.int64), table, torch.tensor([0, 0, 0, 0, 1, 0, 0, 0, 0]))
        assert any(torch.equal(buf[0], s) for s in sources), "row 0 mixes the bytes of its two sources"
