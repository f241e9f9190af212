"""kvpool's kernels, one subpackage per family, each with its kernel, plan, launcher and reference
together: the K/V write (``store_kv/``), the FP4 K/V writes (``store_fp4/``, and two-level NVFP4:
``store_nvfp4/``), the per-token-head FP8 write (``store_fp8_token/``), the row copy
(``copy_rows/``) and the speculative state commit (``state_commit/``); and what the families
share: the launch machinery and ``Tile`` (``launch.py``), the dtype and scale kinds
(``formats.py``), the write's eligibility gate (``gate.py``), the scaled pools' choice between
kernel and reference path (``fused_path.py``) and the tables of row buffers (``row_table.py``)."""

from kvpool.errors import FusedPathUnavailable
from kvpool.kernels.gate import fused_eligibility
from kvpool.kernels.store_kv.naive import quantize
from kvpool.kernels.store_kv.op import fused_fp8_set_kv_buffer, reference_set_kv_buffer
from kvpool.kernels.store_kv.writer import PathStats

__all__ = [
    "FusedPathUnavailable",
    "PathStats",
    "fused_eligibility",
    "fused_fp8_set_kv_buffer",
    "quantize",
    "reference_set_kv_buffer",
]
