"""``Fp4KVCache``: what SGLang's FP4 pools share (``MHATokenToKVPoolFP4``, ``MLATokenToKVPoolFP4``):
the layers a rank holds, per layer a few uint8 buffers of ``size + page_size`` rows (packed e2m1
codes and their scale bytes), the row table over them, and what copies rows over it: moves and CPU
copies, which carry the scale bytes with the codes. The format is in docs/contract.md, "FP4 pools"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from kvpool.checks import (
    check_in_range,
    check_index,
    layer_id_of,
    layer_index,
    non_negative_int,
    positive_int,
    resolve_device,
)
from kvpool.config import validate_enabled
from kvpool.kernels.copy_rows import RowTable, checked_copy
from kvpool.kernels.store_fp4 import FP4_BLOCK, FP4_DTYPE

#: SGLang's ``--kv-cache-dtype`` name for this format: what the FP4 pools take as ``dtype`` on a torch
#: without ``torch.float4_e2m1fn_x2`` (they take either on a torch with it).
FP4_DTYPE_NAME = "fp4_e2m1"

#: What an FP4 pool's ``dtype`` attribute is: the torch dtype where torch has it, else the name.
Fp4Dtype = Union[torch.dtype, str]


def check_fp4_dtype(dtype: object) -> Fp4Dtype:
    """``dtype`` if it names SGLang's FP4 format: ``torch.float4_e2m1fn_x2`` (where torch has it) or
    the string ``"fp4_e2m1"``; the torch dtype is returned for either where it exists."""
    accepted = ([FP4_DTYPE] if FP4_DTYPE is not None else []) + [FP4_DTYPE_NAME]
    if dtype not in accepted:
        spelled = " or ".join(str(a) if isinstance(a, torch.dtype) else repr(a) for a in accepted)
        raise ValueError(f"dtype must be {spelled} for an FP4 pool, got {dtype!r}")
    return FP4_DTYPE if FP4_DTYPE is not None else FP4_DTYPE_NAME


def fp4_dim(value: object, name: str) -> int:
    """A positive multiple of 16 (a row part of whole scale blocks), else ValueError naming it."""
    dim = positive_int(value, name)
    if dim % FP4_BLOCK:
        raise ValueError(f"{name} must be a multiple of {FP4_BLOCK} for an FP4 pool (one scale per 16 elements), got {dim}")
    return dim


@dataclass(frozen=True)
class Fp4CpuCopy:
    """Some slots of every layer of an FP4 pool in host memory, as ``get_cpu_copy`` returns them and
    ``load_cpu_copy`` takes them back: the stored bytes, scales included, untouched.

    Attributes
    ----------
    parts : tuple of Tensor [layer_num, n, ...] uint8, one per buffer of a layer, in the pool's
        ``part_names`` order (an MHA pool: K codes, V codes, K scales, V scales). Pinned on CUDA.
    part_names : the buffers' names, as the pool's attributes call them.
    start_layer : the global id of layer 0.
    global_scales : per layer ``(k, v)``, the float32 global scales of an NVFP4 pool the rows were
        quantized with (empty for a format without them): a copy loads only into a pool with the same.
    """

    parts: tuple[torch.Tensor, ...]
    part_names: tuple[str, ...]
    start_layer: int
    global_scales: tuple[tuple[float, float], ...] = ()

    def __len__(self) -> int:
        return self.parts[0].shape[1]

    def layers(self) -> list[torch.Tensor]:
        """The per-layer row blocks, layer by layer, in a pool's ``row_table`` order."""
        return [p[layer] for layer in range(self.parts[0].shape[0]) for p in self.parts]


class Fp4KVCache:
    """Layers, slots and the row copies of an FP4 pool. A subclass allocates its buffers (lists of
    per-layer uint8 tensors with ``rows`` rows) and hands them, named, to ``_init_parts``.

    Attributes (SGLang names): ``size``, ``page_size``, ``dtype``, ``store_dtype`` (uint8),
    ``layer_num``, ``start_layer``, ``end_layer``, ``device``, ``layer_transfer_counter``; kvpool's:
    ``row_table`` over every buffer of every layer, ``part_names``, ``validate``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: object,
        layer_num: int,
        device: str | torch.device,
        start_layer: Optional[int],
        end_layer: Optional[int],
        validate: bool,
    ) -> None:
        self.size = positive_int(size, "size")
        self.page_size = positive_int(page_size, "page_size")
        self.dtype = check_fp4_dtype(dtype)
        self.store_dtype = torch.uint8
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
        self.layer_transfer_counter = None
        #: Per layer ``(k, v)`` global scales, for a format that has them (CPU copies carry them).
        self.global_scale_values: tuple[tuple[float, float], ...] = ()

    @property
    def rows(self) -> int:
        """Rows per layer buffer: ``size + page_size`` (slot 0 and the rest of page 0 are padding)."""
        return self.size + self.page_size

    def _new_buffer(self, width: tuple[int, ...]) -> list[torch.Tensor]:
        """One zeroed uint8 buffer ``[rows, *width]`` per layer."""
        return [torch.zeros((self.rows, *width), dtype=torch.uint8, device=self.device) for _ in range(self.layer_num)]

    def _init_parts(self, parts: dict[str, list[torch.Tensor]]) -> None:
        """Record the buffers of every layer, by attribute name (in the order row copies take them)."""
        for name, buffers in parts.items():
            setattr(self, name, buffers)
        self.part_names = tuple(parts)
        self._parts = [tuple(parts[n][i] for n in self.part_names) for i in range(self.layer_num)]
        #: Every buffer of every layer, layer by layer in ``part_names`` order: moves and CPU copies
        #: copy rows of all of them in one launch.
        self.row_table = RowTable.of([b for layer in self._parts for b in layer])

    # --- layers ----------------------------------------------------------------------------------

    def _write_index(self, layer: object, layer_id_override: Optional[int]) -> int:
        layer_id = layer_id_of(layer) if layer_id_override is None else layer_id_override
        return layer_index(layer_id, self.start_layer, self.end_layer)

    def _wait_layer(self, layer_id: object) -> int:
        """Index of global layer ``layer_id`` (raises for any other id), after the current stream
        waits for its load when a layer-transfer counter is registered."""
        i = layer_index(layer_id, self.start_layer, self.end_layer)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(i)
        return i

    def register_layer_transfer_counter(self, layer_transfer_counter: object) -> None:
        """Make the getters call ``layer_transfer_counter.wait_until(layer_index)`` first."""
        self.layer_transfer_counter = layer_transfer_counter

    def part_bytes(self) -> dict[str, int]:
        """Bytes held by each kind of buffer, all layers together, by attribute name."""
        return {n: sum(layer[j].numel() for layer in self._parts) for j, n in enumerate(self.part_names)}

    # --- moves and CPU copies --------------------------------------------------------------------

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """For every layer, row ``tgt_loc[i]`` of every buffer (codes and scales) becomes a byte copy
        of row ``src_loc[i]``, as if every source were read before any target is written (the rules
        of ``MHATokenToKVPool.move_kv_cache``).

        Parameters
        ----------
        tgt_loc, src_loc : Tensor [n], int32/int64, on the pool's device. Negative slots are padding;
            slots >= ``size + page_size`` are never read or written (IndexError under ``validate``).
        """
        table = self.row_table
        checked_copy(table, tgt_loc, table, src_loc, None, self.validate, ("tgt_loc", "src_loc"))

    def get_cpu_copy(self, indices: torch.Tensor) -> Fp4CpuCopy:
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
            torch.empty((self.layer_num, n, *b.shape[1:]), dtype=torch.uint8, pin_memory=pinned) for b in self._parts[0]
        )
        copy = Fp4CpuCopy(parts, self.part_names, self.start_layer, self.global_scale_values)
        if n:
            host = RowTable.of(copy.layers(), table_device=self.device if pinned else None, non_blocking=pinned)
            positions = torch.arange(n, dtype=torch.int64, device=self.device)
            checked_copy(host, positions, self.row_table, indices, None, False, ("positions", "indices"))
            if pinned:
                torch.cuda.current_stream(self.device).synchronize()
        return copy

    def load_cpu_copy(self, kv_cache_cpu: Fp4CpuCopy, indices: torch.Tensor) -> None:
        """Write ``get_cpu_copy``'s rows (codes and scales) back into slots ``indices``, byte for byte.

        Parameters
        ----------
        kv_cache_cpu : an Fp4CpuCopy of this pool's buffers and layers.
        indices : Tensor [len(kv_cache_cpu)], int32/int64, on the pool's device. Entries outside the
            buffers are never written (IndexError under ``validate``).

        Raises
        ------
        TypeError, ValueError
            On a malformed ``indices`` or a copy of another geometry, layers or length, naming
            ``kv_cache_cpu``; nothing is written.
        """
        check_index(indices, "indices", device=self.device)
        n = indices.shape[0]
        copy = self._check_cpu_copy(kv_cache_cpu, n)
        if self.validate:
            check_in_range([(indices, self.rows, "indices")])
        if n == 0:
            return
        cuda = self.device.type == "cuda"
        parts = tuple(p.to(self.device, non_blocking=True) for p in copy.parts) if cuda else copy.parts
        staged = RowTable.of(Fp4CpuCopy(parts, copy.part_names, copy.start_layer).layers(), non_blocking=cuda)
        positions = torch.arange(n, dtype=torch.int64, device=self.device)
        checked_copy(self.row_table, indices, staged, positions, None, False, ("indices", "positions"))

    def _check_cpu_copy(self, copy: object, n: int) -> Fp4CpuCopy:
        if not isinstance(copy, Fp4CpuCopy):
            raise TypeError(f"kv_cache_cpu must be an Fp4CpuCopy (from get_cpu_copy), got {type(copy).__name__}")
        if copy.part_names != self.part_names:
            raise ValueError(f"kv_cache_cpu must hold the buffers {list(self.part_names)}, got {list(copy.part_names)}")
        if copy.start_layer != self.start_layer:
            raise ValueError(f"kv_cache_cpu must start at layer {self.start_layer}, got {copy.start_layer}")
        if copy.global_scales != self.global_scale_values:
            raise ValueError(
                f"kv_cache_cpu.global_scales must be this pool's per-layer (k, v) global scales "
                f"{self.global_scale_values}, got {copy.global_scales}"
            )
        if len(copy.parts) != len(self.part_names):
            raise ValueError(f"kv_cache_cpu must hold {len(self.part_names)} buffers (one per name), got {len(copy.parts)}")
        for name, t, mine in zip(self.part_names, copy.parts, self._parts[0]):
            want = (self.layer_num, n, *mine.shape[1:])
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_cache_cpu.{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != want:
                raise ValueError(f"kv_cache_cpu.{name} must have shape {want} ([layers, len(indices), ...]), got {tuple(t.shape)}")
            if t.dtype != torch.uint8:
                raise ValueError(f"kv_cache_cpu.{name} must be torch.uint8, got {t.dtype}")
            if t.device.type != "cpu":
                raise ValueError(f"kv_cache_cpu.{name} must be in host memory, got {t.device}")
            if t.numel() and not t[0, 0].is_contiguous():
                raise ValueError(f"kv_cache_cpu.{name} must have contiguous rows (as get_cpu_copy makes them), got strides {t.stride()}")
        return copy
