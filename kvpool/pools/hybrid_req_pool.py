"""``HybridReqToTokenPool``: the request table of a hybrid linear-attention model, with a state
slot per request.

Each running request holds a row of ``req_to_token`` (its KV slots, for the full-attention layers)
and a slot of the ``MambaPool`` (its linear layers' state); with SGLang's ``extra_buffer`` strategy
also track slots, where its state is snapshotted at track points for a prefix cache. A request that
keeps its row (a chunked prefill's next chunk, a resumed request) keeps its slots. Freeing the row
(``free``) and freeing the state (``free_mamba_cache``) are separate calls, as in SGLang, because a
prefix cache may take over a finished request's state instead of freeing it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from kvpool.errors import IntegrityError
from kvpool.pools.mamba_pool import MambaPool
from kvpool.pools.req_to_token import ReqToTokenPool
from kvpool.pools.state_params import MambaCacheParams
from kvpool.pools.state_slots import as_slot_list


class HybridReqToTokenPool(ReqToTokenPool):
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

    # --- allocation ------------------------------------------------------------------------------

    def alloc(self, need_size: int | Sequence[Any]) -> Optional[list[int]]:  # type: ignore[override]
        """Rows for requests, each with a state slot (and track slots with the extra buffer).

        ``need_size`` is a count (that many new requests, fresh rows and slots) or a list of
        request objects (SGLang's form): one with a ``req_pool_idx`` keeps its row, one with a
        ``mamba_pool_idx`` (an int or a 0-D tensor; a CUDA tensor is read with one synchronisation
        unless its row is kept) keeps its slot, the others get new ones and have the attributes
        set (``mamba_pool_idx`` a 0-D int64 tensor on the device, ``mamba_ping_pong_track_buffer``
        a [track slots] tensor, ``mamba_next_track_idx`` 0). New slots are zeroed in one launch.

        Returns the rows, or None with nothing changed when too few rows or state slots are free.
        Raises ``ValueError`` (nothing changed) for a kept row or slot that is not handed out.
        """
        reqs = None if isinstance(need_size, int) and not isinstance(need_size, bool) else list(need_size)
        n = need_size if reqs is None else len(reqs)
        per_track = self.track_slots_per_request
        kept_rows = [None] * n if reqs is None else [getattr(r, "req_pool_idx", None) for r in reqs]
        kept_main = [self._kept_slot(r, row) for r, row in zip(reqs, kept_rows)] if reqs is not None else [None] * n
        kept_track = [self._kept_track(r, row) for r, row in zip(reqs, kept_rows)] if reqs is not None else [None] * n
        for pos, row in enumerate(kept_rows):
            if row is not None and (not isinstance(row, int) or not 0 <= row < self.size or self._is_free[row]):
                raise ValueError(f"reqs[{pos}].req_pool_idx = {row!r} is not a row handed out by this pool")
        for pos, slot in enumerate(kept_main):
            if slot is not None and not self.mamba_pool.is_held(slot):
                raise ValueError(f"reqs[{pos}].mamba_pool_idx = {slot} is not a state slot handed out by this pool")
        new_rows = sum(r is None for r in kept_rows)
        new_slots = sum(s is None for s in kept_main) + per_track * sum(t is None for t in kept_track)
        if new_rows > len(self.free_slots) or new_slots > self.mamba_pool.available_size():
            return None
        fresh_rows = super().alloc(new_rows)
        fresh = self.mamba_pool.alloc_slots(new_slots)
        assert fresh_rows is not None and fresh is not None  # both checked above
        rows_out, mains, tracks, it_rows, it_slots = [], [], [], iter(fresh_rows), iter(fresh)
        for row, main, track in zip(kept_rows, kept_main, kept_track):
            rows_out.append(next(it_rows) if row is None else row)
            mains.append(next(it_slots) if main is None else main)
            tracks.append(tuple(next(it_slots) for _ in range(per_track)) if track is None else track)
        for row, main, track in zip(rows_out, mains, tracks):
            self._row_slot[row], self._row_track[row] = main, track
        if fresh:
            self.mamba_pool.clear_slots(self.mamba_pool.slots_tensor(fresh))
        self._write_mappings(rows_out, mains, tracks)
        if reqs is not None:
            self._set_request_attributes(reqs, kept_rows, kept_main, kept_track, rows_out, mains, tracks)
        return rows_out

    def _kept_slot(self, req: Any, row: Optional[int]) -> Optional[int]:
        slot = getattr(req, "mamba_pool_idx", None)
        if slot is None:
            return None
        if isinstance(row, int) and 0 <= row < self.size and self._row_slot[row]:
            return self._row_slot[row]  # known on the host: no synchronisation
        (value,) = as_slot_list(slot, "mamba_pool_idx")
        return value

    def _kept_track(self, req: Any, row: Optional[int]) -> Optional[tuple[int, ...]]:
        if not self.enable_mamba_extra_buffer or getattr(req, "mamba_ping_pong_track_buffer", None) is None:
            return None
        if isinstance(row, int) and 0 <= row < self.size and self._row_track[row]:
            return self._row_track[row]
        return tuple(as_slot_list(req.mamba_ping_pong_track_buffer, "mamba_ping_pong_track_buffer"))

    def _write_mappings(self, rows: list[int], mains: list[int], tracks: list[tuple[int, ...]]) -> None:
        if not rows:
            return
        index = self._device_ints(rows, torch.int64)
        self.req_index_to_mamba_index_mapping[index] = self._device_ints(mains, torch.int32)
        if self.enable_mamba_extra_buffer:
            flat = [s for t in tracks for s in t]
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[index] = self._device_ints(flat, torch.int32).view(
                len(rows), self.mamba_ping_pong_track_buffer_size
            )

    def _device_ints(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _set_request_attributes(self, reqs, kept_rows, kept_main, kept_track, rows, mains, tracks) -> None:
        new_main = self._device_ints(mains, torch.int64)
        new_track = self._device_ints([s for t in tracks for s in t], torch.int64).view(len(reqs), -1)
        for i, req in enumerate(reqs):
            if kept_rows[i] is None:
                req.req_pool_idx = rows[i]
            if kept_main[i] is None:
                req.mamba_pool_idx = new_main[i]
            if self.enable_mamba_extra_buffer and kept_track[i] is None:
                req.mamba_ping_pong_track_buffer = new_track[i]
                req.mamba_next_track_idx = 0

    # --- freeing ---------------------------------------------------------------------------------

    def free(self, free_index: Any) -> None:
        """Free rows: an int, a sequence of ints, an integer tensor, or a request object (SGLang's
        form: its ``req_pool_idx``, then set to None). The rows' states stay allocated: free them
        with ``free_mamba_cache`` first, or let the owner of their slots (a prefix cache) free them."""
        req = None
        if hasattr(free_index, "req_pool_idx"):
            req, free_index = free_index, free_index.req_pool_idx
            if free_index is None:
                raise ValueError("free: the request has no req_pool_idx (a double free?)")
        super().free(free_index)
        for row in as_slot_list(free_index):
            self._row_slot[row], self._row_track[row] = 0, ()
        if req is not None:
            req.req_pool_idx = None

    def free_mamba_cache(self, req: Any, mamba_ping_pong_track_buffer_to_keep: Optional[int] = None) -> None:
        """Free a request's state slot and its track slots, except track slot number
        ``mamba_ping_pong_track_buffer_to_keep`` (whose owner, a prefix cache, frees it later).

        ``req`` is a row still held (an int) or a request object (its ``mamba_pool_idx`` and track
        slots, then set to None). Raises ``ValueError`` (nothing freed) for a row without a state,
        a request without ``mamba_pool_idx`` (a double free) or a bad keep index."""
        keep = mamba_ping_pong_track_buffer_to_keep
        if keep is not None and keep not in range(self.track_slots_per_request):
            raise ValueError(
                f"mamba_ping_pong_track_buffer_to_keep must be in 0..{self.track_slots_per_request - 1} or None, "
                f"got {keep!r}"
            )
        if isinstance(req, int) and not isinstance(req, bool):
            row = req
            if not 0 <= row < self.size or self._is_free[row] or not self._row_slot[row]:
                raise ValueError(f"req must be a row that holds a state, got row {row}")
            main, track = self._row_slot[row], self._row_track[row]
        else:
            if getattr(req, "mamba_pool_idx", None) is None:
                raise ValueError("free_mamba_cache: the request has no mamba_pool_idx (a double free?)")
            row = getattr(req, "req_pool_idx", None)
            main = self._kept_slot(req, row)
            track = self._kept_track(req, row) or ()
        slots = [main, *(s for i, s in enumerate(track) if i != keep)]
        self.mamba_pool.free(slots)
        if isinstance(row, int) and 0 <= row < self.size and self._row_slot[row] == main:
            self._row_slot[row], self._row_track[row] = 0, ()
        if not isinstance(req, int):
            req.mamba_pool_idx = None
            if self.enable_mamba_extra_buffer:
                req.mamba_ping_pong_track_buffer = None

    def clear(self) -> None:
        """Every row and every state slot free; the device mappings zeroed."""
        super().clear()
        if hasattr(self, "mamba_pool"):
            self.mamba_pool.clear()
            self.req_index_to_mamba_index_mapping.zero_()
            if self.enable_mamba_extra_buffer:
                self.req_index_to_mamba_ping_pong_track_buffer_mapping.zero_()
            self._clear_rows()

    # --- lookups ---------------------------------------------------------------------------------

    def mamba_slot(self, row: int) -> int:
        """The state slot of held row ``row`` (0 if it has none), from the host mirror."""
        return self._row_slot[row]

    def track_slots(self, row: int) -> tuple[int, ...]:
        """The track slots of held row ``row`` (empty without the extra buffer or a state)."""
        return self._row_track[row]

    def get_mamba_indices(self, req_indices: torch.Tensor) -> torch.Tensor:
        """State slots of rows ``req_indices`` (a gather on the device)."""
        return self.req_index_to_mamba_index_mapping[req_indices]

    def get_mamba_ping_pong_other_idx(self, mamba_next_track_idx: int) -> int:
        """The track slot number that is not ``mamba_next_track_idx`` (itself with one track slot)."""
        return 1 - mamba_next_track_idx if self.mamba_ping_pong_track_buffer_size == 2 else mamba_next_track_idx

    def mamba2_layer_cache(self, layer_id: int) -> MambaPool.State:
        """The states of global linear layer ``layer_id`` (SGLang's ``State`` at that layer)."""
        return self.mamba_pool.mamba2_layer_cache(self.mamba_pool.layer_index(layer_id))

    def get_speculative_mamba2_params_all_layers(self) -> MambaPool.SpeculativeState:
        """The ``mamba_pool``'s states and scratch of every layer (SGLang's name); ``ValueError`` without
        speculative state."""
        return self.mamba_pool.get_speculative_mamba2_params_all_layers()

    def check_integrity(self, external_slots: Sequence[int] = ()) -> None:
        """Rows, state slots and their association, together: every state slot handed out belongs to
        exactly one held row or is listed in ``external_slots`` (slots a prefix cache owns), and every
        row's slots are handed out. Raises ``IntegrityError`` listing each inconsistency with counts."""
        super().check_integrity()
        self.mamba_pool.check_integrity()
        held = set(self.mamba_pool.held_slots())
        owners: dict[int, int] = {}
        twice = []
        for row in range(self.size):
            if self._is_free[row]:
                continue
            for s in (self._row_slot[row], *self._row_track[row]):
                if s:
                    if s in owners:
                        twice.append(s)
                    owners[s] = row
        external = list(external_slots)
        problems = []
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
