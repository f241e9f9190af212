"""``HybridReqToTokenPool``: the request table of a hybrid linear-attention model, with a state
slot per request.

Each running request holds a row of ``req_to_token`` (its KV slots, for the full-attention layers)
and a slot of the ``MambaPool`` (its linear layers' state); with SGLang's ``extra_buffer`` strategy
also track slots, where its state is snapshotted at track points for a prefix cache. A request that
keeps its row (a chunked prefill's next chunk, a resumed request) keeps its slots. Freeing the row
(``free``) and freeing the state (``free_mamba_cache``) are separate calls, as in SGLang, because a
prefix cache may take over a finished request's state instead of freeing it; they work in either
order. Every call checks all it is given (rows and slots handed out, owned as the call assumes)
before it changes anything.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from kvpool.checks import int_list, is_int, non_negative_int, one_slot
from kvpool.errors import IntegrityError
from kvpool.pools.hybrid_views import HybridStateViews
from kvpool.pools.mamba_pool import MambaPool
from kvpool.pools.req_to_token import ReqToTokenPool, check_assignable
from kvpool.pools.state_params import MambaCacheParams
from kvpool.pools.state_slots import as_slot_list


#: The request attributes ``alloc(reqs)`` may set.
_SETS = ("req_pool_idx", "mamba_pool_idx", "mamba_ping_pong_track_buffer", "mamba_next_track_idx")


class HybridReqToTokenPool(HybridStateViews, ReqToTokenPool):
    """``ReqToTokenPool`` plus one ``MambaPool`` slot per request (SGLang's class and keywords).

    Parameters
    ----------
    size, max_context_len, device, enable_memory_saver : as for ``ReqToTokenPool``.
    mamba_size : state slots of the ``MambaPool`` (``mamba_pool``).
    mamba_spec_state_size : batch positions of speculative scratch (default ``size``).
    cache_params : the state's shapes, dtypes and linear layers (``MambaCacheParams`` or SGLang's
        ``Mamba2CacheParams``).
    enable_mamba_extra_buffer : give each request ``mamba_ping_pong_track_buffer_size`` track
        slots (2 without speculative decoding, 1 with it, as SGLang).
    speculative_num_draft_tokens : ``K`` for the pool's scratch, or None.
    mamba_layer_ids : if given, must equal ``cache_params.layers``.
    enable_mamba_extra_buffer_lazy : must be False (not provided).
    enable_overlap_schedule, start_layer : accepted, no effect.
    validate : passed to the ``MambaPool``.

    Attributes
    ----------
    mamba_pool : the ``MambaPool``.
    req_index_to_mamba_index_mapping : Tensor [size] int32 on the device: row -> state slot (rows
        without a state hold stale values).
    req_index_to_mamba_ping_pong_track_buffer_mapping : Tensor [size, track slots] int32 (with the
        extra buffer).
    mamba_map : dict, global linear layer id -> dense index.

    ``alloc`` takes a count (rows for new requests, each with fresh zeroed slots) or, as SGLang,
    a list of request objects with ``req_pool_idx``, ``mamba_pool_idx`` (and, with the extra
    buffer, ``mamba_ping_pong_track_buffer`` and ``mamba_next_track_idx``) attributes, reusing the
    row and slots of those that have them.

    Examples
    --------
    >>> from kvpool.pools.state_params import MambaCacheParams, MambaStateShape
    >>> params = MambaCacheParams(MambaStateShape(conv=(24, 3), temporal=(2, 4, 4)), layers=[0, 1, 2])
    >>> table = HybridReqToTokenPool(size=4, mamba_size=8, max_context_len=32, device="cpu",
    ...                              cache_params=params, enable_mamba_extra_buffer=True)
    >>> rows = table.alloc(2)
    >>> rows, table.mamba_slot(rows[1]), table.track_slots(rows[1])
    ([0, 1], 4, (5, 6))
    >>> table.free_mamba_cache(rows[1]); table.free(rows[1])
    >>> table.mamba_pool.available_size()
    5
    """

    def __init__(
        self,
        *,
        size: int,
        mamba_size: int,
        mamba_spec_state_size: Optional[int] = None,
        max_context_len: int,
        device: str | torch.device,
        enable_memory_saver: bool = False,
        cache_params: object,
        enable_mamba_extra_buffer: bool = False,
        speculative_num_draft_tokens: Optional[int] = None,
        mamba_layer_ids: Optional[Sequence[int]] = None,
        enable_mamba_extra_buffer_lazy: bool = False,
        enable_overlap_schedule: bool = True,
        start_layer: Optional[int] = None,
        validate: bool = False,
    ) -> None:
        super().__init__(size, max_context_len, device, enable_memory_saver)
        params = MambaCacheParams.of(cache_params)
        if mamba_layer_ids is not None and tuple(mamba_layer_ids) != params.layers:
            raise ValueError(
                f"mamba_layer_ids must equal cache_params.layers {list(params.layers)}, got {list(mamba_layer_ids)}"
            )
        if enable_mamba_extra_buffer_lazy:
            raise ValueError("enable_mamba_extra_buffer_lazy must be False: kvpool has no lazy track buffers")
        for name, flag in (
            ("enable_mamba_extra_buffer", enable_mamba_extra_buffer),
            ("enable_overlap_schedule", enable_overlap_schedule),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        self.enable_mamba_extra_buffer = enable_mamba_extra_buffer
        self.mamba_ping_pong_track_buffer_size = 2 if speculative_num_draft_tokens is None else 1
        self.start_layer = start_layer
        self.mamba_pool = MambaPool(
            size=mamba_size, spec_state_size=size if mamba_spec_state_size is None else mamba_spec_state_size,
            cache_params=params, device=self.device, speculative_num_draft_tokens=speculative_num_draft_tokens,
            validate=validate,
        )  # fmt: skip
        self.mamba_map = {layer: i for i, layer in enumerate(params.layers)}
        self.req_index_to_mamba_index_mapping = torch.zeros(size, dtype=torch.int32, device=self.device)
        if enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping = torch.zeros(
                (size, self.mamba_ping_pong_track_buffer_size), dtype=torch.int32, device=self.device
            )
        self._clear_rows()

    @property
    def track_slots_per_request(self) -> int:
        """Track slots a request holds beside its own state slot (0 without the extra buffer)."""
        return self.mamba_ping_pong_track_buffer_size if self.enable_mamba_extra_buffer else 0

    def available_size(self) -> int:
        """New requests ``alloc`` can take now: free rows, or free state slots over the slots a
        request takes (1 + its track slots), whichever is fewer (an admission gate)."""
        return min(len(self.free_slots), self.mamba_pool.available_size() // (1 + self.track_slots_per_request))

    def _clear_rows(self) -> None:
        self._row_slot = [0] * self.size  # host mirror of the mapping; 0: no state
        self._row_track: list[tuple[int, ...]] = [()] * self.size
        self._owner: dict[int, int] = {}  # attached state or track slot -> its row (held, or freed before its state)
        self._row_req: list[Any] = [None] * self.size  # the request object alloc(reqs) gave each row

    def _attach(self, row: int, main: int, track: tuple[int, ...]) -> None:
        self._detach(row)
        for s in (main, *track):
            prev = self._owner.get(s)
            if prev is not None:  # a freed row's state, taken over by the request that carries it
                self._row_slot[prev] = 0 if self._row_slot[prev] == s else self._row_slot[prev]
                self._row_track[prev] = tuple(t for t in self._row_track[prev] if t != s)
            self._owner[s] = row
        self._row_slot[row], self._row_track[row] = main, track

    def _detach(self, row: int) -> None:
        for s in (self._row_slot[row], *self._row_track[row]):
            if s and self._owner.get(s) == row:
                del self._owner[s]
        self._row_slot[row], self._row_track[row] = 0, ()

    # --- allocation ------------------------------------------------------------------------------

    def alloc(self, need_size: int | Sequence[Any]) -> Optional[list[int]]:  # type: ignore[override]
        """Rows for requests, each with a state slot (and track slots with the extra buffer).

        ``need_size`` is a count (that many new requests, fresh rows and slots) or a list of
        request objects (SGLang's form): one with a
        ``req_pool_idx`` keeps its row and the row's slots; one with a ``mamba_pool_idx`` (an int or
        a one-entry tensor, a slot handed out that no other running row holds) or a
        ``mamba_ping_pong_track_buffer`` keeps those; the others get new ones, and the attributes are
        set (``mamba_pool_idx`` a 0-D int64 tensor on the device, ``mamba_ping_pong_track_buffer``
        a [track slots] tensor, ``mamba_next_track_idx`` 0 with new track slots). New slots are
        zeroed in one launch.

        Returns the rows, or None with nothing changed when too few rows or state slots are free.
        Every request is checked first (``ValueError``, nothing changed): the same request object
        listed twice, one that refuses assignment of these attributes, a kept row or slot that is
        not handed out, one kept by two requests, a slot another running row holds, a
        ``mamba_pool_idx`` other than the kept row's. A kept row's device ``mamba_pool_idx`` and
        track buffer are not read (no synchronisation) when ``alloc(reqs)`` gave that row to this
        very request object and ``validate`` is off; otherwise they are read and checked.
        """
        if isinstance(need_size, bool) or not isinstance(need_size, (int, list, tuple)):
            raise ValueError(f"need_size must be a non-negative int or a list of requests, got {need_size!r}")
        if isinstance(need_size, int):
            plans: list[tuple[Optional[int], Optional[int], Optional[tuple[int, ...]]]] = [
                (None, None, None)
            ] * non_negative_int(need_size, "need_size")
        else:
            kept = self.check_requests(need_size, _SETS if self.enable_mamba_extra_buffer else _SETS[:2])
            plans = [self._plan(pos, req, row) for pos, (req, row) in enumerate(zip(need_size, kept))]
            self._check_distinct(plans)
        per_track = self.track_slots_per_request
        new_rows = sum(row is None for row, _, _ in plans)
        new_slots = sum(main is None for _, main, _ in plans) + per_track * sum(t is None for _, _, t in plans)
        if new_rows > len(self.free_slots) or new_slots > self.mamba_pool.available_size():
            return None
        fresh = self.mamba_pool.alloc_slots(new_slots) or []
        # The new rows are the free list's front, which the table's alloc takes once the slots are zeroed.
        fresh_rows, it = iter(self.free_slots[:new_rows]), iter(fresh)
        rows, mains, tracks = [], [], []
        for row, main, track in plans:
            rows.append(next(fresh_rows) if row is None else row)
            mains.append(next(it) if main is None else main)
            tracks.append(tuple(next(it) for _ in range(per_track)) if track is None else track)
        if not rows:
            return rows
        # One copy to the device for what it needs of this call: new slots, rows, state slots, track slots.
        n, k, flat = len(rows), len(fresh), [s for t in tracks for s in t]
        try:
            ints = self.mamba_pool.slots_tensor(fresh + rows + mains + flat)
            if fresh:
                self.mamba_pool.clear_slots(ints[:k])
        except BaseException:  # the upload or the zeroing refused: nothing taken
            if fresh:
                self.mamba_pool.free(fresh)
            raise
        super().alloc(new_rows)
        for row, main, track in zip(rows, mains, tracks):
            self._attach(row, main, track)
        for row, req in zip(rows, [None] * n if isinstance(need_size, int) else need_size):
            self._row_req[row] = req
        rows_d, mains_d, flat_d = ints[k : k + n], ints[k + n : k + 2 * n], ints[k + 2 * n :]
        self._write_mappings(rows_d, mains_d, flat_d)
        if not isinstance(need_size, int):
            self._set_request_attributes(list(need_size), plans, rows, mains_d, flat_d)
        return rows

    def _plan(
        self, pos: int, req: Any, row: Optional[int]
    ) -> tuple[Optional[int], Optional[int], Optional[tuple[int, ...]]]:
        """(kept row, kept state slot, kept track slots) of request ``pos``, None where it gets a new one."""
        main = self._given_slot(req, pos, row)
        track = self._given_track(req, pos, row)
        if row is not None and self._row_slot[row]:  # the row keeps its own slots
            if main is not None and main != self._row_slot[row]:
                raise ValueError(
                    f"reqs[{pos}].mamba_pool_idx = {main}, but its row {row} holds state slot {self._row_slot[row]}"
                )
            if track is not None and track != self._row_track[row]:
                raise ValueError(
                    f"reqs[{pos}].mamba_ping_pong_track_buffer = {list(track)}, but its row {row} holds track "
                    f"slots {list(self._row_track[row])}"
                )
            return row, self._row_slot[row], self._row_track[row] if self.enable_mamba_extra_buffer else ()
        for s, what in [(main, "mamba_pool_idx"), *((t, "mamba_ping_pong_track_buffer") for t in track or ())]:
            owner = self._owner.get(s) if s is not None else None
            if owner is not None and not self._is_free[owner]:
                raise ValueError(f"reqs[{pos}].{what} holds slot {s}, a state slot of running row {owner}")
        return row, main, (track if self.enable_mamba_extra_buffer else ())

    def _given_slot(self, req: Any, pos: int, row: Optional[int]) -> Optional[int]:
        value = getattr(req, "mamba_pool_idx", None)
        if value is None:
            return None
        name = f"reqs[{pos}].mamba_pool_idx"
        if self._trusts_row(req, row, value, self._row_slot):
            return None  # the row's slot is known on the host: no synchronisation
        slot = one_slot(value, name)
        if not self.mamba_pool.is_held(slot):
            raise ValueError(f"{name} = {slot} is not a state slot handed out by this pool")
        return slot

    def _given_track(self, req: Any, pos: int, row: Optional[int]) -> Optional[tuple[int, ...]]:
        value = getattr(req, "mamba_ping_pong_track_buffer", None)
        if not self.enable_mamba_extra_buffer or value is None:
            return None
        name = f"reqs[{pos}].mamba_ping_pong_track_buffer"
        if self._trusts_row(req, row, value, self._row_track):
            return None
        track = tuple(as_slot_list(value, name))
        if len(track) != self.mamba_ping_pong_track_buffer_size:
            want = self.mamba_ping_pong_track_buffer_size
            raise ValueError(f"{name} must hold {want} track slots, got {list(track)}")
        for i, s in enumerate(track):
            if not self.mamba_pool.is_held(s):
                raise ValueError(f"{name}[{i}] = {s} is not a state slot handed out by this pool")
        return track

    def _trusts_row(self, req: Any, row: Any, value: object, mirror: list) -> bool:
        """Whether ``req``'s device ``value`` may be taken as the host mirror's entry of its row
        (unread, no synchronisation): the row is this request's (``alloc(reqs)`` gave it to this
        very object, so a stale ``req_pool_idx`` never names another request's slots), it has slots,
        and ``validate`` is off."""
        return (
            is_int(row) and 0 <= row < self.size and self._row_req[row] is req and bool(mirror[row])
            and isinstance(value, torch.Tensor) and value.device.type != "cpu" and not self.mamba_pool.validate
        )  # fmt: skip

    @staticmethod
    def _check_distinct(plans: list[tuple[Optional[int], Optional[int], Optional[tuple[int, ...]]]]) -> None:
        slots: dict[int, int] = {}
        for pos, (_, main, track) in enumerate(plans):
            for s in (() if main is None else (main,)) + (track or ()):
                if s in slots:
                    raise ValueError(f"reqs[{pos}] names state slot {s}, which reqs[{slots[s]}] holds too")
                slots[s] = pos

    def _write_mappings(self, rows: torch.Tensor, mains: torch.Tensor, flat: torch.Tensor) -> None:
        """The device mappings of ``rows`` (int64 on the device) to their state slots ``mains`` and,
        with the extra buffer, their track slots ``flat`` (row after row)."""
        self.req_index_to_mamba_index_mapping[rows] = mains.to(torch.int32)
        if self.enable_mamba_extra_buffer:
            track = flat.to(torch.int32).view(rows.shape[0], self.mamba_ping_pong_track_buffer_size)
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[rows] = track

    def _set_request_attributes(self, reqs, plans, rows, mains: torch.Tensor, flat: torch.Tensor) -> None:
        """Each request's attributes: ``mains`` and ``flat`` (track slots, row after row) are int64 on
        the device, one entry per request."""
        new_track = flat.view(len(reqs), self.track_slots_per_request)
        for i, (req, (row, _, track)) in enumerate(zip(reqs, plans)):
            if row is None:
                req.req_pool_idx = rows[i]
            if getattr(req, "mamba_pool_idx", None) is None:
                req.mamba_pool_idx = mains[i]
            if self.enable_mamba_extra_buffer:
                if getattr(req, "mamba_ping_pong_track_buffer", None) is None:
                    req.mamba_ping_pong_track_buffer = new_track[i]
                if track is None or getattr(req, "mamba_next_track_idx", None) is None:
                    req.mamba_next_track_idx = 0

    # --- freeing ---------------------------------------------------------------------------------

    def free(self, free_index: Any) -> None:
        """Free rows: an int, a sequence of ints, an integer tensor, or a request object (SGLang's
        form: its ``req_pool_idx``, then set to None). Checked first (``ValueError``, nothing freed),
        including a request whose ``req_pool_idx`` names a row ``alloc(reqs)`` gave another request.

        The rows' states stay allocated: ``free_mamba_cache`` frees them before or after this call
        (with the row or the request), or their owner (a prefix cache) does. A request whose
        ``mamba_pool_idx`` is None (the request given, or the one ``alloc`` gave the row) has handed
        its state on; otherwise a freed row keeps its state attached until ``free_mamba_cache(row)``
        or until a new request takes the row (then the state belongs to nobody and
        ``check_integrity`` reports it, unless it is owned outside the table)."""
        req = None
        if hasattr(free_index, "req_pool_idx"):
            req, free_index = free_index, free_index.req_pool_idx
            if free_index is None:
                raise ValueError("free: the request has no req_pool_idx (a double free?)")
            check_assignable(req, ("req_pool_idx",), "req", "free")
        rows = int_list(free_index, "free_index", accepts="an int, a sequence of ints, an integer tensor or a request")
        others = [self._row_req[r] for r in rows if 0 <= r < self.size] if req is not None else []
        if any(other is not None and other is not req for other in others):
            raise ValueError(f"free: req.req_pool_idx = {free_index} is the row of another request (a stale index?)")
        super().free(rows)
        if req is not None:
            req.req_pool_idx = None
        for row in rows:
            holder = req if req is not None else self._row_req[row]
            if holder is None or getattr(holder, "mamba_pool_idx", None) is None:
                if holder is not None or not self._row_slot[row]:
                    self._detach(row)  # the request handed its state on (a prefix cache took it) or freed it
                self._row_req[row] = None

    def free_mamba_cache(self, req: Any, mamba_ping_pong_track_buffer_to_keep: Optional[int] = None) -> None:
        """Free a request's state slot and its track slots, except track slot number
        ``mamba_ping_pong_track_buffer_to_keep`` (whose new owner, a prefix cache, frees it later).

        ``req`` is a row (an int: held, or freed with its state still attached) or a request object
        (its ``mamba_pool_idx`` and the track slots of its row, then set to None), before or after
        ``free`` of its row. Everything is checked first; ``ValueError`` and nothing freed for a row
        without a state, a request without ``mamba_pool_idx`` (a double free), a slot that is
        another row's or not handed out, or a keep index that is not an int in ``0..track slots - 1``.
        A request's device ``mamba_pool_idx`` is read (one synchronisation) unless its row is the one
        ``alloc(reqs)`` gave this very request object (then the row's host copy is used) and
        ``validate`` is off. A ``req_pool_idx`` naming a row another request holds now (the row was
        freed by number and taken again) is ignored: the request's own slots are freed."""
        keep = mamba_ping_pong_track_buffer_to_keep
        if keep is not None and not (is_int(keep) and keep in range(self.track_slots_per_request)):
            raise ValueError(
                f"mamba_ping_pong_track_buffer_to_keep must be an int in 0..{self.track_slots_per_request - 1} or "
                f"None, got {keep!r}"
            )
        owner, main, track = self._state_of(req)
        slots = [main, *(s for i, s in enumerate(track) if i != keep)]
        for s in slots:
            if not self.mamba_pool.is_held(s):
                raise ValueError(f"req's state slot {s} is not handed out (a double free?)")
        self.mamba_pool.free(slots)
        holder = req if not isinstance(req, int) else self._row_req[req]  # the row's request forgets it too
        if owner is not None:
            self._detach(owner)
            if self._is_free[owner]:
                self._row_req[owner] = None
        if holder is not None:
            holder.mamba_pool_idx = None
            if self.enable_mamba_extra_buffer:
                holder.mamba_ping_pong_track_buffer = None

    def _state_of(self, req: Any) -> tuple[Optional[int], int, tuple[int, ...]]:
        """(the row it is attached to or None, state slot, track slots) that ``free_mamba_cache(req)`` frees."""
        if isinstance(req, bool):
            raise ValueError(f"req must be a row (an int) or a request, got {req!r}")
        if isinstance(req, int):
            if not 0 <= req < self.size or not self._row_slot[req]:
                raise ValueError(f"req must be a row that holds a state, got row {req}")
            return req, self._row_slot[req], self._row_track[req]
        if getattr(req, "mamba_pool_idx", None) is None:
            raise ValueError("free_mamba_cache: the request has no mamba_pool_idx (a double free?)")
        check_assignable(req, _SETS[1:3] if self.enable_mamba_extra_buffer else _SETS[1:2], "req", "free_mamba_cache")
        row = getattr(req, "req_pool_idx", None)
        value = req.mamba_pool_idx
        if self._trusts_row(req, row, value, self._row_slot):
            return row, self._row_slot[row], self._row_track[row]  # known on the host: no synchronisation
        if is_int(row) and 0 <= row < self.size and self._row_req[row] is not None and self._row_req[row] is not req:
            row = None  # a stale req_pool_idx: the row is another request's now
        main = one_slot(value, "req.mamba_pool_idx")
        owner = self._owner.get(main)
        if owner is not None and self._row_slot[owner] != main:
            raise ValueError(f"req.mamba_pool_idx = {main} is a track slot of row {owner}, not a request's state slot")
        if owner is not None and (owner != row if row is not None else not self._is_free[owner]):
            raise ValueError(
                f"req.mamba_pool_idx = {main} is the state slot of row {owner}, not of this request (row {row})"
            )
        if owner is None and isinstance(row, int) and 0 <= row < self.size and self._row_slot[row]:
            raise ValueError(f"req.mamba_pool_idx = {main}, but its row {row} holds state slot {self._row_slot[row]}")
        if owner is not None:
            return owner, main, self._row_track[owner]
        value = getattr(req, "mamba_ping_pong_track_buffer", None) if self.enable_mamba_extra_buffer else None
        track = () if value is None else tuple(as_slot_list(value, "req.mamba_ping_pong_track_buffer"))
        for s in track:
            if s in self._owner:
                raise ValueError(
                    f"req.mamba_ping_pong_track_buffer holds slot {s}, a state slot of row {self._owner[s]}"
                )
        return None, main, track

    def clear(self) -> None:
        """Every row and every state slot free; the device mappings zeroed."""
        super().clear()
        self.mamba_pool.clear()
        self.req_index_to_mamba_index_mapping.zero_()
        if self.enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping.zero_()
        self._clear_rows()

    # --- lookups ---------------------------------------------------------------------------------

    def mamba_slot(self, row: int) -> int:
        """The state slot attached to row ``row`` (0 if none), from the host mirror: a held row's, or
        a freed row's whose state has not been freed yet."""
        return self._row_slot[self._row(row)]

    def track_slots(self, row: int) -> tuple[int, ...]:
        """The track slots attached to row ``row`` (empty without the extra buffer or a state)."""
        return self._row_track[self._row(row)]

    def _row(self, row: object) -> int:
        if isinstance(row, bool) or not isinstance(row, int):
            raise ValueError(f"row must be an int, got {row!r}")
        if not 0 <= row < self.size:
            raise IndexError(f"row must be in 0..{self.size - 1}, got {row}")
        return row

    def check_integrity(self, external_slots: Sequence[int] = ()) -> None:
        """Rows, state slots and their association, together: every state slot handed out belongs to
        exactly one row (held, or freed before its state) or is listed in ``external_slots`` (slots a
        prefix cache owns), and every row's slots are handed out. Raises ``IntegrityError`` listing
        each inconsistency with counts."""
        super().check_integrity()
        self.mamba_pool.check_integrity()
        held = set(self.mamba_pool.held_slots())
        owners: dict[int, int] = {}
        twice = []
        for row in range(self.size):
            for s in (self._row_slot[row], *self._row_track[row]):
                if s:
                    if s in owners:
                        twice.append(s)
                    owners[s] = row
        external = list(external_slots)
        problems = []
        if owners != self._owner:
            odd = sorted(set(owners.items()) ^ set(self._owner.items()))
            problems.append(
                f"{len(odd)} (slot, row) pairs differ between the owner map and the rows' slots (first: slot "
                f"{odd[0][0]}, row {odd[0][1]})"
            )
        if twice:
            problems.append(f"{len(twice)} state slots attached to two rows (first: {twice[0]})")
        not_held = sorted((set(owners) | set(external)) - held)
        if not_held:
            problems.append(f"{len(not_held)} slots attached or external but not handed out (first: {not_held[0]})")
        both = sorted(set(owners) & set(external))
        if both:
            problems.append(f"{len(both)} slots both attached to a row and external (first: {both[0]})")
        if len(set(external)) != len(external):
            problems.append(f"{len(external) - len(set(external))} external slots listed twice")
        leaked = sorted(held - set(owners) - set(external))
        if leaked:
            problems.append(
                f"{len(leaked)} state slots handed out but owned by no row and not external "
                f"(leaked; first: {leaked[0]})"
            )
        if problems:
            raise IntegrityError("HybridReqToTokenPool integrity check failed: " + "; ".join(problems))

