"""An endpoint's staging buffer and row tables: the pool's rows (KV heads of every row part, state
bands) and the two staging halves addressed in the wire's byte layout (:mod:`kvpool.transfer.wire`,
:mod:`kvpool.transfer.parts`, :mod:`kvpool.transfer.state_wire`), built once per head range and kept. docs/contract.md, "KV
transfer between ranks", says what memory an endpoint holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from kvpool.kernels.row_table import RowTable
from kvpool.transfer.parts import KVParts
from kvpool.transfer.state_wire import StateOverlap, StateSide, band_spans, band_views, state_plan, whole_rows
from kvpool.transfer.wire import TokenLayout

if TYPE_CHECKING:
    from kvpool.pools.mamba_pool import MambaPool

Spans = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class Chunk:
    """One message of a staged transfer: ``count`` rows of ``pool`` (slots ``rows``) laid out in a
    staging half as ``stages[half]`` addresses it, ``nbytes`` on the wire."""

    count: int
    nbytes: int
    pool: RowTable
    rows: torch.Tensor  # [count] this side's slots, on the pool's device
    stages: tuple[RowTable, RowTable]


class Staging:
    """The staging buffer (two halves of ``chunk_bytes``) and the tables that address it and the pools."""

    def __init__(
        self, parts: KVParts, mamba: Optional["MambaPool"], state: Optional[StateSide], chunk_bytes: int,
        cuda: bool,
    ) -> None:  # fmt: skip
        self.parts, self.mamba, self.state, self.chunk_bytes, self.cuda = parts, mamba, state, chunk_bytes, cuda
        dev = parts.device
        self.buffer = torch.empty(2 * chunk_bytes, dtype=torch.uint8, device=dev)
        one_head = parts.layout(1)
        rows = parts.rows
        state_rows = 0 if mamba is None else mamba.size + 1
        # A chunk holds at most this many rows: tokens of one head, or every state slot.
        self.arange = torch.arange(max(min(rows, chunk_bytes // one_head.token_bytes), state_rows), device=dev)
        self._kv: dict[tuple[int, int], tuple[TokenLayout, RowTable, tuple[RowTable, RowTable]]] = {}
        self._state_pool: dict[Spans, RowTable] = {}
        self._state_stages: dict[tuple[Spans, int, int], tuple[RowTable, RowTable]] = {}

    def half(self, half: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` bytes of staging half ``half`` (0 or 1), a uint8 view of ``buffer``."""
        return self.buffer[half * self.chunk_bytes :][:nbytes]

    # --- KV -----------------------------------------------------------------------------------------

    def kv_tables(self, lo: int, hi: int) -> tuple[TokenLayout, RowTable, tuple[RowTable, RowTable]]:
        """Row tables of the pool (local heads ``[lo, hi)`` of every row part of every layer: a K/V
        pool's own ``row_table`` for all its heads) and of the two staging halves, in the wire order; built once
        per head range, on the current stream (the address tables are copied there without a
        synchronisation, ready for the work that follows)."""
        key = (lo, hi)
        cached = self._kv.get(key)
        if cached is not None:
            return cached
        layout = self.parts.layout(hi - lo)
        entry = (layout, self.parts.table(lo, hi, self.cuda), self._halves(layout.row_bytes))
        self._kv[key] = entry
        return entry

    def kv_chunks(self, layout: TokenLayout, pool_table: RowTable, stages: tuple[RowTable, RowTable],
                  plan: list[tuple[int, int]], index: torch.Tensor) -> list[Chunk]:  # fmt: skip
        """The KV chunks of a staged transfer, one per entry of ``plan``.

        Parameters
        ----------
        layout : the wire's bytes of one token (:meth:`kv_tables`' layout).
        pool_table, stages : the pool's rows and the two staging halves, from :meth:`kv_tables`.
        plan : ``(first token, tokens)`` of each chunk (:func:`~kvpool.transfer.wire.chunk_plan`).
        index : Tensor [tokens] int32/int64, this side's slots, on the pool's device.

        Returns
        -------
        list of Chunk, in ``plan``'s order; each holds a view of its part of ``index``.
        """
        return [Chunk(count, count * layout.token_bytes, pool_table, index[start : start + count], stages)
                for start, count in plan]  # fmt: skip

    # --- state --------------------------------------------------------------------------------------

    def state_spans(self, agreed: StateOverlap) -> Spans:
        """The byte spans of one layer's state that move for the ``agreed`` heads (the same for every
        layer), as a tuple that keys :meth:`state_table`."""
        assert self.state is not None
        return tuple(band_spans(self.state, agreed))

    def state_table(self, spans: Spans) -> RowTable:
        """The state pool's wire buffers for ``spans``, every layer (its own ``row_table`` for whole rows)."""
        table = self._state_pool.get(spans)
        if table is None:
            assert self.mamba is not None and self.state is not None
            if whole_rows(self.state, list(spans)):
                table = self.mamba.row_table
            else:
                table = RowTable.of(band_views(self.mamba.conv, self.mamba.temporal, list(spans)), non_blocking=self.cuda)
            self._state_pool[spans] = table
        return table

    def state_chunks(self, spans: Spans, states: int, index: torch.Tensor, capacity: int) -> list[Chunk]:
        """The chunks of ``states`` state slots (``index`` on the pool's device) of at most
        ``capacity`` bytes (the agreed chunk size), after the KV's."""
        table = self.state_table(spans)
        out = []
        for b0, b1, first, count in state_plan(table.row_bytes, states, capacity):
            stages = self._state_stages.get((spans, b0, b1))
            if stages is None:
                stages = self._state_stages[(spans, b0, b1)] = self._halves(table.row_bytes[b0:b1])
            nbytes = count * sum(table.row_bytes[b0:b1])
            out.append(Chunk(count, nbytes, table.select(b0, b1), index[first : first + count], stages))
        return out

    # --- staging halves -----------------------------------------------------------------------------

    def _halves(self, row_bytes: tuple[int, ...]) -> tuple[RowTable, RowTable]:
        """Each half as rows of ``sum(row_bytes)`` bytes whose column band ``b`` is buffer ``b``: a
        chunk of ``count`` rows is the half's first ``count * sum(row_bytes)`` bytes."""
        per_row = sum(row_bytes)
        capacity = self.chunk_bytes // per_row
        halves = []
        for half in range(2):
            rows = self.buffer[half * self.chunk_bytes :][: capacity * per_row].view(capacity, per_row)
            bands, at = [], 0
            for n in row_bytes:
                bands.append(rows[:, at : at + n])
                at += n
            halves.append(RowTable.of(bands, non_blocking=self.cuda))
        return halves[0], halves[1]
