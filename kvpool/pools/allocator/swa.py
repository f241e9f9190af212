"""``SWATokenToKVPoolAllocator``: slots of an ``SWAKVPool``, a full allocator and a sliding-window
(SWA) allocator with the full-to-SWA index mapping between them.

Callers hold full slots. Every allocation takes as many slots in each part and records, for each
full slot, its SWA slot in the mapping (an int64 tensor on the device, 0 = no SWA part, its last
entry -1 so that -1 translates to -1). ``free_swa`` gives back only the SWA part of slots whose
tokens left the window; ``free`` gives back both. The rules are in docs/contract.md,
"Sliding-window attention".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from kvpool.checks import non_negative_int, positive_int
from kvpool.errors import IntegrityError
from kvpool.pools.allocator import checks
from kvpool.pools.allocator.base import TokenToKVPoolAllocator
from kvpool.pools.allocator.checks import Indices
from kvpool.pools.allocator.paged import PagedTokenToKVPoolAllocator
from kvpool.pools.allocator.state import AllocatorErrors, AllocatorState
from kvpool.pools.swa_pool import SWAKVPool, translate_slots

Part = TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator


@dataclass(frozen=True)
class SWAAllocatorState:
    """``backup_state()`` of an ``SWATokenToKVPoolAllocator``: both parts' snapshots and a copy of
    the mapping (taken on the device, nothing read back)."""

    full: AllocatorState
    swa: AllocatorState
    mapping: torch.Tensor


class SWATokenToKVPoolAllocator:
    """Hands out full slots of an ``SWAKVPool`` (or of two pools' sizes), each with a SWA slot.

    Parameters
    ----------
    size, size_swa : slots of the full part and of the SWA part.
    page_size : slots per page of both; 1 takes ``TokenToKVPoolAllocator`` for each part (``alloc``
        only, as in SGLang), above 1 ``PagedTokenToKVPoolAllocator`` (also ``alloc_extend`` and
        ``alloc_decode``).
    dtype : kept for SGLang compatibility, not used.
    device : where both parts' bookkeeping and the mapping live.
    kvcache : the ``SWAKVPool`` these slots index, or None; the mapping is registered with it, and
        each part must fit its pool.
    need_sort, validate : as for the part allocators (``KVPOOL_VALIDATE=1`` turns validate on).

    Attributes
    ----------
    full_attn_allocator, swa_attn_allocator : the parts.
    full_to_swa_index_mapping : Tensor [rows + 1] int64 on ``device``; ``rows`` is the full pool's
        ``size + page_size`` (the allocator's own when built without a pool).

    Examples
    --------
    >>> a = SWATokenToKVPoolAllocator(8, 4, 1)
    >>> full = a.alloc(3)
    >>> full, a.translate_loc_from_full_to_swa(full)
    (tensor([1, 2, 3]), tensor([1, 2, 3], dtype=torch.int32))
    >>> a.free_swa(full[:2])
    >>> a.full_available_size(), a.swa_available_size()
    (5, 3)
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: Optional[torch.dtype] = None,
        device: str | torch.device = "cpu",
        kvcache: Optional[SWAKVPool] = None,
        need_sort: bool = False,
        *,
        validate: bool = False,
    ) -> None:
        p = positive_int(page_size, "page_size")
        if kvcache is not None and not isinstance(kvcache, SWAKVPool):
            raise ValueError(f"kvcache must be an SWAKVPool or None, got {type(kvcache).__name__}")
        full_pool = kvcache.full_kv_pool if kvcache is not None else None
        swa_pool = kvcache.swa_kv_pool if kvcache is not None else None
        if p == 1:
            full: Part = TokenToKVPoolAllocator(size, dtype, device, full_pool, need_sort, validate=validate)
            swa: Part = TokenToKVPoolAllocator(size_swa, dtype, device, swa_pool, need_sort, validate=validate)
        else:
            full = PagedTokenToKVPoolAllocator(size, p, dtype, device, full_pool, need_sort, validate=validate)
            swa = PagedTokenToKVPoolAllocator(size_swa, p, dtype, device, swa_pool, need_sort, validate=validate)
        self.full_attn_allocator, self.swa_attn_allocator = full, swa
        self.page_size, self.dtype, self.device = p, dtype, full.device
        self.need_sort, self.validate = full.need_sort, full.validate
        self._size_full, self._size_swa = full.size, swa.size
        rows = full_pool.rows if full_pool is not None else full.size + p
        swa_rows = swa_pool.rows if swa_pool is not None else swa.size + p
        # A CPU allocator reads its arguments for free, and validate reads them anyway: there the
        # second part's own checks may refuse what the first accepted, so the first is backed up.
        self._checked = self.device.type == "cpu" or self.validate
        self._map = SlotMapping(rows, swa_rows, p, self.device)
        self.full_to_swa_index_mapping = self._map.tensor
        self._kvcache = kvcache
        if kvcache is not None:
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    # --- sizes -----------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """``min(size_full, size_swa)``: the slots a request can hold in both parts at most."""
        return min(self._size_full, self._size_swa)

    @property
    def size_full(self) -> int:
        """Slots of the full part."""
        return self._size_full

    @property
    def size_swa(self) -> int:
        """Slots of the SWA part."""
        return self._size_swa

    def available_size(self) -> int:
        """Slots ``alloc`` can hand out in both parts now: the smaller part's count (never waits)."""
        return min(self.full_attn_allocator.available_size(), self.swa_attn_allocator.available_size())

    def full_available_size(self) -> int:
        """The full part's ``available_size()`` (never waits)."""
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        """The SWA part's ``available_size()`` (never waits)."""
        return self.swa_attn_allocator.available_size()

    @property
    def is_not_in_free_group(self) -> bool:
        """False between ``free_group_begin()`` and ``free_group_end()``."""
        return self.full_attn_allocator.is_not_in_free_group

    def get_kvcache(self) -> Optional[SWAKVPool]:
        """The ``SWAKVPool`` given as ``kvcache`` (None if none was)."""
        return self._kvcache

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """SWA slots of full slots ``kv_indices`` as int32 (0: no SWA part, -1: padding or outside the
        full pool), through this allocator's mapping; no synchronisation."""
        if not isinstance(kv_indices, torch.Tensor) or kv_indices.dtype not in (torch.int32, torch.int64):
            got = kv_indices.dtype if isinstance(kv_indices, torch.Tensor) else type(kv_indices).__name__
            raise ValueError(f"kv_indices must be an int32 or int64 tensor, got {got}")
        if kv_indices.device != self.device:
            raise ValueError(f"kv_indices must be on the allocator's device {self.device}, got {kv_indices.device}")
        return self._map.translate(kv_indices).to(torch.int32)

    # --- allocation ------------------------------------------------------------------------------

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` full slots (a multiple of ``page_size``), each with a SWA slot; None, with
        nothing changed, when either part has too few free.

        Raises
        ------
        ValueError
            If ``need_size`` is not a non-negative multiple of ``page_size``.
        """
        n = non_negative_int(need_size, "need_size")
        if n % self.page_size:
            raise ValueError(f"need_size must be a multiple of page_size = {self.page_size}, got {n}")
        if not self._room(n):
            return None
        full = self.full_attn_allocator.alloc(n)
        swa = self.swa_attn_allocator.alloc(n)
        self._map.record(full, swa, inside=True)  # type: ignore[arg-type]
        return full

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """``PagedTokenToKVPoolAllocator.alloc_extend`` in both parts: the full part continues from
        ``last_loc``, the SWA part from ``last_loc`` translated through the mapping. Returns the full
        slots, or None, with nothing changed, when either part has too few pages free.

        Raises
        ------
        NotImplementedError
            With ``page_size`` 1 (as the token allocator; use ``alloc``).
        ValueError, IndexError
            As the paged allocator's, before anything changes; a refusal of the SWA part says so
            (its ``last_loc`` is the translated one).
        """
        if self.page_size == 1:
            return self.full_attn_allocator.alloc_extend()  # raises NotImplementedError
        checks.request_vectors(
            (prefix_lens_cpu, seq_lens_cpu), ("prefix_lens_cpu", "seq_lens_cpu"),
            (prefix_lens, seq_lens, last_loc), ("prefix_lens", "seq_lens", "last_loc"), self.device,
        )  # fmt: skip
        _, fresh = checks.extend_lengths(
            checks.as_int64(prefix_lens_cpu), checks.as_int64(seq_lens_cpu), extend_num_tokens, self.page_size
        )
        if not self._room(fresh * self.page_size):
            return None
        args = (prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu)
        return self._in_both(lambda part, last: part.alloc_extend(*args, last, extend_num_tokens), last_loc)

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """``PagedTokenToKVPoolAllocator.alloc_decode`` in both parts (the SWA part from the
        translated ``last_loc``): one full slot per request, or None, with nothing changed, when
        either part has too few pages free. Raises as ``alloc_extend``."""
        if self.page_size == 1:
            return self.full_attn_allocator.alloc_decode()  # raises NotImplementedError
        checks.request_vectors(
            (seq_lens_cpu,), ("seq_lens_cpu",), (seq_lens, last_loc), ("seq_lens", "last_loc"), self.device
        )  # fmt: skip
        fresh = checks.decode_lengths(checks.as_int64(seq_lens_cpu), self.page_size)
        if not self._room(fresh * self.page_size):
            return None
        return self._in_both(lambda part, last: part.alloc_decode(seq_lens, seq_lens_cpu, last), last_loc)

    def _room(self, n: int) -> bool:
        """Whether both parts can hand out ``n`` slots. Decided from the host counts; a part whose
        count falls short reads its device counts first (one synchronisation on a GPU when a free's
        count is still on its way back), exactly when its own allocation would."""
        for part in (self.full_attn_allocator, self.swa_attn_allocator):
            if part.available_size() < n:
                part.free_pages  # noqa: B018 -- reading the list makes the part's counts exact
                if part.available_size() < n:
                    return False
        return True

    def _in_both(
        self, call: Callable[[Part, torch.Tensor], Optional[torch.Tensor]], last_loc: torch.Tensor
    ) -> torch.Tensor:
        """Run an extension in the full part, then in the SWA part from the translated ``last_loc``,
        and record the mapping. Both parts have room (``_room``). Where the SWA part's checks may
        refuse what the full part accepted (``_checked``) the full part is backed up first and put
        back; elsewhere its host checks, the full part's, have passed already."""
        # The parts take any integer dtype; the translation indexes with it, so as int64.
        swa_last = self._map.translate(checks.as_int64(last_loc))
        backup = self.full_attn_allocator.backup_state() if self._checked else None
        full = call(self.full_attn_allocator, last_loc)
        try:
            swa = call(self.swa_attn_allocator, swa_last)
        except (ValueError, IndexError) as e:
            if backup is not None:
                self.full_attn_allocator.restore_state(backup)
            raise type(e)(f"the SWA part refused last_loc translated through the full-to-SWA mapping: {e}") from e
        self._map.record(full, swa, inside=self._checked)  # type: ignore[arg-type]
        return full  # type: ignore[return-value]

    # --- giving back -----------------------------------------------------------------------------

    def free(self, free_index: Indices) -> None:
        """Give back both parts of full slots ``free_index`` (a tensor on ``device`` or the CPU, or a
        sequence of ints) and clear their mapping. Slots whose SWA part is already freed free only
        their full part. Errors as the parts' ``free`` (under ``validate`` a slot not held raises),
        raised before anything is freed in either part."""
        slots = checks.free_index_slots(free_index, self.device)
        if slots.numel() == 0:
            return
        backup = self.full_attn_allocator.backup_state() if self.validate else None
        self.full_attn_allocator.free(slots)
        try:
            self._free_swa_slots(slots)
        except ValueError:
            if backup is not None:
                self.full_attn_allocator.restore_state(backup)
            raise

    def free_swa(self, free_index: Indices) -> None:
        """Give back only the SWA part of full slots ``free_index`` (tokens that left the window) and
        set their mapping to 0; the full slots stay held. Entries with no SWA part are skipped."""
        slots = checks.free_index_slots(free_index, self.device)
        if slots.numel():
            self._free_swa_slots(slots)

    def _free_swa_slots(self, slots: torch.Tensor) -> None:
        part = self.swa_attn_allocator
        if not self._checked and part.frees_through_mapping(slots.numel()):
            # One launch translates, frees (unmapped entries skipped) and clears the mapping.
            part.free_through_mapping(slots, self._map.tensor)
            return
        swa = self._map.translate(slots)
        if self._checked:  # host tensors, or validate: which entries are mapped is read here
            swa = swa[swa > 0]
            if swa.numel():
                self.swa_attn_allocator.free(swa)
        else:
            # Which entries are mapped is known only on the device: the part skips the others
            # (slot 0 or -1, padding) without a wait and without counting them as bad frees.
            self.swa_attn_allocator.free(swa, skip_padding=True)
        self._map.clear(slots)

    def free_group_begin(self) -> None:
        """Both parts start a free group: pages freed until ``free_group_end()`` wait there."""
        self.full_attn_allocator.free_group_begin()
        self.swa_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        """Both parts make the pages freed in the group available."""
        self.full_attn_allocator.free_group_end()
        self.swa_attn_allocator.free_group_end()

    def merge_and_sort_free(self) -> None:
        """Both parts merge their released pages into their free lists, sorted (reads the device)."""
        self.full_attn_allocator.merge_and_sort_free()
        self.swa_attn_allocator.merge_and_sort_free()

    # --- snapshots, reset, checks ----------------------------------------------------------------

    def backup_state(self) -> SWAAllocatorState:
        """Both parts' snapshots and a copy of the mapping; nothing read back."""
        return SWAAllocatorState(
            self.full_attn_allocator.backup_state(), self.swa_attn_allocator.backup_state(),
            self.full_to_swa_index_mapping.clone(),
        )  # fmt: skip

    def restore_state(self, state: SWAAllocatorState) -> None:
        """Return both parts and the mapping (in place: the pool keeps its reference) to a
        ``backup_state()``; ``ValueError`` for a state of another allocator's geometry, checked
        before anything changes."""
        if not isinstance(state, SWAAllocatorState):
            raise ValueError(f"state must be an SWAAllocatorState from backup_state(), got {type(state).__name__}")
        parts = (("full", self.full_attn_allocator, state.full), ("swa", self.swa_attn_allocator, state.swa))
        for name, part, sub in parts:
            fits = isinstance(sub, AllocatorState) and sub.owners.device == part.device
            if not (fits and (sub.page_size, sub.num_pages) == (part.page_size, part.num_pages)):
                raise ValueError(f"state.{name} must be a snapshot of this allocator's {name} part")
        m, mine = state.mapping, self.full_to_swa_index_mapping
        if not (isinstance(m, torch.Tensor) and (m.shape, m.dtype, m.device) == (mine.shape, mine.dtype, mine.device)):
            raise ValueError(f"state.mapping must be a copy of this allocator's mapping ([{self._map.rows + 1}] int64)")
        self.full_attn_allocator.restore_state(state.full)
        self.swa_attn_allocator.restore_state(state.swa)
        self.full_to_swa_index_mapping.copy_(m)

    def clear(self) -> None:
        """Every slot of both parts free, the mapping all 0 (its last entry stays -1)."""
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self._map.reset()

    def errors(self) -> AllocatorErrors:
        """Both parts' bad calls so far, summed (entries with no SWA part that a GPU free handed the
        SWA part are not counted). Waits for the device."""
        f, s = self.full_attn_allocator.errors(), self.swa_attn_allocator.errors()
        return AllocatorErrors(f.rejected_frees + s.rejected_frees, f.unrecorded + s.unrecorded)

    def debug_print(self) -> str:
        """One line per part, for logs (reads the device)."""
        return (
            f"#swa-available-size: {self.swa_available_size()}, #full-attn-available-size: "
            f"{self.full_available_size()}; full: {self.full_attn_allocator.debug_print()}; swa: "
            f"{self.swa_attn_allocator.debug_print()}"
        )

    def check_integrity(self) -> None:
        """Both parts' checks and the mapping's: every mapped full slot is held, its SWA slot is held
        by the SWA part, at the same page offset, and mapped from no other full slot; every held SWA
        slot is mapped; page 0 is unmapped and the last entry is -1. Reads everything to the host.

        Raises
        ------
        IntegrityError
            Listing every inconsistency found, with counts.
        """
        problems: list[str] = []
        for name, part in (("full", self.full_attn_allocator), ("swa", self.swa_attn_allocator)):
            try:
                part.check_integrity()
            except IntegrityError as e:
                problems.append(f"{name} part: {e}")
        problems += self._map.problems(
            self.full_attn_allocator.backup_state().owners.cpu(), self.swa_attn_allocator.backup_state().owners.cpu()
        )
        if problems:
            raise IntegrityError(f"{type(self).__name__} integrity check failed: " + "; ".join(problems))

    # --- CPU copies ------------------------------------------------------------------------------

    def get_cpu_copy(self, indices: torch.Tensor) -> Any:
        """``kvcache.get_cpu_copy(indices)`` (``ValueError`` without a kvcache)."""
        return self._pool("get_cpu_copy").get_cpu_copy(indices)

    def load_cpu_copy(self, kv_cache_cpu: Any, indices: torch.Tensor) -> None:
        """``kvcache.load_cpu_copy(kv_cache_cpu, indices)`` (``ValueError`` without a kvcache)."""
        self._pool("load_cpu_copy").load_cpu_copy(kv_cache_cpu, indices)

    def _pool(self, what: str) -> SWAKVPool:
        if self._kvcache is None:
            raise ValueError(
                f"{what} copies rows of the pool: construct SWATokenToKVPoolAllocator with kvcache=<an SWAKVPool>"
            )
        return self._kvcache


class SlotMapping:
    """The full-to-SWA index mapping of an ``SWATokenToKVPoolAllocator``: ``tensor`` [rows + 1] int64
    on the device, entry ``s`` the SWA slot of full slot ``s`` (0: none), the last entry -1. Every
    update stays inside it and keeps the last entry, whatever slots it is given; nothing waits.

    Parameters
    ----------
    rows, swa_rows : rows of the full and the SWA pool (``size + page_size``).
    page_size : slots per page of both.
    device : where the tensor lives.
    """

    def __init__(self, rows: int, swa_rows: int, page_size: int, device: torch.device) -> None:
        self.rows, self.swa_rows, self.page_size = rows, swa_rows, page_size
        self.tensor = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        self.tensor[-1] = -1

    def translate(self, loc: torch.Tensor) -> torch.Tensor:
        """``translate_slots(tensor, loc)``: int64 SWA slots, 0 unmapped, -1 outside the full pool."""
        return translate_slots(self.tensor, loc)

    def record(self, full: torch.Tensor, swa: torch.Tensor, inside: bool) -> None:
        """``mapping[full] = swa``. Unless both are known to be in their parts' ranges (``inside``), a
        full slot outside the pool (an unchecked ``last_loc`` on a GPU) is not recorded and a SWA slot
        outside its pool is recorded as 0, so that no index leaves the mapping and slot 0 stays
        unmapped; the parts' ``check_integrity`` report those slots."""
        p = self.page_size
        if not inside:
            ok = (full >= p) & (full < self.rows)
            swa = torch.where(ok, torch.where((swa >= p) & (swa < self.swa_rows), swa, 0), -1)
            full = torch.where(ok, full, self.rows)  # the last entry, which keeps its -1
        self.tensor[full] = swa

    def clear(self, slots: torch.Tensor) -> None:
        """Set the entries of full ``slots`` (int64, any values) to 0; slots outside the full pool
        change nothing."""
        inside = (slots >= 0) & (slots < self.rows)
        self.tensor[torch.where(inside, slots, self.rows)] = torch.where(inside, 0, -1)

    def reset(self) -> None:
        """Every entry 0 but the last (-1)."""
        self.tensor[:-1].zero_()

    def problems(self, full_owners: torch.Tensor, swa_owners: torch.Tensor) -> list[str]:
        """Inconsistencies of the mapping (read to the host) with the parts' holder counts per slot
        (host int32 tensors, as ``AllocatorState.owners``)."""
        mapping = self.tensor.cpu()
        p, problems = self.page_size, []
        if int(mapping[-1]) != -1:
            problems.append(f"the mapping's last entry must be -1, got {int(mapping[-1])}")
        m = mapping[:-1]
        page0 = (m[:p] != 0).nonzero().flatten()
        if page0.numel():
            problems.append(f"{page0.numel()} slots of page 0 mapped (first: {int(page0[0])})")
        full = (m > 0).nonzero().flatten()
        full = full[full >= p]
        swa = m[full]
        bad = ((m < 0) | (m >= swa_owners.numel())).nonzero().flatten()
        if bad.numel():
            problems.append(
                f"{bad.numel()} mapping entries outside 0..{swa_owners.numel() - 1} (first: full slot {int(bad[0])})"
            )
        keep = swa < swa_owners.numel()
        full, swa = full[keep], swa[keep]
        held_full = torch.zeros_like(m, dtype=torch.bool)
        held_full[: min(m.numel(), full_owners.numel())] = full_owners[: m.numel()] > 0
        for what, wrong in (
            ("mapped full slots not held by the full part", ~held_full[full]),
            ("mapped full slots whose SWA slot the SWA part does not hold", swa_owners[swa] <= 0),
            ("mapped full slots whose SWA slot is on SWA page 0", swa < p),
            ("mapped full slots at another page offset than their SWA slot", (full % p) != (swa % p)),
        ):
            if bool(wrong.any()):
                problems.append(f"{int(wrong.sum())} {what} (first: full slot {int(full[wrong][0])})")
        uniq, counts = torch.unique(swa, return_counts=True)
        twice = uniq[counts > 1]
        if twice.numel():
            problems.append(f"{twice.numel()} SWA slots mapped from more than one full slot (first: {int(twice[0])})")
        mapped = torch.zeros(swa_owners.numel(), dtype=torch.bool)
        mapped[swa] = True
        orphans = ((swa_owners > 0) & ~mapped).nonzero().flatten()
        if orphans.numel():
            problems.append(f"{orphans.numel()} SWA slots held but mapped from no full slot (first: {int(orphans[0])})")
        return problems
