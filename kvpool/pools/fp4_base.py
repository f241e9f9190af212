"""``Fp4KVCache``: what SGLang's FP4 pools (``MHATokenToKVPoolFP4``, ``MLATokenToKVPoolFP4``) add to
a ``RowPartsCache``: the FP4 ``dtype``, uint8 buffers (packed e2m1 codes and their scale bytes), the
``row_table`` name for the table over them, and CPU copies (``Fp4CpuCopy``) that carry an NVFP4
pool's global scales with the rows. The format is in docs/contract.md, "FP4 pools"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from kvpool.checks import positive_int
from kvpool.kernels.store_fp4 import FP4_BLOCK, FP4_DTYPE
from kvpool.pools.row_parts import PartsCpuCopy, RowPartsCache

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
class Fp4CpuCopy(PartsCpuCopy):
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

    global_scales: tuple[tuple[float, float], ...] = ()


class Fp4KVCache(RowPartsCache):
    """Layers, slots and the row copies of an FP4 pool. A subclass allocates its buffers (lists of
    per-layer uint8 tensors with ``rows`` rows) and hands them, named, to ``_init_parts``.

    Attributes (SGLang names): ``size``, ``page_size``, ``dtype``, ``store_dtype`` (uint8),
    ``layer_num``, ``start_layer``, ``end_layer``, ``device``, ``layer_transfer_counter``; kvpool's:
    ``row_table`` (the ``parts_table``) over every buffer of every layer, ``part_names``,
    ``validate``, ``global_scale_values``.
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
        dtype = check_fp4_dtype(dtype)
        super().__init__(size, page_size, layer_num, device, start_layer, end_layer, validate)
        self.dtype: Fp4Dtype = dtype
        self.store_dtype = torch.uint8
        #: Per layer ``(k, v)`` global scales, for a format that has them (CPU copies carry them).
        self.global_scale_values: tuple[tuple[float, float], ...] = ()

    def _init_parts(self, parts: dict[str, list[torch.Tensor]]) -> None:
        super()._init_parts(parts)
        #: The ``parts_table`` by the name the FP4 pools have always given it.
        self.row_table = self.parts_table

    def _new_cpu_copy(self, parts: tuple[torch.Tensor, ...]) -> Fp4CpuCopy:
        return Fp4CpuCopy(parts, self.part_names, self.start_layer, self.global_scale_values)

    def _check_copy_extras(self, copy: PartsCpuCopy) -> None:
        scales = getattr(copy, "global_scales", ())
        if scales != self.global_scale_values:
            raise ValueError(
                f"kv_cache_cpu.global_scales must be this pool's per-layer (k, v) global scales "
                f"{self.global_scale_values}, got {scales}"
            )

    def check_cpu_copy(self, copy: object, n: int) -> Fp4CpuCopy:
        """``copy`` if ``load_cpu_copy`` can write it to ``n`` slots of this pool: an Fp4CpuCopy of
        this pool's buffers, layers, global scales and ``n`` rows (``RowPartsCache.check_cpu_copy``);
        raises naming ``kv_cache_cpu`` otherwise."""
        if not isinstance(copy, Fp4CpuCopy):
            raise TypeError(f"kv_cache_cpu must be an Fp4CpuCopy (from get_cpu_copy), got {type(copy).__name__}")
        super().check_cpu_copy(copy, n)
        return copy
