"""The integrity checks of the state pool and the request tables, checked themselves: each problem
they can report is planted alone in a consistent pool or table, and exactly its report is expected."""

from __future__ import annotations

import re

import pytest

from kvassert import state_params
from kvpool import HybridReqToTokenPool, IntegrityError, MambaPool, ReqToTokenPool


def _slots():
    pool = MambaPool(size=5, cache_params=state_params(), device="cpu")
    pool.alloc_slots(3)  # 1, 2, 3 held; 4, 5 free
    pool.free([2])  # free list: 4, 5, 2
    return pool


SLOT_FAULTS = {
    "free-entry-out-of-range": (lambda p: p._slots._free.append(6), "1 free entries outside 1..5 (first: 6)"),
    "slot-0-listed-free": (lambda p: p._slots._free.append(0), "1 free entries outside 1..5 (first: 0)"),
    "listed-free-twice": (lambda p: p._slots._free.append(4), "1 slots listed free more than once"),
    "free-and-held": (lambda p: p._slots._free.append(1), "1 slots both free and held (first: 1)"),
    "neither-free-nor-held": (lambda p: p._slots._held.__setitem__(3, False), "1 slots neither free nor held (leaked)"),
}


@pytest.mark.parametrize("fault", list(SLOT_FAULTS))
def test_mamba_pool_integrity_reports_each_planted_fault(fault):
    pool = _slots()
    pool.check_integrity()
    plant, report = SLOT_FAULTS[fault]
    plant(pool)
    with pytest.raises(IntegrityError, match=f"^{re.escape('MambaPool integrity check failed: ' + report)}$"):
        pool.check_integrity()


def _rows():
    t = ReqToTokenPool(4, 4, "cpu")
    t.alloc(2)  # rows 0 and 1 held
    return t


ROW_FAULTS = {
    "free-row-out-of-range": (lambda t: t.free_slots.append(7),
                              "1 free rows outside 0..3 (first: 7); 3 rows listed free but 2 flagged free"),
    "listed-free-twice": (lambda t: t.free_slots.append(2), "1 rows listed free more than once"),
    "flagged-free-not-listed": (lambda t: t._is_free.__setitem__(0, True), "2 rows listed free but 3 flagged free"),
}


@pytest.mark.parametrize("fault", list(ROW_FAULTS))
def test_request_table_integrity_reports_each_planted_fault(fault):
    t = _rows()
    t.check_integrity()
    plant, report = ROW_FAULTS[fault]
    plant(t)
    with pytest.raises(IntegrityError, match=f"^{re.escape('ReqToTokenPool integrity check failed: ' + report)}$"):
        t.check_integrity()


def _table():
    t = HybridReqToTokenPool(size=3, mamba_size=9, max_context_len=4, device="cpu", cache_params=state_params())
    t.alloc(2)  # rows 0 and 1 with state slots 1 and 2
    return t


def _two_rows_one_slot(t):
    t.mamba_pool.free([t.mamba_slot(1)])
    t._row_slot[1] = t._row_slot[0]


def _spare(t):
    return t.mamba_pool.alloc_slots(1)


HYBRID_FAULTS = {
    "owner-lost": (lambda t: (t._owner.pop(2), ())[1],
                   "1 (slot, row) pairs differ between the owner map and the rows' slots (first: slot 2, row 1)"),
    "two-rows-one-slot": (lambda t: (_two_rows_one_slot(t), ())[1],
                          "3 (slot, row) pairs differ between the owner map and the rows' slots (first: slot 1, row 0); "
                          "1 state slots attached to two rows (first: 1)"),
    "external-not-handed-out": (lambda t: [7], "1 slots attached or external but not handed out (first: 7)"),
    "attached-and-external": (lambda t: [2], "1 slots both attached to a row and external (first: 2)"),
    "external-twice": (lambda t: _spare(t) * 2, "1 external slots listed twice"),
    "leaked": (lambda t: (_spare(t), ())[1],
               "1 state slots handed out but owned by no row and not external (leaked; first: 3)"),
}


@pytest.mark.parametrize("fault", list(HYBRID_FAULTS))
def test_hybrid_table_integrity_reports_each_planted_fault(fault):
    t = _table()
    t.check_integrity()
    plant, report = HYBRID_FAULTS[fault]
    external = plant(t)
    with pytest.raises(IntegrityError, match=f"^{re.escape('HybridReqToTokenPool integrity check failed: ' + report)}$"):
        t.check_integrity(external_slots=external)


def test_a_freed_rows_attached_state_is_owned_and_a_retaken_rows_is_leaked():
    t = _table()
    t.free(0)  # its state is still attached to it: owned, not leaked
    t.check_integrity()
    assert t.alloc(1) == [2] and t.alloc(1) == [0]  # a new request takes row 0: slot 1 is nobody's now
    with pytest.raises(IntegrityError, match=r"leaked; first: 1\)$"):
        t.check_integrity()
