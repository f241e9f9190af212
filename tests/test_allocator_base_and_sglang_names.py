"""The allocators' base class and SGLang's surface: the docstring examples run, the base class is
exported and both allocators derive from it, a subclass overriding ``clear`` constructs as in SGLang,
the methods left to subclasses raise ``NotImplementedError``, SGLang's attribute names keep their
meaning, and CPU copies delegate to the kvcache.
"""

from __future__ import annotations

import doctest

import pytest
import torch

import kvpool.pools.allocator.base as token_allocator_module
import kvpool.pools.allocator.paged as paged_allocator_module
from kvpool.pools.allocator import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

T = torch.tensor


def test_docstring_examples_run():
    for module in (token_allocator_module, paged_allocator_module):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


# --- the base class, SGLang's attribute names, CPU copies ------------------------------------------


def test_base_class_is_exported_and_both_allocators_derive_from_it():
    import kvpool
    import kvpool.pools

    assert kvpool.BaseTokenToKVPoolAllocator is kvpool.pools.BaseTokenToKVPoolAllocator is BaseTokenToKVPoolAllocator
    assert issubclass(TokenToKVPoolAllocator, BaseTokenToKVPoolAllocator)
    assert issubclass(PagedTokenToKVPoolAllocator, BaseTokenToKVPoolAllocator)


def test_a_subclass_that_overrides_clear_constructs_as_in_sglang():
    """SGLang's subclasses call super().__init__(size, page_size, dtype, device, kvcache, need_sort),
    set their own fields, then call their clear(); the base must not call it before those exist."""

    class Tracked(BaseTokenToKVPoolAllocator):
        def __init__(self, size: int) -> None:
            super().__init__(size, 1, torch.bfloat16, "cpu", None, False)
            self.handed_out: list[int] = []
            self.clear()

        def clear(self) -> None:
            super().clear()
            self.handed_out.clear()

        def alloc(self, need_size: int):
            out = super().alloc(need_size)
            if out is not None:
                self.handed_out += out.tolist()
            return out

    a = Tracked(4)
    assert a.alloc(2).tolist() == [1, 2] and a.handed_out == [1, 2]
    a.clear()
    assert a.handed_out == [] and a.available_size() == 4
    a.check_integrity()


def test_a_subclass_clear_may_assign_sglangs_lists():
    """SGLang's allocators' clear() assigns free_pages, release_pages and free_group directly."""

    class SGLangStyle(BaseTokenToKVPoolAllocator):
        def clear(self) -> None:
            super().clear()
            self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64)
            self.release_pages = torch.empty((0,), dtype=torch.int64)
            self.free_group = []

    a = SGLangStyle(4, 1)
    a.alloc(3)
    a.clear()
    assert a.free_pages.tolist() == [1, 2, 3, 4] and a.release_pages.tolist() == [] and a.free_group == []
    assert a.alloc(4).tolist() == [1, 2, 3, 4]
    a.check_integrity()
    with pytest.raises(ValueError, match="free_group must be a list of page tensors, got int"):
        a.free_group = 3


def test_base_class_methods_left_to_subclasses_raise_not_implemented():
    a = BaseTokenToKVPoolAllocator(8, 2)
    calls = (a.alloc_extend, a.alloc_decode, a.get_cpu_copy, a.load_cpu_copy,  # SGLang's base takes any arguments
             lambda: a.get_cpu_copy(T([2])), lambda: a.load_cpu_copy(None, T([2]), mamba_indices=None))
    for call in calls:
        with pytest.raises(NotImplementedError):
            call()
    assert a.alloc(4).tolist() == [2, 3, 4, 5]
    line = a.debug_print()
    assert isinstance(line, str) and "4 slots available" in line and "2 pages held" in line


def test_sglang_attribute_names_keep_sglangs_meaning():
    a = PagedTokenToKVPoolAllocator(16, 4, need_sort=True)
    assert a.free_pages.tolist() == [1, 2, 3, 4] and a.release_pages.tolist() == []  # page ids
    assert a.is_not_in_free_group and a.free_group == []
    s = a.alloc(12)
    a.free(s[4:8])
    assert a.free_pages.tolist() == [4] and a.release_pages.tolist() == [2]  # need_sort: set aside
    a.free_group_begin()
    assert not a.is_not_in_free_group
    a.free(s[:4])
    assert [t.tolist() for t in a.free_group] == [[1]] and a.available_size() == 8
    a.free_group_end()
    assert a.release_pages.tolist() == [2, 1]
    a.merge_and_sort_free()
    assert a.free_pages.tolist() == [1, 2, 4] and a.release_pages.tolist() == []
    t = TokenToKVPoolAllocator(3)
    t.alloc(1)
    assert t.free_pages.tolist() == [2, 3]  # page size 1: page ids are slot ids


class FakeKVCache:
    def __init__(self):
        self.calls = []

    def get_cpu_copy(self, indices):
        self.calls.append(("get", indices.tolist()))
        return [f"rows {indices.tolist()}"]

    def load_cpu_copy(self, kv_cache_cpu, indices):
        self.calls.append(("load", kv_cache_cpu, indices.tolist()))


@pytest.mark.parametrize(
    "make",
    [lambda kv: TokenToKVPoolAllocator(8, kvcache=kv), lambda kv: PagedTokenToKVPoolAllocator(8, 2, kvcache=kv)],
    ids=["token", "paged"],
)
def test_cpu_copies_delegate_to_the_kvcache(make):
    kv = FakeKVCache()
    a = make(kv)
    idx = a.alloc(2)
    copy = a.get_cpu_copy(idx)
    assert copy == [f"rows {idx.tolist()}"]
    assert a.load_cpu_copy(copy, idx, mamba_indices=None) is None
    assert kv.calls == [("get", idx.tolist()), ("load", copy, idx.tolist())]
    with pytest.raises(ValueError, match="mamba_indices must be None"):
        a.get_cpu_copy(idx, mamba_indices=T([0]))
    no_pool = make(None)
    with pytest.raises(ValueError, match="get_cpu_copy copies rows of the pool .* with kvcache=.*got kvcache=None"):
        no_pool.get_cpu_copy(idx)
    with pytest.raises(ValueError, match="load_cpu_copy"):
        make(object()).load_cpu_copy(copy, idx)
