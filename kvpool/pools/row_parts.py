"""``RowPartsCache``: a pool whose layers each keep several buffers ("parts") of ``size + page_size``
rows that belong together, such as FP8 codes and the scales beside them, and what copies rows of all
of them at once: moves and CPU copies (``PartsCpuCopy``), so a scale never travels without its codes.
The rules are those of docs/contract.md, "Moves and CPU copies"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvpool.checks import check_in_range, check_index, layer_id_of, layer_index, non_negative_int, positive_int
from kvpool.checks import resolve_device
from kvpool.config import validate_enabled
from kvpool.kernels.copy_rows import RowTable, checked_copy
from kvpool.pools.cpu_copy import copy_rows_from_host, copy_rows_to_host


@dataclass(frozen=True)
class PartsCpuCopy:
    """Some slots of every layer of a ``RowPartsCache`` in host memory, as ``get_cpu_copy`` returns
    them and ``load_cpu_copy`` takes them back: the stored bytes, untouched.

    Attributes
    ----------
    parts : tuple of Tensor [layer_num, n, ...], one per buffer of a layer, in the pool's
        ``part_names`` order and of that buffer's dtype; row ``j`` is slot ``indices[j]``. Pinned on CUDA.
    part_names : the buffers' names, as the pool's attributes call them.
    start_layer : the global id of layer 0.
    """

    parts: tuple[torch.Tensor, ...]
    part_names: tuple[str, ...]
    start_layer: int

    def __len__(self) -> int:
        return self.parts[0].shape[1]

    def layers(self) -> list[torch.Tensor]:
        """The per-layer row blocks, layer by layer, in a pool's ``parts_table`` order."""
        return [p[layer] for layer in range(self.parts[0].shape[0]) for p in self.parts]


class RowPartsCache:
    """Layers, slots and the row copies of a pool with several buffers per layer. A subclass checks
    its own ``dtype``, allocates its buffers (per layer, ``rows`` rows each, contiguous rows) and hands
    them, named, to ``_init_parts``.

    Attributes (SGLang names): ``size``, ``page_size``, ``layer_num``, ``start_layer``, ``end_layer``,
    ``device``, ``layer_transfer_counter``; kvpool's: ``parts_table`` over every buffer of every
    layer, ``part_names``, ``validate``. The table is deliberately not called ``row_table``: code
    that reads a pool's ``row_table`` as two buffers per layer (K, V) finds none, rather than copy
    the codes without their scales; the host tier reads ``part_names`` and this table and copies
    every part. (The FP4 pools, ``Fp4KVCache``, also give it the name ``row_table`` they have always
    had.)
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        layer_num: int,
        device: str | torch.device,
        start_layer: Optional[int],
        end_layer: Optional[int],
        validate: bool,
    ) -> None:
        self.size = positive_int(size, "size")
        self.page_size = positive_int(page_size, "page_size")
        self.layer_num = positive_int(layer_num, "layer_num")
        self.start_layer = 0 if start_layer is None else non_negative_int(start_layer, "start_layer")
        last = self.start_layer + layer_num - 1
        if end_layer is not None and end_layer != last:
            raise ValueError(
                f"end_layer must be start_layer + layer_num - 1 = {last} (both ends included), got {end_layer!r}"
            )
        self.end_layer = last
        self.device = resolve_device(device)
        if not isinstance(validate, bool):
            raise ValueError(f"validate must be a bool, got {validate!r}")
        self.validate = validate_enabled(validate)
        self.layer_transfer_counter: object = None

    @property
    def rows(self) -> int:
        """Rows per layer buffer: ``size + page_size`` (slot 0 and the rest of page 0 are padding)."""
        return self.size + self.page_size

    def _new_buffer(self, width: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """One zeroed buffer ``[rows, *width]`` of ``dtype`` per layer."""
        return [torch.zeros((self.rows, *width), dtype=dtype, device=self.device) for _ in range(self.layer_num)]

    def _init_parts(self, parts: dict[str, list[torch.Tensor]]) -> None:
        """Record the buffers of every layer, by attribute name (in the order row copies take them)."""
        for name, buffers in parts.items():
            setattr(self, name, buffers)
        self.part_names = tuple(parts)
        self._parts = [tuple(parts[n][i] for n in self.part_names) for i in range(self.layer_num)]
        #: Every buffer of every layer, layer by layer in ``part_names`` order: moves and CPU copies
        #: copy rows of all of them in one launch.
        self.parts_table = RowTable.of([b for layer in self._parts for b in layer])

    # --- layers ----------------------------------------------------------------------------------

    def _write_index(self, layer: object, layer_id_override: Optional[int]) -> int:
        layer_id = layer_id_of(layer) if layer_id_override is None else layer_id_override
        return layer_index(layer_id, self.start_layer, self.end_layer)

    def _wait_layer(self, layer_id: object) -> int:
        """Index of global layer ``layer_id`` (raises for any other id), after the current stream
        waits for its load when a layer-transfer counter is registered."""
        i = layer_index(layer_id, self.start_layer, self.end_layer)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(i)  # type: ignore[attr-defined]
        return i

    def register_layer_transfer_counter(self, layer_transfer_counter: object) -> None:
        """Make the getters call ``layer_transfer_counter.wait_until(layer_index)`` first."""
        self.layer_transfer_counter = layer_transfer_counter

    def part_bytes(self) -> dict[str, int]:
        """Bytes held by each kind of buffer, all layers together, by attribute name."""
        return {n: sum(layer[j].nbytes for layer in self._parts) for j, n in enumerate(self.part_names)}

    # --- moves and CPU copies --------------------------------------------------------------------

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """For every layer, row ``tgt_loc[i]`` of every buffer becomes a byte copy of row
        ``src_loc[i]``, as if every source were read before any target is written (the rules of
        ``MHATokenToKVPool.move_kv_cache``).

        Parameters
        ----------
        tgt_loc, src_loc : Tensor [n], int32/int64, on the pool's device. Negative slots are padding;
            slots >= ``size + page_size`` are never read or written (IndexError under ``validate``).
        """
        table = self.parts_table
        checked_copy(table, tgt_loc, table, src_loc, None, self.validate, ("tgt_loc", "src_loc"))

    def get_cpu_copy(self, indices: torch.Tensor) -> PartsCpuCopy:
        """The rows ``indices`` of every buffer of every layer in host memory, exact bytes (pinned on
        CUDA, complete on return).

        Parameters
        ----------
        indices : Tensor [n], int32/int64, on the pool's device; every entry in ``0..size +
            page_size - 1``.

        Raises
        ------
        TypeError, ValueError
            On a malformed ``indices``.
        IndexError
            Naming the first entry outside the buffers.
        """
        check_index(indices, "indices", device=self.device)
        check_in_range([(indices, self.rows, "indices")], what="slots", negative_ok=False)
        n = indices.shape[0]
        pinned = self.device.type == "cuda"
        parts = tuple(
            torch.empty((self.layer_num, n, *b.shape[1:]), dtype=b.dtype, pin_memory=pinned) for b in self._parts[0]
        )
        copy = self._new_cpu_copy(parts)
        copy_rows_to_host(self.parts_table, indices, copy.layers(), self.device)
        return copy

    def load_cpu_copy(self, kv_cache_cpu: PartsCpuCopy, indices: torch.Tensor) -> None:
        """Write ``get_cpu_copy``'s rows (every buffer) back into slots ``indices``, byte for byte.

        Parameters
        ----------
        kv_cache_cpu : a PartsCpuCopy of this pool's buffers and layers.
        indices : Tensor [len(kv_cache_cpu)], int32/int64, on the pool's device. Entries outside the
            buffers are never written (IndexError under ``validate``).

        Raises
        ------
        TypeError, ValueError
            On a malformed ``indices`` or a copy of other buffers, layers or length, naming
            ``kv_cache_cpu``; nothing is written.
        """
        check_index(indices, "indices", device=self.device)
        n = indices.shape[0]
        copy = self.check_cpu_copy(kv_cache_cpu, n)
        if self.validate:
            check_in_range([(indices, self.rows, "indices")])
        if n == 0:
            return
        cuda = self.device.type == "cuda"
        parts = tuple(p.to(self.device, non_blocking=True) for p in copy.parts) if cuda else copy.parts
        staged = PartsCpuCopy(parts, copy.part_names, copy.start_layer).layers()
        copy_rows_from_host(self.parts_table, indices, staged, self.device)

    def _new_cpu_copy(self, parts: tuple[torch.Tensor, ...]) -> PartsCpuCopy:
        """The CPU copy ``get_cpu_copy`` returns around host buffers ``parts`` (a subclass adds what
        else its copies carry)."""
        return PartsCpuCopy(parts, self.part_names, self.start_layer)

    def _check_copy_extras(self, copy: PartsCpuCopy) -> None:
        """Raise, naming ``kv_cache_cpu``, if what ``copy`` carries beyond its rows does not fit this
        pool (nothing, here; a subclass whose copies carry more checks it)."""

    def check_cpu_copy(self, copy: object, n: int) -> PartsCpuCopy:
        """``copy`` if ``load_cpu_copy`` can write it to ``n`` slots of this pool: a PartsCpuCopy of
        this pool's buffers (names, dtypes, row shapes), layers and ``n`` rows, in host memory with
        contiguous rows; raises naming ``kv_cache_cpu`` otherwise."""
        if not isinstance(copy, PartsCpuCopy):
            raise TypeError(f"kv_cache_cpu must be a PartsCpuCopy (from get_cpu_copy), got {type(copy).__name__}")
        if copy.part_names != self.part_names:
            raise ValueError(f"kv_cache_cpu must hold the buffers {list(self.part_names)}, got {list(copy.part_names)}")
        if copy.start_layer != self.start_layer:
            raise ValueError(f"kv_cache_cpu must start at layer {self.start_layer}, got {copy.start_layer}")
        self._check_copy_extras(copy)
        if len(copy.parts) != len(self.part_names):
            raise ValueError(f"kv_cache_cpu must hold {len(self.part_names)} buffers (one per name), got {len(copy.parts)}")
        for name, t, mine in zip(self.part_names, copy.parts, self._parts[0]):
            want = (self.layer_num, n, *mine.shape[1:])
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_cache_cpu.{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise ValueError(
                    f"kv_cache_cpu.{name} must have shape {want} ([layers, len(indices), ...]), got {tuple(t.shape)}"
                )
            if t.dtype != mine.dtype:
                raise ValueError(f"kv_cache_cpu.{name} must be {mine.dtype}, got {t.dtype}")
            if t.device.type != "cpu":
                raise ValueError(f"kv_cache_cpu.{name} must be in host memory, got {t.device}")
            if t.numel() and not t[0, 0].is_contiguous():
                raise ValueError(
                    f"kv_cache_cpu.{name} must have contiguous rows (as get_cpu_copy makes them), got strides {t.stride()}"
                )
        return copy
