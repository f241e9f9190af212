"""``ReqToTokenPool``: the request table a scheduler keeps beside the slot allocators.

Row ``r`` of ``req_to_token`` lists, for the request holding row ``r``, the KV-cache slot of each of
its tokens in order; attention backends read it as their page table. Rows are handed out and taken
back on the host (a Python free list), so those checks are cheap and always on; ``write`` checks its
host tensors always and its device tensors under ``validate`` (docs/contract.md, "Allocators and the
request table").
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from kvpool.checks import INDEX_DTYPES, INTEGER_DTYPES, check_in_range, int_list, positive_int, resolve_device
from kvpool.config import validate_enabled
from kvpool.errors import IntegrityError

_INT32 = torch.iinfo(torch.int32)
#: What a request object (SGLang's ``Req``) is not.
_NOT_REQUESTS = (type(None), int, float, complex, str, bytes, torch.Tensor, list, tuple, dict)


def check_assignable(req: Any, attributes: Sequence[str], name: str, call: str) -> None:
    """Raise ``ValueError`` naming request ``name`` unless each of ``attributes`` can be assigned on
    it (``call`` sets them once it has changed the table): each is written back with its present value
    (None where it has none), which changes nothing a reader sees. A frozen dataclass or a class
    whose ``__slots__`` lacks the attribute is refused here, before anything changes."""
    for attr in attributes:
        try:
            setattr(req, attr, getattr(req, attr, None))
        except Exception as e:
            raise assignment_refused(name, attr, call, e) from e


def assignment_refused(name: str, attr: str, call: str, e: Exception) -> ValueError:
    """The error for request ``name`` refusing assignment of ``attr`` (``e``), which ``call`` sets."""
    return ValueError(f"{name} must accept assignment of {attr} ({call} sets it), got {type(e).__name__}: {e}")


class ReqToTokenPool:
    """Rows of token-slot indices, one row per running request.

    Parameters
    ----------
    size : rows (the most requests running at once).
    max_context_len : columns (the most tokens one request holds).
    device : where ``req_to_token`` lives (the pool's device, for the attention backend).
    enable_memory_saver : SGLang's; must be False, as for the pools (kvpool has no memory saver).
    validate : also check ``write``'s index and value tensors that live on a GPU (one
        synchronisation per write; host tensors are always checked); ``KVPOOL_VALIDATE=1`` turns it on.

    Attributes
    ----------
    req_to_token : Tensor [size, max_context_len] int32, zero-initialised.

    Unlike the slot allocators, bad frees (a row freed twice, out of range, listed twice) always
    raise ``ValueError``: the free list is on the host, so the check costs no synchronisation.

    Examples
    --------
    >>> table = ReqToTokenPool(4, max_context_len=16, device="cpu")
    >>> rows = table.alloc(2)
    >>> rows
    [0, 1]
    >>> table.write((rows[1], slice(0, 3)), torch.tensor([7, 8, 9], dtype=torch.int32))
    >>> table.req_to_token[1, :4].tolist()
    [7, 8, 9, 0]
    >>> table.free(rows)
    >>> table.available_size()
    4
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: str | torch.device,
        enable_memory_saver: bool = False,
        *,
        validate: bool = False,
    ) -> None:
        if enable_memory_saver not in (False, None):
            raise ValueError(
                f"enable_memory_saver must be False: kvpool has no memory saver, got {enable_memory_saver!r}"
            )
        self.size = positive_int(size, "size")
        self.max_context_len = positive_int(max_context_len, "max_context_len")
        self.device = resolve_device(device)
        self.validate = validate_enabled(validate)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._reset_rows()

    def available_size(self) -> int:
        """Free rows: how many ``alloc`` can hand out now."""
        return len(self.free_slots)

    def alloc(self, need_size: Union[int, Sequence[Any]]) -> Optional[list[int]]:
        """Hand out ``need_size`` rows, or return None (changing nothing) when fewer are free.

        ``need_size`` may also be SGLang's list of request objects: one with a ``req_pool_idx`` (a
        row handed out, kept by that request only) keeps it, the others get new rows, set as their
        ``req_pool_idx``; the rows of all of them come back in order. Everything is checked first
        (``ValueError``, nothing changed; see ``check_requests``)."""
        if isinstance(need_size, (list, tuple)):
            return self._alloc_requests(list(need_size))
        if isinstance(need_size, bool) or not isinstance(need_size, int) or need_size < 0:
            raise ValueError(f"need_size must be a non-negative int or a list of requests, got {need_size!r}")
        return self._take(need_size)

    def _take(self, n: int) -> Optional[list[int]]:
        if n > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        for r in rows:
            self._is_free[r] = False
        return rows

    def _alloc_requests(self, reqs: list[Any]) -> Optional[list[int]]:
        one = reqs[0] if len(reqs) == 1 else None
        if one is not None and self.free_slots and not isinstance(one, _NOT_REQUESTS) and getattr(one, "req_pool_idx", None) is None:
            return self._alloc_one(one)
        kept = self.check_requests(reqs, ("req_pool_idx",))
        fresh = self._take(sum(row is None for row in kept))
        if fresh is None:
            return None
        it = iter(fresh)
        for req, row in zip(reqs, kept):
            if row is None:
                req.req_pool_idx = next(it)
        return [req.req_pool_idx for req in reqs]

    def _alloc_one(self, req: Any) -> Optional[list[int]]:
        """``alloc([req])`` of one request without a row while a row is free, the common step: the
        front row becomes its ``req_pool_idx`` (a request that refuses the assignment raises before
        the table changes)."""
        row = self.free_slots[0]
        try:
            req.req_pool_idx = row
        except Exception as e:
            raise assignment_refused("reqs[0]", "req_pool_idx", "alloc", e) from e
        del self.free_slots[0]
        self._is_free[row] = False
        return [row]

    def check_requests(self, reqs: Sequence[Any], attributes: Sequence[str]) -> list[Optional[int]]:
        """The row each of SGLang's request objects ``reqs`` keeps (its ``req_pool_idx``), None for
        one that gets a new row, once every request is checked; changes nothing.

        ``ValueError`` naming the request for: an entry that is not a request object, the same
        request object listed twice, a ``req_pool_idx`` that is not a row handed out, a row kept by
        two requests, or a request that refuses assignment of one of ``attributes`` (the ones
        ``alloc`` sets; each is tried by writing its present value back, None where it has none)."""
        seen: dict[int, int] = {}
        kept: dict[int, int] = {}
        rows: list[Optional[int]] = []
        for pos, req in enumerate(reqs):
            if isinstance(req, _NOT_REQUESTS):
                raise ValueError(f"reqs[{pos}] must be a request object (SGLang's Req), got {req!r}")
            if id(req) in seen:
                raise ValueError(f"reqs[{pos}] is the same request object as reqs[{seen[id(req)]}]")
            seen[id(req)] = pos
            row = getattr(req, "req_pool_idx", None)
            if row is not None:
                if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.size or self._is_free[row]:
                    raise ValueError(f"reqs[{pos}].req_pool_idx = {row!r} is not a row handed out by this pool")
                if row in kept:
                    raise ValueError(f"reqs[{pos}].req_pool_idx = {row} is kept by reqs[{kept[row]}] too")
                kept[row] = pos
            rows.append(row)
        for pos, req in enumerate(reqs):
            check_assignable(req, attributes, f"reqs[{pos}]", "alloc")
        return rows

    def free(self, free_index: Union[int, Sequence[int], torch.Tensor, Any]) -> None:
        """Give back one row (an int) or several (a sequence of ints or a 1-D integer tensor), or
        a request's (SGLang's form: its ``req_pool_idx``, then set to None).

        Raises
        ------
        ValueError
            If a row is out of range, not handed out (double free), or listed twice, or the request
            has no row; nothing is freed.
        """
        if hasattr(free_index, "req_pool_idx") and not isinstance(free_index, torch.Tensor):
            req, row = free_index, free_index.req_pool_idx
            if type(row) is int and 0 <= row < self.size and not self._is_free[row]:  # a running request's row
                try:
                    req.req_pool_idx = None
                except Exception as e:
                    raise assignment_refused("req", "req_pool_idx", "free", e) from e
                self._is_free[row] = True
                self.free_slots.append(row)
                return
            if req.req_pool_idx is None:
                raise ValueError("free: the request has no req_pool_idx (a double free?)")
            check_assignable(req, ("req_pool_idx",), "req", "free")
            self._free_rows(int_list(req.req_pool_idx, "req.req_pool_idx"))
            req.req_pool_idx = None
            return
        self._free_rows(int_list(free_index, "free_index"))

    def _free_rows(self, rows: list[int]) -> None:
        seen: set[int] = set()
        for pos, r in enumerate(rows):
            if not 0 <= r < self.size:
                raise ValueError(f"free_index must hold rows in 0..{self.size - 1}, got {r} at position {pos}")
            if self._is_free[r] or r in seen:
                why = "which is listed twice" if r in seen else "which is already free"
                raise ValueError(
                    f"free_index must hold rows that are handed out, once each, got row {r} at position {pos}, "
                    f"{why} (a double free)"
                )
            seen.add(r)
        for r in rows:
            self._is_free[r] = True
        self.free_slots.extend(rows)

    def write(self, indices: Any, values: Any) -> None:
        """``req_to_token[indices] = values`` (SGLang's signature; any tensor indexing works), checked
        first, so that nothing is written when it raises.

        Parameters
        ----------
        indices : rows, or ``(rows, columns)``; each an int, a slice, an integer tensor or a list of
            ints (negative entries count from the end, as in Python indexing).
        values : the slots to store: an int or an int32/int64 tensor, every value within int32 (the
            table's dtype); any other type (a float, bool or uint64 tensor, a list) is refused.

        Raises
        ------
        IndexError
            Naming the first index outside its dimension.
        ValueError
            For values of another type, or naming the first value outside int32 (it would be stored
            truncated).

        Index and value tensors on the CPU are always checked; tensors on a GPU under ``validate``
        (reading them costs a synchronisation).
        """
        parts = indices if isinstance(indices, tuple) else (indices,)
        if not any(p is None or p is Ellipsis for p in parts):  # else dims shift: torch checks alone
            for dim, (part, size, what) in enumerate(zip(parts, self.req_to_token.shape, ("rows", "columns"))):
                self._check_index(part, size, "indices" if len(parts) == 1 else f"indices[{dim}]", what)
        self._check_values(values)
        self.req_to_token[indices] = values

    def _check_index(self, part: object, size: int, name: str, what: str) -> None:
        if isinstance(part, list) and all(type(p) is int for p in part):
            part = torch.tensor(part, dtype=torch.int64)
        if type(part) is int:
            if not -size <= part < size:
                raise IndexError(
                    f"{name} = {part} is out of range: {what} are 0..{size - 1} (negative entries count from the end)"
                )
        elif isinstance(part, torch.Tensor) and part.dtype in INTEGER_DTYPES and self._reads(part):
            check_in_range([(part, size, name)], what=what, wrap=True)

    def _check_values(self, values: object) -> None:
        if type(values) is int:
            values = torch.tensor([values], dtype=torch.int64)
        if not isinstance(values, torch.Tensor):
            raise ValueError(f"values must be an int or an int32/int64 tensor, got {type(values).__name__}")
        if values.dtype not in INDEX_DTYPES:  # a float, bool or uint64 tensor would be stored converted
            raise ValueError(f"values must be int32 or int64 (slots), got {values.dtype}")
        if values.dtype != torch.int64 or not values.numel() or not self._reads(values):
            return
        bad = (values < _INT32.min) | (values > _INT32.max)
        if bool(bad.any()):
            flat = int(torch.argmax(bad.reshape(-1).to(torch.uint8)))
            value = int(values.reshape(-1)[flat])
            raise ValueError(
                f"values must fit int32 (the dtype of req_to_token: {_INT32.min}..{_INT32.max}), got {value} "
                f"at flat position {flat}"
            )

    def _reads(self, t: torch.Tensor) -> bool:
        """Whether checking ``t``'s values is free (host memory) or asked for (``validate``)."""
        return t.device.type == "cpu" or self.validate

    def clear(self) -> None:
        """Every row free (contents are left as they are; rows are rewritten before they are read)."""
        self._reset_rows()

    def _reset_rows(self) -> None:
        self.free_slots: list[int] = list(range(self.size))
        self._is_free = [True] * self.size

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` (with counts) if the free list and the free flags disagree."""
        problems = []
        out_of_range = [r for r in self.free_slots if not (isinstance(r, int) and 0 <= r < self.size)]
        if out_of_range:
            problems.append(f"{len(out_of_range)} free rows outside 0..{self.size - 1} (first: {out_of_range[0]!r})")
        if len(set(self.free_slots)) != len(self.free_slots):
            problems.append(f"{len(self.free_slots) - len(set(self.free_slots))} rows listed free more than once")
        flagged = sum(self._is_free)
        if set(self.free_slots) != {r for r in range(self.size) if self._is_free[r]}:
            problems.append(f"{len(self.free_slots)} rows listed free but {flagged} flagged free")
        if problems:
            raise IntegrityError("ReqToTokenPool integrity check failed: " + "; ".join(problems))
