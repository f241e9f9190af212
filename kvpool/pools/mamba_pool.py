"""``MambaPool``: per-request state of a hybrid model's linear-attention layers, in state slots.

Each linear-attention layer keeps, per slot, a convolution window ``[conv_dim, conv_kernel - 1]``
and a recurrent (SSM) state ``[v_heads, v_head_dim, k_head_dim]``. Each kind is one allocation
``[layers, size + 1, ...]`` (slot 0 is the padding slot), whose per-layer views are made once. With
speculative decoding the pool also holds, per batch position, the states after each of ``K`` draft
steps, and ``commit`` keeps each request's accepted one.

Every operation on slots (fork, clear, commit, CPU copies) is one launch over every layer on CUDA:
the row-copy kernel (``kvpool.kernels.copy_rows``) over the pool's ``row_table``, or for ``commit``
its sibling ``kvpool.kernels.state_commit``; off CUDA the same copies run in plain PyTorch. Every
path copies bytes, bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from kvpool.checks import check_in_range, check_index, check_same_length, dense_layer_index, positive_int, resolve_device
from kvpool.config import validate_enabled
from kvpool.kernels.copy_rows import checked_copy
from kvpool.kernels.launch import sm_count
from kvpool.kernels.row_table import RowTable
from kvpool.kernels.state_commit.launcher import commit_rows
from kvpool.pools.base import check_sglang_keywords
from kvpool.pools.cpu_copy import MambaCpuCopy, check_mamba_cpu_copy, copy_rows_from_host, copy_rows_to_host
from kvpool.pools.state_params import MambaCacheParams
from kvpool.pools.state_slots import SlotsArg, StateSlots, as_slot_list

#: Programs per SM of a state fork (the one-pass row copy over the pool's own table): fewer, longer
#: programs than a KV move's grid, whose rows are a few hundred bytes.
STATE_FORK_PROGRAMS_PER_SM = 4

GB = 1024**3


class MambaPool:
    """State slots for the linear-attention layers of one rank (SGLang's ``MambaPool``).

    Parameters
    ----------
    size : usable slots (``alloc`` hands out ``1..size``; slot 0 is padding).
    spec_state_size : batch positions of speculative scratch (default ``size``); scratch has
        ``spec_state_size + 1`` rows, row ``i`` for the request at position ``i`` of a verify batch.
    cache_params : a :class:`~kvpool.pools.state_params.MambaCacheParams` or SGLang's
        ``Mamba2CacheParams`` (shapes, dtypes and the global ids of the linear layers).
    device : where the buffers live (``"cpu"`` works: plain PyTorch copies).
    enable_memory_saver : SGLang's; must be False (kvpool has no memory saver).
    speculative_num_draft_tokens : ``K``, the draft steps a verify step checks; None: no scratch.
    validate : check slot ranges and step counts on every operation (one synchronisation each);
        ``KVPOOL_VALIDATE=1`` turns it on too.

    Attributes
    ----------
    conv : list of Tensor [layers, size + 1, conv_dim, conv_kernel - 1] (one per convolution).
    temporal : Tensor [layers, size + 1, v_heads, v_head_dim, k_head_dim].
    intermediate_conv_window : list of Tensor [layers, spec_state_size + 1, K, conv_dim,
        conv_kernel - 1], or None without speculative decoding.
    intermediate_ssm : Tensor [layers, spec_state_size + 1, K, v_heads, v_head_dim, k_head_dim] or None.
    mamba_cache : the same tensors as SGLang's ``State`` / ``SpeculativeState``.
    row_table : RowTable over every layer's state views, ``conv_0, ssm_0, conv_1, ssm_1, ...`` (with
        several convolutions, all of a layer's convolutions come before its SSM state).
    spec_row_table : RowTable over the scratch views in the same order, rows ``(spec_state_size + 1)
        * K`` (row ``i * K + j``: position ``i``, after step ``j + 1``); None without scratch.

    Examples
    --------
    >>> from kvpool.pools.state_params import MambaCacheParams, MambaStateShape
    >>> params = MambaCacheParams(MambaStateShape(conv=(24, 3), temporal=(2, 4, 4)), layers=[0, 1, 2])
    >>> pool = MambaPool(size=8, cache_params=params, device="cpu", speculative_num_draft_tokens=4)
    >>> pool.get_ssm_state(2).shape, pool.get_intermediate_ssm_state(2).shape
    (torch.Size([9, 2, 4, 4]), torch.Size([9, 4, 2, 4, 4]))
    >>> slots = pool.alloc(2)
    >>> pool.clear_slots(slots)
    >>> pool.copy_from(slots[:1], slots[1:])
    """

    @dataclass(frozen=True)
    class State:
        """SGLang's view of the state tensors: ``conv`` a list of [layers, slots, ...] tensors and
        ``temporal`` [layers, slots, ...]; ``at_layer_idx(i)`` the same for dense layer index ``i``."""

        conv: list[torch.Tensor]
        temporal: torch.Tensor

        def at_layer_idx(self, layer: int) -> "MambaPool.State":
            """The same tensors at dense layer index ``layer``, each without its layer dimension
            (SGLang's name)."""
            kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            out = {k: ([t[layer] for t in v] if isinstance(v, list) else v[layer]) for k, v in kwargs.items()}
            return type(self)(**out)

        def mem_usage_bytes(self) -> int:
            """Bytes of every tensor it holds (SGLang's name)."""
            tensors = [getattr(self, f.name) for f in dataclasses.fields(self)]
            flat = [t for v in tensors for t in (v if isinstance(v, list) else [v])]
            return sum(t.numel() * t.element_size() for t in flat)

    @dataclass(frozen=True)
    class SpeculativeState(State):
        """``State`` plus the per-draft-step scratch."""

        intermediate_ssm: torch.Tensor
        intermediate_conv_window: list[torch.Tensor]

    def __init__(
        self,
        *,
        size: int,
        spec_state_size: Optional[int] = None,
        cache_params: object,
        device: str | torch.device,
        enable_memory_saver: bool = False,
        speculative_num_draft_tokens: Optional[int] = None,
        validate: bool = False,
    ) -> None:
        check_sglang_keywords(enable_memory_saver)
        self.size = positive_int(size, "size")
        self.cache_params = params = MambaCacheParams.of(cache_params)
        self.device = resolve_device(device)
        # A fork's grid on CUDA (None: the row copy's own elsewhere).
        self._fork_programs = sm_count(self.device) * STATE_FORK_PROGRAMS_PER_SM if self.device.type == "cuda" else None
        self.validate = validate_enabled(validate)
        self.layers: tuple[int, ...] = params.layers
        self.num_mamba_layers = n_layers = params.num_layers
        self._dense = {layer: i for i, layer in enumerate(params.layers)}
        conv_shapes, temporal = params.shape.conv, params.shape.temporal
        conv_dtype, ssm_dtype = params.dtype.conv, params.dtype.temporal
        slots = size + 1

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.conv = [zeros(n_layers, slots, *c, dtype=conv_dtype) for c in conv_shapes]
        self.temporal = zeros(n_layers, slots, *temporal, dtype=ssm_dtype)
        self.row_table = RowTable.of(_per_layer(self.conv, self.temporal))

        self.speculative_num_draft_tokens = None if speculative_num_draft_tokens is None else positive_int(
            speculative_num_draft_tokens, "speculative_num_draft_tokens"
        )
        self.intermediate_ssm: Optional[torch.Tensor] = None
        self.intermediate_conv_window: Optional[list[torch.Tensor]] = None
        self.spec_row_table: Optional[RowTable] = None
        self.spec_state_size = 0
        if self.speculative_num_draft_tokens is not None:
            k = self.speculative_num_draft_tokens
            self.spec_state_size = size if spec_state_size is None else positive_int(spec_state_size, "spec_state_size")
            positions = self.spec_state_size + 1
            self.intermediate_conv_window = [zeros(n_layers, positions, k, *c, dtype=conv_dtype) for c in conv_shapes]
            self.intermediate_ssm = zeros(n_layers, positions, k, *temporal, dtype=ssm_dtype)
            flat_conv = [t.view(n_layers, positions * k, *t.shape[3:]) for t in self.intermediate_conv_window]
            flat_ssm = self.intermediate_ssm.view(n_layers, positions * k, *temporal)
            self.spec_row_table = RowTable.of(_per_layer(flat_conv, flat_ssm))
            self.mamba_cache: MambaPool.State = self.SpeculativeState(
                conv=self.conv, temporal=self.temporal, intermediate_ssm=self.intermediate_ssm,
                intermediate_conv_window=self.intermediate_conv_window,
            )  # fmt: skip
        else:
            if spec_state_size is not None:
                positive_int(spec_state_size, "spec_state_size")
            self.mamba_cache = self.State(conv=self.conv, temporal=self.temporal)
        self.mem_usage = self.mamba_cache.mem_usage_bytes() / GB

        # clear_slots copies from one zero row per buffer (all views of one allocation).
        zero = zeros(1, max(self.row_table.row_bytes), dtype=torch.uint8)
        self._zero_rows = RowTable.of([zero[:, :rb] for rb in self.row_table.row_bytes])
        self._zero_index = zeros(slots, dtype=torch.int64)
        self._slots = StateSlots(size)

    # --- layers ----------------------------------------------------------------------------------

    def layer_index(self, layer_id: object) -> int:
        """Dense index (into the ``[layers, ...]`` tensors) of global linear layer ``layer_id``.

        Raises ``TypeError`` for a non-int and ``ValueError`` naming the id and this pool's layers."""
        return dense_layer_index(layer_id, self._dense, "linear-attention", "layers")

    def get_conv_state(self, layer_id: int, index: int = 0) -> torch.Tensor:
        """Convolution window of global layer ``layer_id``: ``[size + 1, conv_dim, conv_kernel - 1]``
        (a view; ``index`` picks one of several convolutions)."""
        return self.conv[index][self.layer_index(layer_id)]

    def get_ssm_state(self, layer_id: int) -> torch.Tensor:
        """Recurrent state of global layer ``layer_id``: ``[size + 1, v_heads, v_head_dim, k_head_dim]``
        (a view)."""
        return self.temporal[self.layer_index(layer_id)]

    def get_intermediate_conv_window(self, layer_id: int, index: int = 0) -> torch.Tensor:
        """Scratch a verify step writes for global layer ``layer_id``: ``[spec_state_size + 1, K,
        conv_dim, conv_kernel - 1]``; entry ``[i, j]`` is the window of the request at batch
        position ``i`` after draft step ``j + 1``. A view; ``ValueError`` without speculative state."""
        return self._spec("get_intermediate_conv_window")[0][index][self.layer_index(layer_id)]

    def get_intermediate_ssm_state(self, layer_id: int) -> torch.Tensor:
        """Scratch recurrent states of global layer ``layer_id``: ``[spec_state_size + 1, K, v_heads,
        v_head_dim, k_head_dim]``, indexed as :meth:`get_intermediate_conv_window`."""
        return self._spec("get_intermediate_ssm_state")[1][self.layer_index(layer_id)]

    def mamba2_layer_cache(self, layer_idx: int) -> "MambaPool.State":
        """SGLang's per-layer view: ``mamba_cache`` at **dense** index ``layer_idx`` (0 for the first
        linear layer, as SGLang's ``MambaPool``; ``HybridReqToTokenPool.mamba2_layer_cache`` takes
        global ids)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_mamba_layers:
            raise IndexError(f"layer_idx must be a dense index in 0..{self.num_mamba_layers - 1}, got {layer_idx!r}")
        return self.mamba_cache.at_layer_idx(layer_idx)

    def get_speculative_mamba2_params_all_layers(self) -> "MambaPool.SpeculativeState":
        """Every layer's states and scratch (SGLang's name); ``ValueError`` without speculative state."""
        self._spec("get_speculative_mamba2_params_all_layers")
        return self.mamba_cache  # type: ignore[return-value]

    def _spec(self, what: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        if self.intermediate_ssm is None or self.intermediate_conv_window is None:
            raise ValueError(f"{what} needs speculative state: build the pool with speculative_num_draft_tokens")
        return self.intermediate_conv_window, self.intermediate_ssm

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(addresses, byte lengths, bytes per slot) of every layer's state buffer, convolutions then
        SSM states, scratch excluded: SGLang's registration list for transfers between ranks."""
        tensors = [*self.conv, self.temporal]
        views = [t[i] for t in tensors for i in range(self.num_mamba_layers)]
        return ([v.data_ptr() for v in views], [v.numel() * v.element_size() for v in views],
                [v[0].numel() * v.element_size() for v in views])  # fmt: skip

    # --- slots -----------------------------------------------------------------------------------

    def available_size(self) -> int:
        """Free state slots: how many ``alloc`` can hand out now."""
        return self._slots.available()

    def alloc_slots(self, need_size: int) -> Optional[list[int]]:
        """``need_size`` slots as host ints, or None (nothing changed) when fewer are free. Their
        states are left as they are (zero them with ``clear_slots``, or overwrite them)."""
        return self._slots.take(need_size)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """``need_size`` slots as an int64 tensor on the pool's device (from pinned memory on CUDA,
        no synchronisation), or None with nothing changed. States are left as they are, as in
        SGLang (which zeroes them through ``clear_slots``)."""
        got = self._slots.take(need_size)
        return None if got is None else self.slots_tensor(got)

    def slots_tensor(self, slots: Sequence[int]) -> torch.Tensor:
        """Host ints as an int64 tensor on the pool's device, without synchronising."""
        host = torch.tensor(list(slots), dtype=torch.int64)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def free(self, free_index: SlotsArg) -> None:
        """Give slots back: an int, a sequence of ints, or an integer tensor (a CUDA tensor costs one
        synchronisation). Slot 0, a slot not handed out (double free), out of range or listed twice
        raises ``ValueError`` and frees nothing."""
        self._slots.give_back(as_slot_list(free_index))

    def fork_from(self, src_index: torch.Tensor) -> Optional[torch.Tensor]:
        """A new slot holding a copy of slot ``src_index`` ([1] int32/int64 on the pool's device, a
        slot handed out), or None (nothing changed) when none is free. The source is checked before
        anything is allocated (on CUDA that reads it: one synchronisation); a failed copy gives the
        new slot back."""
        check_index(src_index, "src_index", device=self.device, dims="[1]", length=1, per="the source slot")
        src = src_index.tolist()  # the one read (a synchronisation on CUDA); the checks use the host copy
        check_in_range([(torch.tensor(src), self.size + 1, "src_index")], what="slots", negative_ok=False)
        self._slots.check_usable(src, "src_index", padding=False)
        dst = self.alloc(1)
        if dst is None:
            return None
        try:
            self.copy_from(src_index, dst)
        except BaseException:
            self._slots.give_back(dst.tolist())
            raise
        return dst

    def clear(self) -> None:
        """Every slot free (states are left as they are)."""
        self._slots.clear()

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if the free list and the held slots disagree."""
        self._slots.check_integrity()

    def held_slots(self) -> list[int]:
        """Slots handed out and not given back, ascending (for integrity checks above the pool)."""
        return self._slots.held()

    def is_held(self, slot: int) -> bool:
        """Whether ``slot`` is handed out and not given back (False for slot 0 and slots out of range)."""
        return self._slots.is_held(slot)

    # --- copies ----------------------------------------------------------------------------------

    def copy_from(self, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
        """For every layer, the states of slot ``dst_index[i]`` become a byte copy of slot
        ``src_index[i]`` (SGLang's argument order: source first), as if every source were read before
        any destination is written. Both ``[n]`` int32/int64 on the pool's device, each entry a slot
        handed out or padding (negative entries, slot 0). One launch on CUDA (up to the row
        copy's one-pass limit, ``ONE_PASS_MAX_PAIRS``; more pairs go through a staging buffer)."""
        n = check_index(dst_index, "dst_index", device=self.device, dims="[n]").shape[0]
        check_index(src_index, "src_index", device=self.device, dims="[n]")
        check_same_length(dst_index, "dst_index", src_index, "src_index")
        self._check_slots([(src_index, "src_index"), (dst_index, "dst_index")])
        if n:
            table, cap = self.row_table, self._fork_programs
            checked_copy(table, dst_index, table, src_index, cap, False, ("dst_index", "src_index"))

    def clear_slots(self, indices: torch.Tensor) -> None:
        """Zero every layer's states of slots ``indices`` ([n] int32/int64 on the pool's device, each
        a slot handed out or padding). One launch on CUDA, no synchronisation."""
        n = check_index(indices, "indices", device=self.device, dims="[n]").shape[0]
        self._check_slots([(indices, "indices")])
        zeros = self._zero_index[:n] if n <= self._zero_index.shape[0] else self._zero_index.new_zeros(n)
        checked_copy(self.row_table, indices, self._zero_rows, zeros, None, False, ("indices", "indices"))

    def _check_slots(self, checks: list[tuple[torch.Tensor, str]], *, negative_ok: bool = True) -> None:
        """Every entry of each ``(index, name)`` in range and a slot handed out (or padding: negative
        entries where ``negative_ok``, slot 0). Read where it is free (host tensors) or asked for
        (``validate``: one synchronisation per tensor on a device)."""
        live = [(t, name) for t, name in checks if t.numel() and (t.device.type == "cpu" or self.validate)]
        check_in_range([(t, self.size + 1, name) for t, name in live], what="slots", negative_ok=negative_ok)
        for t, name in live:
            self._slots.check_usable(t.tolist(), name)

    def commit(
        self,
        slots: torch.Tensor,
        accepted_steps: torch.Tensor,
        track_slots: Optional[torch.Tensor] = None,
        track_steps: Optional[torch.Tensor] = None,
    ) -> None:
        """Keep each request's state after its last accepted draft step.

        For the request at batch position ``i`` with ``1 <= accepted_steps[i] <= K``, every layer's
        states of slot ``slots[i]`` become a byte copy of scratch entry ``[i, accepted_steps[i] - 1]``
        (what the verify step wrote through ``get_intermediate_*``); ``accepted_steps[i] == 0`` keeps
        the old state. ``track_slots``/``track_steps`` (both or neither) snapshot scratch entry ``[i,
        track_steps[i] - 1]`` into a track slot the same way (0: no snapshot), for a prefix cache.

        Parameters
        ----------
        slots, accepted_steps, track_slots, track_steps : Tensor [bs], int32/int64, on the pool's
            device, ``bs <= spec_state_size + 1``. Read on the device: no synchronisation, one
            launch on CUDA for both sets, CUDA-graph safe.

        Each slot is one handed out or padding (negative entries, slot 0). A step count outside
        ``0..K`` raises ``ValueError``, a slot ``> size`` ``IndexError``, a slot not handed out
        ``ValueError``, all before anything is written: always for host tensors, under ``validate``
        for device tensors (one synchronisation), which otherwise the kernel never reads or writes.
        A slot named twice gets one of its sources.
        """
        if self.spec_row_table is None:
            raise ValueError("commit needs speculative state: build the pool with speculative_num_draft_tokens")
        bs = check_index(slots, "slots", device=self.device, dims="[bs]").shape[0]
        if bs > self.spec_state_size + 1:
            raise ValueError(
                f"slots must have at most spec_state_size + 1 = {self.spec_state_size + 1} entries (batch "
                f"positions with scratch), got {bs}"
            )
        if (track_slots is None) != (track_steps is None):
            raise ValueError("track_slots and track_steps must be given together, got only one of them")
        pairs = [(slots, accepted_steps, "slots", "accepted_steps")]
        if track_slots is not None:
            pairs.append((track_slots, track_steps, "track_slots", "track_steps"))
        for d, s, d_name, s_name in pairs:
            for t, name in ((d, d_name), (s, s_name)):
                if t is not slots:
                    check_same_length(slots, "slots", check_index(t, name, device=self.device, dims="[bs]"), name)
        if self.validate or slots.device.type == "cpu":
            self._check_commit(pairs)
        k = self.speculative_num_draft_tokens
        commit_rows(self.row_table, self.spec_row_table, k, slots, accepted_steps, track_slots, track_steps)

    def _check_commit(self, pairs: list[tuple[torch.Tensor, torch.Tensor, str, str]]) -> None:
        k = self.speculative_num_draft_tokens
        live = [(s, name) for _, s, _, name in pairs if s.numel()]
        if live:
            bad = torch.stack([((s < 0) | (s > k)).any() for s, _ in live]).tolist()  # type: ignore[operator]
            for (s, name), b in zip(live, bad):
                if b:
                    pos = int(torch.argmax(((s < 0) | (s > k)).to(torch.uint8)))  # type: ignore[operator]
                    raise ValueError(f"{name}[{pos}] = {int(s[pos])} must be a step count in 0..{k}")
        self._check_slots([(d, name) for d, _, name, _ in pairs])

    # --- CPU copies ------------------------------------------------------------------------------

    def get_cpu_copy(
        self, indices: Optional[torch.Tensor] = None, mamba_indices: Optional[torch.Tensor] = None
    ) -> MambaCpuCopy:
        """Every layer's states of slots ``indices`` ([n] on the pool's device, slots handed out or
        slot 0; ``mamba_indices``, the allocators' keyword, names the same argument) in host memory
        (pinned on CUDA), byte for byte. One launch on CUDA writes them straight into host memory;
        the call then waits for the current stream. Every index is checked first: one outside
        ``0..size`` raises ``IndexError``, a slot not handed out ``ValueError``."""
        indices, name = _one_index(indices, mamba_indices)
        n = check_index(indices, name, device=self.device, dims="[n]").shape[0]
        slots = indices.tolist()  # the one read; the checks use the host copy
        check_in_range([(torch.tensor(slots, dtype=torch.int64), self.size + 1, name)], what="slots", negative_ok=False)
        self._slots.check_usable(slots, name)
        pinned = self.device.type == "cuda"
        l = self.num_mamba_layers

        def host(t: torch.Tensor) -> torch.Tensor:
            return torch.empty((l, n, *t.shape[2:]), dtype=t.dtype, pin_memory=pinned)

        copy = MambaCpuCopy(tuple(host(c) for c in self.conv), host(self.temporal), self.layers)
        copy_rows_to_host(self.row_table, indices, _per_layer(list(copy.conv), copy.temporal), self.device, name)
        return copy

    def load_cpu_copy(
        self, mamba_cache_cpu: Any, indices: Optional[torch.Tensor] = None, mamba_indices: Optional[torch.Tensor] = None
    ) -> None:
        """Write a CPU copy into slots ``indices`` (any slots handed out, or padding: negative entries
        and slot 0; ``mamba_indices`` names the same argument), byte for byte. ``mamba_cache_cpu`` is
        a ``get_cpu_copy`` result or SGLang's ``(conv, temporal)`` pair; its type, layers, shapes,
        dtypes, layout and length, and the indices (host tensors always, device tensors under
        ``validate``), are checked before anything is written. No synchronisation on CUDA."""
        indices, name = _one_index(indices, mamba_indices)
        n = check_index(indices, name, device=self.device, dims="[n]").shape[0]
        conv, temporal = check_mamba_cpu_copy(mamba_cache_cpu, self.conv, self.temporal, self.layers, n)
        self._check_slots([(indices, name)])
        if n == 0:
            return
        cuda = self.device.type == "cuda"

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True) if cuda else t

        staged = _per_layer([dev(c) for c in conv], dev(temporal))
        copy_rows_from_host(self.row_table, indices, staged, self.device, name)


def _one_index(indices: Optional[torch.Tensor], mamba_indices: Optional[torch.Tensor]) -> tuple[torch.Tensor, str]:
    """The index argument of a CPU copy given as ``indices`` or as ``mamba_indices`` (exactly one)."""
    if (indices is None) == (mamba_indices is None):
        raise TypeError("give the slots as indices or as mamba_indices (exactly one of them), got "
                        f"{'both' if indices is not None else 'neither'}")  # fmt: skip
    if indices is not None:
        return indices, "indices"
    return mamba_indices, "mamba_indices"  # type: ignore[return-value]


def _per_layer(conv: list[torch.Tensor], temporal: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer views of ``[layers, rows, ...]`` tensors in row-table order: each layer's
    convolutions, then its SSM state."""
    return [t[i] for i in range(temporal.shape[0]) for t in (*conv, temporal)]
